"""`rose bench e2e`: the demo's RL job under static / naive_share / elastic_baseline / rose.

The pure figures are checked on made-up events; the short end-to-end run checks every JSON field
the issue (and the simulator's calibration) reads, and that each policy's knobs really change what
the fleet does: no rollout on serving executors under static, standing leases never revoked under
naive_share, at most one serving executor lent at a time under elastic_baseline (min_serving = 1).
No figure is asserted (speed belongs to the full-length bench on a quiet machine). Pinning is checked
from outside: while the bench runs, the test reads Cpus_allowed_list in /proc of the bench's executor
processes and of their children (the rollout forward process): one core each, a different one per executor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rose.bench.demo import SPEC
from rose.bench.e2e import (
    DEDICATED_ROLLOUT_SLOTS,
    batch_rollout_spans,
    batch_tails,
    demand_settings,
    later_turns,
    lent_fraction,
    max_in_flight,
    max_lent_at_once,
    prefetch_steps,
    reusable_context,
    step_figures,
)
from rose.services.trainer.config import GrpoSettings
from rose.shared.workload import TRAINER

# GRPO seconds after the warm start (not part of the window), at most: UNTIL_STEPS ends it sooner. A cap far from
# the steps' time: at 20 s, four suite workers on 2 cores once left the run one step (2026-12-06).
DURATION_S = 120
UNTIL_STEPS = 2  # a rate needs two steps (static: about 2 s each alone, 5-10 under the suite's load)
# The demo's is 200. At 20 the policy never answered right (reward 0 in every group): the trainer stopped the
# job for degenerate groups after 8 steps without training one, and the rates this test reads were absent.
WARM_START_STEPS = 60
RUN_TIMEOUT_S = 420  # one policy: start-up, warm start, DURATION_S of job, drain and report
POLICY_FIELDS = (
    "rl_steps_per_hour",
    "rollout_s_per_step",
    "serving_slo_attainment",
    "rollout_tokens_per_s",
    "reward_first",
    "reward_last",
    "trajectories_lost",
    "rollout_share_of_step",
    "devices",
)
PINNED = len(os.sched_getaffinity(0)) >= 2  # one core per executor needs two cores (one serving, one dedicated executor)


def test_step_figures_leave_out_the_warm_start_and_subtract_training():
    steps = [SimpleNamespace(step=i + 1, at=100.0 + 10.0 * i, train_s=2.0, publish_s=1.0) for i in range(4)]
    f = step_figures(list(reversed(steps)))
    assert f["rl_steps_per_hour"] == pytest.approx(3 / 30 * 3600)
    assert f["trainer_wait_s_per_step"] == pytest.approx(7.0) and f["step_s"] == pytest.approx(10.0)
    assert step_figures(steps[:1])["rl_steps_per_hour"] == 0.0 and step_figures([])["trainer_wait_s_per_step"] is None


def test_an_asynchronous_trainers_rate_leaves_out_its_pipeline_fill():
    """With a batch handed out ahead, the second step's rollout was under way from the start: it comes sooner
    than any later one, and the steady rate counts from it. The trainer's settings say how many went ahead."""
    at = [100.0, 104.0, 114.0, 124.0]  # the prefetched batch makes step 2 come 4 s after step 1, the rest 10 s
    steps = [SimpleNamespace(step=i + 1, at=t, train_s=2.0, publish_s=1.0) for i, t in enumerate(at)]
    assert step_figures(steps, prefetch=1)["rl_steps_per_hour"] == pytest.approx(2 / 20 * 3600)
    assert step_figures(steps)["rl_steps_per_hour"] == pytest.approx(3 / 24 * 3600)  # synchronous: from the first
    assert step_figures(steps[:2], prefetch=1)["rl_steps_per_hour"] == pytest.approx(3600 / 4)  # too few: from the first
    assert prefetch_steps({"ROSE_GRPO__PREFETCH_STEPS": "0"}) == 0 and prefetch_steps({}) == GrpoSettings().prefetch_steps == 1


def test_batch_rollout_spans_from_first_turn_to_last_trajectory():
    def traj(step: int, start: float, end: float):
        return SimpleNamespace(group_id=f"job-7-s{step}-g0", turns=[SimpleNamespace(started_at=start)], finished_at=end)

    trajectories = [traj(0, 10.0, 12.0), traj(0, 11.0, 15.0), traj(1, 14.0, 20.0), traj(1, 16.0, 18.0), traj(2, 30.0, 31.0)]
    assert batch_rollout_spans(trajectories, per_step=2) == [5.0, 6.0]  # step 2 is incomplete


def test_batch_tails_from_the_ninetieth_percentile_finish_to_the_last():
    def traj(step: int, end: float):
        return SimpleNamespace(group_id=f"job-7-s{step}-g0", turns=[SimpleNamespace(started_at=0.0)], finished_at=end)

    batch = [traj(0, float(end)) for end in range(1, 11)] + [traj(0, 30.0)]  # 11 trajectories: the 90th percentile is the 10th
    assert batch_tails(batch + [traj(1, 5.0)], per_step=11) == [20.0]  # step 1 is incomplete


def _conversation(executors: list[str], cached: list[int]) -> SimpleNamespace:
    """Turns as a worker records them: a 50-token first prompt; each turn samples 16 tokens and the next prompt is
    the last one, those 16 and a 10-token observation."""
    turns, prompt = [], list(range(50))
    for k, (executor, hit) in enumerate(zip(executors, cached)):
        out = [1000 + 100 * k + j for j in range(16)]
        turns.append(SimpleNamespace(executor_id=executor, prefix_cached_tokens=hit, prompt_token_ids=prompt, token_ids=out))
        prompt = prompt + out + [2000 + 100 * k + j for j in range(10)]
    return SimpleNamespace(turns=turns)


def test_later_turns_count_hits_reuse_and_moves_from_the_second_turn_on():
    # the first turns never count (nothing to cache yet). A turn's reusable context is what the executor retained of
    # the turn before: its prompt and all but its last sampled token (turn 1: 50 + 15; turn 2: 76 + 15)
    trajectories = [
        _conversation(["a", "a", "b"], [0, 65, 0]),  # stayed, whole context cached; moved, none
        _conversation(["a", "b", "a"], [0, 0, 65]),  # moved; back to a, which holds turn 0's context only
        _conversation(["a"], [0]),
    ]
    got = later_turns(trajectories)
    assert got == {"prefix_hit_rate": 0.5, "prefix_reuse": 130 / (65 + 91 + 65 + 91), "moved": 0.75}
    assert later_turns(trajectories[2:]) == {"prefix_hit_rate": None, "prefix_reuse": None, "moved": None}


def test_the_reusable_context_is_what_the_executors_matching_rule_serves():
    """A chat template that renders the sampled answer differently leaves only the tokens before it reusable."""
    prev, turn = _conversation(["a", "a"], [0, 65]).turns
    assert reusable_context(prev, turn) == 65
    rerendered = SimpleNamespace(prompt_token_ids=prev.prompt_token_ids + [7] * 26)
    assert reusable_context(prev, rerendered) == 50


def test_max_in_flight_counts_overlapping_trajectories():
    def traj(start: float, end: float):
        return SimpleNamespace(turns=[SimpleNamespace(started_at=start)], finished_at=end)

    # three overlap in 2-3; the last starts as one ends (back to back, not at once); unfinished ones are left out
    trajectories = [traj(0.0, 3.0), traj(1.0, 4.0), traj(2.0, 5.0), traj(5.0, 6.0), traj(1.0, 0.0), SimpleNamespace(turns=[], finished_at=2.0)]
    assert max_in_flight(trajectories) == 3 and max_in_flight([]) == 0


def test_rollout_demand_is_in_flight_over_the_dedicated_batch():
    worker, job = demand_settings(1, dedicated=1)  # the default job, unchanged
    assert int(worker["ROSE_CONCURRENCY"]) == SPEC.worker_concurrency == DEDICATED_ROLLOUT_SLOTS
    assert job["ROSE_GRPO__GROUPS_PER_STEP"] == TRAINER["ROSE_GRPO__GROUPS_PER_STEP"]
    worker, job = demand_settings(4, dedicated=1)  # a step asks at least as many as are in flight
    group_size = int(TRAINER["ROSE_GRPO__GROUP_SIZE"])
    assert int(worker["ROSE_CONCURRENCY"]) == 4 * DEDICATED_ROLLOUT_SLOTS <= int(job["ROSE_GRPO__GROUPS_PER_STEP"]) * group_size
    assert int(demand_settings(2, dedicated=2)[0]["ROSE_CONCURRENCY"]) == 4 * DEDICATED_ROLLOUT_SLOTS
    with pytest.raises(ValueError, match="at least 1"):
        demand_settings(0, dedicated=1)


def test_lent_fraction_and_max_lent_at_once():
    events = [
        (10.0, "a", "granted"),
        (15.0, "a", "renewed"),
        (20.0, "a", "revoked"),
        (18.0, "b", "granted"),
        (30.0, "b", "expired"),
        (35.0, "a", "granted"),
    ]
    assert lent_fraction(events, ["a", "b"], 0.0, 40.0) == pytest.approx((10 + 5 + 12) / 80)
    assert max_lent_at_once(events, ["a", "b"], 40.0) == 2
    assert max_lent_at_once([(1.0, "a", "granted"), (2.0, "a", "revoked"), (2.0, "b", "granted")], ["a", "b"], 5.0) == 1
    assert lent_fraction([], ["a"], 0.0, 10.0) == 0.0 and max_lent_at_once([], ["a"], 10.0) == 0


def test_device_plan_gives_each_executor_a_core_of_its_own_dedicated_first():
    from rose.bench.demo import SPEC
    from rose.bench.fleet import cpu_list, device_plan

    plan = device_plan(SPEC, serving=2, dedicated=1, cpus=[3, 5, 6, 7])
    assert plan == {"demo-dedicated-0": frozenset({3}), "demo-serving-0": frozenset({5}), "demo-serving-1": frozenset({6})}
    with pytest.raises(ValueError, match="needs 3 cores.*--pin none"):
        device_plan(SPEC, serving=2, dedicated=1, cpus=[0, 1])
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list({1}) == "1"


def _status(pid: int, field: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for task in os.listdir(f"/proc/{pid}/task") for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []


def _executor_instance(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"executor" not in cmd or b"run" not in cmd:
            return None
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        return env.get(b"ROSE_RUNTIME__INSTANCE", b"").decode() or None
    except OSError:
        return None


def watch_executor_cpus(bench_pid: int, stop: threading.Event, seen: dict[str, set[str]]) -> None:
    """Every second: the Cpus_allowed_list of each executor the bench started (its direct children) and
    of every process below it (the rollout forward child), by instance name."""
    while not stop.wait(1.0):
        for pid in _children(bench_pid):
            name = _executor_instance(pid)
            if name is None:
                continue
            tree, todo = [], [pid]
            while todo:
                p = todo.pop()
                tree.append(p)
                todo += _children(p)
            seen.setdefault(name, set()).update(c for c in (_status(p, "Cpus_allowed_list") for p in tree) if c is not None)
            seen.setdefault(f"{name}#processes", set()).add(str(len(tree)))


def _bench_e2e(tmp_path, *policies: str, extra: tuple[str, ...] = ()) -> tuple[dict, str, dict[str, set[str]]]:
    """Run the bench as a command; on a timeout it gets SIGTERM first, so it stops its fleet. Also returns the
    CPU sets its executors' process trees were seen with (`watch_executor_cpus`)."""
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable,
        "-m",
        "rose.cli.main",
        "bench",
        "e2e",
        "--duration",
        str(DURATION_S),
        "--seed",
        "2",
        "--json",
        str(out),
        "--until-steps",
        str(UNTIL_STEPS),
        "--warm-start-steps",
        str(WARM_START_STEPS),
        "--pin",
        "auto" if PINNED else "none",
        "--policies",
        *policies,
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(target=watch_executor_cpus, args=(proc.pid, stop, seen), daemon=True)
    watcher.start()
    try:
        stdout, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, _ = proc.communicate(timeout=60)
    finally:
        stop.set()
        watcher.join()
    assert out.exists(), stdout[-4000:]
    r = json.loads(out.read_text())
    assert list(r["policies"]) == list(policies)
    for name, p in r["policies"].items():
        for field in POLICY_FIELDS:
            assert field in p, (name, field)
        assert 0.0 <= p["serving_slo_attainment"] <= 1.0 and p["serving_requests"] > 0
        assert p["trajectories_published"] > 0 and p["trajectories_lost"] == 0, name
        assert set(p["calibration"]) >= {
            "step_s",
            "train_s_per_step",
            "publish_s_per_step",
            "turn_s_p50",
            "tokens_per_turn",
            "serving_step_model",
            "trajectories_per_step",
        }
    assert "speedup_vs_static" in r and "rollout_time_ratio_vs_elastic" in r
    assert r["trainer"]["ROSE_SFT__STEPS"] == str(WARM_START_STEPS)  # what the runs' trainers were given
    assert set(r["fleet"]) >= {"slo_ttft_ms", "slo_tpot_ms", "base_rps", "burst_factor", "burst_every_s", "burst_len_s"}
    for model in ("serving", "policy"):
        assert set(r["calibration"]["step_times"][model]["measured_steps"]) == {
            "decode_base_s",
            "decode_per_seq_s",
            "prefill_base_s",
            "prefill_per_token_s",
        }
    assert (tmp_path / "e2e.png").stat().st_size > 1000
    assert "rose bench e2e" in stdout
    # the job: the demo's, made rollout-dominated, and said so
    assert r["job"]["rollout_dominated"] is True and r["job"]["differs_from_demo"]["ROSE_GRPO__EPOCHS"] == "1"
    assert r["trainer"]["ROSE_GRPO__EPOCHS"] == "1" and "static_rollout_share_of_step" in r["job"]
    return r, stdout, seen


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_bench_e2e_static_on_a_pinned_fleet(tmp_path):
    """One of the four policies, to keep the suite short: static, the baseline every ratio divides by,
    at rollout demand 2 (the default job, demand 1, only differs in the worker's concurrency),
    whose knob (no serving executor ever lent) only a real fleet shows. The rose policy's fleet is the
    demo's (tests/test_demo.py runs it end to end); the naive_share and elastic_baseline knobs are tested
    in the services (tests/scheduler/test_lending_modes.py, tests/executor/test_alert_policy.py,
    tests/rollout_worker/test_turn_preemption.py); `rose bench e2e` runs all four in full."""
    r, _, seen = _bench_e2e(tmp_path, "static", extra=("--rollout-demand", "2"))
    static = r["policies"]["static"]
    executors = sorted(n for n in seen if "#" not in n)
    assert executors == sorted(r["devices"]) and any("-serving-" in n for n in executors) and any("-dedicated-" in n for n in executors), seen
    assert max(int(n) for e in executors for n in seen[f"{e}#processes"]) >= 2  # the rollout forward child was seen too
    if PINNED:  # each executor's whole process tree on one core of its own, as the JSON says
        assert r["pin"] == "auto" and all(len(seen[e]) == 1 for e in executors), seen
        cores = {e: next(iter(seen[e])) for e in executors}
        assert len(set(cores.values())) == len(executors) and all(c.isdigit() for c in cores.values()), cores
        assert cores == r["devices"] == static["devices"]
    else:
        assert r["pin"] == "none"
    # the window ended on the trainer's steps (one more may land while the trainer stops), not on --duration's
    assert r["until_steps"] == UNTIL_STEPS and UNTIL_STEPS <= static["steps"] <= UNTIL_STEPS + 1, static["steps"]
    # the job trained: a rate between steps, and the share of a step its rollout took
    assert static["rl_steps_per_hour"] > 0 and 0.0 < static["rollout_share_of_step"] < 1.0, static
    # static: the dedicated executor only; no serving executor is ever lent
    assert static["rollout_tokens_on_serving"] == 0 and static["leases_granted"] == 0 and static["max_lent_at_once"] == 0
    assert static["rollout_tokens_per_s"] > 0
    assert 0.0 < static["dedicated_device_busy"] <= 1.0  # its pinned core (executor and forward child) did the rollout
    assert r["speedup_vs_static"] is None and r["rollout_time_ratio_vs_elastic"] is None  # rose and elastic_baseline did not run
    # demand 2: the worker kept twice the dedicated executor's batch in flight, and the fleet saw more than one batch at once
    assert r["job"]["rollout_demand"] == 2 and r["fleet"]["worker_concurrency"] == 2 * DEDICATED_ROLLOUT_SLOTS
    assert static["calibration"]["trajectories_in_flight_max"] > DEDICATED_ROLLOUT_SLOTS, static["calibration"]


def test_the_ratios_divide_rose_by_its_baselines():
    from rose.bench.e2e import run_ratios

    policies = {"static": {"rl_steps_per_hour": 1000.0}, "rose": {"rl_steps_per_hour": 1300.0, "rollout_s_per_step": 8.0}}
    assert run_ratios(policies) == (pytest.approx(1.3), None)
    policies["elastic_baseline"] = {"rollout_s_per_step": 10.0}
    assert run_ratios(policies) == (pytest.approx(1.3), pytest.approx(0.8))
    assert run_ratios({"static": {"rl_steps_per_hour": 0.0}, "rose": {"rl_steps_per_hour": 5.0}}) == (None, None)  # no static step: no ratio


def test_the_console_reads_the_dedicated_devices_utilization():
    from rose.bench.e2e import _busy_words

    assert "keeps up" in _busy_words(0.63) and "saturated" in _busy_words(0.97) and "not reported" in _busy_words(None)
