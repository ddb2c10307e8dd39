"""The agentic RL workload: multi-turn trajectories with long-tailed turn counts and lengths.

One definition for the two things that run it: the simulator samples whole batches of it
(``sample_batch``), and the emulated agentic environment (shared/agentic/env_emulated.py) plays
one trajectory of it per task against the real services, so both see the same job.

One RL step rolls out ``prompts x group_size`` trajectories (GRPO-style groups). A
trajectory is a system/task prompt, then turns: each turn the policy generates tokens (a
thought and a tool call), the tool runs (a latency, no GPU) and its output is appended to
the context; the next turn's prompt is the whole context so far (a prefix-cache hit on the
executor that ran the previous turn needs only the new tokens prefilled).

Distributions (assumptions, chosen for the long tail the paper describes, not fitted to a
published trace; every knob is a field below and a ``rose bench sim`` option):
- turns per trajectory: log-normal, median 5, sigma 0.6, 1..30 (p99/p50 ~ 4x);
- generated tokens per turn: log-normal, median 300, sigma 0.9, 16..4096 (``gen_min``..``gen_max``);
- tool output tokens per turn: log-normal, median 400, sigma 1.0, 0..8192;
- tool latency: log-normal, median 1.5 s, sigma 1.0, up to 60 s;
- the first prompt: log-normal, median 2000 tokens, sigma 0.3;
- a trajectory ends early when its context would pass ``max_context`` (32k) tokens.

Batch size: a step rolls out ``oversubscription`` (2) x the trajectories the dedicated pool's
KV cache holds at once at the mean context (``batch_trajectories``): the static pool is then
throughput-bound, the regime in which the paper motivates borrowing serving GPUs; with a
smaller batch a step is bound by its slowest trajectory and extra capacity buys little (set
``trajectories`` explicitly to study that).

``bundle``: for speed, one simulated trajectory may stand for ``bundle`` identical ones
(same lengths, placed together, ``bundle`` x the batch slots, KV and tokens). The tail is
then sampled ``trajectories / bundle`` times per step rather than ``trajectories`` times,
which makes the simulated tail slightly lighter. ``bundle_size`` keeps ``trajectories /
bundle`` at ``max_bundles`` (384) or more, and a bundle at its longest context within half
of a dedicated instance's KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The demo's RL job (`rose demo`, bench/demo.py): the trainer's settings as environment variables (see
# services/trainer/config.py). Here rather than in bench/ because the simulator's calibration reads it too.
TRAINER = {
    "ROSE_TASKS__ENVS": '["arithmetic"]',
    "ROSE_TASKS__MAX_OPERAND": "4",
    "ROSE_TASKS__MAX_TOKENS": "16",
    "ROSE_TASKS__MAX_TURNS": "3",
    "ROSE_SFT__STEPS": "200",
    "ROSE_SFT__TRACES_PER_ENV": "300",
    "ROSE_GRPO__GROUP_SIZE": "8",
    "ROSE_GRPO__GROUPS_PER_STEP": "8",
    "ROSE_GRPO__LR": "1e-3",
    "ROSE_GRPO__EPOCHS": "2",
    "ROSE_TASKS__PROBLEMS": "16",
    "ROSE_GRPO__MAX_STALENESS": "2",
    # Synchronous steps: on this one box the trainer shares the serving executors' cores, and with a step
    # prefetched it trains while the next batch rolls out, leaving serving too little CPU (bench e2e,
    # static policy: SLO attainment 0.82 with prefetch 1 vs 0.98 without). On separate hardware use 1.
    "ROSE_GRPO__PREFETCH_STEPS": "0",
    "ROSE_THREADS": "1",
}
# The demo's job with a LoRA policy of the serving model (`rose demo --lora`, `rose bench lora`): no warm start of the
# adapter (its base, the serving model, was warm-started when the models were built: `rose models init --preset demo
# --lora`), and GRPO at 10x the full-parameter lr, as the LoRA-for-RL results advise; `rose bench lora` chose it on
# this job (rank 1: rank 8 swung between seeds, higher lrs collapsed the reward; docs/benchmarks.md 2026-12-07).
LORA_TRAINER = {"ROSE_GRPO__LR": "1e-2", "ROSE_SFT__STEPS": "0"}
# `rose bench e2e`'s job: the demo's, made rollout-dominated as agentic RL is (rollout >= 70 % of a static
# step; the bench's JSON reports `rollout_share_of_step`): one epoch per batch, longer multi-turn episodes.
ROLLOUT_DOMINATED_JOB = {
    "ROSE_GRPO__EPOCHS": "1",  # the demo's 2 epochs double the training time of a step
    "ROSE_TASKS__MAX_TURNS": "4",  # an episode that has not answered yet gets another turn (the demo: 3)
    "ROSE_TASKS__MAX_TOKENS": "32",  # per turn (the demo: 16): longer turns, a longer tail
    # a fresh AdamW's first step moves every weight by the whole lr: offline at seed 11 (this job, local
    # sampling) lr 5e-3 took the reward from 0.14 to 0 in one step for good and 2 epochs at 1e-3 to 0 for two
    # steps; lr 1e-3 ramped over 10 steps did not fall (docs/benchmarks.md, 2026-12-04)
    "ROSE_GRPO__LR_WARMUP_STEPS": "10",
}


@dataclass(frozen=True)
class RolloutSpec:
    oversubscription: float = 2.0  # batch of one RL step: this x what the dedicated pool's KV holds at once
    group_size: int = 8
    turns_median: float = 5.0
    turns_sigma: float = 0.6
    max_turns: int = 30
    gen_median: float = 300.0
    gen_sigma: float = 0.9
    gen_min: int = 16
    gen_max: int = 4096
    tool_tokens_median: float = 400.0
    tool_tokens_sigma: float = 1.0
    tool_tokens_max: int = 8192
    tool_latency_median_s: float = 1.5
    tool_latency_sigma: float = 1.0
    tool_latency_max_s: float = 60.0
    prompt_median: float = 2000.0
    prompt_sigma: float = 0.3
    max_context: int = 32768
    max_bundles: int = 384  # simulated trajectories per step at most (see ``bundle``)


@dataclass
class Batch:
    """One step's trajectories, as arrays (``turns`` used columns of the [n, max_turns] arrays)."""

    bundle: int
    prompt: np.ndarray  # [n]
    turns: np.ndarray  # [n]
    gen: np.ndarray  # [n, max_turns] generated tokens per turn
    tool_tokens: np.ndarray  # [n, max_turns] tool output appended after each turn
    tool_s: np.ndarray  # [n, max_turns] tool latency after each turn

    @property
    def n(self) -> int:
        return len(self.prompt)

    @property
    def trajectories(self) -> int:
        return self.n * self.bundle

    def tokens(self) -> int:
        """Every token a trainer sees this step (prompt, generated and tool tokens), all bundles."""
        total = 0
        for i in range(self.n):
            k = int(self.turns[i])
            total += int(self.prompt[i]) + int(self.gen[i, :k].sum()) + int(self.tool_tokens[i, : max(0, k - 1)].sum())
        return total * self.bundle

    def generated(self) -> int:
        return int(sum(int(self.gen[i, : int(self.turns[i])].sum()) for i in range(self.n))) * self.bundle


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size) -> np.ndarray:
    return rng.lognormal(math.log(median), sigma, size)


def mean_context(spec: RolloutSpec, samples: int = 4000, seed: int = 12345) -> float:
    """Mean context (tokens) a trajectory holds while one of its turns runs, over a fixed sample."""
    b = sample_batch(spec, samples, np.random.default_rng(seed), bundle=1)
    total, count = 0.0, 0
    for i in range(b.n):
        ctx = float(b.prompt[i])
        for k in range(int(b.turns[i])):
            total += ctx + b.gen[i, k] / 2.0
            count += 1
            ctx += b.gen[i, k] + (b.tool_tokens[i, k] if k + 1 < b.turns[i] else 0)
    return total / max(1, count)


def batch_trajectories(spec: RolloutSpec, pool_kv_tokens: float) -> int:
    """Trajectories per step: ``oversubscription`` x what ``pool_kv_tokens`` hold at the mean context."""
    return max(spec.group_size, int(round(spec.oversubscription * pool_kv_tokens / mean_context(spec) / spec.group_size)) * spec.group_size)


def bundle_size(spec: RolloutSpec, trajectories: int, instance_kv_tokens: float) -> int:
    """Identical trajectories per simulated one: at most ``max_bundles`` simulated, and a bundle at
    ``max_context`` within half of one instance's KV."""
    by_count = max(1, math.ceil(trajectories / spec.max_bundles))
    by_kv = max(1, int(0.5 * instance_kv_tokens // spec.max_context))
    return min(by_count, by_kv)


def sample_batch(spec: RolloutSpec, trajectories: int, rng: np.random.Generator, bundle: int | None = None) -> Batch:
    """Sample one step's batch of ``trajectories`` (rounded up to whole bundles)."""
    if bundle is None:
        bundle = max(1, math.ceil(trajectories / spec.max_bundles))
    n = math.ceil(trajectories / bundle)
    t = spec.max_turns
    prompt = np.round(np.clip(_lognormal(rng, spec.prompt_median, spec.prompt_sigma, n), 64, spec.max_context // 2)).astype(np.int64)
    turns = np.clip(np.round(_lognormal(rng, spec.turns_median, spec.turns_sigma, n)), 1, t).astype(np.int64)
    gen = np.round(np.clip(_lognormal(rng, spec.gen_median, spec.gen_sigma, (n, t)), min(spec.gen_min, spec.gen_max), spec.gen_max)).astype(np.int64)
    tool_tokens = np.round(np.clip(_lognormal(rng, spec.tool_tokens_median, spec.tool_tokens_sigma, (n, t)), 0, spec.tool_tokens_max)).astype(
        np.int64
    )
    tool_s = np.clip(_lognormal(rng, spec.tool_latency_median_s, spec.tool_latency_sigma, (n, t)), 0.0, spec.tool_latency_max_s)
    # stop a trajectory before its context would pass max_context
    for i in range(n):
        ctx = int(prompt[i])
        for k in range(int(turns[i])):
            ctx += int(gen[i, k])
            if ctx > spec.max_context:
                turns[i] = max(1, k)
                break
            if k + 1 < turns[i]:
                ctx += int(tool_tokens[i, k])
                if ctx > spec.max_context:
                    turns[i] = k + 1
                    break
    return Batch(bundle, prompt, turns, gen, tool_tokens, tool_s)


def turn_length_quantile(spec: RolloutSpec, q: float) -> float:
    """The q-quantile of generated tokens per turn (used for naive_share's batch-to-completion time)."""
    z = {0.5: 0.0, 0.9: 1.2816, 0.99: 2.3263}.get(q)
    if z is None:
        raise ValueError("q must be 0.5, 0.9 or 0.99")
    return float(min(spec.gen_max, spec.gen_median * math.exp(z * spec.gen_sigma)))


def steady_step_rate(done_at: list[float], prefetch_steps: int) -> float:
    """RL steps per hour in steady state, from the times training steps finished (in step order).

    An asynchronous trainer hands ``prefetch_steps`` batches out with the first, before any training, so
    its first steps find their rollouts already under way and come faster than any later one (simulated
    70B on 16 GPUs, async demand 2: rose / static 2.15x over the first two intervals, 1.30-1.40x over
    nine). The rate counts from the step that trained the last of those batches to the last step; with
    too few steps for that, from the first. The simulator and the e2e benches share this definition."""
    if len(done_at) < 2:
        return 0.0
    first = min(prefetch_steps, len(done_at) - 2)
    span = done_at[-1] - done_at[first]
    return 3600.0 * (len(done_at) - 1 - first) / span if span > 0 else 0.0
