"""The simulator's prefix caches follow the executor's ``PrefixCache`` and ``HostTier``
(services/executor/prefix_cache.py): one entry per trajectory and instance, kept when the trajectory's next turn
runs elsewhere, taken by the next turn sent there, reused in part by a later turn that comes back, evicted least
recently retained first, written through to a host tier that outlives the device copy and a revoked lease, and
missed once the instance has a newer policy version than the one that computed it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rose.shared.workload import RolloutSpec
from rose.sim.engine import SimConfig, Simulation
from rose.sim.turns import TurnTable

KVB = 2.0  # bytes per token in these tables


def finished(t: TurnTable, i: int, d: int, ctx: float, version: int = 0, at: float = 0.0) -> None:
    """Row ``i`` runs a turn on instance ``d`` whose context ends at ``ctx`` tokens, finished at ``at``."""
    t.submit(i, d, None, ctx, 0.0, 1.0, ctx)
    t.state[i] = 2
    t.finish(i, KVB, version, at)


def test_an_entry_stays_where_the_trajectory_left_it_and_is_taken_once():
    t = TurnTable(3)
    t.alloc(2)
    finished(t, 0, 0, 100.0)
    finished(t, 0, 1, 180.0)  # the next turn ran on instance 1: instance 0 keeps what it had
    assert t.cache_tokens[0, 0] == 100.0 and t.cache_tokens[0, 1] == 180.0
    assert t.where(0, 0, 0.0, 1e9, 0.0) == "device"
    assert t.take(0, 0) == (100.0, 0)  # a later turn back on instance 0 finds the first turn's context
    assert t.take(0, 0) == (0.0, 0) and t.where(0, 0, 0.0, 1e9, 1e9) == ""  # taken: the executor handed it over
    finished(t, 0, 1, 250.0)  # the entry there is replaced, not added to
    assert t.cache_bytes[:, 1].sum() == 250.0 * KVB


def test_eviction_takes_the_least_recently_retained_first_and_the_host_tier_keeps_them():
    t = TurnTable(2)
    t.alloc(3)
    finished(t, 0, 0, 100.0, at=1.0)
    finished(t, 1, 0, 100.0, at=2.0)
    finished(t, 2, 0, 100.0, at=3.0)
    cap = 400.0 * KVB  # running turns hold 150 tokens' KV: the two newest entries fit beside them, not the oldest
    assert [t.where(i, 0, 150.0 * KVB, cap, 0.0) for i in range(3)] == ["", "device", "device"]
    assert [t.where(i, 0, 0.0, cap, 0.0) for i in range(3)] == ["device"] * 3  # nothing running: all of them fit
    # a host tier of 250 tokens holds the newest two copies whole, not the oldest
    assert [t.where(i, 0, 150.0 * KVB, cap, 250.0 * KVB) for i in range(3)] == ["", "device", "device"]
    assert [t.where(i, 0, 400.0 * KVB, cap, 250.0 * KVB) for i in range(3)] == ["", "host", "host"]


def test_a_revoked_lease_loses_its_device_copies_and_keeps_the_host_tier():
    t = TurnTable(2)
    t.alloc(2)
    finished(t, 0, 1, 100.0)
    finished(t, 1, 1, 100.0)
    t.drop_instance_cache(1, keep_host=True)
    assert t.where(0, 1, 0.0, 1e9, 1e9) == "host" and t.where(0, 1, 0.0, 1e9, 0.0) == ""
    t.drop_instance_cache(1, keep_host=False)
    assert t.where(1, 1, 0.0, 1e9, 1e9) == ""


def test_ending_a_trajectory_and_moving_a_hedge():
    t = TurnTable(3)
    t.alloc(2)
    finished(t, 0, 0, 100.0)
    finished(t, 2, 1, 70.0)  # row 2 = N + 0: row 0's hedge finished on instance 1
    t.move_cache(2, 0)
    assert t.cache_tokens[0, 1] == 70.0 and t.cache_tokens[2].sum() == 0.0 and t.where(0, 1, 0.0, 1e9, 0.0) == "device"
    t.drop_cache(0)
    assert t.cache_tokens.sum() == 0.0 and t.cache_bytes.sum() == 0.0


def sim_with(host_kv_ratio: float = 2.0) -> Simulation:
    s = Simulation(SimConfig(model="7B", gpus=8, policy="rose", steps=1, seed=0, rollout_gpu_ratio=0.25, host_kv_ratio=host_kv_ratio))
    s.turns.alloc(4)
    return s


def retain(sim: Simulation, i: int, d: int, tokens: float) -> None:
    sim.turns.submit(i, d, None, tokens, 0.0, 1.0, tokens)
    sim.turns.state[i] = 2
    sim.turns.finish(i, sim.sized.memory.kvb_p, 0, sim.env.now)


def test_a_returning_turn_reuses_the_prefix_it_left_there():
    sim = sim_with()
    d = sim.inst.D - 1  # a dedicated instance, its KV free
    retain(sim, 0, d, 300.0)
    assert sim.worker.cached(0, d, 900.0) == (300.0, 0.0)  # on the device: only the rest is prefilled, nothing to copy
    assert sim.worker.cached(0, d, 900.0) == (0.0, 0.0)  # taken


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host_tier_at_the_links_speed():
    sim = sim_with()
    d = sim.inst.D - 1
    retain(sim, 0, d, 3000.0)
    sim.inst.kvcap[d] = 0.0  # the device copy is gone (no room for it)
    tokens, load_s = sim.worker.cached(0, d, 4000.0)
    assert tokens == 3000.0
    assert load_s == pytest.approx(float(sim.sized.shape.pperf_d.host_load_s(3000.0)) * sim.turns.bundle) and load_s > 0
    off = sim_with(host_kv_ratio=0.0)
    retain(off, 0, d, 3000.0)
    off.inst.kvcap[d] = 0.0
    assert off.worker.cached(0, d, 4000.0) == (0.0, 0.0)  # without a host tier the prefix is prefilled again


def test_a_new_policy_version_misses_what_the_old_one_computed():
    sim = sim_with()
    d = sim.inst.D - 1
    retain(sim, 0, d, 300.0)
    sim.trainer.state.published(dedicated_at=0.0, serving_at=5.0)  # version 1 is on the dedicated pool now
    assert sim.trainer.state.version_at(True, sim.env.now) == 1 and sim.trainer.state.version_at(False, sim.env.now) == 0
    assert sim.worker.cached(0, d, 900.0) == (0.0, 0.0)
    assert sim.turns.cache_tokens[0, d] == 0.0  # the executor dropped the stale entry when the turn took it


@pytest.mark.parametrize("policy", ["static", "rose"])
def test_the_host_tier_redoes_less_prefill_than_the_device_alone(policy):
    """A demand-4 batch overflows the dedicated pool's KV while tools run: the host tier brings prefixes back."""
    out = {}
    for ratio in (0.0, 2.0):
        cfg = SimConfig(
            model="7B", gpus=8, policy=policy, steps=1, seed=0, rollout_gpu_ratio=0.25, host_kv_ratio=ratio,
            rollout=replace(RolloutSpec(), oversubscription=4.0),
        )  # fmt: skip
        out[ratio] = Simulation(cfg).run()
    assert out[0.0]["prefix_host_share"] == 0.0 and out[2.0]["prefix_host_share"] > 0
    assert out[2.0]["reprefill_share"] < out[0.0]["reprefill_share"]
    assert out[2.0]["prefix_hit_rate"] > out[0.0]["prefix_hit_rate"]
    assert 0 < out[0.0]["prefix_reuse"] < out[2.0]["prefix_reuse"] <= 1  # what is prefilled again falls too
