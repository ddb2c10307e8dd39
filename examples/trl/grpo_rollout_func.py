"""TRL's GRPOTrainer, rolled out by ROSE: `rollout_func` is the only line that points it at ROSE.

Start ROSE (`rose up`: NATS, executors, scheduler, monitor, rollout worker, weight publisher), then:

    NATS_URL=nats://127.0.0.1:PORT ROSE_BUS__NKEY_SEED_FILE=.rose/security/trainer.nk \\
        python examples/trl/grpo_rollout_func.py --policy .rose/models/policy --steps 20

Each generation batch TRL asks for is rolled out by ROSE's fleet as GRPO groups of multi-turn
arithmetic-with-a-calculator episodes (the demo's job); the reward is the environment's. After
each step the next call publishes TRL's weights and waits until every executor runs them, so the
samples are on-policy (TRL without vLLM trains without an importance correction); each step goes out
as a `TrainingStep` event, as ROSE's own trainer's do. `--json PATH` writes what each step trained on.

With `--lora` the policy is a LoRA adapter of the serving model (`rose models init DIR --lora`, executors with
`engine.rollout_mode = "co_batched"`): TRL trains the adapter over the base (TRL's peft path: `LoraPolicy`) and
each version is the adapter's tensors. A LoRA job wants its own, larger `--lr` (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from rose.integrations.trl import LoraPolicy, RoseConnection, RoseRolloutFunc, TaskTable, env_reward, policy_state_dict
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
    p.add_argument("--steps", type=int, default=20, help="RL steps: batches rolled out and trained on (each --epochs optimizer steps)")
    p.add_argument("--problems", type=int, default=16, help="arithmetic problems (seeds 0..N-1)")
    p.add_argument("--seeds", default="", help="the problems' seeds, comma-separated (instead of --problems)")
    p.add_argument("--max-operand", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="GRPO group: TRL's num_generations")
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="per turn")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=1, help="optimizer steps on each batch (TRL's num_iterations)")
    # ROSE's reference trainer's loss: each sequence's token mean, then the batch's (TRL's default, dapo, averages all tokens)
    p.add_argument("--loss-type", default="grpo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a CPU shared with ROSE's services)")
    p.add_argument("--out", default="trl-out", help="TRL's output_dir")
    p.add_argument("--json", default="", help="write a summary of each step here")
    return p.parse_args(argv)


def job_tasks(args: argparse.Namespace) -> TaskTable:
    """The job's problems: the arithmetic environment's, from `--seeds` (or seeds 0..`--problems`-1)."""
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else range(args.problems)
    return TaskTable([ArithmeticEnv(args.max_operand)], seeds, max_turns=args.max_turns, max_tokens=args.max_tokens)


def grpo_config(args: argparse.Namespace, **changes: object) -> GRPOConfig:
    """TRL's configuration of the job (`rose bench trl` runs TRL alone on it too, with `changes`)."""
    return GRPOConfig(
        output_dir=args.out,
        use_cpu=not torch.cuda.is_available(),
        num_generations=args.group_size,
        per_device_train_batch_size=args.group_size * args.groups,
        max_steps=args.steps * args.epochs,
        num_iterations=args.epochs,
        loss_type=args.loss_type,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        seed=args.seed,
        bf16=False,  # train in the dtype the executors sample in (the policy's own): no importance correction covers a gap
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        **changes,
    )


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    lora = LoraPolicy.read(args.policy) if args.lora else None  # the adapter the executors serve (AdapterError: not one)
    if lora is None and is_adapter_dir(args.policy):
        raise SystemExit(f"--policy {args.policy} is a LoRA adapter of the serving model: pass --lora")
    torch.set_num_threads(args.threads)
    tasks = job_tasks(args)
    bus = BusConfig(url=args.nats_url, nkey_seed_file=args.nkey_seed_file)
    with RoseConnection(bus, tasks) as rose:
        rollout_func = RoseRolloutFunc(rose)  # ROSE
        trainer = GRPOTrainer(
            model=str(lora.base_dir) if lora else AutoModelForCausalLM.from_pretrained(args.policy),
            peft_config=lora.config if lora else None,  # TRL's peft path: an adapter of this shape over the base
            processing_class=AutoTokenizer.from_pretrained(args.policy),
            reward_funcs=[env_reward],
            args=grpo_config(args),
            train_dataset=tasks.dataset(),
            rollout_func=rollout_func,
        )
        if lora:
            lora.load_into(trainer.model)  # ROSE: start from the adapter the executors serve
        trainer.train()
        rollout_func.finish(trainer)  # ROSE: the executors get the trained weights
        summary = {
            "run_id": rose.run_id,
            "steps": trainer.state.global_step,
            "versions": rose.versions,
            "stats": rose.stats,
            "rounds": [
                {"step": r.step, "version": r.version, "min_version": r.min_version, "reward_mean": r.reward_mean, "trajectories": r.trajectory_ids}
                for r in rollout_func.rounds
            ],
            "trl_rewards": [h["rewards/env_reward/mean"] for h in trainer.state.log_history if "rewards/env_reward/mean" in h],
            "policy_sha256": state_digest(policy_state_dict(trainer.accelerator.unwrap_model(trainer.model))),  # the last version's
        }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"{summary['steps']} TRL steps through ROSE; reward per step {[round(r['reward_mean'], 3) for r in summary['rounds']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
