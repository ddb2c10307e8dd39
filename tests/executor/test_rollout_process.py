"""The rollout lane's forwards and sampling in a child process (CPU): same tokens, same logprobs,
same weights, same KV as in the engine's own process; a dead child is replaced and nothing is lost."""

import asyncio
import dataclasses
import os
import signal
import time

import pytest
import torch

from rose.services.executor.engine import EngineConfig
from rose.services.executor.forward_item import ForwardItem
from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass
from rose.services.executor.rollout_process import ProcessRunner, _Samplers
from rose.services.executor.sampling import SamplerState
from rose.shared.models import load_model
from rose.testing.polling import until_sync

# one torch thread throughout: a lane widened over a lent core for some layers rounds differently

HERE = EngineConfig(serving_kv_bytes=8 << 20, rollout_kv_bytes=16 << 20, device="cpu", seed=0, lend_serving_core=False)
IN_CHILD = dataclasses.replace(HERE, rollout_process=True)


def _turns(tag: str, n: int = 6) -> list[GenerationRequest]:
    """Sampled rollout turns of different lengths, two of them one trajectory's turns."""
    out = []
    for i in range(n):
        sampling = EngineSampling(temperature=0.9, top_p=0.95 if i == 1 else 1.0, max_tokens=12 + 3 * i, seed=100 + i, ignore_eos=True)
        out.append(
            GenerationRequest(
                request_id=f"{tag}-{i}",
                work_class=WorkClass.ROLLOUT,
                prompt_token_ids=tuple(range(30 + i, 50 + 2 * i)),
                sampling=sampling,
                trajectory_id=f"{tag}-traj" if i < 2 else None,
                stream=False,
            )
        )
    return out


async def _generate(engine, requests) -> list[tuple[tuple[int, ...], tuple[float, ...], int]]:
    """One at a time: a batch's make-up (which depends on when the lane wakes) changes float rounding."""
    results = [await engine.submit(r).result() for r in requests]
    return [(r.token_ids, r.logprobs, r.policy_version) for r in results]


def _same(a, b) -> bool:
    """Same tokens and versions; logprobs equal up to float rounding (the child's tensors sit in
    shared memory, aligned differently, and BLAS kernels round by alignment). A sampled token
    only changes if its uniform falls within that rounding of a CDF step."""
    return len(a) == len(b) and all(
        ta == tb and va == vb and torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4) for (ta, la, va), (tb, lb, vb) in zip(a, b)
    )


def _runner(engine) -> ProcessRunner:
    runner = engine.work_for(WorkClass.ROLLOUT).runner
    assert isinstance(runner, ProcessRunner) and runner.child_pid != os.getpid()
    return runner


async def test_the_child_samples_exactly_what_the_engine_would(make_engine):
    here = make_engine(config=HERE, fresh_policy=True)
    there = make_engine(config=IN_CHILD, fresh_policy=True)
    _runner(there)
    assert _same(await _generate(there, _turns("a")), await _generate(here, _turns("a")))
    # the engine's generators kept pace with the child's: a sequence the engine samples itself
    # (or a fresh child rebuilds) continues the same stream
    assert _same(await _generate(there, _turns("b")), await _generate(here, _turns("b")))
    assert there.stats().device["process_rss_bytes"] > here.stats().device["process_rss_bytes"]  # the child's memory counts
    # the policy's occupancy guard applies only where rollout ops hand the serving lane's interpreter lock over
    assert here.rollout_shares_interpreter and not there.rollout_shares_interpreter


def test_the_child_is_sent_weights_that_need_no_transformers(model_paths):
    """What the child unpickles (``ModelWeights``) imports torch only: transformers' model code
    would add seconds to every executor start."""
    import pickle
    import subprocess
    import sys

    from rose.services.executor.model_runner import ModelWeights

    weights = ModelWeights.of(load_model(model_paths.policy))
    probe = (
        "import pickle, sys; w = pickle.load(sys.stdin.buffer); print(sorted(m for m in sys.modules if m.startswith('transformers')), len(w.params))"
    )
    done = subprocess.run([sys.executable, "-c", probe], input=pickle.dumps(weights), capture_output=True, check=True)
    assert done.stdout.decode().split() == ["[]", str(len(weights.params))]


async def test_weight_swaps_reach_the_child(make_engine):
    here = make_engine(config=HERE, fresh_policy=True)
    there = make_engine(config=IN_CHILD, fresh_policy=True)
    before = await _generate(there, _turns("w0"))
    new = {name: t + 0.05 * torch.randn_like(t) for name, t in here.policy_state_dict().items() if name.endswith("mlp.up_proj.weight")}
    for engine in (here, there):
        await asyncio.wrap_future(engine.apply_policy_weights(new, 1))
    after_here, after_there = await _generate(here, _turns("w0")), await _generate(there, _turns("w0"))
    assert _same(after_there, after_here) and {v for _, _, v in after_there} == {1}
    assert [t for t, _, _ in after_there] != [t for t, _, _ in before]


async def test_a_killed_child_is_replaced_and_the_rollout_goes_on(make_engine):
    here = make_engine(config=HERE, fresh_policy=True)
    there = make_engine(config=IN_CHILD, fresh_policy=True)
    runner = _runner(there)
    await _generate(there, _turns("k0", 2))
    os.kill(runner.child_pid, signal.SIGKILL)
    # a fresh child: weights and KV are the engine's; the sampled streams are rebuilt from seed and draws
    assert _same(await _generate(there, _turns("k1")), await _generate(here, _turns("k1")))
    assert runner.restarts == 1


async def test_released_and_restored_kv_is_handed_to_the_child(make_engine):
    here = make_engine(config=HERE, fresh_policy=True)
    there = make_engine(config=IN_CHILD, fresh_policy=True)
    await _generate(there, _turns("r0", 2))
    freed = await asyncio.wrap_future(there.control.release_memory(("kv_cache",)))
    assert freed["kv_cache"] > 0
    await asyncio.wrap_future(there.control.resume_memory(("kv_cache",)))
    assert _same(await _generate(there, _turns("r1")), await _generate(here, _turns("r1")))


def test_rebuilt_generators_continue_the_engines_stream():
    params = EngineSampling(temperature=1.0, seed=7)
    live = SamplerState(params, 7)
    for _ in range(5):
        live.draw()
    samplers = _Samplers()
    ((_, rebuilt),) = samplers.states([(0, 1, params, 7, live.draws)])
    assert rebuilt.draw().item() == live.draw().item()
    ((_, same),) = samplers.states([(0, 1, params, 7, live.draws)])
    assert same is rebuilt  # kept while in step with the engine
    ((_, other),) = samplers.states([(0, 1, params, 8, live.draws)])
    assert other is not rebuilt  # another sequence behind a reused key: never its generator


def _long_prefill(make_engine) -> tuple[ProcessRunner, list[ForwardItem]]:
    """An in-child engine's runner and a 4k-token prefill (16 x 256): it outlasts the engine's 1 ms
    polls, so the child meets the engine's stop or hold at one of its layer safepoints."""
    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    pool.set_budget_bytes(pool.num_blocks * pool.block_bytes)
    tokens = 256
    return _runner(engine), [ForwardItem(pool.allocate(pool.blocks_for(tokens)), 0, list(range(10, 10 + tokens))) for _ in range(16)]


def test_a_forward_stops_at_the_childs_safepoint_and_samples_nothing(loaded, make_engine):
    runner, items = _long_prefill(make_engine)
    state = SamplerState(EngineSampling(temperature=1.0), 3)
    assert runner.forward_sample(items, [(0, state)], should_stop=lambda: True) is None  # a 4k-token prefill: stopped at a layer
    assert state.draws == 0  # nothing sampled, no randomness used
    ids, logprobs = runner.forward_sample(items, [(0, state)])
    assert len(ids) == 1 and state.draws == 1


def test_a_held_forward_waits_at_a_safepoint_and_goes_on_where_it_was(loaded, make_engine):
    """A serving burst holds the child's forward at a layer safepoint; released, it finishes with
    exactly the result of a forward never held (nothing redone, no randomness used meanwhile)."""
    runner, items = _long_prefill(make_engine)
    params = EngineSampling(temperature=1.0)
    free = runner.forward_sample(items, [(0, SamplerState(params, 3)), (5, SamplerState(params, 4))])
    asked = []  # the hold condition's answers, one per poll
    before = runner.held_polls
    held_at = []  # the poll at which the child was first seen held

    def burst() -> bool:
        """The engine's hold condition: on until the child has held at a safepoint, then 30 polls (~30 ms)
        more. Not a fixed number of polls from the start: on a loaded host the child (at idle priority)
        may not run within them, and its forward would never meet the hold."""
        if not held_at and runner.held_polls > before:
            held_at.append(len(asked))
        asked.append(len(asked) < 20_000 if not held_at else len(asked) - held_at[0] < 30)
        return asked[-1]

    held = runner.forward_sample(items, [(0, SamplerState(params, 3)), (5, SamplerState(params, 4))], should_hold=burst)
    assert runner.held_polls > before  # a 4k-token prefill: the child reached a safepoint while held
    assert held == free and len(asked) > 30
    stopped = runner.forward_sample(
        items, [(0, SamplerState(params, 3))], should_stop=lambda: len(asked) > 40, should_hold=lambda: asked.append(True) or True
    )
    assert stopped is None  # a stop while held still abandons


def test_a_held_forward_is_asked_again_at_the_serving_pace_not_every_poll(loaded, make_engine):
    """While held, the engine's rollout thread asks again once per `held_poll_s` (the engine: one
    serving iteration) instead of every POLL_S: each ask takes the serving process's interpreter lock."""
    runner, items = _long_prefill(make_engine)
    params = EngineSampling(temperature=1.0)
    free = runner.forward_sample(items, [(0, SamplerState(params, 3))])
    runner.held_poll_s = lambda: 0.02
    asked: list[tuple[float, bool]] = []  # (when, held) per ask
    before = runner.held_polls
    held_since: list[float] = []

    def burst() -> bool:
        """Held until the child has held at a safepoint, then 0.3 s more. Not 0.3 s from the call: on a
        loaded host the child (at idle priority) may not reach a safepoint within it."""
        now = time.monotonic()
        if not held_since and runner.held_polls > before:
            held_since.append(now)
        asked.append((now, not held_since or now - held_since[0] < 0.3))
        return asked[-1][1]

    held = runner.forward_sample(items, [(0, SamplerState(params, 3))], should_hold=burst)
    assert runner.held_polls > before and held == free
    held_at = [t for t, h in asked if h]
    window_s = held_at[-1] - held_at[0]
    assert len(held_at) <= window_s / 0.02 + 3, (len(held_at), window_s)  # one per 20 ms, not one per POLL_S


def test_the_child_answers_through_a_descriptor_above_1024(loaded, make_engine):
    """A busy executor (HTTP clients, NATS, model files) holds over a thousand descriptors; the wait for
    the child's reply must not use select(), which refuses a descriptor >= FD_SETSIZE (1024)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    filler = []
    try:
        while len(filler) < 1100 and (not filler or filler[-1] < 1100):
            filler.append(os.open(os.devnull, os.O_RDONLY))
        runner, items = _long_prefill(make_engine)  # its child (and pipe) start at the first forward, above the filler
        state = SamplerState(EngineSampling(temperature=1.0), 3)
        ids, _ = runner.forward_sample(items[:1], [(0, state)], should_hold=lambda: False)
        assert runner._pipe().fileno() >= 1024 and len(ids) == 1
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_holding_in_process_waits_and_stop_still_wins():
    from rose.services.executor.model_runner import holding

    assert holding(None, None) is None
    calls = []
    safepoint = holding(lambda: False, lambda: calls.append(1) or len(calls) < 5)
    assert safepoint() is False and len(calls) == 5  # waited through four "hold" answers, then went on
    assert holding(lambda: True, lambda: True)() is True


def test_the_child_takes_the_width_core_lending_asks_for(loaded, make_engine):
    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    runner = _runner(engine)
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    pool.set_budget_bytes(pool.num_blocks * pool.block_bytes)  # as the lease does (the idle lane may not have yet)
    items = [ForwardItem(pool.allocate(1), 0, [11, 12, 13])]
    runner.set_width(2)  # idle child: nothing to wait for
    runner.forward_sample(items, [])
    assert runner.width == 2  # applied at the forward's first safepoint
    runner.set_width(1)
    runner.forward_sample(items, [])
    assert runner.width == 1


def test_a_guest_rollout_child_runs_at_idle_priority_with_every_thread_it_starts(loaded, make_engine):
    """Read from the kernel, per thread of the child, after a forward at width 2 (torch starts its
    second thread then): rose on a serving executor runs it at SCHED_IDLE, so serving and any other
    process preempt it; on a dedicated executor (rollout is the device's own work) and under
    static_partition (a fixed share whatever else runs) it keeps the normal policy. The engine's own
    process (serving's lane) is never lowered."""
    cases = [("rose", True, os.SCHED_IDLE), ("rose", False, os.SCHED_OTHER), ("static_partition", True, os.SCHED_OTHER)]
    for policy, guest, expected in cases:
        engine = make_engine(policy, config=dataclasses.replace(IN_CHILD, rollout_is_guest=guest), fresh_policy=True)
        runner = _runner(engine)
        pool = engine.work_for(WorkClass.ROLLOUT).pool
        pool.set_budget_bytes(pool.num_blocks * pool.block_bytes)
        runner.set_width(2)
        runner.forward_sample([ForwardItem(pool.allocate(1), 0, [11, 12, 13])], [])
        threads = [int(t) for t in os.listdir(f"/proc/{runner.child_pid}/task")]
        assert len(threads) >= 2, threads  # the torch thread the wide forward started
        assert {os.sched_getscheduler(t) for t in threads} == {expected}, (policy, guest)
        assert runner.idle_priority == (expected == os.SCHED_IDLE)
    assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{os.getpid()}/task")} == {os.SCHED_OTHER}


def test_process_runner_refuses_a_model_off_the_cpu(model_paths):
    model = load_model(model_paths.policy)
    model.to("meta")
    try:
        ProcessRunner(model, None, 1)
    except ValueError as exc:
        assert "CPU" in str(exc)
    else:
        raise AssertionError("a non-CPU model was accepted")


def test_too_little_shared_memory_keeps_the_forwards_in_process(make_engine, monkeypatch, tmp_path, caplog):
    from rose.services.executor import rollout_process

    monkeypatch.setattr(rollout_process, "SHM_DIR", str(tmp_path / "no-tmpfs-here"))
    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    assert not isinstance(engine.work_for(WorkClass.ROLLOUT).runner, ProcessRunner)
    assert "shared memory lacks" in caplog.text


async def test_the_rollout_lane_outlives_a_child_that_dies_twice(make_engine, monkeypatch, caplog):
    """A forward process that dies twice in a row fails that iteration, not the lane: its running
    requests finish with "abort" (nothing waits forever), the failure is logged and counted, and
    the next request gets a fresh child."""
    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    runner = _runner(engine)
    real, deaths = ProcessRunner._forward_once, []

    def dies_twice(self, *args):  # fault injection: the child gone before each of two replies
        if len(deaths) < 2:
            deaths.append(self.child_pid)
            raise EOFError("rollout forward process exited")
        return real(self, *args)

    monkeypatch.setattr(ProcessRunner, "_forward_once", dies_twice)
    failed = await engine.submit(_turns("dead", 1)[0]).result()
    assert failed.finish_reason == "abort" and engine.stats().lane_failures == 1
    assert "an iteration failed" in caplog.text and runner.restarts == 1
    after = await engine.submit(_turns("alive", 1)[0]).result()
    assert after.finish_reason == "length" and len(after.token_ids) == 12
    assert engine.work_for(WorkClass.ROLLOUT).queue_lengths() == (0, 0)  # nothing left running: the pool holds the retained prefixes alone
    assert engine.work_for(WorkClass.ROLLOUT).pool.usage().used_blocks == engine.prefix_cache.cached_blocks
    health = await _health(engine)
    assert health[0] == 200, health  # production traffic never touches the rollout lane
    assert health[1]["status"] == "degraded" and health[1]["lane_failures"] == 1
    assert health[1]["last_lane_failure"]["lane"] == "rollout" and "died twice in a row" in health[1]["last_lane_failure"]["error"]


async def _health(engine) -> tuple[int, dict]:
    """GET /health of the executor's OpenAI app on ``engine``, behind a real aiohttp server."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from rose.services.executor.http_api import OpenAIApi
    from rose.services.executor.telemetry import Telemetry

    server = TestServer(OpenAIApi(engine, Telemetry(engine, "ex-test", "dedicated", 1.0), "rose-serving", 1 << 20).app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session, session.get(server.make_url("/health")) as r:
            return r.status, await r.json()
    finally:
        await server.close()


async def test_a_failed_serving_iteration_takes_the_replica_out_of_rotation_for_a_while(make_engine, monkeypatch):
    """A serving iteration that raises aborts its requests and the lane goes on; /health answers 503
    "degraded" (a load balancer sends traffic elsewhere) until the replica has run clean for the window."""
    from rose.services.executor import http_api

    engine = make_engine(config=HERE)
    assert await _health(engine) == (200, {"status": "ok", "policy_version": 0, "lane_failures": 0})
    runner, failures = engine.work_for(WorkClass.SERVING).runner, []
    real = runner.forward_sample

    def fails_once(*args, **kwargs):  # fault injection: one serving forward raises
        if not failures:
            failures.append(1)
            raise RuntimeError("injected serving fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "forward_sample", fails_once)
    request = GenerationRequest(
        request_id="s-fault",
        work_class=WorkClass.SERVING,
        prompt_token_ids=tuple(range(20, 40)),
        sampling=EngineSampling(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert (await engine.submit(request).result()).finish_reason == "abort"
    assert (await engine.submit(dataclasses.replace(request, request_id="s-after")).result()).finish_reason == "length"
    status, body = await _health(engine)
    assert status == 503 and body["status"] == "degraded" and body["lane_failures"] == 1
    assert body["last_lane_failure"]["lane"] == "serving" and body["last_lane_failure"]["error"] == "RuntimeError: injected serving fault"
    monkeypatch.setattr(http_api, "LANE_FAILURE_HEALTH_WINDOW_S", 0.0)  # the window has passed
    assert await _health(engine) == (200, {"status": "ok", "policy_version": 0, "lane_failures": 1})


async def test_a_request_a_failed_iteration_cut_short_is_a_503_to_the_client(make_engine, monkeypatch):
    """Through the OpenAI API the aborted request is a 503 server_error the client retries, as JSON and in a
    stream (an in-band error event): never a 200 whose finish_reason is "abort", which OpenAI's schema lacks."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from rose.services.executor.http_api import OpenAIApi
    from rose.services.executor.telemetry import Telemetry

    engine = make_engine(config=HERE)
    runner, failures = engine.work_for(WorkClass.SERVING).runner, []
    real = runner.forward_sample

    def fails_once(*args, **kwargs):  # fault injection: the next serving forward raises
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("injected serving fault")
        return real(*args, **kwargs)

    server = TestServer(OpenAIApi(engine, Telemetry(engine, "ex-test", "serving", 1.0), "rose-serving", 1 << 20).app)
    await server.start_server()
    body = {"model": "rose-serving", "prompt": "2+3=", "max_tokens": 6, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as session:
            monkeypatch.setattr(runner, "forward_sample", fails_once)
            async with session.post(server.make_url("/v1/completions"), json=body) as r:
                assert r.status == 503 and (await r.json())["error"]["type"] == "server_error"
            async with session.post(server.make_url("/v1/completions"), json={**body, "stream": True}) as r:
                text = await r.text()
            assert r.status == 200 and '"type": "server_error"' in text and '"finish_reason": "abort"' not in text
            async with session.post(server.make_url("/v1/completions"), json=body) as r:  # the lane went on
                assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        await server.close()


# ---- double-buffered weight swaps (issue 21, item 5) -------------------------------------------


def _perturbed(engine, suffix: str = "mlp.up_proj.weight", scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {n: t + scale * torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in engine.policy_state_dict().items() if n.endswith(suffix)}


def _fresh_child_forward(runner: ProcessRunner, items) -> torch.Tensor:
    """The same forward in a child started from scratch on the engine's live weights (the reference
    a flipped child must match bit for bit: same shared tensors, same kernels)."""
    restarts = runner.restarts
    os.kill(runner.child_pid, signal.SIGKILL)
    logits = runner.forward(items)
    assert runner.restarts == restarts + 1
    return logits


async def test_a_flip_serves_the_new_version_whole_and_bit_exact(make_engine):
    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    runner = _runner(engine)
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    pool.set_budget_bytes(pool.num_blocks * pool.block_bytes)  # as the lease does (the idle lane may not have yet)
    items = [
        ForwardItem(pool.allocate(pool.blocks_for(24)), 0, list(range(40, 64))),
        ForwardItem(pool.allocate(pool.blocks_for(9)), 0, list(range(7, 16))),
    ]
    old_state = {n: t.clone() for n, t in engine.policy_state_dict().items()}
    old = runner.forward(items)
    new = _perturbed(engine)
    pause_ms = await asyncio.wrap_future(engine.apply_policy_weights(new, 1))
    assert engine.policy_version == 1 and engine.stats().max_swap_pause_ms == pause_ms
    live = engine.policy_state_dict()
    assert all(torch.equal(live[n], new[n] if n in new else old_state[n]) for n in live)  # the new version, bit for bit; the rest untouched
    flipped = runner.forward(items)
    assert not torch.equal(flipped, old)
    # a second version flips back onto the first bank, which must first catch up with the first version
    newer = _perturbed(engine, "self_attn.o_proj.weight")
    await asyncio.wrap_future(engine.apply_policy_weights(newer, 2))
    live = engine.policy_state_dict()
    assert all(torch.equal(live[n], newer.get(n, new.get(n, old_state[n]))) for n in live)
    flipped_again = runner.forward(items)
    assert not torch.equal(flipped_again, flipped)
    assert torch.equal(flipped_again, _fresh_child_forward(runner, items))  # the child reads the engine's live bank, whole


def test_a_forward_in_flight_during_an_update_sees_the_old_weights_whole(loaded, make_engine):
    """The next version is written while the child is in the middle of a forward (held at a layer
    safepoint): the forward finishes exactly as one never disturbed, on the old weights; the next
    forward, after the flip, is the new version's (a fresh child's result)."""
    import threading

    from rose.services.executor.weights import stage

    runner, items = _long_prefill(make_engine)
    items = items[:8]  # 2k tokens: still outlasts the engine's 1 ms polls
    params = EngineSampling(temperature=1.0)
    samples = lambda: [(row, SamplerState(params, 10 + row)) for row in range(8)]  # noqa: E731
    undisturbed = runner.forward_sample(items, samples())
    new = {n: t + 0.05 for n, t in runner.model.state_dict().items() if n.endswith(("up_proj.weight", "down_proj.weight", "q_proj.weight"))}
    staged = stage(runner.model, new, 1)
    written, out = threading.Event(), {}
    before = runner.held_polls

    def forward() -> None:
        out["held"] = runner.forward_sample(items, samples(), should_hold=lambda: not written.is_set())

    t = threading.Thread(target=forward)
    t.start()
    until_sync(lambda: runner.held_polls > before, timeout=60, what="the child holding inside the forward, at a layer", step=0.001)
    runner.prepare_weights(staged)  # the whole new version written meanwhile (into the standby bank)
    written.set()
    t.join(60)
    assert out["held"] == undisturbed  # the old weights, whole: not one layer read the new ones
    runner.apply_weights(staged)  # between forwards, as the rollout lane does
    after = runner.forward_sample(items, samples())
    assert after != undisturbed
    os.kill(runner.child_pid, signal.SIGKILL)
    assert runner.forward_sample(items, samples()) == after  # what a child started on the new weights computes
    assert runner.restarts == 1


async def test_a_failed_update_leaves_the_old_weights_serving(make_engine, monkeypatch):
    """The copy into the standby bank fails halfway (fault injection): the update is refused, the old
    version keeps serving (the engine's parameters, the child's tokens), and the next version, which
    changes other tensors, comes out bit-exact: the half-written tensors were put back."""
    from rose.services.executor import rollout_process

    engine = make_engine(config=IN_CHILD, fresh_policy=True)
    before = await _generate(engine, _turns("f0"))
    old_state = {n: t.clone() for n, t in engine.policy_state_dict().items()}
    new = _perturbed(engine)
    assert len(new) >= 2
    real_copy, copies = torch.Tensor.copy_, []

    class HalfFill(rollout_process._WeightBanks):
        def fill(self, staged):
            def copy_then_fail(t, src):  # the second tensor copied into the standby: an error
                copies.append(1)
                if len(copies) == 2:
                    raise RuntimeError("injected: copy into the standby failed")
                return real_copy(t, src)

            monkeypatch.setattr(torch.Tensor, "copy_", copy_then_fail)
            try:
                return super().fill(staged)
            finally:
                monkeypatch.setattr(torch.Tensor, "copy_", real_copy)

    banks = _runner(engine)._banks
    banks.__class__ = HalfFill
    with pytest.raises(RuntimeError, match="injected"):
        engine.apply_policy_weights(new, 1)
    assert len(copies) == 2 and engine.policy_version == 0
    assert all(torch.equal(t, old_state[n]) for n, t in engine.policy_state_dict().items())
    again = await _generate(engine, _turns("f0"))
    assert _same(again, before) and {v for _, _, v in again} == {0}  # the child still serves the old version
    banks.__class__ = rollout_process._WeightBanks
    newer = _perturbed(engine, "self_attn.o_proj.weight")
    await asyncio.wrap_future(engine.apply_policy_weights(newer, 1))
    assert engine.policy_version == 1
    assert all(torch.equal(t, newer.get(n, old_state[n])) for n, t in engine.policy_state_dict().items())  # no trace of the failed update
    after = await _generate(engine, _turns("f0"))
    assert {v for _, _, v in after} == {1} and [t for t, _, _ in after] != [t for t, _, _ in before]
