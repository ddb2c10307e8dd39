"""The rollout pool's host-memory tier (prefix_cache.HostTier, SGLang's HiCache): retained trajectory prefixes
copied to host memory when retained, restored from there once the device lost them (evicted, or the pool released
by a revoked lease), token-exact, never to another trajectory, and priced on an emulated device.

Real engines with the tiny real models; the device's entries are dropped by releasing and resuming the rollout
pool (what a lease revocation and its return do), or evicted by a turn that needs the whole pool.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgspec
import pytest
import torch

from rose.contracts.executor import MetricsSnapshot
from rose.services.executor.config import ExecutorConfig
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.kv_pool import KVPool, KVShape
from rose.services.executor.prefix_cache import HostEntry, HostTier, reusable_tokens
from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass
from rose.shared.config import ConfigError, load_config
from rose.shared.devices import DEVICES, MODELS, Roofline
from rose.testing.engine import EMULATED_7B_H100, generate, req

MIB = 1 << 20
TEST_CONFIG = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0)  # as in conftest
PROMPT = tuple(range(5, 25))  # 20 token ids valid in the policy's vocabulary
TOOL = (40, 41, 42)  # a tool's answer, appended to the next turn's prompt
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
SEEDED = dict(temperature=1.0, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True)


def _turn(engine, rid: str, prompt: tuple[int, ...], key: str | None, params: dict) -> GenerationRequest:
    return req(engine, rid, prompt=prompt, trajectory_id=key, stream=False, **params)


def _next_prompt(first: GenerationRequest, result) -> tuple[int, ...]:
    return first.prompt_token_ids + result.token_ids + TOOL


def _retained(result, prompt: tuple[int, ...]) -> int:
    """What a turn retains of its KV: its prompt and all but its last token (never computed)."""
    return len(prompt) + len(result.token_ids) - 1


async def _drop_device_prefixes(engine: Engine) -> None:
    """Release and resume the rollout KV pool, as a revoked lease and its return do: the device's entries go."""
    await asyncio.wrap_future(engine.control.release_memory(("kv_cache",)))
    await asyncio.wrap_future(engine.control.resume_memory(("kv_cache",)))
    assert len(engine.prefix_cache) == 0


# ---------------------------------------------------------------- the pieces, alone


def test_the_match_is_token_by_token_same_version_and_leaves_a_token_to_compute():
    held = (1, 2, 3, 4)
    assert reusable_tokens(held, 0, (1, 2, 3, 4, 5), 0) == 4
    assert reusable_tokens(held, 0, (1, 2, 3, 4), 0) == 3  # the last prompt token is computed for its logits
    assert reusable_tokens(held, 0, (1, 2, 9, 4, 5), 0) == 2
    assert reusable_tokens(held, 0, (9, 2, 3, 4, 5), 0) == 0
    assert reusable_tokens(held, 0, (1, 2, 3, 4, 5), 1) == 0  # another policy version computed it


def _entry(tokens: tuple[int, ...], nbytes: int = 100, version: int = 0) -> HostEntry:
    return HostEntry(tokens, version, nbytes, None)


def test_the_host_tier_is_lru_within_its_bytes_and_a_put_replaces():
    tier = HostTier(capacity_bytes=250)
    for key in ("a", "b"):
        tier.put(key, _entry((1, 2, 3)))
    tier.put("a", _entry((1, 2, 3, 4)))  # a's next turn: replaces its entry and becomes the most recent
    assert list(tier.entries()) == ["b", "a"] and tier.bytes_held == 200
    tier.put("c", _entry((7, 8)))
    assert list(tier.entries()) == ["a", "c"] and tier.bytes_held == 200  # the least recently put went first
    tier.put("d", _entry((7, 8), nbytes=251))  # larger than the whole tier: not held
    assert "d" not in tier.entries() and tier.bytes_held <= tier.capacity_bytes
    tier.clear()
    assert len(tier) == 0 and tier.bytes_held == 0
    with pytest.raises(ValueError, match=">= 0"):
        HostTier(-1)


def test_host_take_hits_once_drops_stale_or_diverging_entries_and_waits_for_room():
    tier = HostTier(capacity_bytes=1000)
    tier.put("t", _entry((1, 2, 3, 4)))
    assert tier.take("t", (1, 2, 3, 4, 5), version=0, room_tokens=3) is None  # no room for 4 tokens now: kept
    assert "t" in tier.entries()
    hit = tier.take("t", (1, 2, 3, 4, 5), version=0, room_tokens=4)
    assert hit is not None and hit.reused_tokens == 4 and "t" not in tier.entries()
    assert tier.take("t", (1, 2, 3, 4, 5), version=0) is None  # taken: once
    tier.put("t", _entry((1, 2, 3, 4)))
    assert tier.take("t", (1, 2, 3, 4, 5), version=1) is None and "t" not in tier.entries()  # stale: dropped
    tier.put("t", _entry((1, 2, 3, 4)))
    assert tier.take("u", (1, 2, 3, 4, 5), version=0) is None and "t" in tier.entries()  # another trajectory
    assert tier.take("t", (9, 2, 3, 4, 5), version=0) is None and "t" not in tier.entries()  # diverges at once
    assert (tier.hits, tier.misses, tier.bytes_held) == (1, 5, 0)


def test_blocks_read_off_the_pool_come_back_whole_and_only_into_held_blocks():
    shape = KVShape(2, 2, 8, torch.float32)
    pool = KVPool("rollout", shape, 8 * shape.bytes_per_token() * 4, 4, torch.device("cpu"))
    blocks = pool.allocate(3)
    pool.k.normal_(), pool.v.normal_()
    before_k, before_v = pool.k.clone(), pool.v.clone()
    payload = pool.read_blocks(blocks)
    assert payload is not None and payload.k.device.type == "cpu" and payload.num_blocks == 3
    pool.free(blocks)  # zeroed
    with pytest.raises(ValueError, match="nobody holds"):
        pool.write_blocks(blocks, payload)
    again = pool.allocate(2)
    with pytest.raises(ValueError, match="3 blocks written into 2"):
        pool.write_blocks(again, payload)
    pool.write_blocks(again, payload.head(2))
    for new, old in zip(again, blocks[:2], strict=True):
        slots, was = slice(new * 4, new * 4 + 4), slice(old * 4, old * 4 + 4)
        assert torch.equal(pool.k[:, slots], before_k[:, was]) and torch.equal(pool.v[:, slots], before_v[:, was])
    accounted = KVPool("rollout", shape, 8 * shape.bytes_per_token() * 4, 4, torch.device("cpu"), storage=False)
    assert accounted.read_blocks(accounted.allocate(2)) is None


def test_the_ratio_is_a_checked_setting_and_reaches_the_engine():
    config = load_config(ExecutorConfig, env={"ROSE_ENGINE__HOST_KV_RATIO": "0.5"})
    assert config.engine.host_kv_ratio == 0.5 and EngineConfig.from_settings(config.engine).host_kv_ratio == 0.5
    assert ExecutorConfig().engine.host_kv_ratio == 2.0  # SGLang's --hicache-ratio default
    with pytest.raises(ConfigError, match="engine.host_kv_ratio.*>= 0"):
        load_config(ExecutorConfig, env={"ROSE_ENGINE__HOST_KV_RATIO": "-1"})


def test_a_metrics_snapshot_without_the_host_fields_still_decodes():
    old = msgspec.json.encode(MetricsSnapshot(executor_id="e1", at=1.0, interval_s=1.0))
    fields = msgspec.json.decode(old)
    for name in ("prefix_host_hits", "host_kv_bytes"):
        fields.pop(name)
    snapshot = msgspec.json.decode(msgspec.json.encode(fields), type=MetricsSnapshot)
    assert snapshot.prefix_host_hits == 0 and snapshot.host_kv_bytes == 0


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize(
    ("params", "rollout_process"),
    [(GREEDY, False), (SEEDED, False), (GREEDY, True)],
    ids=["greedy", "seeded", "greedy-in-child"],
)
async def test_a_turn_restored_from_host_is_the_turn_on_the_device_and_the_turn_without_cache(make_engine, params, rollout_process):
    engine = make_engine(config=replace(TEST_CONFIG, rollout_process=rollout_process))
    firsts = {key: _turn(engine, f"{key}-1", PROMPT, key, params) for key in ("device", "host")}
    results = {key: await generate(engine, turn) for key, turn in firsts.items()}
    assert results["device"].token_ids == results["host"].token_ids  # one seed, one prompt: one first turn
    prompt = _next_prompt(firsts["device"], results["device"])
    on_device = await generate(engine, _turn(engine, "device-2", prompt, "device", params))
    await _drop_device_prefixes(engine)
    assert "host" in engine.host_tier.entries()
    from_host = await generate(engine, _turn(engine, "host-2", prompt, "host", params))
    no_cache = await generate(engine, _turn(engine, "none-2", prompt, None, params))
    reused = _retained(results["host"], PROMPT)
    assert on_device.prefix_cached_tokens == from_host.prefix_cached_tokens == reused and no_cache.prefix_cached_tokens == 0
    assert engine.stats().prefix_host_hits == 1
    assert from_host.token_ids == on_device.token_ids == no_cache.token_ids
    assert from_host.logprobs == on_device.logprobs  # the same KV, bit for bit
    assert from_host.logprobs == pytest.approx(no_cache.logprobs, abs=1e-4)  # a full prefill sums in another order


async def test_a_prefix_evicted_from_the_device_is_restored_from_host(make_engine):
    pool_bytes = 8 * 16 * 4096  # 8 blocks of 16 tokens of the tiny policy's 4 KiB per token
    engine = make_engine(config=replace(TEST_CONFIG, rollout_kv_bytes=pool_bytes))
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    assert pool.num_blocks == 8
    first = _turn(engine, "a-1", PROMPT, "a", GREEDY)
    result = await generate(engine, first)
    assert "a" in engine.prefix_cache.entries() and "a" in engine.host_tier.entries()
    big = await generate(engine, _turn(engine, "big", tuple(range(30, 130)), None, dict(GREEDY, max_tokens=20)))  # 120 tokens: every block
    assert len(big.token_ids) == 20
    assert "a" not in engine.prefix_cache.entries() and "a" in engine.host_tier.entries()  # evicted on the device only
    prompt = _next_prompt(first, result)
    restored = await generate(engine, _turn(engine, "a-2", prompt, "a", GREEDY))
    plain = await generate(engine, _turn(engine, "plain", prompt, None, GREEDY))
    stats = engine.stats()
    assert restored.prefix_cached_tokens == _retained(result, PROMPT) > 0
    assert stats.prefix_host_hits == 1 and stats.prefix_hits == 0
    assert restored.token_ids == plain.token_ids


async def test_released_and_resumed_rollout_memory_keeps_the_host_entries(make_engine):
    engine = make_engine()
    first = _turn(engine, "t-1", PROMPT, "traj", GREEDY)
    result = await generate(engine, first)
    held = engine.stats().host_kv_bytes
    assert held == engine.prefix_cache.cached_blocks * engine.work_for(WorkClass.ROLLOUT).pool.block_bytes > 0
    await asyncio.wrap_future(engine.control.release_memory(("kv_cache",)))
    assert engine.work_for(WorkClass.ROLLOUT).pool.released and len(engine.prefix_cache) == 0
    assert engine.stats().host_kv_bytes == held  # the lease went, the host copy stays
    await asyncio.wrap_future(engine.control.resume_memory(("kv_cache",)))
    again = await generate(engine, _turn(engine, "t-2", _next_prompt(first, result), "traj", GREEDY))
    assert again.prefix_cached_tokens == _retained(result, PROMPT)
    assert engine.stats().prefix_host_hits == 1


async def test_a_weight_swap_misses_the_host_tier_and_a_flush_clears_it(make_engine):
    engine = make_engine(fresh_policy=True)
    first = _turn(engine, "a-1", PROMPT, "a", GREEDY)
    result = await generate(engine, first)
    await _drop_device_prefixes(engine)
    assert "a" in engine.host_tier.entries()
    same = {k: v.clone() for k, v in engine.policy_state_dict().items()}
    await asyncio.wrap_future(engine.apply_policy_weights(same, 1))  # a new version, even with the same values
    assert len(engine.host_tier) == 0 and engine.stats().host_kv_bytes == 0
    after_swap = await generate(engine, _turn(engine, "a-2", _next_prompt(first, result), "a", GREEDY))
    assert after_swap.prefix_cached_tokens == 0 and after_swap.policy_version == 1
    first = _turn(engine, "b-1", PROMPT, "b", GREEDY)
    result = await generate(engine, first)
    assert "b" in engine.host_tier.entries()
    await asyncio.wrap_future(engine.control.flush_cache())
    assert len(engine.host_tier) == 0 and len(engine.prefix_cache) == 0
    after_flush = await generate(engine, _turn(engine, "b-2", _next_prompt(first, result), "b", GREEDY))
    assert after_flush.prefix_cached_tokens == 0 and engine.stats().prefix_host_hits == 0


async def test_a_small_ratio_keeps_the_newest_entries_within_its_bytes(make_engine):
    pool_bytes = TEST_CONFIG.rollout_kv_bytes
    block_bytes = 16 * 4096
    engine = make_engine(config=replace(TEST_CONFIG, host_kv_ratio=5 * block_bytes / pool_bytes))  # room for 5 blocks
    tier = engine.host_tier
    assert tier.capacity_bytes == 5 * block_bytes
    firsts, results = {}, {}
    for key in ("t0", "t1", "t2", "t3"):  # 23 tokens retained each: 2 blocks
        firsts[key] = _turn(engine, f"{key}-1", PROMPT, key, GREEDY)
        results[key] = await generate(engine, firsts[key])
        assert 0 < tier.bytes_held <= tier.capacity_bytes
    assert list(tier.entries()) == ["t2", "t3"] and tier.bytes_held == 4 * block_bytes
    await _drop_device_prefixes(engine)
    oldest = await generate(engine, _turn(engine, "t0-2", _next_prompt(firsts["t0"], results["t0"]), "t0", GREEDY))
    newest = await generate(engine, _turn(engine, "t3-2", _next_prompt(firsts["t3"], results["t3"]), "t3", GREEDY))
    assert oldest.prefix_cached_tokens == 0 and newest.prefix_cached_tokens == _retained(results["t3"], PROMPT)


async def test_a_zero_ratio_turns_the_tier_off(make_engine):
    engine = make_engine(config=replace(TEST_CONFIG, host_kv_ratio=0.0))
    first = _turn(engine, "t-1", PROMPT, "traj", GREEDY)
    result = await generate(engine, first)
    assert len(engine.host_tier) == 0 and engine.stats().host_kv_bytes == 0
    await _drop_device_prefixes(engine)
    again = await generate(engine, _turn(engine, "t-2", _next_prompt(first, result), "traj", GREEDY))
    assert again.prefix_cached_tokens == 0 and engine.stats().prefix_host_hits == 0


async def test_a_host_entry_reaches_only_its_trajectory_and_only_the_tokens_that_match(make_engine):
    engine = make_engine()
    first = _turn(engine, "victim-1", PROMPT, "victim", GREEDY)
    result = await generate(engine, first)
    await _drop_device_prefixes(engine)
    prompt = _next_prompt(first, result)
    other = await generate(engine, _turn(engine, "attacker", prompt, "attacker", GREEDY))  # the victim's very tokens
    assert other.prefix_cached_tokens == 0 and "victim" in engine.host_tier.entries()
    forked = PROMPT[:5] + tuple(range(100, 120))  # the victim's id, its prompt diverging at the 6th token
    partial = await generate(engine, _turn(engine, "victim-fork", forked, "victim", GREEDY))
    plain = await generate(engine, _turn(engine, "plain", forked, None, GREEDY))
    assert partial.prefix_cached_tokens == 5 and engine.stats().prefix_host_hits == 1
    assert partial.token_ids == plain.token_ids  # the rest of the restored block was recomputed, never read
    await _drop_device_prefixes(engine)
    assert "victim" in engine.host_tier.entries()  # the fork's own turn, written through
    stranger = await generate(engine, _turn(engine, "victim-other", tuple(range(200, 220)), "victim", GREEDY))
    assert stranger.prefix_cached_tokens == 0 and engine.stats().prefix_host_hits == 1
    assert "victim" in engine.host_tier.entries() and engine.host_tier.entries()["victim"].tokens[0] == 200  # only its own turn now


# ---------------------------------------------------------------- an emulated device

SPEC_7B = replace(EMULATED_7B_H100, time_scale=2.0)  # forwards, and the host load, take twice their emulated time


async def test_an_emulated_restore_holds_the_device_for_the_host_load(loaded):
    """The same second turn, its prefix on the device and then from host: the one from host asks the device
    timeline for exactly ``Roofline.host_load_s(reused) x time_scale`` more (its forwards are the same)."""
    s_model, s_tok = loaded["serving"]
    p_model, p_tok = loaded["policy"]
    engine = Engine(s_model, s_tok, p_model, p_tok, EngineConfig(device="emulated:H100", emulation=SPEC_7B))
    engine.start()
    try:
        engine.set_rollout_lease(SPEC_7B.rollout_kv_bytes, time.monotonic() + 3600)
        prompt1 = tuple(range(10, 610))
        params = EngineSampling(max_tokens=4, seed=3)

        def turn(rid: str, prompt: tuple[int, ...], key: str) -> GenerationRequest:
            return GenerationRequest(request_id=rid, work_class=WorkClass.ROLLOUT, prompt_token_ids=prompt, sampling=params, trajectory_id=key)

        firsts = [await engine.submit(turn(f"{key}-1", prompt1, key)).result() for key in ("device", "host")]
        assert firsts[0].token_ids == firsts[1].token_ids
        prompt2 = prompt1 + firsts[0].token_ids + TOOL
        accelerator = engine.device.accelerator

        async def planned_s(rid: str, key: str):
            before = accelerator.planned_s
            result = await engine.submit(turn(rid, prompt2, key)).result()
            return result, accelerator.planned_s - before

        on_device, device_s = await planned_s("device-2", "device")
        await _drop_device_prefixes(engine)
        pool = engine.work_for(WorkClass.ROLLOUT).pool
        entry = engine.host_tier.entries()["host"]
        assert entry.payload is None and entry.nbytes == pool.blocks_for(_retained(firsts[1], prompt1)) * pool.block_bytes
        from_host, host_s = await planned_s("host-2", "host")
        reused = from_host.prefix_cached_tokens
        assert reused == on_device.prefix_cached_tokens == _retained(firsts[1], prompt1)
        assert engine.stats().prefix_host_hits == 1 and engine.work_for(WorkClass.ROLLOUT).runner.pending_load_s == 0.0
        load_s = float(Roofline(DEVICES["H100"], MODELS["7B"], 1).host_load_s(reused)) * SPEC_7B.time_scale
        assert load_s > 0 and host_s - device_s == pytest.approx(load_s, rel=1e-6)
    finally:
        await engine.stop()
