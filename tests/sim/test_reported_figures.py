"""What the simulated executors and monitor report is what the running ones measure.

Placement reads the same headroom in both (services/scheduler/placement.py); where the simulator's figures
were not the ones an executor measures, its placement saw another fleet than the running system's
(docs/benchmarks.md, 2026-12-05 (evening 2)): a lane three times faster than it sustains (a peak of single
ticks), a queue beside free slots (counted before the turns waiting were admitted), a lane's prefill at the
device's rate alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rose.bench.emulated import EmulatedJob
from rose.contracts.slo import Headroom
from rose.sim.engine import Simulation
from rose.sim.monitor import MonitorState


class Recording(Simulation):
    """The simulator, keeping every headroom its monitor hands the scheduler."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.reported: list[Headroom] = []
        report = self.control.report

        def recording(headroom: Headroom) -> None:
            self.reported.append(headroom)
            report(headroom)

        self.control.report = recording


@pytest.fixture(scope="module")
def reported() -> tuple[Recording, list[Headroom]]:
    """rose on 4 H100s (7B) with one dedicated instance, 4x its batch in flight: its lanes serve and roll out."""
    job = EmulatedJob(gpus=4, model="7B", demand=4, mode="async")
    sim = Recording(dataclasses.replace(job.sim_config("rose", steps=2), seed=0))
    sim.run()
    return sim, sim.reported


def test_the_throughput_peak_is_of_metrics_intervals_not_of_ticks():
    """The monitor's ``rollout_tokens_per_s_peak`` is the highest snapshot's rate: one tick's burst (a tick in which a
    lane's serving work left rollout the whole device) is averaged over its metrics interval."""
    mon = MonitorState.__new__(MonitorState)
    mon.dt, mon.k_snap, mon.W = 0.05, 20, 600
    mon.ring_tps = np.full((2, mon.W), 100.0)
    mon.ring_tps[0, 599] = 2100.0  # one tick of the newest interval on instance 0
    mon.ring_tps[1, 5] = 300.0  # one of the first ticks on instance 1
    assert mon.peak_interval_tps(600).tolist() == pytest.approx([200.0, 110.0])  # (19 x 100 + 2100) / 20; (19 x 100 + 300) / 20
    assert mon.peak_interval_tps(10).tolist() == pytest.approx([100.0, 120.0])  # no whole interval yet: the ticks seen


def test_a_reported_queue_means_no_free_slot(reported):
    """An executor admits waiting turns each iteration: a snapshot shows a queue only where the slots are full (or its
    KV is, which a 7B policy's 32 turns on an H100 never fill)."""
    sim, heads = reported
    dedicated = [h for h in heads if h.role == "dedicated" and h.rollout_queue > 0]
    assert dedicated, "the dedicated executor never had turns waiting"
    assert all(h.rollout_running == h.rollout_batch_slots for h in dedicated)
    lanes = [h for h in heads if h.role == "serving" and h.rollout_queue > 0]
    assert all(h.rollout_running >= sim.inst.slots[sim.inst.index[h.executor_id]] for h in lanes)


def test_a_lane_reports_its_prefill_at_the_share_of_the_device_its_rollout_got(reported):
    """A lane's rollout forwards yield to serving ones, so its measured prefill rate is below a dedicated device's."""
    sim, heads = reported
    dedicated = np.median([h.rollout_prefill_tokens_per_s for h in heads if h.role == "dedicated" and h.rollout_prefill_tokens_per_s > 0])
    lanes = [h.rollout_prefill_tokens_per_s for h in heads if h.role == "serving" and h.rollout_running > 0]
    assert lanes and 0 < np.median(lanes) < 0.9 * dedicated
    assert np.all(sim.rollout.share_seen <= 1.0) and sim.rollout.share_seen[sim.inst.n_serv :].tolist() == [1.0] * (sim.inst.D - sim.inst.n_serv)
