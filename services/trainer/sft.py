"""Supervised warm start on scripted expert traces, so a tiny random policy learns the tool format.

Expert traces come from the environments' ground truth (`ToolEnv.expert`), run through the
environment itself (the observations are the tools' real results) and tokenized exactly as
rollouts are (local_rollout.scripted_episode). The loss is the mean negative log-likelihood
of the assistant's tokens (the same mask GRPO trains on); prompts and tool results are
context only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.lora import LoraShape
from rose.shared.models import ModelPaths, init_adapter, load_model, load_tokenizer

from .batch import Sequence, pad, sequences_of, token_logprobs
from .config import SftSettings
from .local_rollout import Tokens, scripted_episode
from .lora import trainable_parameters

SFT_EVAL_SEEDS = range(1_000_000, 1_000_032)  # held out from the training traces


def expert_sequences(envs: list[ToolEnv], tokens: Tokens, seeds: range) -> list[Sequence]:
    out: list[Sequence] = []
    for env in envs:
        for seed in seeds:
            problem = env.problem(seed)
            task = env.task(seed, task_id=f"expert-{env.name}-{seed}")
            out += sequences_of(scripted_episode(None, tokens, env, task, env.expert(problem)))
    return out


@torch.no_grad()
def mean_nll(model, seqs: list[Sequence], pad_id: int, batch_size: int = 16) -> float:
    """Mean negative log-likelihood per assistant token (lower: the traces are more probable)."""
    total, count = 0.0, 0.0
    for i in range(0, len(seqs), batch_size):
        b = pad(seqs[i : i + batch_size], pad_id)
        lp = token_logprobs(model, b)
        total += float(-(lp * b.mask).sum())
        count += float(b.mask.sum())
    return total / max(count, 1.0)


@dataclass
class SftReport:
    steps: int
    nll_before: float
    nll_after: float


def warm_start(
    model, seqs: list[Sequence], pad_id: int, *, steps: int, lr: float, batch_size: int, seed: int = 0, eval_seqs: list[Sequence] | None = None
) -> SftReport:
    """`steps` AdamW steps of NLL on random mini-batches of `seqs`; NLL measured on `eval_seqs`."""
    eval_seqs = eval_seqs or seqs
    before = mean_nll(model, eval_seqs, pad_id)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=0.0)  # of a LoRA policy: the adapter
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        b = pad(rng.sample(seqs, min(batch_size, len(seqs))), pad_id)
        loss = -(token_logprobs(model, b) * b.mask).sum() / b.mask.sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    return SftReport(steps, before, mean_nll(model, eval_seqs, pad_id))


def warm_start_base(paths: ModelPaths, envs: list[ToolEnv], settings: SftSettings, lora: LoraShape, *, seed: int = 0) -> SftReport:
    """Make the serving model at ``paths.serving`` a trained model, then ``paths.policy`` a fresh adapter of it.

    Why: a production serving model is a trained model, and a LoRA of a random network has nothing to refine; so
    ``rose models init --lora`` (and ``rose bench lora``) first warm-start the serving model on the environments'
    expert traces, with this trainer's own warm start, and save it in place in its own dtype. The adapter is then
    rebuilt (``shared.models.init_adapter``, seed ``seed + 1`` as ``init_models`` seeds it) so that its recorded
    fingerprint is the warm base's."""
    model = load_model(paths.serving)
    tokens = Tokens(load_tokenizer(paths.serving))
    train = expert_sequences(envs, tokens, range(settings.traces_per_env))
    held_out = expert_sequences(envs, tokens, SFT_EVAL_SEEDS)
    s = settings
    report = warm_start(model, train, tokens.pad_id, steps=s.steps, lr=s.lr, batch_size=s.batch_size, seed=seed, eval_seqs=held_out)
    stored = json.loads((paths.serving / "config.json").read_text())
    dtype = stored.get("dtype") or stored.get("torch_dtype") or "float32"
    model.to(getattr(torch, dtype)).save_pretrained(paths.serving, safe_serialization=True)
    init_adapter(paths.serving, paths.policy, lora, seed + 1)
    return report
