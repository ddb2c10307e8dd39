"""`rose bench lora`: LoRA GRPO against full-parameter GRPO on the demo's job, from the same warm base, in one run.

What it answers: does a LoRA adapter of the serving model learn the demo's job as well as training every weight
(the target: LoRA GRPO gains at least the reward full-parameter GRPO gains in the same steps), and what one version
costs on the wire (the target: an adapter version <= 1 % of the full policy's).

How: one base for every run, built as ``rose models init --preset demo --lora`` builds it: the demo preset's serving
model (DEMO_POLICY_SHAPE) warm-started on the demo job's expert traces with the trainer's own warm start
(services/trainer/sft.py ``warm_start_base``), and version 0 of its adapter. Then, per seed, two arms take the same
GRPO steps on the demo's job (shared/workload.py TRAINER: 8 groups of 8 on 16 arithmetic problems, 2 epochs; the task
seed is the seed): full-parameter (every weight of the base, at the demo's ``grpo.lr``) and LoRA (the adapter over
the frozen base, services/trainer/lora.py, at its own lr). Episodes are sampled locally at temperature 1
(local_rollout ``sample_episodes``, no fleet: the learning, not the fleet, is measured), from the same sampling seed
in both arms, so step 0 samples the very same episodes (version 0 of the adapter is the base). Each step: sample,
the trainer's GRPO step (grpo.py, the job's settings), then the version as the trainer publishes it (a bf16 cast of
``trained_state``) encoded by the weight publisher's codec against the one before: its bytes on the wire.

It prints the mean reward per step of both arms, each arm's gain (mean reward of the last 20 % of steps minus the
first 20 %, as `rose demo` reports it) per seed with the spread over seeds, the bytes per version of both, and an
adapter version at 7B-70B (shared/devices.py MODELS) at the adapter's measured bytes per element, against the full
policy's bf16 weights and against a full delta (``at_scale``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from rose.services.trainer.batch import pad
from rose.services.trainer.config import PublishSettings, TrainerConfig
from rose.services.trainer.groups import GroupCollector
from rose.services.trainer.grpo import grpo_step
from rose.services.trainer.local_rollout import Tokens, sample_episodes
from rose.services.trainer.lora import load_policy, trainable_parameters, trained_state
from rose.services.trainer.main import tool_envs
from rose.services.trainer.sft import warm_start_base
from rose.services.trainer.trainer import group_tasks, warmed_up_lr
from rose.services.weight_publisher.config import DEFAULT_KEYFRAME_INTERVAL
from rose.shared.config import load_config
from rose.shared.devices import MODELS, ModelSpec, SyncSpec
from rose.shared.lora import DEFAULT_LORA, LoraShape
from rose.shared.models import init_models, load_model, load_tokenizer
from rose.shared.weight_codec import encode_shard
from rose.shared.weight_layout import layout_of, pack_shards, state_bytes
from rose.shared.workload import LORA_TRAINER, TRAINER

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_STEPS = 20  # GRPO steps per arm: the offline reproduction's length (docs/benchmarks.md, "Learning at seed 11")
GAIN_SHARE = 0.2  # the gain compares the mean reward of the last 20 % of steps with the first 20 %, as `rose demo` reports it
FULL_LR = float(TRAINER["ROSE_GRPO__LR"])  # full-parameter GRPO at the demo job's own lr
# The LoRA arm's settings, chosen by this bench (docs/benchmarks.md 2026-12-07): "LoRA Without Regret" (2025) finds rank 1
# enough for RL and the best LoRA lr ~10x full fine-tuning's. On the demo's job at scale 2 (alpha / rank), seeds 0-2:
# rank 1 at lr 1e-2 gained at every seed (+0.031 to +0.047), 2e-2 swung (-0.039 to +0.070), 5e-3 barely moved; rank 8
# at 1e-2 swung (-0.047 to +0.059) and at 2e-2, like rank 32 at 1e-2, took the reward to 0 within three steps; a 5-step
# lr warm-up did not help. So rank 1 (shared/lora.py DEFAULT_LORA), lr 1e-2, no warm-up.
LORA_RANK = DEFAULT_LORA.rank
LORA_ALPHA = DEFAULT_LORA.alpha
LORA_LR = float(LORA_TRAINER["ROSE_GRPO__LR"])  # shared/workload.py LORA_TRAINER: the demo's LoRA job (also rose demo --lora)
PUBLISH_DTYPE = getattr(torch, PublishSettings().dtype)  # what the trainer publishes
KEYFRAME_INTERVAL = DEFAULT_KEYFRAME_INTERVAL  # the weight publisher's cadence: one version in ten is dense


def demo_job(seed: int) -> TrainerConfig:
    """The demo's trainer settings (shared/workload.py TRAINER) at task seed ``seed``, as `rose demo --seed` runs them."""
    return load_config(TrainerConfig, env={**TRAINER, "ROSE_TASKS__SEED": str(seed)})


def build_base(root: Path, lora: LoraShape, warm_start_steps: int) -> dict[str, Any]:
    """The demo preset's LoRA models under ``root`` (`rose models init --preset demo --lora --warm-start-steps N`)."""
    paths = init_models(root, seed=0, preset="demo", lora=lora)
    config = demo_job(0)
    started = time.monotonic()
    sft = msgspec.structs.replace(config.sft, steps=warm_start_steps)
    report = warm_start_base(paths, tool_envs(config.tasks), sft, lora)
    return {"paths": paths, "sft_nll_before": report.nll_before, "sft_nll_after": report.nll_after, "warm_start_s": time.monotonic() - started}


# ---- bytes on the wire ----------------------------------------------------------------------------


@dataclass
class Wire:
    """A model's versions as the weight publisher encodes them: the first dense, each later one a delta."""

    dense_bytes: int = 0  # a keyframe: every tensor, dense
    deltas: list[int] = field(default_factory=list)  # bytes of each delta version
    elements: int = 0
    _last: dict[int, np.ndarray] | None = None

    def publish(self, state: dict[str, torch.Tensor]) -> None:
        cast = {k: v.detach().to(PUBLISH_DTYPE).contiguous() for k, v in state.items()}
        layout = layout_of(cast)
        shards = pack_shards(layout, state_bytes(cast))
        if self._last is None:
            self.dense_bytes = sum(encode_shard(buf, None, layout.segments(sid)).wire_bytes for sid, buf in shards.items())
            self.elements = sum(t.numel() for t in cast.values())
        else:
            self.deltas.append(sum(encode_shard(buf, self._last[sid], layout.segments(sid)).wire_bytes for sid, buf in shards.items()))
        self._last = shards

    def per_version(self) -> float:
        """Mean bytes per version with the publisher's keyframe cadence (one dense version in KEYFRAME_INTERVAL)."""
        delta = statistics.fmean(self.deltas) if self.deltas else float(self.dense_bytes)
        return (self.dense_bytes + (KEYFRAME_INTERVAL - 1) * delta) / KEYFRAME_INTERVAL


# ---- one arm --------------------------------------------------------------------------------------


@dataclass
class Arm:
    name: str
    seed: int
    lr: float
    rewards: list[float] = field(default_factory=list)  # mean reward of each step's episodes, sampled before its update
    skipped: int = 0  # steps whose every group had equal rewards (nothing to learn, as the trainer skips them)
    trained_parameters: int = 0
    seconds: float = 0.0
    wire: Wire = field(default_factory=Wire)

    def gain(self) -> float:
        k = max(1, round(len(self.rewards) * GAIN_SHARE))
        return statistics.fmean(self.rewards[-k:]) - statistics.fmean(self.rewards[:k])


def run_arm(arm: Arm, model: torch.nn.Module, tokens: Tokens, steps: int) -> Arm:
    """``steps`` GRPO steps of the demo's job at ``arm.seed``, sampled locally; rewards and wire bytes recorded."""
    config = demo_job(arm.seed)
    envs, g = tool_envs(config.tasks), config.grpo
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=arm.lr, weight_decay=0.0)
    arm.trained_parameters = sum(p.numel() for p in trainable_parameters(model))
    generator = torch.Generator().manual_seed(arm.seed)
    arm.wire.publish(trained_state(model))
    started = time.monotonic()
    for step in range(steps):
        collector = GroupCollector(max_staleness=g.max_staleness)
        by_env: dict[int, list] = {}  # every episode of an environment in one batched generation
        for i in range(g.groups_per_step):
            tasks = group_tasks(config, envs, f"lora-{arm.name}-{arm.seed}", step, i)
            collector.expect(tasks[0].group_id, len(tasks))
            by_env.setdefault((step * g.groups_per_step + i) % len(envs), []).extend(tasks)
        trajectories = []
        for e, tasks in by_env.items():
            trajectories += sample_episodes(model, tokens, envs[e], tasks, max_tokens=config.tasks.max_tokens, generator=generator, version=step)
        for t in trajectories:
            collector.add(t)
        arm.rewards.append(statistics.fmean(t.reward for t in trajectories))
        seqs = collector.sequences(collector.ready(), step)
        if not seqs:
            arm.skipped += 1
            continue
        for group in optimizer.param_groups:
            group["lr"] = warmed_up_lr(arm.lr, g.lr_warmup_steps, step)
        batches = [pad(seqs[i : i + g.micro_batch], tokens.pad_id) for i in range(0, len(seqs), g.micro_batch)]
        grpo_step(model, optimizer, batches, clip_eps=g.clip_eps, max_grad_norm=g.max_grad_norm, epochs=g.epochs)
        arm.wire.publish(trained_state(model))
    arm.seconds = time.monotonic() - started
    return arm


# ---- the run --------------------------------------------------------------------------------------


def adapter_elements(model: ModelSpec, lora: LoraShape) -> int:
    """The adapter's parameters at ``model``'s layer sizes: rank x (in + out) of every targeted linear layer."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    sizes = {
        "q_proj": (model.hidden, q),
        "k_proj": (model.hidden, kv),
        "v_proj": (model.hidden, kv),
        "o_proj": (q, model.hidden),
        "gate_proj": (model.hidden, model.intermediate),
        "up_proj": (model.hidden, model.intermediate),
        "down_proj": (model.intermediate, model.hidden),
    }
    return model.layers * sum(lora.rank * sum(sizes[t]) for t in lora.targets)


def at_scale(lora: LoraShape, adapter_delta_bytes_per_element: float) -> list[dict[str, Any]]:
    """An adapter version against a full-policy version at 7B-70B (shared/devices.py MODELS): the adapter's elements at
    the delta bytes per element measured here (every adapter element moves each step: its share does not shrink with
    the model), against the full policy's bf16 weights dense (a keyframe) and as a delta of SyncSpec's share of them
    (the public 2-3 % figures of a real RL step at 72B; the demo's tiny model at its high lr changes far more)."""
    full_delta_share = SyncSpec().delta_bytes_fraction
    rows = []
    for name, spec in MODELS.items():
        adapter = adapter_elements(spec, lora) * adapter_delta_bytes_per_element
        rows.append(
            {
                "model": name,
                "adapter_parameters": adapter_elements(spec, lora),
                "adapter_bytes": adapter,
                "vs_full_dense": adapter / spec.weight_bytes,
                "vs_full_delta": adapter / (spec.weight_bytes * full_delta_share),
            }
        )
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """What a `rose bench lora` run compares: ``steps`` GRPO steps of each arm at every seed in ``seeds``, the LoRA arm an
    adapter of rank ``lora_rank`` and ``lora_alpha`` at ``lora_lr``, the full-parameter arm at ``full_lr``, both from one
    base warm-started for ``warm_start_steps`` SFT steps (default: the demo job's)."""

    seeds: tuple[int, ...] = DEFAULT_SEEDS
    steps: int = DEFAULT_STEPS
    lora_rank: int = LORA_RANK
    lora_alpha: float = LORA_ALPHA
    lora_lr: float = LORA_LR
    full_lr: float = FULL_LR
    warm_start_steps: int | None = None

    @property
    def lora(self) -> LoraShape:
        return LoraShape(rank=self.lora_rank, alpha=self.lora_alpha)


def run_lora_bench(options: LoraOptions, out_json: str | Path, console: Console | None = None) -> dict[str, Any]:
    """Both arms at every seed from one warm base; the result (also written to ``out_json``)."""
    console = console or Console()
    seeds, steps, lora, lora_lr, full_lr = options.seeds, options.steps, options.lora, options.lora_lr, options.full_lr
    warm = demo_job(0).sft.steps if options.warm_start_steps is None else options.warm_start_steps
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rose-bench-lora-") as scratch:
        console.print(f"building the demo's LoRA models and warm-starting the base ({warm} SFT steps) ...")
        base = build_base(Path(scratch), lora, warm)
        paths = base.pop("paths")
        tokens = Tokens(load_tokenizer(paths.policy))
        arms: list[Arm] = []
        for seed in seeds:
            for name, lr in (("full", full_lr), ("lora", lora_lr)):
                model = load_model(paths.serving) if name == "full" else load_policy(paths.policy)
                arm = run_arm(Arm(name, seed, lr), model, tokens, steps)
                arms.append(arm)
                console.print(
                    f"seed {seed} {name:4}: reward {arm.rewards[0]:.3f} -> {arm.rewards[-1]:.3f}, gain {arm.gain():+.3f}, "
                    f"{arm.skipped} skipped, {arm.seconds:.0f} s"
                )
    result = summarise(arms, lora, lora_lr=lora_lr, full_lr=full_lr, steps=steps, warm=warm, base=base)
    result["wall_s"] = time.monotonic() - started
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2))
    print_summary(result, console)
    return result


def summarise(arms: list[Arm], lora: LoraShape, *, lora_lr: float, full_lr: float, steps: int, warm: int, base: dict[str, Any]) -> dict[str, Any]:
    by = {name: [a for a in arms if a.name == name] for name in ("full", "lora")}
    gains = {name: [a.gain() for a in runs] for name, runs in by.items()}
    per_version = {name: statistics.fmean(a.wire.per_version() for a in runs) for name, runs in by.items()}
    # a run whose every step was skipped (all groups' rewards equal) published no delta: its dense bytes stand in
    delta = {name: statistics.fmean(statistics.fmean(a.wire.deltas or [a.wire.dense_bytes]) for a in runs) for name, runs in by.items()}
    return {
        "job": "the demo's (shared/workload.py TRAINER), episodes sampled locally",
        "steps": steps,
        "seeds": sorted({a.seed for a in arms}),
        "warm_start_steps": warm,
        "base": base,
        "lora": {**asdict(lora), "scale": lora.scale, "lr": lora_lr},
        "full_lr": full_lr,
        "reward_per_step": {name: [statistics.fmean(a.rewards[s] for a in runs) for s in range(steps)] for name, runs in by.items()},
        "gain": {name: {"per_seed": values, **spread(values)} for name, values in gains.items()},
        "trained_parameters": {name: by[name][0].trained_parameters for name in by},
        "wire": {
            name: {"dense_bytes": by[name][0].wire.dense_bytes, "delta_bytes_mean": delta[name], "per_version_bytes": per_version[name]}
            for name in by
        },
        "wire_ratio": per_version["lora"] / per_version["full"],  # keyframes included, at the publisher's cadence
        "delta_ratio": delta["lora"] / delta["full"],
        "wire_at_scale": at_scale(lora, delta["lora"] / by["lora"][0].wire.elements),
        "runs": [{"arm": a.name, "seed": a.seed, "lr": a.lr, "rewards": a.rewards, "skipped": a.skipped, "seconds": a.seconds} for a in arms],
        "meets_target": statistics.fmean(gains["lora"]) >= statistics.fmean(gains["full"]),
        "meets_wire_target": per_version["lora"] <= 0.01 * per_version["full"],
    }


def print_summary(result: dict[str, Any], console: Console) -> None:
    steps = Table(title="mean reward per GRPO step over seeds (sampled before the step's update)")
    steps.add_column("arm")
    steps.add_column("rewards, step 0 ..", overflow="fold")
    for name, rewards in result["reward_per_step"].items():
        steps.add_row(name, " ".join(f"{r:.2f}" for r in rewards))
    console.print(steps)
    table = Table(title=f"gain (last {GAIN_SHARE:.0%} of steps minus first) and bytes per version on the wire")
    for col in ("arm", "lr", "trained params", "gain per seed", "gain mean [min, max]", "dense B", "delta B (mean)", "B/version"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for name in ("full", "lora"):
        g, w = result["gain"][name], result["wire"][name]
        lr = result["full_lr"] if name == "full" else result["lora"]["lr"]
        table.add_row(
            name,
            f"{lr:g}",
            f"{result['trained_parameters'][name]:,}",
            " ".join(f"{v:+.3f}" for v in g["per_seed"]),
            f"{g['mean']:+.3f} [{g['min']:+.3f}, {g['max']:+.3f}]",
            f"{w['dense_bytes']:,}",
            f"{w['delta_bytes_mean']:,.0f}",
            f"{w['per_version_bytes']:,.0f}",
        )
    console.print(table)
    console.print(
        f"LoRA / full bytes on the wire, measured here: {result['wire_ratio']:.2%} per version (keyframes included), "
        f"{result['delta_ratio']:.2%} per delta"
    )
    scale = "; ".join(f"{r['model']} {r['vs_full_dense']:.3%} of dense, {r['vs_full_delta']:.2%} of a delta" for r in result["wire_at_scale"])
    console.print(f"an adapter version at rank {result['lora']['rank']} against the full policy's at scale: {scale}")
    verdict = "meets" if result["meets_target"] else "misses"
    console.print(f"learning target (LoRA gain >= full gain, mean over seeds): {verdict}; wall {result.get('wall_s', 0):.0f} s")
