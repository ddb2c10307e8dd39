"""Bad input against the real executor's HTTP API (hypothesis): every answer is 2xx, or a 4xx with an OpenAI-style error body.

The requests are hand-written strategies of what a spec does not describe: any method and path,
random bytes, random JSON, and completion / chat bodies whose fields take valid and invalid values
(NaN, Infinity, lone surrogates, huge integers, wrong types). Never a 5xx, and the executor keeps
serving. The number of requests tried is printed at the end. Requests drawn from OpenAI's published
OpenAPI description, with every answer checked against its schemas, are test_openapi_spec.py's.
"""

from __future__ import annotations

import collections
import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MODEL = "rose-serving"
EXAMPLES = 250  # requests per test; a valid one generates at most 16 tokens of the tiny model
TIMEOUT_S = 60.0
CASES: collections.Counter[str] = collections.Counter()
STATUSES: collections.Counter[int] = collections.Counter()

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
SMALL_TOKENS = st.integers(-2, 4)
FIELDS = {
    "model": st.just(MODEL) | st.just(MODEL) | JSON_VALUES,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 5000), max_size=6) | st.lists(st.text(max_size=5), max_size=2) | JSON_VALUES,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]), "content": st.text(max_size=20) | JSON_VALUES}
        ),
        max_size=3,
    )
    | JSON_VALUES,
    "max_tokens": SMALL_TOKENS | JSON_VALUES,
    "max_completion_tokens": SMALL_TOKENS | JSON_VALUES,
    "temperature": st.floats() | st.sampled_from([0, 1e-320, 1e-40, 1e308]) | JSON_VALUES,
    "top_p": st.floats() | st.sampled_from([1e-320, 0.5, 1]) | JSON_VALUES,
    "seed": st.integers() | JSON_VALUES,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "n": st.integers(0, 2) | JSON_VALUES,
    "logprobs": st.none() | st.integers(0, 2) | JSON_VALUES,
    "echo": st.booleans() | JSON_VALUES,
}
# Without an explicit max_tokens a valid request generates the default 16 tokens: cheap enough.
API_BODY = st.fixed_dictionaries({"model": FIELDS["model"]}, optional={k: v for k, v in FIELDS.items() if k != "model"})
ENDPOINTS = st.sampled_from(
    [("POST", "/v1/completions")] * 4
    + [("POST", "/v1/chat/completions")] * 4
    + [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/v1/models"),
        ("GET", "/v1/completions"),
        ("PUT", "/v1/chat/completions"),
        ("POST", "/v1/nope"),
        ("GET", "/"),
    ]
)


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["api", "api", "api", "api_truncated", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=128))
    doc = draw(API_BODY) if kind.startswith("api") else draw(JSON_VALUES)
    data = json.dumps(doc).encode()  # allow_nan: Python's json (the server's parser) reads NaN and Infinity back
    if kind == "api_truncated":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    return data


class Client:
    """One keep-alive connection (stdlib: the test drives the server synchronously, as hypothesis needs)."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        self.host, self.port = url.hostname, url.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)

    def send(self, method: str, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, str, bytes]:
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=body, headers={"Content-Type": content_type})
                r = self.conn.getresponse()
                return r.status, r.getheader("Content-Type", ""), r.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):  # the server closed an idle keep-alive
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def check(status: int, content_type: str, data: bytes, method: str, path: str, body: bytes) -> None:
    STATUSES[status] += 1
    where = f"{method} {path} {body[:200]!r}"
    assert status < 500, f"{status} for {where}: {data[:300]!r}"
    if status >= 400:
        doc = json.loads(data)
        if "success" in doc:  # SGLang's weight endpoints answer a refusal as {"success": false, "message"}
            assert doc["success"] is False and isinstance(doc["message"], str) and doc["message"], where
            return
        error = doc["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), where
        assert "param" in error and "code" in error, where
    elif content_type.startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n"), where
    elif path not in ("/metrics", "/flush_cache", "/abort_request", "/health_generate"):  # text or empty bodies, as SGLang
        json.loads(data)


@pytest.fixture(scope="module")
def api(executor):
    client = Client(executor[1])
    yield client
    client.conn.close()


@pytest.fixture(scope="module", autouse=True)
def _show(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown also without -s
        print(f"\nexecutor HTTP API: {sum(CASES.values())} generated requests ({dict(CASES)}), statuses {dict(sorted(STATUSES.items()))}; no 5xx")


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


@FUZZ
@given(ENDPOINTS, bodies())
@example(("POST", "/v1/completions"), b"[" * 100_000 + b"]" * 100_000)  # nesting past Python's recursion limit
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}))  # a lone surrogate
@example(("POST", "/v1/chat/completions"), _json({"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2}))
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "x", "temperature": 1e-320, "max_tokens": 2}))  # 0 in float32
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "x", "top_p": 1e-320, "max_tokens": 2}))
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "x", "temperature": float("inf"), "max_tokens": 2}))
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "x", "temperature": float("nan"), "max_tokens": 2}))
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": "x", "seed": 2**70, "max_tokens": 2}))
@example(("POST", "/v1/completions"), _json({"model": MODEL, "prompt": [True, False], "max_tokens": 2}))
@example(("POST", "/v1/completions"), b"\xff\xfe not utf-8")
@example(("POST", "/v1/completions"), b"")
def test_generated_requests_get_2xx_or_an_openai_style_4xx(api, endpoint, body):
    method, path = endpoint
    CASES[f"{method} {path}"] += 1
    check(*api.send(method, path, body), method, path, body)


def test_oversized_and_wrong_content_type(api):
    """A body over the limit (4 MiB by default) is a 413 with an error body; a non-JSON content type changes nothing."""
    body = b'{"model": "rose-serving", "prompt": "' + b"x" * (4 << 20) + b'"}'
    status, content_type, data = api.send("POST", "/v1/completions", body)
    CASES["oversized"] += 1
    assert status == 413 and "too large" in json.loads(data)["error"]["message"]
    status, content_type, data = api.send("POST", "/v1/completions", _json({"model": MODEL, "prompt": "hi", "max_tokens": 1}), "text/plain")
    CASES["text/plain"] += 1
    check(status, content_type, data, "POST", "/v1/completions", b"")


def test_serving_continues_after_the_fuzz(api):
    status, _, data = api.send("POST", "/v1/completions", _json({"model": MODEL, "prompt": "2+3?", "max_tokens": 3, "temperature": 0}))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3
    status, _, data = api.send("GET", "/health", b"")
    assert status == 200 and json.loads(data)["status"] == "ok"


# ---- SGLang-compatible endpoints (sglang_api.py) of a dedicated executor with admin open ----------

SGLANG_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": SMALL_TOKENS | JSON_VALUES,
        "temperature": FIELDS["temperature"],
        "top_p": FIELDS["top_p"],
        "top_k": st.integers(-3, 3) | JSON_VALUES,
        "stop": FIELDS["stop"],
        "stop_token_ids": st.lists(st.integers(-2, 5000), max_size=3) | JSON_VALUES,
        "ignore_eos": st.booleans() | JSON_VALUES,
        "sampling_seed": st.integers() | JSON_VALUES,
        "n": st.integers(-1, 2) | JSON_VALUES,
        "no_stop_trim": st.booleans(),
        "frequency_penalty": st.floats() | JSON_VALUES,
        "skip_special_tokens": st.booleans(),
        "bogus": JSON_VALUES,
    },
)
GENERATE_BODY = st.fixed_dictionaries(
    {},
    optional={
        "text": st.text(max_size=20) | st.lists(st.text(max_size=6), max_size=3) | JSON_VALUES,
        "input_ids": st.lists(st.integers(-3, 5000), max_size=6) | st.lists(st.lists(st.integers(0, 50), max_size=3), max_size=2) | JSON_VALUES,
        "sampling_params": SGLANG_SAMPLING | JSON_VALUES,
        "return_logprob": st.booleans() | JSON_VALUES,
        "logprob_start_len": st.integers(-2, 3) | JSON_VALUES,
        "top_logprobs_num": st.integers(0, 2) | JSON_VALUES,
        "stream": st.booleans() | JSON_VALUES,
        "rid": st.text(max_size=6) | JSON_VALUES,
        "priority": st.integers() | JSON_VALUES,
        "return_text_in_logprobs": st.booleans(),
    },
)
# pause, continue and memory release are left out: a valid one (an empty body is one) would hold every later request
SGLANG_ENDPOINTS = st.sampled_from(
    [("POST", "/generate")] * 6
    + [
        ("POST", "/update_weights_from_tensor"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/update_weight_version"),
        ("POST", "/abort_request"),
        ("GET", "/get_weight_version"),
        ("GET", "/get_model_info"),
        ("GET", "/get_server_info"),
        ("POST", "/get_weights_by_name"),
        ("GET", "/flush_cache"),
        ("GET", "/health_generate"),
        ("DELETE", "/generate"),
    ]
)
ADMIN_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "serialized_named_tensors": st.lists(
            st.text(max_size=40) | st.binary(max_size=30).map(lambda b: __import__("base64").b64encode(b).decode()), max_size=2
        )
        | JSON_VALUES,
        "load_format": st.sampled_from([None, "direct", "flattened_bucket", "pt"]) | JSON_VALUES,
        "model_path": st.text(max_size=10) | JSON_VALUES,
        "weight_version": st.text(max_size=5) | JSON_VALUES,
        "new_version": st.text(max_size=5) | JSON_VALUES,
        "rid": st.text(max_size=5) | JSON_VALUES,
        "name": st.text(max_size=10) | JSON_VALUES,
        "truncate_size": st.integers(-2, 3) | JSON_VALUES,
        "flush_cache": st.booleans() | JSON_VALUES,
    },
)


@st.composite
def sglang_bodies(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["api", "api", "api", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    doc = draw(GENERATE_BODY if path == "/generate" else ADMIN_FIELDS) if kind == "api" else draw(JSON_VALUES)
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
async def sglang_server(nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
    from rose.shared.bus import Bus
    from rose.shared.launch import ServiceProcess
    from rose.shared.provisioning import provision

    env = {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_ROLE": "dedicated",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "8",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
        "ROSE_WEIGHTS__FOLLOW": "false",
        "ROSE_SGLANG_API__ALLOW_UNAUTHENTICATED_ADMIN": "true",
    }
    proc = ServiceProcess("executor", "ex-sglang-fuzz", env, tmp_path_factory.mktemp("sglang-fuzz") / "executor.log").start()
    try:
        async with Bus(bus_config, service="tests", instance="sglang-fuzz-fixture") as bus:
            await provision(bus.js)
            endpoints = await proc.wait_ready(bus, 120.0)
        client = Client(endpoints["http"])
        yield client
        client.conn.close()
    finally:
        proc.stop()


# Fewer here: a valid /generate without max_new_tokens makes SGLang's default 128 tokens, so a request
# costs about ten of the OpenAI API's (16 by default); 100 examples still reach every endpoint many times.
SGLANG_FUZZ = settings(FUZZ, max_examples=100)


@SGLANG_FUZZ
@given(st.data())
def test_generated_sglang_requests_get_2xx_or_a_4xx_that_says_why(sglang_server, data):
    method, path = data.draw(SGLANG_ENDPOINTS)
    body = data.draw(sglang_bodies(path))
    CASES[f"{method} {path}"] += 1
    status, content_type, raw = sglang_server.send(method, path, body)
    check(status, content_type, raw, method, path, body)
    if path == "/generate" and status == 200 and not content_type.startswith("text/event-stream"):
        outs = json.loads(raw)
        for out in outs if isinstance(outs, list) else [outs]:
            assert (
                out["meta_info"]["finish_reason"]["type"] in ("stop", "length", "abort")
                and len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
            )


def test_sglang_generate_still_works_after_the_fuzz(sglang_server):
    status, _, data = sglang_server.send(
        "POST", "/generate", _json({"text": "2+3?", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    )
    assert status == 200 and json.loads(data)["meta_info"]["completion_tokens"] == 3
