"""How much rollout rides in serving's next iteration when the policy is a LoRA adapter of the serving model.

Co-batched mode: rollout sequences are extra rows in serving's own packed forward (every row through the base
projections, rollout rows also through the adapter), so a rollout token comes at serving's iteration time. The
executor's SLO guard bounds that iteration: while serving has running requests, rollout gets the most rows, and
then the most prefill tokens, such that the predicted iteration stays under a threshold (the guard's
``share x SETPOINT x TPOT SLO``, services/executor/slo_guard.py); serving's own work (its decodes and prefill chunks)
is in the iteration first. With no serving work every row rides, and the threshold (the quantum) bounds only the
prefill beside them, so an arrival waits at most one iteration. Reclaim is the next iteration leaving rows out.

One rule, written once: the real executor calls it with its measured fit of an iteration, the simulator (sim/) with
the roofline (shared/devices.py). It imports no torch and no service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CoBatchBudget:
    """What rollout may put in the next iteration: ``rows`` decoding sequences and ``prefill_tokens`` of prompt.
    Ints when ``co_batch_rows`` was given scalars, integer arrays when it was given arrays."""

    rows: Any
    prefill_tokens: Any


def co_batch_rows(
    pass_s: Callable[[Any, Any], Any],
    *,
    threshold_s: float | np.ndarray,
    max_rows: int | np.ndarray,
    max_prefill_tokens: int | np.ndarray,
    serving_busy: bool = True,
) -> CoBatchBudget:
    """The rollout rows, then the rollout prefill tokens, that ride in serving's next iteration.

    ``pass_s(rows, prefill_tokens)``: the caller's prediction of that iteration in seconds with serving's planned work
    in it and ``rows`` rollout decodes and ``prefill_tokens`` rollout prompt tokens added; it must not decrease in
    either. ``threshold_s``: the guard's bound on the iteration. ``max_rows``: the rollout sequences ready to decode
    (within the lease's rows); ``max_prefill_tokens``: the rollout prompt tokens waiting (within the executor's chunk).

    ``serving_busy``: serving has running requests. Then the rows are the most with ``pass_s(rows, 0) <= threshold_s``
    (none where serving's own work is past it), and the prefill tokens the most with
    ``pass_s(rows, tokens) <= threshold_s``. Without serving work every row rides, and the prefill tokens are the most
    that keep the iteration within the larger of ``threshold_s`` (the quantum) and the rows' own decode step.

    Scalars or numpy arrays (broadcast together; ``pass_s`` then takes and returns arrays): the simulator prices every
    instance at once. A bisection over integers, ~log2(max) calls of ``pass_s`` each."""
    scalar = all(np.ndim(x) == 0 for x in (threshold_s, max_rows, max_prefill_tokens))
    threshold = np.asarray(threshold_s, dtype=float)
    cap_rows = np.maximum(np.asarray(max_rows, dtype=np.int64), 0)
    cap_tokens = np.maximum(np.asarray(max_prefill_tokens, dtype=np.int64), 0)
    threshold, cap_rows, cap_tokens = np.broadcast_arrays(threshold, cap_rows, cap_tokens)

    def seconds(rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        if scalar:  # the executor's predictor takes plain ints
            return np.asarray(float(pass_s(int(rows), int(tokens))))
        return np.asarray(pass_s(rows, tokens), dtype=float)

    none = np.zeros_like(cap_rows)
    if serving_busy:
        rows = _most(lambda r: seconds(r, none) <= threshold, cap_rows)
    else:
        rows = cap_rows.copy()
        threshold = np.maximum(threshold, seconds(rows, none))
    tokens = _most(lambda p: seconds(rows, p) <= threshold, cap_tokens)
    if scalar:
        return CoBatchBudget(int(rows), int(tokens))
    return CoBatchBudget(rows, tokens)


def _most(fits: Callable[[np.ndarray], np.ndarray], cap: np.ndarray) -> np.ndarray:
    """Per element, the largest n in [0, cap] with ``fits(n)`` (``fits`` true up to some n and false past it); 0 where
    even ``fits(0)`` is false."""
    lo = np.zeros_like(cap)
    hi = np.where(fits(lo), cap, 0)
    while (open_ := lo < hi).any():
        mid = (lo + hi + 1) // 2
        ok = fits(mid)
        lo, hi = np.where(open_ & ok, mid, lo), np.where(open_ & ~ok, mid - 1, hi)
    return lo
