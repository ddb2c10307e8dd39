"""Training progress: what a trainer reports after each optimizer step."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .base import Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds


class TrainingStep(Message):
    """One optimizer step of an RL job: the reward of the groups it trained on, and the version it published.

    Why on the bus: dashboards, `rose demo` and users' own systems follow a job's learning
    without reading the trainer's logs.
    """

    run_id: Identifier
    step: NonNegInt  # 1-based count of optimizer steps taken
    version: NonNegInt  # the policy version published after this step
    reward_mean: float  # mean reward of the completed trajectories in this step's groups
    groups: NonNegInt
    trajectories: NonNegInt  # completed trajectories in those groups
    trained_sequences: NonNegInt  # after the staleness bound and zero-variance groups
    loss: float = 0.0
    clip_fraction: NonNegFloat = 0.0
    approx_kl: float = 0.0
    stale_dropped: NonNegInt = 0  # cumulative
    train_s: NonNegFloat = 0.0  # time in the optimizer step
    publish_s: NonNegFloat = 0.0  # from the step's end to every executor able to fetch the version
    at: UnixSeconds = 0.0
    resumed_from_step: (
        Annotated[
            int,
            msgspec.Meta(
                ge=0, description="The checkpoint step the reporting trainer process resumed from after a restart; null: it started the run."
            ),
        ]
        | None
    ) = None
