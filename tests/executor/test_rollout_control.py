"""Rollout control on a real engine (what SGLang's admin endpoints map to): pause in its three
modes, continue, abort, prefix-cache flush, releasing and resuming the rollout memory."""

import asyncio

import pytest

from rose.services.executor.protocol import InvalidRequest, WorkClass
from rose.testing.engine import generate, req
from rose.testing.polling import until

PARAMS = dict(temperature=0, max_tokens=40, ignore_eos=True)


async def _started(engine, rid: str):
    """A rollout request that has produced a few tokens."""
    handle = engine.submit(req(engine, rid, **PARAMS))
    seen = []
    async for delta in handle:
        seen.extend(delta.token_ids)
        if len(seen) >= 3:
            return handle, seen
    raise AssertionError("rollout finished before it could be paused")


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_holds_rollout_and_continue_finishes_the_same_tokens(make_engine, mode):
    engine = make_engine()
    reference = await generate(engine, req(engine, "ref", **PARAMS))
    handle, _ = await _started(engine, "p")
    affected = await asyncio.wrap_future(engine.control.pause_generation(mode))
    assert affected == 1 and engine.control.paused == mode
    stalled = engine.stats().rollout_tokens_per_s  # reset the interval
    await asyncio.sleep(0.3)
    stats = engine.stats()
    assert stats.rollout_tokens_per_s == 0, stalled
    used = stats.rollout_pool.used_blocks
    assert (used == 0) if mode == "retract" else (used > 0)  # retract gives the KV back, in_place keeps it
    serving = await generate(engine, req(engine, "srv", WorkClass.SERVING, **PARAMS))  # serving is untouched by a pause
    assert len(serving.token_ids) == 40
    engine.control.continue_generation()
    result = await handle.result()
    assert result.token_ids == reference.token_ids  # nothing lost or duplicated
    assert result.timings.preemptions == (1 if mode == "retract" else 0)


async def test_pause_abort_finishes_everything_with_abort_and_queues_new_requests(make_engine):
    engine = make_engine()
    handle, seen = await _started(engine, "a")
    queued = engine.submit(req(engine, "q", **PARAMS))
    assert await asyncio.wrap_future(engine.control.pause_generation("abort")) == 2
    result = await handle.result()
    assert result.finish_reason == "abort" and len(result.token_ids) >= len(seen)
    assert (await queued.result()).finish_reason == "abort"
    later = engine.submit(req(engine, "later", **PARAMS))  # accepted while paused, runs after continue
    await until(lambda: engine.stats().rollout_queue == 1, 10, "the turn queued while paused")
    engine.control.continue_generation()
    assert (await later.result()).finish_reason == "length"


async def test_abort_one_rollout_request_by_id(make_engine):
    engine = make_engine()
    handle, _ = await _started(engine, "one")
    other = engine.submit(req(engine, "two", **PARAMS))
    engine.control.abort("one")
    assert (await handle.result()).finish_reason == "abort"
    assert (await other.result()).finish_reason == "length"


async def test_flush_prefix_cache_frees_retained_turns(make_engine):
    engine = make_engine()
    await generate(engine, req(engine, "t0", trajectory_id="traj", stream=False, **PARAMS))
    held = engine.stats().rollout_pool.cached_blocks
    assert held > 0
    assert await asyncio.wrap_future(engine.control.flush_cache()) == held
    assert engine.stats().rollout_pool.used_blocks == 0


async def test_release_and_resume_rollout_memory(make_engine):
    engine = make_engine()
    reference = await generate(engine, req(engine, "ref", **PARAMS))
    handle, _ = await _started(engine, "r")
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    freed = await asyncio.wrap_future(engine.control.release_memory(("kv_cache", "weights")))
    assert freed["kv_cache"] == pool.num_blocks * pool.block_bytes and pool.released
    assert freed["weights"] == 0  # CPU: the weights already live in host memory
    assert engine.control.released == {"kv_cache", "weights"}
    await asyncio.sleep(0.2)
    assert not handle.done()  # held, not failed
    restored = await asyncio.wrap_future(engine.control.resume_memory(("kv_cache", "weights")))
    assert restored["kv_cache"] == freed["kv_cache"] and not pool.released
    result = await handle.result()
    assert result.token_ids == reference.token_ids and result.timings.preemptions == 1


async def test_bad_control_arguments_are_refused(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="pause mode"):
        engine.control.pause_generation("nap")
    with pytest.raises(InvalidRequest, match="memory tags"):
        engine.control.release_memory(("cuda_graph_of_doom",))
    assert engine.control.paused is None and not engine.control.released


async def test_rollout_may_queue_without_a_lease_when_asked(make_engine):
    engine = make_engine(lease=False)
    handle = engine.submit(req(engine, "wait", **PARAMS), require_lease=False)
    await until(lambda: engine.stats().rollout_queue == 1, 10, "the turn queued")  # queued, not run: no lease
    await asyncio.sleep(0.2)
    assert engine.stats().rollout_queue == 1 and engine.stats().rollout_running == 0  # and it stays there
    import time

    engine.set_rollout_lease(16 << 20, time.monotonic() + 60)
    assert (await handle.result()).finish_reason == "length"
