"""The SGLang API as the RL frameworks that drive SGLang servers call it, against one real executor
(`rose run executor`, dedicated, weights.follow = false) set up as docs/http-api.md tells an operator
to for slime's external-engine mode: no admin key, `sglang_api.allow_unauthenticated_admin = true`,
bound to a private address (here 127.0.0.1). Each test replays one peer's requests as its source
builds them (payload keys, headers, methods, empty bodies) and reads the fields that source reads:

- THUDM/slime `slime/backends/sglang_utils/sglang_engine.py` (external init, memory, weights, flush),
  `slime/rollout/sglang_rollout.py` (generate), `slime/utils/http_utils.py` (`post` = httpx json=payload or {});
- volcengine/verl `verl/workers/rollout/sglang_rollout/http_server_engine.py` (AsyncHttpServerAdapter:
  generate with None values filtered out, image_data of nulls, memory, flush, /v1/models) and
  `async_sglang_server.py` (reads output_token_logprobs as (logprob, token_id, _));
- inclusionAI/AReaL `areal/engine/sglang_remote.py` (health, generate, pause with no body, resubmit of the
  partial output after an abort, update_weights_from_disk);
- sgl-project/sglang `test/srt/test_srt_endpoint.py`, `test/srt/rl/test_update_weights_from_disk.py`,
  `test/srt/test_weight_version.py`, `test/srt/test_metrics.py`.

Admin-key enforcement (401 / 403, `Bearer None` against a keyed executor) is in test_sglang_api.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest

from rose.shared.bus import Bus
from rose.shared.launch import ServiceProcess
from rose.shared.provisioning import provision

START_TIMEOUT_S = 120.0
SLIME_HEALTH_HEADERS = {"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"}  # _wait_server_healthy(api_key=None)
IDS = list(range(5, 25))


@pytest.fixture(scope="module")
async def peer_executor(nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
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
        "ROSE_HTTP__HOST": "127.0.0.1",
    }
    proc = ServiceProcess("executor", "ex-peers", env, tmp_path_factory.mktemp("peer-executor") / "executor.log").start()
    try:
        async with Bus(bus_config, service="tests", instance="peer-fixture") as bus:
            await provision(bus.js)
            endpoints = await proc.wait_ready(bus, START_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            yield endpoints["http"], session
    finally:
        proc.stop()


async def post(session, url, payload=None, **kw):
    """slime's http_utils.post / verl's _make_async_request: POST json=payload or {}, JSON (or text) back."""
    async with session.post(url, json=payload or {}, **kw) as r:
        body = await r.read()
        try:
            return r.status, json.loads(body)
        except ValueError:
            return r.status, body.decode()


async def get(session, url, **kw):
    async with session.get(url, **kw) as r:
        return r.status, (await r.json(content_type=None) if r.content_type == "application/json" else await r.text())


async def test_slime_external_engine_init_sees_the_server_args_it_expects(peer_executor):
    base, session = peer_executor
    # _wait_server_healthy(base_url, api_key=None): /health_generate then /flush_cache, both with `Bearer None`
    assert (await get(session, f"{base}/health_generate", headers=SLIME_HEALTH_HEADERS))[0] == 200
    assert (await get(session, f"{base}/flush_cache", headers=SLIME_HEALTH_HEADERS))[0] == 200
    status, actual = await get(session, f"{base}/get_server_info")
    assert status == 200
    # _compute_server_args for one engine of one GPU (rollout_num_gpus_per_engine 1, sglang_pp/dp/ep_size 1, --offload-rollout),
    # minus _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS: _sanity_check_server_args asserts each of these equal
    host, port = base.removeprefix("http://").rsplit(":", 1)
    expected = {
        "enable_memory_saver": True,
        "host": host,
        "port": int(port),
        "nnodes": 1,
        "node_rank": 0,
        "gpu_id_step": 1,
        "base_gpu_id": 0,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
    }
    assert {name: actual.get(name) for name in expected} == expected
    assert actual["model_path"] and actual["served_model_name"] == "policy"


async def test_slime_rollout_memory_and_flush_calls(peer_executor):
    base, session = peer_executor
    # GenerateState.sampling_params + generate(): input_ids, return_logprob; reads output_token_logprobs, text, finish_reason
    sampling_params = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 8,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": True,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 3,
    }
    status, output = await post(session, f"{base}/generate", {"sampling_params": sampling_params, "return_logprob": True, "input_ids": IDS})
    assert status == 200, output
    tokens = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
    log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
    assert len(tokens) == 8 and all(lp <= 0 for lp in log_probs) and isinstance(output["text"], str)
    assert output["meta_info"]["finish_reason"]["type"] == "length" and output["meta_info"]["weight_version"] == "0"
    # release_memory_occupation(): flush_cache (GET, no header) then POST {}; resume_memory_occupation(tags) per stage
    assert (await get(session, f"{base}/flush_cache"))[0] == 200
    assert await post(session, f"{base}/release_memory_occupation") == (200, None)
    for tags in (["weights"], ["cuda_graph"], ["kv_cache"]):
        assert await post(session, f"{base}/resume_memory_occupation", {"tags": tags}) == (200, None), tags
    status, info = await get(session, f"{base}/get_server_info")
    assert info["internal_states"][0]["released_memory"] == [] and not info["internal_states"][0]["kv_cache_released"]
    # pause_generation / continue_generation: POST json={}; get_weight_version reads ["weight_version"]
    assert (await post(session, f"{base}/pause_generation"))[0] == 200
    assert (await post(session, f"{base}/continue_generation"))[0] == 200
    assert (await get(session, f"{base}/get_weight_version"))[1]["weight_version"] == "0"


async def test_verl_batched_generate_with_null_images_and_models(peer_executor):
    base, session = peer_executor
    # AsyncHttpServerAdapter.generate(): None values filtered out of the payload; image_data of nulls for text prompts
    payload = {
        "text": None,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6},
        "input_ids": [IDS, IDS[:10]],
        "image_data": [None, None],
        "return_logprob": True,
        "logprob_start_len": None,
        "top_logprobs_num": None,
    }
    status, outputs = await post(session, f"{base}/generate", {k: v for k, v in payload.items() if v is not None})
    assert status == 200 and isinstance(outputs, list) and len(outputs) == 2, outputs
    for output in outputs:  # async_sglang_server.generate: (log_prob, token_ids, _) triplets
        log_probs, token_ids = zip(*[(log_prob, token_id) for log_prob, token_id, _ in output["meta_info"]["output_token_logprobs"]], strict=True)
        assert list(token_ids) == output["output_ids"] and len(log_probs) == 6
    status, err = await post(session, f"{base}/generate", {"input_ids": IDS, "image_data": ["data:image/png;base64,AAAA"]})
    assert status == 400 and err["error"]["param"] == "image_data"  # a real image: refused, named
    # release / resume with verl's tags, flush (GET), available_models (GET v1/models)
    assert await post(session, f"{base}/release_memory_occupation", {"tags": ["kv_cache", "weights"]}) == (200, None)
    assert await post(session, f"{base}/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}) == (200, None)
    assert (await get(session, f"{base}/flush_cache"))[0] == 200
    status, models = await get(session, f"{base}/v1/models")
    assert status == 200 and "policy" in [m["id"] for m in models["data"]]


async def test_areal_pause_resubmit_and_disk_update(peer_executor, models_dir, tmp_path):
    base, session = peer_executor
    assert (await get(session, f"{base}/health"))[0] == 200  # check_health
    max_new_tokens = 48
    sample_params = {
        "top_p": 1.0,
        "top_k": 100000000,
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": [],
        "frequency_penalty": 0.0,
    }
    payload = {"input_ids": list(IDS), "image_data": None, "sampling_params": sample_params, "return_logprob": True, "stream": False}

    async def agenerate() -> tuple[list[int], str, int]:
        """agenerate(): resubmit prompt + output so far until stop/length (an abort after pause_generation is resubmitted)."""
        accumulated, stop_reason, rounds = [], None, 0
        while stop_reason not in ("stop", "tool_calls", "length") and len(accumulated) < max_new_tokens:
            status, result = await post(session, f"{base}/generate", payload)
            assert status == 200, result
            rounds += 1
            meta_info = result["meta_info"]
            stop_reason = meta_info["finish_reason"]["type"]
            output_tokens = [x[1] for x in meta_info["output_token_logprobs"]]
            accumulated.extend(output_tokens)
            payload["input_ids"] += output_tokens
            sample_params["max_new_tokens"] -= len(output_tokens)
        return accumulated, stop_reason, rounds

    rollout = asyncio.create_task(agenerate())
    await asyncio.sleep(0.3)
    async with session.post(f"{base}/pause_generation") as r:  # update_weights(): requests.post(addr/pause_generation), no body at all
        assert r.status == 200
    await asyncio.sleep(0.2)
    async with session.post(f"{base}/continue_generation") as r:
        assert r.status == 200
    tokens, stop_reason, rounds = await rollout
    assert len(tokens) == max_new_tokens and stop_reason in ("length", "abort") and rounds >= 1
    # update_weights_from_disk(model_path, abort_all_request=True); then SGLang's test_update_weights_from_disk reads /get_model_info
    new_path = tmp_path / "policy-v2"
    shutil.copytree(models_dir / "policy", new_path)
    status, out = await post(session, f"{base}/update_weights_from_disk", {"model_path": str(new_path), "abort_all_request": True})
    assert status == 200 and out["success"], out
    assert (await get(session, f"{base}/get_model_info"))[1]["model_path"] == str(new_path)
    assert (await get(session, f"{base}/get_server_info"))[1]["model_path"] == str(new_path)
    policy = next(m for m in (await get(session, f"{base}/v1/models"))[1]["data"] if m["id"] == "policy")
    assert policy["root"] == str(new_path)  # /v1/models agrees with /get_model_info


async def test_sglang_own_server_tests(peer_executor):
    base, session = peer_executor
    # test_srt_endpoint.py: text prompt with logprobs; top_logprobs_num is refused here, naming it
    status, out = await post(
        session,
        f"{base}/generate",
        {
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True,
            "logprob_start_len": -1,
        },
    )
    assert status == 200 and len(out["meta_info"]["output_token_logprobs"]) == 4
    status, err = await post(
        session, f"{base}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True, "top_logprobs_num": 3}
    )
    assert status == 400 and err["error"]["param"] == "top_logprobs_num"
    # test_weight_version.py: /update_weight_version then /get_weight_version and meta_info.weight_version
    status, out = await post(session, f"{base}/update_weight_version", {"new_version": "v2.0", "abort_all_requests": False})
    assert status == 200 and out["success"]
    assert (await get(session, f"{base}/get_weight_version"))[1] == {"weight_version": "v2.0"}
    _, out = await post(session, f"{base}/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "v2.0"
    # test_metrics.py: a streamed generate, then the essential metrics (those this executor has: no grammar or speculation)
    async with session.post(
        f"{base}/generate", json={"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "stream": True}
    ) as r:
        assert r.status == 200
        async for _ in r.content:
            pass
    status, text = await get(session, f"{base}/metrics")
    for metric in (
        "sglang:num_running_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:num_queue_reqs",
        "sglang:num_grammar_queue_reqs",
        "sglang:cache_hit_rate",
        "sglang:spec_accept_length",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:num_requests_total",
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:e2e_request_latency_seconds",
    ):
        assert metric in text, metric
    assert 'model_name="policy"' in text and "_sum{" in text and "_count{" in text and "_bucket{" in text
