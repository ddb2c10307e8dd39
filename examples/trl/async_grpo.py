"""TRL's AsyncGRPOTrainer on ROSE: a rollout worker and a weight transfer through TRL's own protocols.

Start ROSE (`rose up`), then:

    NATS_URL=nats://127.0.0.1:PORT ROSE_BUS__NKEY_SEED_FILE=.rose/security/trainer.nk \\
        python examples/trl/async_grpo.py --policy .rose/models/policy --steps 20

ROSE's fleet keeps groups in flight while TRL trains; every sample carries the executor's logprobs
(TRL's `old_log_probs`, the importance ratio's denominator) and the policy version its oldest token
came from (TRL's `model_version`: its staleness filter drops what lags more than `max_staleness`).
Each of TRL's weight syncs is a ROSE version every executor applies between its own iterations.
Off CUDA, `install_cpu_fallbacks()` swaps the two places TRL 1.16 hard-wires to CUDA or the Hub
(docs/trl.md), and `token_budget=0` (a fixed count of samples per step) keeps TRL from asking a vLLM server.

With `--lora` the policy is a LoRA adapter of the serving model (`rose models init DIR --lora`, executors with
`engine.rollout_mode = "co_batched"`): TRL trains the adapter over the base (TRL's peft path: `LoraPolicy`) and
each sync publishes the adapter's tensors, read from the adapter itself (TRL merges it into the base for a sync).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from rose.integrations.trl import (
    LoraPolicy,
    RoseConnection,
    RoseRolloutWorker,
    RoseWeightTransfer,
    TaskTable,
    install_cpu_fallbacks,
    policy_state_dict,
)
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.config import BusConfig
from rose.shared.lora import is_adapter_dir
from rose.shared.weight_layout import state_digest


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--nkey-seed-file", default=os.environ.get("ROSE_BUS__NKEY_SEED_FILE", ""), help="the trainer's NKey seed (ROSE's auth)")
    p.add_argument("--policy", required=True, help="the policy model directory the executors serve (rose up: .rose/models/policy)")
    p.add_argument("--lora", action="store_true", help="the policy is a LoRA adapter of the serving model: train the adapter")
    p.add_argument("--steps", type=int, default=20, help="TRL optimizer steps")
    p.add_argument("--problems", type=int, default=16, help="arithmetic problems (seeds 0..N-1)")
    p.add_argument("--max-operand", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="GRPO group: TRL's num_generations")
    p.add_argument("--samples", type=int, default=64, help="samples per optimizer step")
    p.add_argument("--in-flight", type=int, default=128, help="samples ROSE keeps rolling out (TRL's max_inflight_tasks)")
    p.add_argument("--max-staleness", type=int, default=2, help="versions a sample may lag TRL's policy")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="per turn")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a CPU shared with ROSE's services)")
    p.add_argument("--out", default="trl-async-out", help="TRL's output_dir")
    p.add_argument("--json", default="", help="write a summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    lora = LoraPolicy.read(args.policy) if args.lora else None  # the adapter the executors serve (AdapterError: not one)
    if lora is None and is_adapter_dir(args.policy):
        raise SystemExit(f"--policy {args.policy} is a LoRA adapter of the serving model: pass --lora")
    torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        install_cpu_fallbacks()
    tasks = TaskTable([ArithmeticEnv(args.max_operand)], range(args.problems), max_turns=args.max_turns, max_tokens=args.max_tokens)
    bus = BusConfig(url=args.nats_url, nkey_seed_file=args.nkey_seed_file)
    with RoseConnection(bus, tasks) as rose:
        config = AsyncGRPOConfig(
            output_dir=args.out,
            use_cpu=not torch.cuda.is_available(),
            num_generations=args.group_size,
            per_device_train_batch_size=args.samples,
            max_inflight_tasks=args.in_flight,
            max_staleness=args.max_staleness,
            token_budget=0,  # a step is `--samples` samples (TRL would otherwise ask a vLLM server for its max_model_len)
            max_steps=args.steps,
            learning_rate=args.lr,
            seed=args.seed,
            bf16=False,  # train in the dtype the executors sample in (the policy's own): no importance correction covers a gap
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        worker, transfer = RoseRolloutWorker(rose, config), RoseWeightTransfer(rose)  # ROSE
        trainer = AsyncGRPOTrainer(
            model=str(lora.base_dir) if lora else args.policy,
            peft_config=lora.config if lora else None,  # TRL's peft path: an adapter of this shape over the base
            processing_class=AutoTokenizer.from_pretrained(args.policy),
            args=config,
            train_dataset=tasks.dataset(),
            rollout_worker=worker,
            weight_transfer=transfer,
        )
        if lora:
            lora.load_into(trainer.model)  # ROSE: start from the adapter the executors serve
        transfer.bind(trainer.model)  # ROSE: what each sync publishes
        trainer.train()
        summary = {
            "run_id": rose.run_id,
            "steps": trainer.state.global_step,
            "versions": transfer.sent,
            "stats": rose.stats,
            "groups_scored": worker.groups_scored,
            "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            "staleness_max": [h["sample/staleness_max"] for h in trainer.state.log_history if "sample/staleness_max" in h],
            "policy_sha256": state_digest(policy_state_dict(trainer.accelerator.unwrap_model(trainer.model))),  # the last sync's
        }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"{summary['steps']} AsyncGRPO steps through ROSE; reward per step {[round(r, 3) for r in summary['rewards']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
