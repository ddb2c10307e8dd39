"""The executor's OpenAI-compatible HTTP API, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from rose.testing.polling import until

MODEL = "rose-serving"


@pytest.fixture
def client(executor):
    _, base = executor
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


async def test_models_and_health(client, executor):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, "policy"]  # the policy model is served by the SGLang API (POST /generate)
    async with aiohttp.ClientSession() as s, s.get(f"{executor[1]}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"


async def test_completion_greedy_is_deterministic_with_usage(client):
    a = await client.completions.create(model=MODEL, prompt="2+3=", max_tokens=8, temperature=0)
    b = await client.completions.create(model=MODEL, prompt="2+3=", max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.usage.completion_tokens >= 1 and a.usage.prompt_tokens >= 1


async def test_completion_logprobs_and_seed(client):
    r = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=1.0, seed=7, logprobs=1)
    again = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=1.0, seed=7, logprobs=1)
    assert r.choices[0].text == again.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)


async def test_chat_completion_and_streaming(client):
    messages = [{"role": "user", "content": "what is 4+4?"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    pieces, finish = [], None
    async for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason


async def test_completion_streaming_matches_non_streaming(client):
    full = await client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0)
    stream = await client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert text == full.choices[0].text


BAD = [
    pytest.param(b"{not json", 400, "not valid JSON", id="malformed-json"),
    pytest.param(b'{"model": "gpt-9", "prompt": "x"}', 404, "does not exist", id="unknown-model"),
    pytest.param(b'{"model": "rose-serving", "prompt": ""}', 400, "empty", id="empty-prompt"),
    pytest.param(b'{"model": "rose-serving", "prompt": "x", "temperature": -1}', 400, "temperature", id="bad-temperature"),
    pytest.param(b'{"model": "rose-serving", "prompt": "x", "top_p": 0}', 400, "top_p", id="bad-top-p"),
    pytest.param(b'{"model": "rose-serving", "prompt": "x", "max_tokens": 0}', 400, "max_tokens", id="bad-max-tokens"),
    pytest.param(b'{"model": "rose-serving", "prompt": "x", "max_tokens": 100000}', 400, "exceeds", id="over-long"),
    pytest.param(b'{"model": "rose-serving", "prompt": [99999999]}', 400, "token ids", id="bad-token-id"),
    pytest.param(b'{"model": "rose-serving", "prompt": "x", "n": 0}', 400, "`n`", id="n-zero"),
    pytest.param(b'{"model": "policy", "prompt": "x"}', 404, "POST /generate", id="policy-model-on-openai-route"),
    pytest.param(b"[1, 2]", 400, "JSON object", id="not-an-object"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
async def test_bad_requests_get_openai_style_4xx_and_serving_continues(client, executor, body, status, needle):
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{executor[1]}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == status
        err = (await r.json())["error"]
        assert needle in err["message"] and err["type"]
    ok = await client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


async def test_bad_chat_messages(executor):
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{executor[1]}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard"}]}) as r,
    ):
        assert r.status == 400 and "messages[0]" in (await r.json())["error"]["message"]


async def test_openai_client_raises_on_unknown_model(client):
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)


async def test_prometheus_metrics(client, executor):
    await client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)

    async def counted() -> str:
        """The scrape once a telemetry interval has folded the request into the totals ("" before: asked again)."""
        async with aiohttp.ClientSession() as s, s.get(f"{executor[1]}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        done = any(line.startswith("rose_executor_ttft_seconds_count") and float(line.split()[-1]) >= 1 for line in text.splitlines())
        return text if done else ""

    text = await until(counted, 15, "the request in the executor's metrics", step=0.2)
    for name in ("rose_executor_ttft_seconds", "rose_executor_serving_requests_total", "rose_executor_kv_used_bytes", "rose_executor_queue_length"):
        assert f"# TYPE {name}" in text
    count = [line for line in text.splitlines() if line.startswith("rose_executor_ttft_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
