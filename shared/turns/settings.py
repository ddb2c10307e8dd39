"""How a turn is run (shared/turns/runner.py): the settings of every service that runs turns
(the rollout worker's `turns`, the gateway's `turns`; TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.shared.config import PositiveSeconds

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class TurnSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: PositiveInt = 24  # per turn, unless the task's env_args say otherwise
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    route_timeout_s: PositiveSeconds = 2.0
    generate_timeout_s: PositiveSeconds = 60.0  # one attempt on one executor
    turn_deadline_s: PositiveSeconds = 600.0  # all attempts of a turn together
    retry_backoff_s: PositiveSeconds = 0.2
    hedge: bool = True  # duplicate straggling turns (the scheduler decides if it is worth it, or says so with its route)
    hedge_min_s: PositiveSeconds = 2.0  # never hedge a turn younger than this
    hedge_factor: Positive = 1.5  # ask for a hedge past this x the typical turn time
    # an interrupted turn (its executor lost the lease) resumes elsewhere with the tokens it has;
    # false: they are thrown away and the turn starts over (the elastic baseline's whole-job preemption)
    resume_interrupted: bool = True
