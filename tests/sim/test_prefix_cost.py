"""What prefix-cache misses cost the rollout device: a later turn that runs without its cached prefix
(moved to another instance, or its prefix evicted) prefills its whole context again, priced on that
instance's roofline, and the result reports it as a share of every rollout forward's device time.
Simulated (deterministic) figures, not wall-clock timings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rose.shared.workload import RolloutSpec
from rose.sim.engine import SimConfig, Simulation


def run(policy: str, **rollout) -> tuple[Simulation, dict]:
    cfg = SimConfig(
        model="7B", gpus=8, policy=policy, steps=1, seed=0, rollout_gpu_ratio=0.25, rollout=replace(RolloutSpec(), oversubscription=4.0, **rollout)
    )
    sim = Simulation(cfg)
    return sim, sim.run()


def test_single_turn_trajectories_redo_no_prefill():
    """Without a later turn there is no prefix to lose: nothing is redone, whatever the placement."""
    sim, out = run("rose", turns_median=1.0, turns_sigma=0.0)
    assert out["complete"] and sim.counts.rollout.device_s > 0
    assert sim.counts.turns.prefix_hits + sim.counts.turns.prefix_misses == 0
    assert out["reprefill_share"] == 0.0 and out["reprefill_moved_share"] == 0.0


@pytest.mark.parametrize("policy", ["static", "rose"])
def test_multi_turn_misses_are_priced_against_the_device_time(policy):
    sim, out = run(policy)
    c = sim.counts
    assert out["complete"] and c.turns.prefix_misses + c.turns.prefix_hits > 0
    # every second a rollout forward ran on some instance, at most the instances x the simulated time
    instances = out["dedicated_instances"] + out["serving_instances"]
    assert 0 < c.rollout.device_s <= instances * out["simulated_s"]
    assert c.turns.reprefill_s > 0  # a demand-4 batch overflows the prefix caches: some later turns prefill again
    assert out["reprefill_share"] == pytest.approx(c.turns.reprefill_s / c.rollout.device_s)
    assert 0 <= out["reprefill_moved_share"] <= out["reprefill_share"] < 1
    # a redone prefill costs at least what the cheapest miss would: a whole prompt prefilled on this roofline
    shape = sim.sized.shape
    cheapest = min(float(shape.pperf_d.prefill_s(1000.0)), float(shape.pperf_s.prefill_s(1000.0)))
    assert c.turns.reprefill_s >= cheapest
