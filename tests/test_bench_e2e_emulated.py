"""`rose bench e2e --emulate`: the real services on emulated GPUs, the simulator on the same configuration beside.

The end-to-end run is a small fleet (three serving executors in one process, one dedicated one in
another, the monitor, the scheduler, a worker, the publisher and the trainer, each its own process)
running a tiny agentic job under static and rose: every JSON field the issue names is there, the
simulator ran the same configuration, nothing is lost, and each policy's knob shows from outside
(static lends nothing). No speed is asserted: figures belong to the full-length bench.
The rescaling of wall time into the fleet's time is checked on made-up events.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rose.bench.demo import Observed
from rose.bench.e2e_emulated import HOW_FIGURES, run_emulated_e2e
from rose.bench.emulated import EmulatedJob, executor_groups, rescale, serving_requests, trainer_process
from rose.contracts.rollout import PlacementEvent, Trajectory, TurnRecord
from rose.contracts.training import TrainingStep
from rose.services.scheduler.placement import RULES
from rose.shared.security import init_credentials

TINY_WORKLOAD = {
    "turns_median": 2,
    "max_turns": 3,
    "gen_median": 24,
    "gen_min": 8,
    "gen_max": 48,
    "tool_tokens_median": 20,
    "tool_tokens_max": 64,
    "tool_latency_median_s": 0.05,
    "tool_latency_max_s": 0.2,
    "prompt_median": 200,
    "prompt_sigma": 0.1,
    "max_context": 4096,
}
POLICY_FIELDS = (
    "rl_steps_per_hour",
    "rollout_s_per_step",
    "serving_slo_attainment",
    "rollout_tokens_per_s",
    "trajectories_lost",
    "harvested_fraction",
    "leases_granted",
    "fidelity",
    "tokens_by_role_over_time",
)


def test_wall_time_becomes_the_fleets_time():
    obs = Observed()
    turn = TurnRecord(
        turn_index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[-1.0], policy_version=0, executor_id="e", started_at=104.0, finished_at=108.0
    )
    obs.trajectories["t"] = Trajectory(
        task_id="t", trajectory_id="t-traj", env="emulated", status="completed", worker_id="w", turns=[turn], finished_at=112.0
    )
    obs.steps.append(
        TrainingStep(
            run_id="r", step=1, version=1, reward_mean=0.5, groups=1, trajectories=8, trained_sequences=8, train_s=8.0, publish_s=4.0, at=120.0
        )
    )
    obs.serving.requests.append({"executor": "e", "sent_at": 132.0, "t": 140.0, "ttft_ms": 400.0, "tpot_ms": 40.0, "ok": True, "error": None})
    obs.lease_events.append((116.0, "e", "granted"))
    e = rescale(obs, t0=100.0, scale=4.0)
    u = e.trajectories["t"].turns[0]
    assert (u.started_at, u.finished_at, e.trajectories["t"].finished_at) == (101.0, 102.0, 103.0)
    assert (e.steps[0].at, e.steps[0].train_s, e.steps[0].publish_s) == (105.0, 2.0, 1.0)
    assert e.serving.requests[0] == {"executor": "e", "sent_at": 108.0, "t": 110.0, "ttft_ms": 100.0, "tpot_ms": 10.0, "ok": True, "error": None}
    assert e.lease_events == [(104.0, "e", "granted")] and obs.steps[0].at == 120.0  # the original is untouched


def test_the_serving_trace_is_the_simulators():
    job = EmulatedJob(gpus=4, load=0.35, seed=3)
    sim = job.sizing()
    requests = serving_requests(job, 60.0)
    assert len(requests) == pytest.approx(float(sim.sized.traffic.fleet_rate[:60].sum()), rel=0.15)  # Poisson counts at the trace's rate
    assert all(0 <= r.at_s < 60 and r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in requests)
    assert requests == serving_requests(job, 60.0)  # seeded: every policy gets the same requests


def test_a_co_batched_job_co_batches_on_serving_executors_and_folds_on_dedicated_ones():
    """As the simulator prices it (sim/sizing.py): rollout rows ride serving's batches on the serving executors; a
    dedicated executor, with no serving batches, runs the adapter folded into its base copy (the two-model mode)."""
    modes = {g.name: g.env["ROSE_ENGINE__ROLLOUT_MODE"] for g in executor_groups(EmulatedJob(gpus=4, rollout_mode="co_batched"))}
    assert modes == {"emu-serving": "co_batched", "emu-dedicated": "two_model"}
    assert {g.env["ROSE_ENGINE__ROLLOUT_MODE"] for g in executor_groups(EmulatedJob(gpus=4))} == {"two_model"}


def test_over_provisioning_reaches_the_trainer_and_the_simulator_as_one_share(tmp_path):
    """The share of a step's groups handed out beyond it: the simulator takes the share, the trainer the groups,
    rounded up as the simulator rounds them (sim/trainer.py ``extra``)."""
    job = EmulatedJob(gpus=4, over_provision=0.25)
    groups = job.trajectories_per_step() // 8
    assert job.sim_config("rose").over_provision == 0.25 and job.extra_groups() == -(-groups // 4)
    env = trainer_process(tmp_path, "nats://127.0.0.1:1", tmp_path, init_credentials(tmp_path / "creds"), job, tmp_path).env
    assert env["ROSE_GRPO__OVER_PROVISION"] == str(job.extra_groups())
    assert EmulatedJob(gpus=4).extra_groups() == 0
    with pytest.raises(ValueError, match="over_provision"):
        EmulatedJob(over_provision=-0.1)


def short_serving_trace(path: Path, rate_rps: float = 3.0, seconds: int = 600) -> str:
    """A replayed serving trace (Azure's format) of short requests: the run waits for every serving request sent in
    its window to finish, and the synthetic trace's longest (2,048 tokens) would hold the drain for 15 s."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"{i / rate_rps:.3f},{200 + 37 * i % 600},{8 + 13 * i % 56}" for i in range(int(seconds * rate_rps))]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_small_emulated_fleet_runs_static_and_rose_with_the_simulator_beside(tmp_path, models_dir):
    job = EmulatedJob(
        gpus=3,
        dedicated_ratio=0.34,
        demand=1,
        load=0.1,
        time_scale=1.0,
        rollout_max_batch=8,
        workload=TINY_WORKLOAD,
        warmup_s=2.0,
        over_provision=0.5,
        trace=short_serving_trace(tmp_path / "serving.csv"),
    )
    out = tmp_path / "e2e.json"
    # duration_s: a cap, far from when the two steps end the window (a box loaded by the suite is slower)
    run_emulated_e2e(out_json=str(out), job=job, policies=["static", "rose"], duration_s=150, until_steps=2, model_dir=str(models_dir), drain_s=30.0)
    result = json.loads(out.read_text())
    e = result["emulation"]
    assert (e["device"], e["model"], e["time_scale"]) == ("H100", "7B", 1.0)
    assert e["executors_per_process"] == {"serving": 3, "dedicated": 1}
    assert result["job"]["over_provision"] == 0.5 and result["job"]["extra_groups"] >= 1  # partial rollouts through the real trainer
    for policy in ("static", "rose"):
        f = result["policies"][policy]
        assert all(field in f for field in POLICY_FIELDS), sorted(set(POLICY_FIELDS) - set(f))
        assert f["steps"] >= 2 and f["rl_steps_per_hour"] > 0 and f["trajectories_lost"] == 0 and f["trajectories_late"] >= 0
        assert set(f["fidelity"]) == {"forward_lag_p99_percent", "cpu_utilization", "starved", "starved_by", "fleet_cpu_cores"}
        assert f["fidelity"]["forward_lag_p99_percent"] is not None  # the devices reported their lateness
        assert result["sim"][policy]["rl_steps_per_hour"] > 0 and "rl_steps_per_hour" in result["sim_vs_real"][policy]
        spread = result["sim"][policy]["rl_steps_per_hour_by_seed"]  # the simulator at several seeds: the spread a few steps' rate has
        assert len(spread["seeds"]) > 1 and spread["min"] <= spread["mean"] <= spread["max"]
        assert result["sim"][policy]["steps"] == f["steps"]  # as many simulated steps as the real run took
        assert [e["step"] for e in f["step_events"]] == list(range(1, f["steps"] + 1))
        assert {"start", "warmup", "trainer_start", "window", "drain", "stop"} <= set(f["wall_phases_s"])
        how = result["sim_vs_real"][policy]["how"]  # how each side got there, real beside simulated
        assert set(how) == {real for real, _ in HOW_FIGURES} and all(c["sim"] is not None for c in how.values())
        assert 0 <= how["prefix_hit_rate"]["real"] <= 1 and how["tail_s_per_step"]["real"] >= 0
        dumped = [msgspec.json.decode(line, type=Trajectory) for line in (Path(f["report"]) / "trajectories.jsonl").read_bytes().splitlines()]
        assert dumped and len({t.task_id for t in dumped}) == len(dumped) and all(u.executor_id for t in dumped for u in t.turns)
        placed = [msgspec.json.decode(line, type=PlacementEvent) for line in (Path(f["report"]) / "placements.jsonl").read_bytes().splitlines()]
        routed = {(p.trajectory_id, p.turn_index) for p in placed if not p.hedge}  # every turn that ran was placed
        assert {(t.trajectory_id, u.turn_index) for t in dumped for u in t.turns} <= routed
        assert (Path(f["report"]) / "snapshots.jsonl").stat().st_size > 0
        # each placement names its rule, on the real scheduler and in the simulator alike, and the shares sit side by side
        assert sum(f["placement_rules"].values()) == len(placed) and all(p.rule in RULES for p in placed)
        shares = result["sim_vs_real"][policy]["placement_rule_shares"]
        assert set(shares) == set(f["placement_rules"]) | set(result["sim"][policy]["placement_rules"])
        assert sum(c["real"] for c in shares.values()) == pytest.approx(1.0) and sum(c["sim"] for c in shares.values()) == pytest.approx(1.0)
    assert result["side_by_side"]  # both fleets ran at once, each on its own nats-server
    assert result["policies"]["static"]["rollout_tokens_on_serving"] == 0  # static never lends a serving executor
    assert not any(rule.startswith("serving: ") for rule in result["policies"]["static"]["placement_rules"])
    assert result["policies"]["static"]["rollout_tokens_by_executor"]  # the dedicated executor did the rollout
    assert "speedup_vs_static" in result and (tmp_path / "e2e.png").stat().st_size > 0
    assert msgspec.json.decode(out.read_bytes())  # plain JSON throughout
