"""Hugging Face TRL as the RL job's trainer process: `rose demo --trainer trl` and `rose bench trl`.

The process is `examples/trl/grpo_rollout_func.py` (TRL's GRPOTrainer with ROSE's `rollout_func`,
rose.integrations.trl), started with the trainer's credentials and the demo job's settings turned
into its arguments: the same problems (the reference trainer's task seeds), group size, groups per
step, turns, tokens per turn, lr and epochs. It reports each step as a `TrainingStep` event, so the
demo's live table, its report and the e2e step figures read it as they read ROSE's own trainer.

TRL has no warm start of its own here: `warm_start_policy` runs the reference trainer's (sft.py, the
demo's settings) on the policy in place before the fleet starts, so the executors and TRL start from
the same warm policy; `rose bench trl` gives ROSE's trainer the same start (its own warm start off).

`run_trl_alone` runs `rose bench trl`'s third arm, TRL generating by itself (bench/trl_alone.py), on the
same arguments (`job_args`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import rose
from rose.bench.options import BenchOptionsError
from rose.services.trainer.config import SftSettings
from rose.services.trainer.local_rollout import Tokens
from rose.services.trainer.sft import expert_sequences, warm_start
from rose.services.trainer.trainer import task_seed
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.launch import ServiceProcess
from rose.shared.models import load_model, load_tokenizer

EXAMPLE = Path(rose.__file__).resolve().parent / "examples" / "trl" / "grpo_rollout_func.py"
WARM_MARK = "rose_warm_start.json"  # written beside a policy warm-started in place: the same start is not taken twice
RUN_UNTIL_STOPPED = 1_000_000  # RL steps: the job's window ends the process (SIGTERM), as it ends the reference trainer


class TrlTrainerProcess(ServiceProcess):
    """The example script as the job's trainer process (it connects as the `trainer` service, whose credentials it gets)."""

    def start(self) -> ServiceProcess:
        if not EXAMPLE.is_file():
            raise FileNotFoundError(f"{EXAMPLE} is missing: `--trainer trl` runs the example of a source checkout")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(EXAMPLE), *self.args],
                env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._in_child,
            )
        return self

    async def wait_members_ready(self, bus: Any, timeout: float, members: tuple[str, ...] | None = None) -> dict[str, dict[str, str]]:
        """TRL's process runs no ROSE service runtime (no heartbeat to wait for): it is ready once started; if it dies,
        the job sees it (`run_job` watches the trainer's process, and its log tail says why)."""
        if not self.alive():
            raise RuntimeError(f"the TRL trainer exited at its start:\n{self.log_tail()}")
        return {self.instance: {}}


def trl_trainer(reference: ServiceProcess, settings: dict[str, str], policy: Path) -> TrlTrainerProcess:
    """The TRL process standing in for `reference` (the reference trainer's process, its environment and credentials),
    on the job `settings` describes (the reference trainer's ROSE_* settings)."""
    args = ["--steps", str(RUN_UNTIL_STOPPED), *job_args(settings, policy, reference.log_path.parent.parent / "trl-out")]
    return TrlTrainerProcess("trainer", reference.instance, dict(reference.env), reference.log_path, nice=reference.nice, args=tuple(args))


def job_args(settings: dict[str, str], policy: Path, out: Path) -> list[str]:
    """The example's arguments for the job `settings` describes (the reference trainer's ROSE_* settings): the same
    problems (the reference trainer's task seeds), group size, groups per step, turns, tokens per turn, lr, epochs,
    threads and seed; TRL's output under `out`. Both TRL arms of `rose bench trl` run on them."""
    problems = int(settings.get("ROSE_TASKS__PROBLEMS", "0"))
    if problems <= 0:
        raise BenchOptionsError("TRL trains on a dataset of problems: the job needs ROSE_TASKS__PROBLEMS > 0 (the demo's is 16)")
    seed = int(settings.get("ROSE_TASKS__SEED", "0"))
    return [
        "--policy",
        str(policy),
        "--seeds",
        ",".join(str(task_seed(seed, -1, i)) for i in range(problems)),  # the reference trainer's problem set (trainer.py `emit`)
        "--max-operand",
        settings["ROSE_TASKS__MAX_OPERAND"],
        "--max-turns",
        settings["ROSE_TASKS__MAX_TURNS"],
        "--max-tokens",
        settings["ROSE_TASKS__MAX_TOKENS"],
        "--group-size",
        settings["ROSE_GRPO__GROUP_SIZE"],
        "--groups",
        settings["ROSE_GRPO__GROUPS_PER_STEP"],
        "--lr",
        settings["ROSE_GRPO__LR"],
        "--epochs",
        settings.get("ROSE_GRPO__EPOCHS", "1"),
        "--threads",
        settings.get("ROSE_THREADS", "1"),
        "--seed",
        str(seed),
        "--out",
        str(out),
    ]


def run_trl_alone(settings: dict[str, str], policy: Path, out: Path, steps: int, timeout_s: float) -> list[dict]:
    """TRL generating by itself (bench/trl_alone.py, no fleet) on the job `settings` describes, for `steps` batches;
    each batch's figures (`Batch`). Its log is `out / "alone.log"`."""
    out.mkdir(parents=True, exist_ok=True)
    result, log_path = out / "alone.json", out / "alone.log"
    args = ["--steps", str(steps), *job_args(settings, policy, out / "trl-out"), "--json", str(result)]
    with open(log_path, "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "rose.bench.trl_alone", *args],
            env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"TRL alone exited with {done.returncode}:\n{log_path.read_text()[-3000:]}")
    return json.loads(result.read_text())["batches"]


def warm_start_policy(policy: Path, settings: dict[str, str], steps: int) -> dict:
    """The reference trainer's warm start (sft.py, with the job's SFT settings), on the policy at `policy`, in place;
    done once per directory (a mark file records it). Returns what it did."""
    mark = policy / WARM_MARK
    if mark.is_file():
        return json.loads(mark.read_text())
    sft = SftSettings()
    traces = int(settings.get("ROSE_SFT__TRACES_PER_ENV", sft.traces_per_env))
    env = ArithmeticEnv(int(settings["ROSE_TASKS__MAX_OPERAND"]))
    tokens = Tokens(load_tokenizer(policy))
    model = load_model(policy)
    before = torch.get_num_threads()
    torch.set_num_threads(int(settings.get("ROSE_THREADS", "1")))
    try:
        report = warm_start(model, expert_sequences([env], tokens, range(traces)), tokens.pad_id, steps=steps, lr=sft.lr, batch_size=sft.batch_size)
    finally:
        torch.set_num_threads(before)
    model.save_pretrained(policy, safe_serialization=True)
    done = {"steps": report.steps, "nll_before": report.nll_before, "nll_after": report.nll_after}
    mark.write_text(json.dumps(done))
    return done
