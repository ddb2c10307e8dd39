"""GRPO: group-normalised advantages and a clipped, token-level policy-gradient loss.

For a group of G trajectories of the same task with rewards r_i, every generated token of
trajectory i gets the advantage A_i = (r_i - mean r) / (std r + eps); a group whose rewards
are all equal teaches nothing (A = 0) and is counted. The loss is PPO's clipped surrogate
with the importance ratio against the *behaviour* logprobs recorded by the executor that
sampled the token (the policy may have moved on since: asynchronous, co-elastic rollout):

    ratio = exp(logp_new - logp_behaviour)
    loss  = - mean_trajectories [ mean_tokens min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) ]

(GRPO's per-trajectory mean: each trajectory weighs the same whatever its length; `norm =
"token"` averages over all tokens instead, as DAPO does). No KL term and no reference model: the staleness bound and the clip keep
updates near the behaviour policy.

Behaviour logprobs are the executor's untempered logprobs (services/executor/sampling.py),
which equal the sampling distribution at temperature 1, the worker's default; at another
temperature the ratio is biased.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .batch import Padded, token_logprobs

ADVANTAGE_EPS = 1e-6
LossNorm = Literal["sequence", "token"]


def group_advantages(rewards: list[float]) -> list[float]:
    """(r - mean) / (std + eps) within one group; zeros when the group has no spread."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    std = r.std(unbiased=False)
    if std < ADVANTAGE_EPS:
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (std + ADVANTAGE_EPS)).tolist()


@dataclass
class LossStats:
    loss: float
    tokens: int
    clip_fraction: float
    mean_ratio: float
    approx_kl: float


def grpo_loss(new_logprobs: torch.Tensor, batch: Padded, clip_eps: float, norm: LossNorm = "sequence") -> tuple[torch.Tensor, LossStats]:
    """The clipped surrogate; `norm` "sequence" averages per trajectory first (GRPO), "token" over all tokens.

    The returned loss is a mean over the batch's sequences (or tokens); `grpo_step` weights
    micro-batches accordingly.
    """
    mask = batch.mask
    n = mask.sum().clamp(min=1.0)
    log_ratio = (new_logprobs - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = batch.advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    if norm == "sequence":
        per_seq = (surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = -per_seq.mean()
    else:
        loss = -(surrogate * mask).sum() / n
    with torch.no_grad():
        clipped = ((ratio - 1.0).abs() > clip_eps).float() * mask
        stats = LossStats(
            loss=float(loss),
            tokens=int(mask.sum()),
            clip_fraction=float(clipped.sum() / n),
            mean_ratio=float((ratio * mask).sum() / n),
            approx_kl=float(((ratio - 1) - log_ratio).mul(mask).sum() / n),
        )
    return loss, stats


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Padded],
    *,
    clip_eps: float,
    max_grad_norm: float,
    epochs: int = 1,
    norm: LossNorm = "sequence",
) -> LossStats:
    """`epochs` optimizer steps over the same micro-batches (gradients accumulated across them).

    The first epoch's ratio is 1 up to numerics (the behaviour policy is this one, or a few
    versions older); later epochs move away from it and the clip bounds how far.
    """
    weights = [float(b.mask.shape[0]) if norm == "sequence" else float(b.mask.sum()) for b in batches]
    total = sum(weights) or 1.0
    first: LossStats | None = None
    model.train()
    for _ in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        agg = LossStats(0.0, 0, 0.0, 0.0, 0.0)
        for b, w in zip(batches, weights):
            loss, s = grpo_loss(token_logprobs(model, b), b, clip_eps, norm)
            (loss * (w / total)).backward()
            agg.loss += s.loss * w / total
            agg.tokens += s.tokens
            agg.clip_fraction += s.clip_fraction * w / total
            agg.mean_ratio += s.mean_ratio * w / total
            agg.approx_kl += s.approx_kl * w / total
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        first = first or agg
        last = agg
    model.eval()
    assert first is not None
    return LossStats(first.loss, first.tokens, last.clip_fraction, last.mean_ratio, last.approx_kl)
