"""`rose demo` end to end, shortened: the whole fleet as processes, a real RL job, the report.

What is asserted is what must hold at any length: every field of summary.json the issue names,
no trajectory lost, the trainer's versions published and applied by the executors, rollouts on
both kinds of executor, every plot written. Whether the reward rises is a learning figure
measured by the full-length demo (and, in pure torch, by tests/agentic/test_warm_start_and_grpo.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rose.bench.demo import reward_ends

DURATION_S = 180  # at most this many GRPO seconds (the warm start is not part of them) ...
UNTIL_STEPS = 1  # ... the run ends at the first GRPO step: ~45 s on a quiet 2-core box, over 60 s on a busy one
WARM_START_STEPS = 40  # the demo's is 200: learning is not what this checks, and the suite's time is short


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-co-batched"])
def test_demo_runs_a_real_rl_job_and_writes_the_report(tmp_path, lora):
    """The demo's job, and (``--lora``) the same job with the policy a LoRA adapter of the serving model, every
    executor co-batching its rollout rows into serving's batches: the gateway, the worker and the report unchanged."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rose.cli.main",
            "demo",
            "--duration",
            str(DURATION_S),
            "--out",
            str(out),
            "--seed",
            "3",
            "--warm-start-steps",
            str(WARM_START_STEPS),
            "--until-steps",
            str(UNTIL_STEPS),
            *(["--lora"] if lora else []),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert 0.0 <= s["serving"]["slo_attainment"] <= 1.0 and s["serving"]["requests"] > 0
    assert s["rollout"]["tokens_per_s"] > 0 and 0.0 <= s["rollout"]["harvested_fraction"] <= 1.0
    assert s["trajectories"]["lost"] == 0 and s["trajectories"]["published"] > 0
    assert s["until_steps"] == UNTIL_STEPS and s["duration_s"] == DURATION_S
    assert s["training"]["steps"] >= 1 and s["training"]["reward_first"] is not None and s["training"]["reward_last"] is not None
    # one version per GRPO step, each announced by a manifest, and the warm start's (a LoRA job's base was warm-started
    # when its models were built: the adapter trains from version 0)
    assert s["weights"]["versions"] >= s["training"]["steps"] + (0 if lora else 1)
    assert s["weights"]["wire_ratio"] is None or 0.0 < s["weights"]["wire_ratio"] < 1.0
    assert max(s["weights"]["applied"].values()) >= 1, "no executor applied a trained version"
    assert any(ex.startswith("demo-dedicated-") for ex in s["rollout"]["tokens_by_executor"])
    for name in ("latency_vs_slo.png", "lease_timeline.png", "rollout_throughput.png", "reward_curve.png", "weight_bytes.png"):
        assert (out / name).stat().st_size > 1000, name
    assert "rose demo: summary" in proc.stdout
    if lora:
        assert s["policy"]["kind"] == "lora" and s["policy"]["rollout_mode"] == "co_batched"
        # a trained adapter version live everywhere: in the serving executors' slots, folded into the dedicated one's base copy
        assert s["policy"]["dedicated_rollout_mode"] == "two_model" and min(s["weights"]["applied"].values()) >= 1
        assert f"serving model warm-started: {WARM_START_STEPS} steps" in proc.stdout
        assert any(ex.startswith("demo-serving-") for ex in s["rollout"]["tokens_by_executor"])  # rows rode serving's batches
    else:
        assert s["policy"]["kind"] == "model"
        assert f"warm start: {WARM_START_STEPS} steps" in (out / "state" / "logs" / "trainer.log").read_text()


def test_reward_ends_are_the_first_and_last_fifth():
    assert reward_ends([]) == (None, None)
    assert reward_ends([0.5]) == (0.5, 0.5)
    assert reward_ends([0.0] * 5 + [1.0] * 5) == (0.0, 1.0)
    first, last = reward_ends([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert first == pytest.approx(0.15) and last == pytest.approx(0.95)
