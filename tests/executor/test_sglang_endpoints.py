"""SGLang's RL admin API on a real engine behind a real aiohttp server, with requests shaped as
SGLang 0.5.3's clients (slime, verl, AReaL) send them: /generate (single, batch, stream), pause
modes, weight pushes (direct and flattened_bucket tensors, disk), versions, memory, cache, abort."""

import asyncio
import json
import time

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer
from safetensors.torch import save_file

from rose.services.executor.config import SGLangApiSettings
from rose.services.executor.http_api import OpenAIApi
from rose.services.executor.protocol import WorkClass
from rose.services.executor.sglang_api import SGLangApi
from rose.services.executor.sglang_tensors import serialize_named_tensors
from rose.services.executor.telemetry import Telemetry
from rose.testing.polling import until
from rose.testing.sglang_sender import flattened_tensor_metadata

OPEN = SGLangApiSettings(allow_unauthenticated_admin=True)
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture
async def serve(make_engine, model_paths):
    """Start an engine + the OpenAI app with the SGLang routes mounted; yields (session, base URL, engine, api)."""
    servers = []

    async def start(settings: SGLangApiSettings = OPEN, follows_bus_weights: bool = False, **engine_kw):
        engine = make_engine(fresh_policy=True, **engine_kw)
        openai = OpenAIApi(engine, Telemetry(engine, "ex-test", "dedicated", 1.0), "rose-serving", 64 << 20)
        api = SGLangApi(engine, settings, model_dir=str(model_paths.policy), served_name="policy", follows_bus_weights=follows_bus_weights)
        api.mount(openai.app)
        server = TestServer(openai.app)
        await server.start_server()
        session = aiohttp.ClientSession()
        servers.append((server, session))
        return session, str(server.make_url("")), engine, api

    yield start
    for server, session in servers:
        await session.close()
        await server.close()


async def post(session, url, body=None, **kw):
    async with session.post(url, json=body, **kw) as r:
        ctype = r.headers.get("Content-Type", "")
        return r.status, (await r.json() if "json" in ctype else await r.text())


async def test_generate_shape_matches_sglang(serve):
    session, base, engine, _ = await serve()
    ids = engine.tokenizer_for(WorkClass.ROLLOUT).encode("What is 2+3?")
    status, out = await post(session, f"{base}/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, "rid": "r1"})
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["weight_version"] == "0" and meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    tokens = [t for _, t, _ in meta["output_token_logprobs"]]  # slime reads item[1] as the token, item[0] as its logprob
    assert tokens == out["output_ids"] and all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert isinstance(out["text"], str)


async def test_stop_string_reason_and_no_stop_trim(serve):
    session, base, _, _ = await serve()
    status, free = await post(
        session, f"{base}/generate", {"text": "Question: 12+7?", "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    )
    assert status == 200 and len(free["text"]) > 3
    stop = free["text"][1:3]  # a stop string the greedy output is known to contain
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True, "stop": [stop]}
    _, cut = await post(session, f"{base}/generate", {"text": "Question: 12+7?", "sampling_params": params})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and free["text"].startswith(cut["text"])
    _, kept = await post(session, f"{base}/generate", {"text": "Question: 12+7?", "sampling_params": {**params, "no_stop_trim": True}})
    assert stop in kept["text"]


async def test_stream_is_cumulative_and_ends_with_done(serve):
    session, base, _, _ = await serve()
    events = []
    async with session.post(f"{base}/generate", json={"text": "Hello", "sampling_params": GREEDY, "stream": True, "return_logprob": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):  # each event carries everything so far
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(chunks[-1]["output_ids"]) == 24
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 24


async def test_batch_and_parallel_sampling_return_lists(serve):
    session, base, _, _ = await serve()
    status, outs = await post(session, f"{base}/generate", {"text": ["a b", "c d e"], "sampling_params": GREEDY, "rid": "batch"})
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["batch_0", "batch_1"]
    status, outs = await post(session, f"{base}/generate", {"text": "x", "sampling_params": {**GREEDY, "temperature": 1.0, "n": 3}})
    assert status == 200 and len(outs) == 3 and all(len(o["output_ids"]) == 24 for o in outs)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input_ids": []}, "input_ids cannot be empty"),
        ({}, "Either text or input_ids"),
        ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"text": "hi", "sampling_params": {"max_tokens": 5}}, "unknown sampling_params"),
        ({"text": "hi", "logprob_start_len": 0, "return_logprob": True}, "input-token logprobs"),
        ({"text": "hi", "top_logprobs_num": 5}, "top_logprobs_num"),
        ({"text": ["a", "b"], "stream": True}, "streaming a batch"),
        ({"input_ids": [10**9]}, "prompt token ids"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}, "exceeds"),
        ({"text": "hi", "input_ids": [1]}, "either `text` or `input_ids`"),
    ],
)
async def test_bad_generate_requests_get_400_with_a_message(serve, body, words):
    session, base, _, _ = await serve()
    status, out = await post(session, f"{base}/generate", body)
    assert status == 400 and words in out["error"]["message"], out
    async with session.post(f"{base}/generate", data=b"{not json") as r:
        assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
    status, _ = await post(session, f"{base}/generate", {"text": "still serving", "sampling_params": GREEDY})
    assert status == 200


async def test_admin_endpoints_need_the_key_or_an_explicit_opt_in(serve):
    session, base, _, _ = await serve(SGLangApiSettings())
    status, out = await post(session, f"{base}/pause_generation", {})
    assert status == 403 and "admin_api_key" in out["error"]["message"]
    session, base, engine, _ = await serve(SGLangApiSettings(admin_api_key="s3cret"))
    status, out = await post(session, f"{base}/pause_generation", {}, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and engine.control.paused is None
    status, out = await post(session, f"{base}/pause_generation", {"mode": "in_place"}, headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and out == {"message": "Generation paused successfully.", "status": "ok"} and engine.control.paused == "in_place"
    assert "s3cret" not in repr(SGLangApiSettings(admin_api_key="s3cret"))


async def test_pause_abort_returns_partial_outputs_and_continue_resumes(serve):
    session, base, engine, _ = await serve()
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    before = engine.metrics.rollout_tokens_total
    pending = asyncio.create_task(post(session, f"{base}/generate", {"text": "Go", "sampling_params": long, "return_logprob": True}))
    # a token out, not a fixed sleep: a loaded box took over 0.1 s to the first (2026-12-06, three suite workers)
    await until(lambda: engine.metrics.rollout_tokens_total > before, 30, "the request's first token", step=0.01)
    status, out = await post(session, f"{base}/pause_generation")  # AReaL sends no body: SGLang's default mode is abort
    assert status == 200
    status, partial = await pending
    assert status == 200 and partial["meta_info"]["finish_reason"]["type"] == "abort"  # a 200 with the partial output, as SGLang
    assert 0 < len(partial["output_ids"]) < 200 and len(partial["meta_info"]["output_token_logprobs"]) == len(partial["output_ids"])
    queued = asyncio.create_task(post(session, f"{base}/generate", {"text": "Go", "sampling_params": GREEDY}))
    await asyncio.sleep(0.2)
    assert not queued.done()  # new requests wait while paused
    assert (await post(session, f"{base}/continue_generation", {}))[0] == 200
    status, out = await queued
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_retract_then_continue_loses_nothing(serve):
    session, base, engine, _ = await serve()
    body = {"text": "Go", "sampling_params": {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}}
    _, reference = await post(session, f"{base}/generate", body)
    pending = asyncio.create_task(post(session, f"{base}/generate", body))
    await until(lambda: engine.stats().rollout_running, 30, "the request running", step=0.01)
    await asyncio.sleep(0.05)
    assert (await post(session, f"{base}/pause_generation", {"mode": "retract"}))[0] == 200
    await until(lambda: engine.stats().rollout_pool.used_blocks == 0, 30, "the retracted request's KV freed", step=0.01)
    assert not pending.done()
    await post(session, f"{base}/continue_generation", {})
    _, out = await pending
    assert out["output_ids"] == reference["output_ids"]


def _changed(engine, scale=0.5):
    live = engine.policy_state_dict()
    name = next(n for n in live if n.endswith("mlp.down_proj.weight"))
    return name, live[name] * scale


async def test_update_weights_from_tensor_direct(serve):
    session, base, engine, _ = await serve()
    name, new = _changed(engine)
    named = [(name, new.clone())]
    body = {"serialized_named_tensors": [serialize_named_tensors(named)], "load_format": None, "flush_cache": True, "weight_version": "7"}
    status, out = await post(session, f"{base}/update_weights_from_tensor", body)
    assert status == 200 and out["success"] and "Weight version updated to 7" in out["message"], out
    assert torch.equal(engine.policy_state_dict()[name], new) and engine.policy_version == 7
    assert (await (await session.get(f"{base}/get_weight_version")).json()) == {"weight_version": "7"}
    _, gen = await post(session, f"{base}/generate", {"text": "hi", "sampling_params": GREEDY})
    assert gen["meta_info"]["weight_version"] == "7" and set(gen["meta_info"]["rose_token_versions"]) == {7}


async def test_update_weights_flattened_bucket_as_slime_sends_it(serve, monkeypatch):
    """slime pickles sglang's FlattenedTensorMetadata; a module of that name stands in for SGLang on the sending side."""

    FlattenedTensorMetadata = flattened_tensor_metadata(monkeypatch)
    session, base, engine, _ = await serve()
    live = engine.policy_state_dict()
    names = [n for n in live if n.endswith("input_layernorm.weight")][:2]
    tensors = [live[n] + 1.0 for n in names]
    flat = torch.cat([t.flatten() for t in tensors])
    metadata, start = [], 0
    for n, t in zip(names, tensors):
        metadata.append(FlattenedTensorMetadata(n, t.shape, t.dtype, start, start + t.numel(), t.numel()))
        start += t.numel()
    payload = serialize_named_tensors({"flattened_tensor": flat, "metadata": metadata})  # type: ignore[arg-type]
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False, "weight_version": "3"}
    status, out = await post(session, f"{base}/update_weights_from_tensor", body)
    assert status == 200 and out["success"], out
    for n, t in zip(names, tensors):
        assert torch.equal(engine.policy_state_dict()[n], t)


async def test_refused_weight_updates_keep_the_previous_weights(serve, tmp_path):
    session, base, engine, _ = await serve()
    before = {n: t.clone() for n, t in engine.policy_state_dict().items()}

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    status, out = await post(session, f"{base}/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert status == 400 and not out["success"] and "refusing to load builtins.print" in out["message"]
    status, out = await post(
        session, f"{base}/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors([("model.nope", torch.zeros(2))])]}
    )
    assert status == 400 and "unknown parameter names" in out["message"]
    name, new = _changed(engine)
    status, out = await post(
        session, f"{base}/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors([(name, new[:1].clone())])]}
    )
    assert status == 400 and "shape" in out["message"]
    status, out = await post(session, f"{base}/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and not out["success"] and out["num_paused_requests"] == 0
    status, out = await post(session, f"{base}/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]})
    assert status == 400 and "single rank" in out["error"]["message"]
    after = engine.policy_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.policy_version == 0


async def test_update_weights_from_disk(serve, tmp_path):
    session, base, engine, _ = await serve()
    name, new = _changed(engine, 2.0)
    save_file({name: new.contiguous()}, str(tmp_path / "model.safetensors"))
    status, out = await post(
        session, f"{base}/update_weights_from_disk", {"model_path": str(tmp_path), "abort_all_requests": True, "weight_version": "step-12"}
    )
    assert status == 200 and out == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to step-12.",
        "num_paused_requests": 0,
    }
    assert torch.equal(engine.policy_state_dict()[name], new)
    info = await (await session.get(f"{base}/get_model_info")).json()
    assert info["weight_version"] == "step-12" and info["is_generation"] and info["model_path"]


async def test_weight_pushes_are_refused_while_following_the_bus(serve):
    session, base, engine, _ = await serve(follows_bus_weights=True)
    name, new = _changed(engine)
    status, out = await post(session, f"{base}/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors([(name, new)])]})
    assert status == 409 and "weights.follow" in out["error"]["message"]


async def test_version_label_memory_cache_abort_info_and_metrics(serve):
    session, base, engine, _ = await serve()
    status, out = await post(session, f"{base}/update_weight_version", {"new_version": "v-next"})
    assert status == 200 and out == {"success": True, "message": "Weight version updated to v-next", "new_version": "v-next"}
    assert (await (await session.get(f"{base}/get_weight_version")).json())["weight_version"] == "v-next"

    assert (await post(session, f"{base}/release_memory_occupation", {"tags": ["kv_cache"]})) == (200, None)
    state = (await (await session.get(f"{base}/get_server_info")).json())["internal_states"][0]
    assert state["kv_cache_released"] and state["released_memory"] == ["kv_cache"]
    status, out = await post(session, f"{base}/release_memory_occupation", {"tags": ["cuda_graph"]})  # graphs stay resident: refused, named
    assert status == 400 and out["error"]["param"] == "tags" and "never released" in out["error"]["message"]
    status, out = await post(session, f"{base}/release_memory_occupation", {"tags": ["kv_cache", "gpu_dust"]})
    assert status == 400 and "unknown memory tags" in out["error"]["message"]
    assert (await post(session, f"{base}/resume_memory_occupation", {"tags": ["cuda_graph"]})) == (200, None)  # resident already: done
    assert (await (await session.get(f"{base}/get_server_info")).json())["internal_states"][0]["kv_cache_released"]
    assert (await post(session, f"{base}/resume_memory_occupation", {"tags": None})) == (200, None)
    info = await (await session.get(f"{base}/get_server_info")).json()
    assert not info["internal_states"][0]["kv_cache_released"] and info["version"].startswith("0.5.3") and "admin_api_key" not in info

    async with session.get(f"{base}/flush_cache") as r:
        assert r.status == 200 and (await r.text()).startswith("Cache flushed.")

    long = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}
    pending = asyncio.create_task(post(session, f"{base}/generate", {"text": "Go", "sampling_params": long, "rid": "to-abort"}))
    await until(lambda: engine.stats().rollout_running, 30, "the request running", step=0.01)
    assert (await post(session, f"{base}/abort_request", {"rid": "to-abort"}))[0] == 200
    _, out = await pending
    assert out["meta_info"]["finish_reason"]["type"] == "abort"

    async with session.get(f"{base}/health_generate") as r:
        assert r.status == 200
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    for metric in (
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:generation_tokens_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_aborted_requests_total",
    ):
        assert metric in text, metric


async def test_generate_queues_until_a_lease_on_a_serving_executor(serve):
    session, base, engine, _ = await serve(lease=False)
    pending = asyncio.create_task(post(session, f"{base}/generate", {"text": "wait", "sampling_params": GREEDY}))
    await asyncio.sleep(0.3)
    assert not pending.done()
    engine.set_rollout_lease(16 << 20, time.monotonic() + 60)
    status, out = await pending
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


async def test_generate_without_a_lease_in_time_is_a_503_that_says_why(serve):
    session, base, _, _ = await serve(SGLangApiSettings(allow_unauthenticated_admin=True, lease_wait_s=0.2), lease=False)
    status, out = await post(session, f"{base}/generate", {"text": "wait", "sampling_params": GREEDY})
    assert status == 503 and "no rollout lease" in out["error"]["message"]


async def test_health_generate_fails_for_a_while_after_a_rollout_iteration_raised(serve, monkeypatch):
    """/health_generate generates on the rollout lane: after a rollout iteration raised it answers 503
    with the failure (a router stops sending work) until the window has passed; a serving lane
    failure does not touch it."""
    from rose.services.executor import http_api

    session, base, engine, _ = await serve()
    engine.metrics.lane_failed("serving", RuntimeError("a serving fault"))
    async with session.get(f"{base}/health_generate") as r:
        assert r.status == 200
    engine.metrics.lane_failed("rollout", RuntimeError("a rollout fault"))
    async with session.get(f"{base}/health_generate") as r:
        body = await r.json()
        assert r.status == 503 and body["status"] == "degraded"
        assert body["last_lane_failure"]["lane"] == "rollout" and body["last_lane_failure"]["error"] == "RuntimeError: a rollout fault"
    monkeypatch.setattr(http_api, "LANE_FAILURE_HEALTH_WINDOW_S", 0.0)  # the window has passed
    async with session.get(f"{base}/health_generate") as r:
        assert r.status == 200
