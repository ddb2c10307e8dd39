"""When a rollout worker asks for a straggler's duplicate again: a pure rule, so the simulator runs the same."""

from __future__ import annotations


def hedge_ask_again_after(elapsed_s: float) -> float:
    """After a refused hedge, a turn on leased capacity asks again once its age has doubled.

    Why: a burst parks a lease's turns until a new lease or the park's end (seconds), at any moment,
    also after a first ask was refused as "not late yet"; and a refusal for want of a free dedicated
    slot may not hold a moment later. One ask left such a turn waiting out the park, and a
    synchronous step with it (docs/benchmarks.md, 2026-12-04). Asking at doubling ages costs a turn
    a few route requests (log2 of how late it gets) and leaves it at most twice as late as the moment
    a dedicated slot would have taken it. A turn on a dedicated executor asks once, as before.
    """
    return max(elapsed_s, 1e-3)
