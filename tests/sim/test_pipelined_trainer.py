"""The asynchronous trainer (prefetch), the in-situ slowdown fitted from static, and naive_share's
serving lane waiting behind whole rollout batches. Deterministic: simulated times only."""

import inspect
import re
from dataclasses import replace

import numpy as np
import pytest

from rose.services.executor import policies as executor_policies
from rose.shared.devices import MeasuredSteps
from rose.shared.workload import RolloutSpec, steady_step_rate
from rose.sim import calibration as cal
from rose.sim import config, engine
from rose.sim import trainer as sim_trainer
from rose.sim.coserve import rollout_interference, serving_tick
from rose.sim.engine import simulate
from rose.sim.policies import make_fleet_policy
from rose.testing.sim import SYNTHETIC_E2E

SERVING, POLICY = cal._e2e_step_models(SYNTHETIC_E2E, None, 0)[:2]


def e2e_config(policy: str = "static", slowdown: float = 3.0, steps: int = 8, **changes):
    """One policy of the synthetic e2e run as calibration simulates it, with one step prefetched unless told."""
    changes.setdefault("prefetch_steps", 1)
    return replace(cal._e2e_config(SYNTHETIC_E2E, policy, SERVING, cal.slowed(POLICY, slowdown), 0, steps=steps), **changes)


def test_the_models_constants_are_the_services_own():
    from rose.services.trainer import trainer
    from rose.shared import bus

    assert sim_trainer.GROUP_POLL_S == trainer.GROUP_POLL_S
    assert config.FETCH_WINDOW_S == bus.CONSUME_FETCH_TIMEOUT_S
    consume = re.search(r"consume\(\s*TRAJECTORY.*?batch=(\d+)", inspect.getsource(trainer.Trainer.start), re.S)
    assert consume and int(consume.group(1)) == sim_trainer.TRAINER_FETCH_BATCH


def test_trainer_settings_from_the_e2e_json_else_the_demo():
    from rose.shared.workload import TRAINER

    own = cal.trainer_settings({"trainer": {"ROSE_GRPO__PREFETCH_STEPS": "2", "ROSE_GRPO__MAX_STALENESS": "3", "ROSE_GRPO__GROUP_SIZE": "4"}})
    assert (own["prefetch_steps"], own["max_staleness"], own["group_size"]) == (2, 3, 4)
    assert own["trainer_settings_from"] == "the e2e JSON's trainer block"
    demo = cal.trainer_settings({})
    assert demo["prefetch_steps"] == int(TRAINER["ROSE_GRPO__PREFETCH_STEPS"]) and "shared/workload.py" in demo["trainer_settings_from"]
    assert cal._e2e_config(SYNTHETIC_E2E, "static", SERVING, POLICY, 0, steps=2).prefetch_steps == demo["prefetch_steps"]


def test_the_tasks_bounds_cap_simulated_turns_and_tokens():
    """The real job's episodes never pass ROSE_TASKS__MAX_TURNS turns of ROSE_TASKS__MAX_TOKENS tokens:
    the simulated ones follow the same bounds (else their log-normal tail makes the batch's slowest
    trajectory, and so the rollout time of a step, longer than the real job can be)."""
    bounded = {**SYNTHETIC_E2E, "trainer": {"ROSE_TASKS__MAX_TURNS": "3", "ROSE_TASKS__MAX_TOKENS": "16"}}
    spec = cal._e2e_config(bounded, "static", SERVING, POLICY, 0, steps=2).rollout
    assert (spec.max_turns, spec.gen_max) == (3, 16) and spec.gen_median <= 16
    unbounded = cal._e2e_config({**SYNTHETIC_E2E, "trainer": {"ROSE_GRPO__GROUP_SIZE": "8"}}, "static", SERVING, POLICY, 0, steps=2).rollout
    assert unbounded.max_turns == max(2, int(2 * cal.e2e_setup(SYNTHETIC_E2E, "static")["turns_median"]))


def test_prefetch_shortens_the_step_period():
    """Training and rollout take about as long: synchronous, a step is sync + rollout + train; with one
    step prefetched (a trainer taking one step's worth of groups) the next batch rolls out while a
    step trains, and the period comes down to about the longer of the two."""
    sync = simulate(e2e_config(prefetch_steps=0))
    pre = simulate(e2e_config())
    assert sync["complete"] and pre["complete"] and pre["prefetch_steps"] == 1
    assert pre["step_s"] < 0.75 * sync["step_s"]
    assert pre["step_s"] == pytest.approx(max(pre["train_s_per_step"], pre["rollout_s_per_step"]), rel=0.15)
    assert pre["groups_per_trained_step"] == 2 and pre["trainer_wait_s_per_step"] < 0.5


def test_the_asynchronous_rate_counts_from_the_step_after_the_pipeline_fill():
    """The batch handed out with the first makes the second step come sooner than later ones; the simulated
    rate is the services' steady rate (shared/workload.py), from that step on, as rose bench e2e measures it."""
    sim = engine.Simulation(e2e_config())
    out = sim.run()
    done = [s["done"] for s in sim.trainer.state.steps]
    assert out["complete"] and len(done) == 8
    assert out["rl_steps_per_hour"] == pytest.approx(steady_step_rate(done, 1)) == pytest.approx(3600 * 6 / (done[-1] - done[1]))


def test_the_trainer_takes_one_steps_worth_of_groups_oldest_first():
    """As Trainer.next_groups does: the groups of a prefetched batch that are ready early stay for the
    next step, so each step trains on one batch and the prefetch keeps hiding rollout behind training."""
    run = simulate(e2e_config())
    assert run["groups_per_trained_step"] == 2  # the synthetic run's groups per step
    assert simulate(e2e_config()) == run  # deterministic
    src = inspect.getsource(sim_trainer.Trainer.pipelined)
    assert "[:per_step]" in src and "Trainer.next_groups" in src
    from rose.services.trainer import trainer

    assert "take(ready, want)" in inspect.getsource(trainer.Trainer.next_groups)  # exactly one step's worth (groups.py take: oldest first)


def test_contention_factor_is_fitted_from_static_and_applied_to_every_policy(monkeypatch):
    report = {**SYNTHETIC_E2E, "policies": {n: dict(p) for n, p in SYNTHETIC_E2E["policies"].items() if n in ("static", "naive_share", "rose")}}
    for name, p in report["policies"].items():
        p["calibration"] = {**p["calibration"], "turn_s_p50": 0.5 if name == "static" else 0.05}  # only static's may count
        p["steps"] = 4
    used: dict[str, MeasuredSteps] = {}
    real_simulate = engine.simulate

    def recording(cfg):
        used[cfg.policy] = cfg.perf[1]
        return real_simulate(cfg)

    monkeypatch.setattr(engine, "simulate", recording)
    out = cal.calibrate_e2e(report, None, source="synthetic")
    fit = out["calibration_detail"]["contention"]
    assert fit["fitted_on"] == "static: calibration.turn_s_p50" and fit["factor"] > 1.0
    assert fit["predicted_turn_s_p50"] == pytest.approx(0.5, rel=0.1)
    expected = cal.slowed(POLICY, fit["factor"])
    assert set(used) == {"static", "naive_share", "rose"}
    assert all(m == expected for m in used.values())  # the same factor for every policy (the last run of each)
    assert "fitted by construction" in out["calibration_detail"]["per_policy"]["static"]["fitted"]
    # given explicitly, nothing is fitted
    given = cal.calibrate_e2e({**report, "policies": {"rose": report["policies"]["rose"]}}, None, source="synthetic", contention=1.0)
    assert given["calibration_detail"]["contention"]["fitted_on"] is None and used["rose"] == POLICY


def test_naive_lane_makes_serving_wait_behind_a_whole_rollout_batch():
    """naive_share: the executor runs the admitted rollout batch to completion between serving
    iterations (unbounded quanta), so an arrival waits for the batch and every serving iteration
    carries it; rose's lane yields within one quantum."""
    naive, rose = make_fleet_policy("naive_share").executor_policy, make_fleet_policy("rose").executor_policy
    assert isinstance(naive, executor_policies.NaiveShare) and naive.quantum_ms is None and naive.shares_serving_lane
    tau, turn_tokens = np.array([0.008]), 16.0
    signals = lambda d: executor_policies.Signals(now=0.0, serving_prefill_pending=0, serving_running=2, serving_iteration_ms=5.0, slo_tpot_ms=100.0)  # noqa: E731
    extra, wait, _ = rollout_interference(naive, np.array([True]), tau, turn_tokens, signals)
    assert extra[0] == wait[0] == pytest.approx(tau[0] * turn_tokens)  # the whole batch: 16 decode steps
    r_extra, r_wait, _ = rollout_interference(rose, np.array([True]), tau, turn_tokens, signals)
    assert r_wait[0] <= rose.quantum_ms / 1e3
    perf = MeasuredSteps(0.004, 0.0003, 0.004, 0.0001)
    alone = serving_tick(perf, np.array([8.0]), 13.0, 16.0, 13.0, 0.0, 0.0, 0.0, 0.1, 1e6)
    behind = serving_tick(perf, np.array([8.0]), 13.0, 16.0, 13.0, extra, wait, 0.0, 0.1, 1e6)
    assert behind.ttft_p99_s[0] >= alone.ttft_p99_s[0] + tau[0] * turn_tokens
    assert behind.tpot_p99_s[0] > alone.tpot_p99_s[0] + tau[0] * turn_tokens * 0.9
    # in the fleet: with the rollout engine's in-situ speed, naive_share's serving misses its SLO where rose's does not
    runs = {p: simulate(e2e_config(p, slowdown=4.0, steps=4)) for p in ("naive_share", "rose")}
    assert runs["naive_share"]["serving_slo_attainment"] < runs["rose"]["serving_slo_attainment"]


def test_early_hand_out_fills_idle_capacity_within_the_staleness_bound():
    """grpo.early_hand_out as Trainer.hand_out_early does it, on the trainer's own RolloutCapacity fed by
    the simulated monitor's headroom: off, a batch goes out only after a step trains (the lead stays
    prefetch_steps + 1); on, batches also go out while a step waits and no executor has a rollout
    queue, never more than max_staleness ahead of the steps taken, so no step trains on a trajectory
    more than max_staleness versions old."""
    off = engine.Simulation(e2e_config(policy="rose", early_hand_out=False))
    off_run = off.run()
    assert off_run["early_hand_outs"] == 0
    assert all(b - v <= 1 for b, v in off.trainer.state.batch_version.items())  # handed out prefetch_steps ahead at most
    on = engine.Simulation(e2e_config(policy="rose"))
    on_run = on.run()
    assert on.cfg.early_hand_out and on.cfg.max_staleness == 2 and on_run["complete"]
    assert on_run["early_hand_outs"] > 0
    assert max(b - v for b, v in on.trainer.state.batch_version.items()) == 2  # some batch went out two steps ahead
    assert all(s["staleness"] <= on.cfg.max_staleness for s in on.trainer.state.steps)
    assert on_run["staleness_mean"] > off_run["staleness_mean"]
    src = inspect.getsource(sim_trainer.Trainer.pipelined)
    assert "self.capacity.idle(" in src and "Trainer.hand_out_early" in src


def _partial(over_provision: float, **kw) -> dict:
    """7B on 8 GPUs (2 dedicated), static, synchronous, demand 2x, two steps."""
    rollout = replace(RolloutSpec(), oversubscription=2.0)
    cfg = engine.SimConfig(model="7B", gpus=8, policy="static", steps=2, seed=0, rollout_gpu_ratio=0.25, rollout=rollout)
    return simulate(replace(cfg, over_provision=over_provision, **kw))


def test_partial_rollouts_shorten_the_synchronous_tail_and_report_what_they_cost():
    """grpo.over_provision in synchronous RL: N + k groups out, the first N complete trained, the rest carried
    into the next step. The step's tail (after 90 % of the trajectories it trains finished) shrinks; what it
    costs is reported: carried groups are a version old when trained (within max_staleness), and what
    completes first is a little shorter than the batch (length bias under 1, near it)."""
    today, partial = _partial(0.0), _partial(0.25)
    assert today["complete"] and partial["complete"]
    assert today["staleness_max"] == 0 and today["length_bias"] is None
    assert partial["tail_s_per_step"] < 0.8 * today["tail_s_per_step"]
    assert 0.0 < partial["staleness_mean"] <= partial["staleness_max"] <= 2
    assert partial["stale_groups_dropped"] == 0
    assert 0.8 < partial["length_bias"] <= 1.05


def test_carried_groups_past_max_staleness_are_dropped_and_counted():
    out = _partial(0.25, max_staleness=0)
    assert out["complete"] and out["staleness_max"] == 0
    assert out["stale_groups_dropped"] > 0
