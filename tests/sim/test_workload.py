"""The agentic workload (shared/workload.py): siblings of a GRPO group share a prompt and are alike in length."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rose.shared.agentic.env_emulated import EmulatedAgentEnv
from rose.shared.workload import RolloutSpec, sample_batch


def _log_turns(spec: RolloutSpec, groups: int = 400) -> np.ndarray:
    b = sample_batch(spec, groups * spec.group_size, np.random.default_rng(7), bundle=1)
    assert (b.prompt.reshape(groups, spec.group_size) == b.prompt[:: spec.group_size, None]).all()  # one prompt per group
    return np.log(b.turns.reshape(groups, spec.group_size).astype(float))


def test_siblings_share_group_share_of_the_length_variance_and_the_marginals_stay():
    """With group_share 0.5, the spread of log turns within a group is about sqrt(0.5) of the whole's; with 0 it is
    the whole's; the median turn count (the documented marginal) is the same either way."""
    alike, independent = _log_turns(RolloutSpec(group_share=0.5)), _log_turns(replace(RolloutSpec(), group_share=0.0))
    within = lambda x: float(x.std(axis=1, ddof=1).mean() / x.std(ddof=1))  # noqa: E731
    assert within(alike) < 0.8 < within(independent)
    assert abs(np.median(np.exp(alike)) - np.median(np.exp(independent))) <= 1.0


def test_an_emulated_task_draws_its_groups_common_part_alone():
    """The emulated environment plays one task at a time: a task's lengths share its group's part (drawn from the
    group's seed), so siblings there are as alike as in a simulated batch."""
    short = dict(turns_sigma=0.8, gen_median=40.0, tool_tokens_median=40.0)  # contexts far from max_context, which would end one early
    env = EmulatedAgentEnv(RolloutSpec(group_share=1.0, **short))
    for seed in range(3):
        turns = {len(env.episode(seed, f"t{j}").gen) for j in range(8)}
        assert len(turns) == 1  # all of the variance is the group's: every sibling runs as many turns
    env = EmulatedAgentEnv(RolloutSpec(group_share=0.0, **short))
    assert len({len(env.episode(1, f"t{j}").gen) for j in range(8)}) > 1
