"""The SGLang engine backend against real HTTP servers that speak SGLang's API.

SGLang itself cannot be installed here, so the stand-in SGLang servers are two of our own executors
(real processes) with their SGLang-compatible endpoints (sglang_api.py): one runs the serving model,
one the policy. The backend is driven in-process (its engine surface directly) and as a third
executor process with `ROSE_ENGINE__BACKEND=sglang` (OpenAI API, rollout over the bus, leases,
metrics snapshots). Wire-format pieces (SSE, Prometheus text, bucket -> sketch) are checked first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time

import aiohttp
import pytest
import torch
from ddsketch import DDSketch

from rose.contracts import GenerateRequest, Lease, MetricsSnapshot
from rose.contracts import SamplingParams as WireSampling
from rose.contracts.registry import EXECUTOR_METRICS, GENERATE, LEASE
from rose.services.executor.backend import CoServingEngine
from rose.services.executor.config import SGLangBackendSettings
from rose.services.executor.policy_updates import PolicyUpdates
from rose.services.executor.protocol import EngineSampling, GenerationRequest, InvalidRequest, RolloutRejected, WorkClass
from rose.services.executor.sglang_backend import SGLangBackend
from rose.services.executor.sglang_wire import Histogram, SSEDecoder, add_buckets, error_message, finish_reason_of, histogram_delta, parse_metrics
from rose.services.executor.weights import WeightUpdateError
from rose.shared.bus import Bus
from rose.shared.codec import decode
from rose.shared.launch import ServiceProcess, start_all
from rose.shared.provisioning import provision
from rose.testing.engine import CoServingEngineTestcase
from rose.testing.messages import lease_for
from rose.testing.polling import until

START_TIMEOUT_S = 120.0
FAR = 3600.0  # a lease that outlives the test


# ---------------------------------------------------------------------------- wire formats (no servers)


def test_sse_decoder_reassembles_events_split_anywhere():
    stream = b'data: {"text": "a"}\n\ndata: {"text": "ab"}\r\n\r\n: comment\n\ndata: [DONE]\n\n'
    for size in (1, 2, 3, 7, len(stream)):
        decoder = SSEDecoder()
        events = [e for i in range(0, len(stream), size) for e in decoder.feed(stream[i : i + size])]
        assert events == ['{"text": "a"}', '{"text": "ab"}', "[DONE]"], size


def test_error_bodies_and_finish_reasons_of_sglang():
    assert error_message('{"error": {"message": "input_ids cannot be empty."}}') == "input_ids cannot be empty."
    assert error_message('{"object": "error", "message": "bad", "type": "Bad Request", "code": 400}') == "bad"
    assert error_message('{"success": false, "message": "Failed to update weights"}') == "Failed to update weights"
    assert error_message("Cache flushed.\n") == "Cache flushed."
    assert finish_reason_of({"type": "stop", "matched": 2}) == "stop"
    assert finish_reason_of({"type": "length", "length": 8}) == "length"
    assert finish_reason_of({"type": "abort", "message": "Abort in waiting queue"}) == "abort"
    assert finish_reason_of({"type": "something new"}) == "abort" and finish_reason_of(None) is None


METRICS_TEXT = """\
# HELP sglang:time_to_first_token_seconds Time to first token.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="m"} 5.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 6.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 1.5
sglang:time_to_first_token_seconds_count{model_name="m"} 6.0
# HELP sglang:generation_tokens_total Generated tokens.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 120.0
sglang:generation_tokens_created{model_name="m"} 1.7e9
# HELP sglang:num_running_reqs Running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="1",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 2.0
"""


def test_prometheus_text_is_reduced_per_metric():
    scrape = parse_metrics(METRICS_TEXT)
    ttft = scrape.histograms["sglang:time_to_first_token_seconds"]
    assert ttft.buckets == {0.1: 2.0, 0.2: 5.0, math.inf: 6.0} and ttft.count == 6.0 and ttft.sum == 1.5
    assert scrape.values["sglang:generation_tokens_total"] == 120.0
    # tensor-parallel ranks report one batch (counted once), data-parallel ranks add up
    assert scrape.values["sglang:num_running_reqs"] == 5.0


def test_histogram_deltas_and_server_restarts():
    prev = Histogram({0.1: 2.0, 0.2: 5.0, math.inf: 6.0}, sum=1.5, count=6.0)
    cur = Histogram({0.1: 2.0, 0.2: 9.0, math.inf: 11.0}, sum=3.0, count=11.0)
    buckets, total = histogram_delta(prev, cur)
    assert buckets == [(0.1, 0.2, 4.0), (0.2, math.inf, 1.0)] and total == pytest.approx(1.5)
    restarted = Histogram({0.1: 1.0, 0.2: 1.0, math.inf: 1.0}, sum=0.05, count=1.0)
    assert histogram_delta(cur, restarted) == ([(0.0, 0.1, 1.0)], 0.05)


def test_buckets_become_a_sketch_at_representative_values():
    one = DDSketch(0.01)  # every observation in one bucket: the interval's mean is exact
    assert add_buckets(one, [(0.1, 0.2, 4.0)], total=0.6) == 4.0
    assert one.count == 4 and one.get_quantile_value(0.5) == pytest.approx(150.0, rel=0.02)
    spread = DDSketch(0.01)  # several: the geometric midpoint, half the first bound, the overflow's leftover
    add_buckets(spread, [(0.0, 0.1, 1.0), (0.1, 0.4, 2.0), (0.4, math.inf, 1.0)], total=0.05 + 2 * 0.2 + 1.0)
    assert spread.count == 4
    assert spread.get_quantile_value(0.0) == pytest.approx(50.0, rel=0.02)
    assert spread.get_quantile_value(0.5) == pytest.approx(200.0, rel=0.02)
    assert spread.get_quantile_value(1.0) == pytest.approx(1000.0, rel=0.02)


# ---------------------------------------------------------------------------- stand-in SGLang servers (real processes)


def _stand_in_env(nats_server, state_dir, models_dir, model: str) -> dict[str, str]:
    return {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_MODELS__POLICY_DIR": str(models_dir / model),  # the model its SGLang endpoints serve
        "ROSE_ROLE": "dedicated",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "4",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
        "ROSE_WEIGHTS__FOLLOW": "false",
        "ROSE_SGLANG_API__ALLOW_UNAUTHENTICATED_ADMIN": "true",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
    }


@pytest.fixture(scope="module")
async def servers(nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
    """Two stand-in SGLang servers: {"serving": url, "rollout": url, "procs": {...}}."""
    logs = tmp_path_factory.mktemp("sglang-stand-ins")
    procs = {
        name: ServiceProcess("executor", f"sglang-{name}", _stand_in_env(nats_server, state_dir, models_dir, model), logs / f"{name}.log")
        for name, model in (("serving", "serving"), ("rollout", "policy"))
    }
    try:
        async with Bus(bus_config, service="tests", instance="sglang-backend-fixture") as bus:
            await provision(bus.js)
            await start_all(bus, list(procs.values()), START_TIMEOUT_S)
            urls = {name: (await p.wait_ready(bus, START_TIMEOUT_S))["http"] for name, p in procs.items()}
        yield {**urls, "procs": procs}
    finally:
        for p in procs.values():
            p.stop()


def _backend(servers, models_dir, **settings) -> SGLangBackend:
    s = SGLangBackendSettings(serving_url=servers["serving"], rollout_url=servers["rollout"], scrape_interval_s=0.2, **settings)
    return SGLangBackend(s, serving_dir=str(models_dir / "serving"), policy_dir=str(models_dir / "policy"), device="cpu")


async def _get(url: str, path: str, **params) -> object:
    async with aiohttp.ClientSession() as s, s.get(url + path, params=params) as r:
        assert r.status == 200, await r.text()
        return await r.json(content_type=None)


async def _state(url: str) -> dict:
    """What the stand-in reports of its rollout side: paused mode, released memory, lease."""
    return (await _get(url, "/get_server_info"))["internal_states"][0]


def _request(work_class: WorkClass, max_tokens: int = 6, *, stream: bool = True, ignore_eos: bool = False, **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{work_class.value}-{time.monotonic_ns()}",
        work_class=work_class,
        prompt_token_ids=(5, 6, 7, 8, 9),
        sampling=EngineSampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
        stream=stream,
        **kw,
    )


async def test_serving_streams_with_local_timings_and_scraped_stats(servers, models_dir):
    backend = _backend(servers, models_dir)
    assert isinstance(backend, CoServingEngine)
    backend.start()
    try:
        await until(lambda: backend.scrapes.rounds, 10, "the first scrape (the counters' baseline)")
        backend.stats()  # the interval starts now
        handle = backend.submit(_request(WorkClass.SERVING, 8, ignore_eos=True))
        deltas = [d async for d in handle]
        result = await handle.result()
        assert result.finish_reason == "length" and len(result.token_ids) == 8
        assert sum((d.token_ids for d in deltas), ()) == result.token_ids and "".join(d.text for d in deltas) == result.text
        assert deltas[-1].finished and deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])
        assert len(result.logprobs) == 8 and all(lp <= 0.0 for lp in result.logprobs)
        t = result.timings
        assert 0 < t.ttft_ms <= t.total_ms and len(t.token_times_ms) == 8 and t.token_times_ms == tuple(sorted(t.token_times_ms))
        assert result.policy_version == 0 and set(result.token_versions) == {0}

        quiet = await backend.submit(_request(WorkClass.SERVING, 4, stream=False)).result()  # a non-streaming caller
        assert quiet.finish_reason in ("stop", "length") and 1 <= len(quiet.token_ids) <= 4

        with pytest.raises(InvalidRequest, match="positions"):
            backend.submit(
                GenerationRequest(
                    request_id="too-long", work_class=WorkClass.SERVING, prompt_token_ids=(1,) * 10, sampling=EngineSampling(max_tokens=60000)
                )
            )
        with pytest.raises(InvalidRequest, match="token ids"):
            backend.submit(
                GenerationRequest(
                    request_id="bad-ids", work_class=WorkClass.SERVING, prompt_token_ids=(1, 10**7), sampling=EngineSampling(max_tokens=2)
                )
            )

        seen = {"ttft": 0.0, "tpot": 0.0, "tokens": 0.0, "completed": 0}

        def scraped():
            s = backend.stats()
            seen["ttft"] += s.ttft_ms["count"]
            seen["tpot"] += s.tpot_ms["count"]
            seen["tokens"] += s.serving_tokens_per_s * s.interval_s
            seen["completed"] += s.serving_completed
            return seen["ttft"] >= 2 and seen["tokens"] >= 9

        await until(scraped, 10, "the serving server's TTFT histogram in the stats", step=0.25)
        assert seen["tpot"] >= 7 and seen["completed"] == 2  # inter-token latencies of the 8-token request
        stats = backend.stats()
        assert stats.serving_pool.block_bytes > 0 and stats.device["kind"] == "cpu"
    finally:
        await backend.stop()


async def test_rollout_only_under_a_lease_and_lending_drives_the_server(servers, models_dir):
    url = servers["rollout"]
    backend = _backend(servers, models_dir)
    backend.start()
    try:
        # no lease: refused here, and the rollout server is paused with its KV cache released
        with pytest.raises(RolloutRejected) as refused:
            backend.submit(_request(WorkClass.ROLLOUT))
        assert refused.value.reason == "no_lease"
        state = await until(lambda: _paused_and_released(url), 10, "the rollout server paused and released")
        waiting = backend.submit(_request(WorkClass.ROLLOUT, 4, stream=False), require_lease=False)  # waits for a lease here
        await until(lambda: backend.stats().rollout_queue >= 1, 10, "the turn queued")
        await asyncio.sleep(0.3)
        assert not waiting.done() and backend.stats().rollout_queue >= 1  # and it stays queued

        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-1")
        state = await until(lambda: _lent(url), 10, "the rollout server resumed and continued")
        assert state["kv_cache_released"] is False
        first = await waiting.result()
        assert first.finish_reason in ("stop", "length") and first.token_ids
        turn = await backend.submit(_request(WorkClass.ROLLOUT, 5, stream=False, trajectory_id="traj-1")).result()
        assert 1 <= len(turn.token_ids) <= 5 and len(turn.logprobs) == len(turn.token_ids) and all(lp <= 0 for lp in turn.logprobs)
        assert turn.policy_version == 0 and backend.stats().lease_id == "lease-1"

        # cancel: /abort_request on the server, which answers with what it made so far
        long = backend.submit(_request(WorkClass.ROLLOUT, 400, stream=False, ignore_eos=True))
        await asyncio.sleep(0.3)
        long.cancel()
        cancelled = await asyncio.wait_for(long.result(), 10)
        assert cancelled.finish_reason == "abort" and len(cancelled.token_ids) < 400

        # revoke: paused (retract) and KV released; the reclaim latency is in the stats
        backend.stats()
        backend.revoke_rollout()
        with pytest.raises(RolloutRejected) as refused:
            backend.submit(_request(WorkClass.ROLLOUT))
        assert refused.value.reason == "lease_revoked"
        state = await until(lambda: _paused_and_released(url), 10, "the rollout server paused after the revoke")
        assert state["paused"] == "retract"
        await until(lambda: backend.stats().reclaim_latency_ms, 5, "a reclaim latency sample")

        # a short lease expires here on time, whatever the scheduler does
        backend.set_rollout_lease(8 << 20, time.monotonic() + 0.6, "lease-2")
        await until(lambda: _lent(url), 10, "lent again")
        await asyncio.sleep(0.7)
        with pytest.raises(RolloutRejected) as refused:
            backend.submit(_request(WorkClass.ROLLOUT))
        assert refused.value.reason == "lease_expired"
        await until(lambda: _paused_and_released(url), 10, "the rollout server paused after the expiry")

        # revoked on a burst (parked): nothing new is taken, the server pauses in place (KV kept);
        # a new lease continues the parked request where it was, to its full length
        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-3")
        await until(lambda: _lent(url), 10, "lent again")
        parked = backend.submit(_request(WorkClass.ROLLOUT, 400, stream=False, ignore_eos=True))
        await asyncio.sleep(0.2)
        backend.park_rollout(time.monotonic() + FAR)
        with pytest.raises(RolloutRejected) as refused:
            backend.submit(_request(WorkClass.ROLLOUT))
        assert refused.value.reason == "lease_revoked" and "parked" in str(refused.value)
        await until(lambda: _parked(url), 10, "the rollout server paused in place")
        assert not parked.done()
        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-4")
        done = await asyncio.wait_for(parked.result(), 60)
        assert done.finish_reason == "length" and len(done.token_ids) == 400

        # a park that runs out ends the lease as an expiry does: paused with retract, KV released
        backend.park_rollout(time.monotonic() + 0.5)
        await until(lambda: _paused_and_released(url), 10, "the rollout server released at the park's end")
    finally:
        await backend.stop()


async def _paused_and_released(url: str) -> dict | None:
    state = await _state(url)
    return state if state["paused"] and state["kv_cache_released"] else None


async def _parked(url: str) -> dict | None:
    state = await _state(url)
    return state if state["paused"] == "in_place" and not state["kv_cache_released"] else None


async def _lent(url: str) -> dict | None:
    state = await _state(url)
    return state if not state["paused"] and not state["released_memory"] else None


async def _served(url: str, name: str, rows: int = 10**6) -> torch.Tensor:
    """A live parameter of a stand-in (its first `rows` rows), as fp32 (exact through JSON)."""
    return torch.tensor(await _get(url, "/get_weights_by_name", name=name, truncate_size=rows), dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


async def test_weight_updates_send_only_changed_tensors_and_land_bit_exact(servers, models_dir, caplog):
    url = servers["rollout"]
    caplog.set_level(logging.INFO, "rose.executor.sglang")
    backend = _backend(servers, models_dir)
    backend.start()
    try:
        original = {n: t.clone() for n, t in backend.policy_state_dict().items()}
        name = next(n for n in original if n.endswith("layers.0.self_attn.q_proj.weight"))
        other = next(n for n in original if n.endswith("layers.1.mlp.up_proj.weight"))
        state = {n: t.clone() for n, t in original.items()}
        state[name].view(-1)[:64] += 0.25
        # through PolicyUpdates, as the bus weight follower applies versions
        pause_ms = await PolicyUpdates(backend).apply(state, 1)
        assert pause_ms >= 0 and backend.policy_version == 1
        assert "policy version 1 on the rollout server: 1 tensors sent (tensor)" in caplog.text
        assert (await _get(url, "/get_weight_version"))["weight_version"] == "1"
        assert torch.equal(_bits(await _served(url, name)), _bits(state[name]))
        assert torch.equal(_bits(await _served(url, other, 4)), _bits(original[other][:4]))
        assert torch.equal(_bits(backend.policy_state_dict()[name]), _bits(state[name]))  # the mirror follows

        # the next delta is taken against the mirror: putting the old values back sends that tensor again
        caplog.clear()
        await asyncio.wrap_future(backend.apply_policy_weights(original, 2))
        assert "policy version 2 on the rollout server: 1 tensors sent (tensor)" in caplog.text
        assert torch.equal(_bits(await _served(url, name)), _bits(original[name]))
        # nothing changed: only the version label moves
        caplog.clear()
        await asyncio.wrap_future(backend.apply_policy_weights({other: original[other]}, 3))
        assert "0 tensors sent" in caplog.text and (await _get(url, "/get_weight_version"))["weight_version"] == "3"
        # a version that changed no weight reaches it as the weight follower hands it over, an empty state: the label moves
        caplog.clear()
        await PolicyUpdates(backend).apply({}, 4)
        assert "0 tensors sent" in caplog.text and (await _get(url, "/get_weight_version"))["weight_version"] == "4"

        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-w")
        turn = await backend.submit(_request(WorkClass.ROLLOUT, 3, stream=False)).result()
        assert turn.policy_version == 4 and set(turn.token_versions) == {4}
        streamed = await backend.submit(_request(WorkClass.ROLLOUT, 3, stream=True)).result()  # a streaming rollout caller
        assert streamed.policy_version == 4 and len(streamed.logprobs) == len(streamed.token_ids)

        # a state that does not fit the policy is refused here, before anything is sent
        with pytest.raises(WeightUpdateError, match="shape"):
            backend.apply_policy_weights({name: torch.zeros(3, 3)}, 5)
        assert backend.policy_version == 4
    finally:
        await backend.stop()


async def test_a_refused_update_keeps_the_old_version(servers, models_dir):
    # the wrong server behind rollout_url (it runs the serving model): it refuses the policy's tensors with a 400
    wrong = {**servers, "rollout": servers["serving"]}
    backend = _backend(wrong, models_dir)
    backend.start()
    try:
        before = {n: t.clone() for n, t in backend.policy_state_dict().items()}
        state = {n: t.clone() for n, t in before.items()}
        name = next(n for n in state if n.endswith("q_proj.weight"))
        state[name] += 1.0
        with pytest.raises(WeightUpdateError, match="refused version 7") as refused:
            await asyncio.wrap_future(backend.apply_policy_weights(state, 7))
        assert "Failed to update weights" in str(refused.value)  # the server's own message
        assert backend.policy_version == 0 and torch.equal(backend.policy_state_dict()[name], before[name])
        assert (await _get(servers["serving"], "/get_weight_version"))["weight_version"] == "0"
    finally:
        await backend.stop()
        async with aiohttp.ClientSession() as s:  # this backend lent and reclaimed the serving stand-in: give it back
            for path, body in (("/resume_memory_occupation", {"tags": ["kv_cache"]}), ("/continue_generation", {})):
                async with s.post(servers["serving"] + path, json=body) as r:
                    assert r.status == 200


async def test_disk_sync_writes_a_model_directory_the_server_loads(servers, models_dir, tmp_path):
    url = servers["rollout"]
    backend = _backend(servers, models_dir, weight_sync="disk", staging_dir=str(tmp_path / "staging"))
    backend.start()
    try:
        state = {n: t.clone() for n, t in backend.policy_state_dict().items()}
        name = next(n for n in state if n.endswith("layers.2.mlp.down_proj.weight"))
        state[name].view(-1)[::7] *= -1.0
        for version in (4, 5):
            state[name].view(-1)[version] = float(version)
            await asyncio.wrap_future(backend.apply_policy_weights(state, version))
            assert (await _get(url, "/get_weight_version"))["weight_version"] == str(version)
            assert torch.equal(_bits(await _served(url, name)), _bits(state[name]))
        staged = sorted(p.name for p in (tmp_path / "staging").iterdir())
        assert staged == ["v5"] and (tmp_path / "staging" / "v5" / "config.json").exists()  # older versions are dropped
    finally:
        await backend.stop()


async def test_a_request_the_server_refuses_raises_its_message(servers, models_dir, tmp_path):
    # the local copy of the serving model claims more positions than the server's: the server says no (400)
    local = tmp_path / "serving"
    shutil.copytree(models_dir / "serving", local)
    config = json.loads((local / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 100_000}))
    s = SGLangBackendSettings(serving_url=servers["serving"], rollout_url=servers["rollout"])
    backend = SGLangBackend(s, serving_dir=str(local), policy_dir=str(models_dir / "policy"), device="cpu")
    backend.start()
    try:
        for stream in (True, False):
            handle = backend.submit(
                GenerationRequest(
                    request_id=f"long-{stream}",
                    work_class=WorkClass.SERVING,
                    prompt_token_ids=(5, 6, 7),
                    sampling=EngineSampling(max_tokens=5000),
                    stream=stream,
                )
            )
            assert [d async for d in handle] == []
            with pytest.raises(InvalidRequest, match="exceeds the model's 2048 positions"):
                await handle.result()
        await until(lambda: backend.stats().serving_pool.total_blocks > 0, 5, "the serving server's KV capacity")
    finally:
        await backend.stop()
        async with aiohttp.ClientSession() as session:  # this backend reclaimed the rollout stand-in on start: lend it back
            for path, body in (("/resume_memory_occupation", {"tags": ["kv_cache"]}), ("/continue_generation", {})):
                async with session.post(servers["rollout"] + path, json=body) as r:
                    assert r.status == 200


async def test_a_server_that_is_down_finishes_requests_with_abort(servers, models_dir, unused_tcp_port):
    down = f"http://127.0.0.1:{unused_tcp_port}"
    backend = _backend({"serving": down, "rollout": down}, models_dir, connect_timeout_s=2.0)
    backend.start()
    try:
        result = await asyncio.wait_for(backend.submit(_request(WorkClass.SERVING)).result(), 10)
        assert result.finish_reason == "abort" and result.token_ids == ()
        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-down")  # the grant fails (logged), rollout does not wait for ever
        result = await asyncio.wait_for(backend.submit(_request(WorkClass.ROLLOUT, stream=False)).result(), 10)
        assert result.finish_reason == "abort"
        with pytest.raises(WeightUpdateError, match="could not send"):
            await asyncio.wrap_future(backend.apply_policy_weights({n: t + 1 for n, t in list(backend.policy_state_dict().items())[:1]}, 1))
        stats = backend.stats()
        assert stats.serving_running == 0 and stats.policy_version == 0
    finally:
        await asyncio.wait_for(backend.stop(), 15)


# ---------------------------------------------------------------------------- an executor process on the sglang backend


@pytest.fixture(scope="module")
async def backend_executor(servers, nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
    """`rose run executor` with ROSE_ENGINE__BACKEND=sglang in front of the stand-ins; yields (executor id, http URL)."""
    env = {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_ENGINE__BACKEND": "sglang",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_WEIGHTS__FOLLOW": "false",
        "ROSE_SGLANG_BACKEND__SERVING_URL": servers["serving"],
        "ROSE_SGLANG_BACKEND__ROLLOUT_URL": servers["rollout"],
        "ROSE_SGLANG_BACKEND__SCRAPE_INTERVAL_S": "0.2",
        "ROSE_METRICS_INTERVAL_S": "0.5",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
    }
    proc = ServiceProcess("executor", "ex-sglang-backend", env, tmp_path_factory.mktemp("sglang-backend") / "executor.log").start()
    try:
        async with Bus(bus_config, service="tests", instance="sglang-backend-exec") as bus:
            endpoints = await proc.wait_ready(bus, START_TIMEOUT_S)
        yield proc.instance, endpoints["http"], proc
    finally:
        proc.stop()


def _turn(lease: Lease, max_tokens: int = 6, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"sg-turn-{time.monotonic_ns()}",
        trajectory_id="sg-traj",
        turn_index=0,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=WireSampling(temperature=0.0, max_tokens=max_tokens, **kw),
        lease_id=lease.lease_id,
        lease_epoch=lease.epoch,
    )


async def test_executor_serves_openai_through_the_serving_server(backend_executor, bus):
    from openai import AsyncOpenAI

    ex, http, _ = backend_executor
    sub = await bus.nc.subscribe(EXECUTOR_METRICS.subject(executor_id=ex))
    client = AsyncOpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        done = await client.completions.create(model="rose-serving", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0)
        assert done.choices[0].finish_reason in ("stop", "length") and 1 <= done.usage.completion_tokens <= 5
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="rose-serving",
                messages=[{"role": "user", "content": "2+2="}],
                max_tokens=6,
                temperature=0,
                stream=True,
            )
        ]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[0].choices[0].delta.role == "assistant"
        # the telemetry task publishes snapshots whose latency sketches come from the serving server's histograms
        snaps: list[MetricsSnapshot] = []

        async def two_first_tokens_counted() -> bool:
            snaps.append(decode((await sub.next_msg(timeout=5)).data, MetricsSnapshot))
            return sum(s.ttft_ms.count for s in snaps) >= 2

        await until(two_first_tokens_counted, 10, "two first tokens in the published latency sketches", step=0)
        assert snaps[-1].device is not None and snaps[-1].device.kind == "cpu"
        health = await _get(http, "/health")  # the executor's own health, over a backend with no local lanes
        assert health["status"] == "ok" and health["lane_failures"] == 0
    finally:
        await sub.unsubscribe()
        await client.close()


async def test_executor_lends_the_rollout_server_under_bus_leases(backend_executor, bus, servers):
    ex, _, _ = backend_executor
    url = servers["rollout"]
    await bus.kv_delete(LEASE, executor_id=ex)
    await until(lambda: _paused_and_released(url), 10, "no lease: the rollout server paused and released")
    lease = lease_for(ex, 1)
    reply = await bus.request(GENERATE, _turn(lease), executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason in ("no_lease", "lease_revoked")

    await bus.kv_put(LEASE, lease, executor_id=ex)
    await until(lambda: _lent(url), 10, "the lease lends the rollout server")
    reply = await bus.request(GENERATE, _turn(lease), executor_id=ex, timeout=30)
    assert reply.status == "ok", reply.error
    assert 1 <= len(reply.token_ids) <= 6 and len(reply.logprobs) == len(reply.token_ids) and reply.finish_reason in ("stop", "length")
    served = int((await _get(url, "/get_weight_version"))["weight_version"] or 0)
    assert reply.policy_version == served  # the version the rollout server reports, whatever earlier tests loaded

    await bus.kv_put(LEASE, lease_for(ex, 1, state="revoked"), executor_id=ex)
    state = await until(lambda: _paused_and_released(url), 10, "the revoke pauses the rollout server")
    assert state["paused"] == "retract"
    reply = await bus.request(GENERATE, _turn(lease), executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason == "lease_revoked"

    lease = lease_for(ex, 2)
    await bus.kv_put(LEASE, lease, executor_id=ex)
    await until(lambda: _lent(url), 10, "a new lease resumes it")
    reply = await bus.request(GENERATE, _turn(lease, 4), executor_id=ex, timeout=30)
    assert reply.status == "ok", reply.error


async def test_a_killed_rollout_server_aborts_the_turn_and_the_executor_carries_on(backend_executor, bus, servers):
    ex, http, proc = backend_executor
    lease = lease_for(ex, 3)
    await bus.kv_put(LEASE, lease, executor_id=ex)
    await until(lambda: _lent(servers["rollout"]), 10, "lent")
    long_turn = asyncio.ensure_future(bus.request(GENERATE, _turn(lease, 1500), executor_id=ex, timeout=60))
    await asyncio.sleep(1.0)
    assert not long_turn.done()
    rollout = servers["procs"]["rollout"]
    rollout.kill()  # SIGKILL mid-generation
    try:
        reply = await asyncio.wait_for(long_turn, 20)
        assert reply.finish_reason == "abort" and len(reply.token_ids) < 1500
        assert proc.alive()
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{http}/v1/completions", json={"model": "rose-serving", "prompt": [5, 6], "max_tokens": 3, "temperature": 0}) as r,
        ):
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] in ("stop", "length")
    finally:  # the module's later tests (the shared engine test case below) need a rollout server again
        rollout.start()
        servers["rollout"] = (await rollout.wait_ready(bus, START_TIMEOUT_S))["http"]


class TestSGLangBackend(CoServingEngineTestcase):
    """The shared engine test case (rose.testing.engine) on the SGLang backend before its stand-in servers."""

    @pytest.fixture
    async def engine(self, servers, models_dir):
        backend = _backend(servers, models_dir)
        backend.start()
        yield backend
        await backend.stop()
