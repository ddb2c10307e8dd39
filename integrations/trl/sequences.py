"""A ROSE trajectory as TRL's training fields: the episode's tokens, which of them the policy sampled, their logprobs.

Token in, token out: the rollout worker builds each turn's prompt by appending the previous
turn's tokens and the tokenized observation, so the last turn's prompt plus its tokens hold
the whole episode at the same positions. TRL's `rollout_func` wants that split into the
first prompt (`prompt_ids`) and the rest (`completion_ids`), with `logprobs` per completion
token and `env_mask` 1 on sampled tokens, 0 on the environment's (tool results, the next
`<|im_start|>assistant`); `AsyncGRPOTrainer` wants the whole row with `completion_mask` and
`old_log_probs` (zero on context). Both come from `episode_runs`. Where a turn does not line
up with the one before (an external agent's segment break at the gateway), the turns split
into runs, one row each; the rollout function takes one run per episode and refuses more.
"""

from __future__ import annotations

from dataclasses import dataclass

from rose.contracts.rollout import Trajectory, TurnRecord
from rose.shared.errors import RoseError


class EpisodeShapeError(RoseError, ValueError):
    """A trajectory that cannot be laid out as one prompt and one completion."""


@dataclass
class EpisodeRun:
    """Consecutive turns that line up: `tokens[:prompt_len]` is the first turn's prompt."""

    tokens: list[int]
    prompt_len: int
    mask: list[int]  # over tokens: 1 where the policy sampled the token
    logprobs: list[float]  # over tokens: the executor's logprob where sampled, 0.0 elsewhere
    oldest_version: int  # the oldest policy version any of its tokens came from

    @property
    def completion_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def _usable(turn: TurnRecord) -> bool:
    return 0 < len(turn.token_ids) == len(turn.logprobs)


def _lines_up(earlier: TurnRecord, later: TurnRecord) -> bool:
    held = len(earlier.prompt_token_ids) + len(earlier.token_ids)
    return later.prompt_token_ids[:held] == list(earlier.prompt_token_ids) + list(earlier.token_ids)


def episode_runs(trajectory: Trajectory) -> list[EpisodeRun]:
    """The trajectory's runs of turns that line up, each laid out as one row (none without a sampled token)."""
    turns = [t for t in trajectory.turns if _usable(t)]
    runs: list[list[TurnRecord]] = []
    for turn in turns:
        if runs and _lines_up(runs[-1][-1], turn):
            runs[-1].append(turn)
        else:
            runs.append([turn])
    out = []
    for run in runs:
        last = run[-1]
        tokens = list(last.prompt_token_ids) + list(last.token_ids)
        mask, logprobs = [0] * len(tokens), [0.0] * len(tokens)
        for t in run:
            start = len(t.prompt_token_ids)
            for i, lp in enumerate(t.logprobs):
                mask[start + i], logprobs[start + i] = 1, float(lp)
        out.append(EpisodeRun(tokens, len(run[0].prompt_token_ids), mask, logprobs, min(t.policy_version for t in run)))
    return out


def oldest_version(trajectory: Trajectory) -> int:
    """The oldest policy version any token of the trajectory came from (each turn records its oldest token's)."""
    return min((t.policy_version for t in trajectory.turns), default=0)


def single_run(trajectory: Trajectory) -> EpisodeRun:
    """The one row of an episode TRL's `rollout_func` returns: one prompt, one completion."""
    runs = episode_runs(trajectory)
    if len(runs) != 1:
        raise EpisodeShapeError(
            f"trajectory {trajectory.trajectory_id} has {len(runs)} runs of turns that line up (its turns' prompts do not extend "
            "the turn before): GRPOTrainer's rollout_func takes one prompt and one completion per episode; train such episodes "
            "with AsyncGRPOTrainer, whose rows may fork"
        )
    return runs[0]
