"""Isolation of serving and rollout on one device: zeroed KV blocks, no shared prefix cache, per-class memory limits.

Real engines with the tiny real models; the pools' tensors are inspected directly.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rose.services.executor.engine import EngineConfig
from rose.services.executor.kv_pool import KVPool, KVShape
from rose.services.executor.model_runner import kv_shape_of
from rose.services.executor.protocol import EngineSampling, GenerationRequest, InvalidRequest, WorkClass
from rose.testing.polling import until

MIB = 1 << 20
PROMPT = tuple(range(5, 29))  # 24 token ids valid in both models' vocabularies
LONG_LEASE_S = 3600.0


def request(rid: str, cls: WorkClass, prompt=PROMPT, max_tokens: int = 8, trajectory_id: str | None = None) -> GenerationRequest:
    params = EngineSampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(request_id=rid, work_class=cls, prompt_token_ids=prompt, sampling=params, trajectory_id=trajectory_id, stream=False)


def nonzero_blocks(pool: KVPool) -> set[int]:
    """Blocks holding any non-zero K or V value, in any layer."""
    per_slot = (pool.k != 0).any(dim=(0, 2, 3)) | (pool.v != 0).any(dim=(0, 2, 3))
    return set(per_slot.view(pool.num_blocks, pool.block_size).any(dim=1).nonzero().flatten().tolist())


def test_a_freed_block_is_zeroed_and_the_others_are_kept():
    shape = KVShape(2, 2, 8, torch.float32)
    pool = KVPool("rollout", shape, 8 * shape.bytes_per_token() * 4, 4, torch.device("cpu"))
    assert pool.num_blocks == 8
    blocks = pool.allocate(8)
    pool.k.normal_(), pool.v.normal_()
    pool.free(blocks[:3])
    assert nonzero_blocks(pool) == set(blocks[3:])
    again = pool.allocate(3)  # the only free blocks: the ones just freed, handed out zeroed
    assert set(again) == set(blocks[:3]) and nonzero_blocks(pool) == set(blocks[3:])
    with pytest.raises(MemoryError, match="1 blocks requested, 0 free"):
        pool.allocate(1)


def test_scratch_blocks_beyond_the_budget_only_when_asked_and_never_more_than_the_pool():
    """Capturing CUDA graphs before the first lease takes scratch blocks whatever the (zero) budget;
    everything else stays within it."""
    shape = KVShape(1, 1, 4, torch.float32)
    pool = KVPool("rollout", shape, 8 * shape.bytes_per_token() * 4, 4, torch.device("cpu"))
    pool.set_budget_bytes(0)
    with pytest.raises(MemoryError, match="0 free"):
        pool.allocate(1)
    scratch = pool.allocate(3, beyond_budget=True)
    assert pool.unallocated_blocks == 5 and pool.free_blocks == 0
    with pytest.raises(MemoryError, match="5 free"):
        pool.allocate(6, beyond_budget=True)
    pool.free(scratch)
    assert pool.unallocated_blocks == 8 and pool.used_blocks == 0


async def test_kv_written_by_rollout_is_zero_before_anyone_is_handed_it_again(make_engine):
    """While a rollout turn runs its blocks hold K/V; once it finishes, every byte of both pools is zero."""
    engine = make_engine()
    rollout, serving = engine.work_for(WorkClass.ROLLOUT).pool, engine.work_for(WorkClass.SERVING).pool
    assert rollout.k.untyped_storage().data_ptr() != serving.k.untyped_storage().data_ptr()  # one tensor per class
    seen_while_running: set[int] = set()
    handle = engine.submit(request("r1", WorkClass.ROLLOUT, max_tokens=48))
    while not handle.done():
        seen_while_running |= nonzero_blocks(rollout)
        await asyncio.sleep(0.002)
    await handle.result()
    assert seen_while_running, "the rollout turn wrote no KV that the test could see"
    assert rollout.used_blocks == 0 and nonzero_blocks(rollout) == set()
    # the same blocks are handed out next (lowest ids first): a serving-class turn on this device
    # and the next rollout turn both start from zeros
    await engine.submit(request("s1", WorkClass.SERVING)).result()
    assert serving.used_blocks == 0 and nonzero_blocks(serving) == set()
    next_blocks = rollout.allocate(len(seen_while_running))
    assert set(next_blocks) & seen_while_running and nonzero_blocks(rollout) == set()
    rollout.free(next_blocks)


async def test_retained_prefix_blocks_are_zeroed_when_evicted(make_engine):
    engine = make_engine()
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    await engine.submit(request("t1", WorkClass.ROLLOUT, trajectory_id="traj")).result()
    cached = set(engine.prefix_cache.entries()["traj"].blocks)
    assert cached and nonzero_blocks(pool) == cached  # only the retained prefix holds data
    engine.set_rollout_budget(0)  # the lease shrinks to nothing: the cache is evicted
    await until(lambda: pool.used_blocks == 0, timeout=10, what="the rollout pool emptied")
    assert len(engine.prefix_cache) == 0 and nonzero_blocks(pool) == set()


async def test_the_prefix_cache_is_never_shared_with_serving(make_engine):
    engine = make_engine()
    r1 = await engine.submit(request("t1", WorkClass.ROLLOUT, trajectory_id="traj")).result()
    cache = engine.prefix_cache
    entry = cache.entries()["traj"]
    hits, misses = cache.hits, cache.misses
    # A serving request with exactly the cached tokens computes them itself, from its own pool.
    s = await engine.submit(request("s1", WorkClass.SERVING, prompt=PROMPT + r1.token_ids)).result()
    assert s.prefix_cached_tokens == 0 and (cache.hits, cache.misses) == (hits, misses)
    assert cache.entries() == {"traj": entry} and cache.entries()["traj"] is entry  # serving neither took nor added entries
    assert engine.work_for(WorkClass.SERVING).pool.used_blocks == 0
    assert engine.work_for(WorkClass.ROLLOUT).pool.used_blocks == len(entry.blocks) == cache.cached_blocks  # cached blocks are rollout blocks
    with pytest.raises(InvalidRequest, match="rollout requests only"):
        engine.submit(request("s2", WorkClass.SERVING, trajectory_id="traj"))


async def _watch(pool: KVPool, handles: list, peak: list[int]) -> None:
    while not all(h.done() for h in handles):
        peak[0] = max(peak[0], pool.used_blocks)
        await asyncio.sleep(0.001)


async def test_rollout_never_holds_more_kv_than_its_lease(make_engine):
    engine = make_engine()
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    budget_blocks = 5  # each turn needs 3 blocks (24 + 24 tokens): 4 turns at once cannot fit
    engine.set_rollout_lease(budget_blocks * pool.block_bytes, time.monotonic() + LONG_LEASE_S)
    await asyncio.sleep(0.05)
    handles = [engine.submit(request(f"r{i}", WorkClass.ROLLOUT, max_tokens=24)) for i in range(4)]
    peak = [0]
    await _watch(pool, handles, peak)
    results = [await h.result() for h in handles]
    assert all(len(r.token_ids) == 24 for r in results)  # everything finished within the budget
    assert 0 < peak[0] <= budget_blocks and pool.used_blocks == 0
    assert engine.work_for(WorkClass.SERVING).pool.used_blocks == 0
    with pytest.raises(MemoryError):
        pool.allocate(budget_blocks + 1)


async def test_serving_never_holds_more_kv_than_its_pool(make_engine, loaded):
    block_bytes = kv_shape_of(loaded["serving"][0]).bytes_per_token() * 16
    config = EngineConfig(serving_kv_bytes=5 * block_bytes, rollout_kv_bytes=16 * MIB, device="cpu", seed=0)
    engine = make_engine(config=config)
    pool = engine.work_for(WorkClass.SERVING).pool
    assert pool.num_blocks == 5
    with pytest.raises(InvalidRequest, match="serving KV pool"):
        engine.submit(request("big", WorkClass.SERVING, max_tokens=5 * 16))  # more than the whole pool
    handles = [engine.submit(request(f"s{i}", WorkClass.SERVING, max_tokens=24)) for i in range(4)]
    peak = [0]
    await _watch(pool, handles, peak)
    results = [await h.result() for h in handles]
    assert all(len(r.token_ids) == 24 for r in results)  # they queued for blocks; none was refused
    assert 0 < peak[0] <= pool.num_blocks and pool.used_blocks == 0
    assert engine.work_for(WorkClass.ROLLOUT).pool.used_blocks == 0  # serving pressure never spills into the rollout pool
