"""One serving instance per second, as a fluid model: serving latency and what rollout gets.

Vectorised over instances (numpy arrays). Per second, given the arrival rate ``rate``
(req/s), mean prompt ``P`` and output ``O`` tokens and the p99 prompt ``P99``:

- prefill share of the device: ``f_p = rate x prefill(P)``; with chunked prefill the
  prefill work rides on the decode iterations, so the mean time per output token is
  ``TPOT = it / (1 - f_p)`` with the iteration time ``it = decode(B, P + O/2) + extra``, and
  ``extra`` is what rollout adds to every serving iteration (below);
- serving decode batch by Little's law, a fixed point: ``B = rate x O x TPOT``; B is capped
  by the serving KV pool and the engine's max batch: past the cap the instance is overloaded
  and a queue builds up at ``rate - capacity``;
- p99 TPOT = the mean TPOT plus one chunked-prefill chunk (512 tokens) when chunks ride on
  more than 1 % of iterations;
- p99 TTFT = the p99 wait for the prefill lane (M/M/1 with utilisation f_p:
  ``ln(100 f_p) / ((1 - f_p) / prefill(P))``) + ``prefill(P99)`` + one iteration + the wait
  an arrival has before serving gets the device back (``arrival_wait``) + queue / capacity;
- the instance is idle with probability ``exp(-(B + rate x prefill(P)))`` (Poisson number
  in service), busy otherwise.

What rollout adds and gets, by executor policy (services/executor/policies.py, whose
policy objects are asked, not re-implemented):
- ``rose`` (own low-priority lane, bounded quanta, yields to arrivals): each serving
  iteration is followed by at most one quantum ``q = min(quantum_ms, rollout step)`` (a
  longer rollout step is cut at layer safepoints); an arrival waits at most ``q``. The lane
  gets the whole device while serving is idle (``widens_when_serving_idle``), else
  ``(1 - f_p) x q / (it + q)`` of it (no rollout while a prefill is pending:
  ``yields_on_arrival``), and nothing while ``may_run_rollout`` says no (the local TPOT guard);
- ``naive_share`` (same lane, unbounded quanta): the rollout batch runs to completion
  between serving iterations (services/executor/engine.py ``_run_quantum`` with
  ``quantum_ms = None``): ``extra = rollout step x (p90 turn length)`` on every serving
  iteration, and an arrival waits for the batch running when it comes (up to all of it: the
  p99 TTFT takes the whole batch). With the rollout engine's in-situ step time on the e2e box
  this predicts naive_share's measured SLO attainment (0.76 vs 0.70); with forward-only step
  times a 16-token batch took ~40 ms and the SLO looked untouched;
- a dedicated (or whole-device lent) instance: rollout gets the whole device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rose.services.executor.policies import Signals

CHUNK_TOKENS = 512
MAX_SERVING_BATCH = 256


@dataclass
class ServingTick:
    batch: np.ndarray
    iteration_s: np.ndarray  # serving iteration without rollout's share
    tpot_p99_s: np.ndarray
    ttft_p99_s: np.ndarray
    busy: np.ndarray  # probability the instance has serving work
    prefill_frac: np.ndarray
    capacity_rps: np.ndarray
    queue: np.ndarray  # requests waiting at the end of the second


def serving_tick(
    perf,
    rate,
    prompt: float,
    output: float,
    prompt_p99: float,
    extra_s,
    arrival_wait_s,
    queue,
    dt: float,
    kv_tokens_cap,
    max_batch: int = MAX_SERVING_BATCH,
) -> ServingTick:
    rate = np.asarray(rate, dtype=float)
    extra = np.asarray(extra_s, dtype=float) + np.zeros_like(rate)
    queue = np.asarray(queue, dtype=float) + np.zeros_like(rate)
    ctx = prompt + output / 2.0
    pf = float(perf.prefill_s(prompt))
    f_p = rate * pf
    cap_b = np.minimum(max_batch, np.asarray(kv_tokens_cap, dtype=float) / max(1.0, prompt + output))
    cap_b = np.maximum(cap_b, 1.0)
    denom = np.maximum(0.05, 1.0 - f_p)
    b = rate * output * (perf.decode_s(1.0, ctx) + extra) / denom
    for _ in range(4):
        it = perf.decode_s(np.clip(b, 1.0, cap_b), ctx) + extra
        b = rate * output * it / denom
    b_run = np.minimum(b, cap_b)
    tau = perf.decode_s(np.maximum(b_run, 1.0), ctx)
    it = tau + extra
    cap_decode = cap_b * np.maximum(0.0, 1.0 - f_p) / (output * it)
    capacity = np.minimum(cap_decode, 0.98 / pf) if pf > 0 else cap_decode
    capacity = np.maximum(capacity, 1e-6)
    new_queue = np.maximum(0.0, queue + (rate - capacity) * dt)
    chunk_s = max(0.0, float(perf.prefill_s(CHUNK_TOKENS)) - float(perf.decode_s(1.0, ctx)))
    chunky = rate * prompt / CHUNK_TOKENS * it >= 0.01
    tpot = it / denom + np.where(chunky, chunk_s, 0.0)
    rho = np.minimum(f_p, 0.995)
    with np.errstate(divide="ignore", invalid="ignore"):
        wait99 = np.where(rho > 0.01, np.maximum(0.0, np.log(100.0 * rho)) * pf / (1.0 - rho), 0.0)
    ttft = wait99 + float(perf.prefill_s(prompt_p99)) + it + np.asarray(arrival_wait_s, dtype=float) + new_queue / capacity
    busy = np.where(new_queue > 0.5, 1.0, 1.0 - np.exp(-(b_run + rate * pf)))
    busy = np.where(rate > 0, busy, 0.0)
    return ServingTick(b_run, tau, tpot, ttft, busy, f_p, capacity, new_queue)


def slo_capacity_rps(perf, prompt: float, output: float, prompt_p99: float, slo_ttft_s: float, slo_tpot_s: float, kv_tokens_cap: float) -> float:
    """The highest steady arrival rate (req/s) one instance serves alone within both SLOs (bisection)."""

    def ok(r: float) -> bool:
        t = serving_tick(perf, np.array([r]), prompt, output, prompt_p99, 0.0, 0.0, 0.0, 1.0, kv_tokens_cap)
        return bool(t.queue[0] <= 0 and t.ttft_p99_s[0] <= slo_ttft_s and t.tpot_p99_s[0] <= slo_tpot_s)

    if not ok(1e-3):
        return 0.0
    lo, hi = 1e-3, 1.0
    while ok(hi) and hi < 1e5:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def rollout_interference(
    ep, active: np.ndarray, tau_r: np.ndarray, turn_p90: float, signals: Callable[[int], Signals]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(extra seconds per serving iteration, extra wait of an arrival, may run) per instance.

    ``ep``: the executor's policy object (or None: no rollout on serving instances);
    ``active``: instances with rollout work and a lease; ``tau_r``: their rollout step time;
    ``signals(d)``: the engine's Signals for instance d, handed to ``ep.may_run_rollout``.
    """
    n = len(active)
    extra, may = np.zeros(n), np.zeros(n, dtype=bool)
    if ep is None:
        return extra, extra, may
    if ep.quantum_ms is None:  # naive: the admitted batch runs to completion between serving iterations
        may = active.copy()
        extra = np.where(may, tau_r * turn_p90, 0.0)
        return extra, extra, may
    for d in np.flatnonzero(active).tolist():
        may[d] = ep.may_run_rollout(signals(d))
    extra = np.where(may, np.minimum(ep.quantum_ms / 1e3, tau_r), 0.0)
    return extra, extra, may  # an arrival waits for the running quantum's next safepoint at most


def rollout_share(ep, st: ServingTick, extra: np.ndarray, may: np.ndarray) -> np.ndarray:
    """The share of each instance's time its rollout lane gets this second (see the module doc)."""
    idle = 1.0 - st.busy
    if ep.quantum_ms is None:
        busy_share = np.where(may, extra / (st.iteration_s + extra), 0.0)
        return idle + st.busy * busy_share
    q = np.where(may, extra, 0.0)
    yield_factor = (1.0 - np.minimum(st.prefill_frac, 1.0)) if ep.yields_on_arrival else 1.0
    busy_share = yield_factor * q / np.maximum(st.iteration_s + q, 1e-12)
    idle_share = idle if ep.widens_when_serving_idle else idle * busy_share
    return idle_share + st.busy * busy_share


def lane_share_ceiling(ep, perf, rate, prompt: float, output: float, prompt_p99: float, kv_tokens_cap) -> np.ndarray | None:
    """The most of each second a serving instance's rollout lane can have beside serving at ``rate``
    (req/s per instance, any shape): ``rollout_share`` with rollout always allowed and every quantum
    run to its full length (a rollout step shorter than the quantum, or the guard pausing it, gives
    the lane less while serving is busy, which at these loads it nearly always is). None where the
    policy has no bounded quantum (no rollout on serving instances, or naive_share's
    batch-to-completion, whose share depends on the batch).

    It exists to bound what leases can add, whatever the placement: a lane's device-second is worth
    at most a dedicated instance's, so a serving fleet's leases add at most the sum of these shares
    in instances (``ceiling.rollout_capacity_ceiling``)."""
    if ep is None or ep.quantum_ms is None:
        return None
    rate = np.asarray(rate, dtype=float)
    q = np.full(rate.shape, ep.quantum_ms / 1e3)
    st = serving_tick(perf, rate, prompt, output, prompt_p99, q, q, np.zeros(rate.shape), 1.0, kv_tokens_cap)
    return rollout_share(ep, st, q, np.ones(rate.shape, dtype=bool))


def lane_second(
    ep,
    sperf,
    pperf,
    sizes: tuple[float, float, float],
    rate: np.ndarray,
    rows: np.ndarray,
    rows_ctx: np.ndarray,
    may_run: np.ndarray,
    queue: np.ndarray,
    dt: float,
    kv_tokens: float,
    turn_p90: float,
    signals: Callable[[int], Signals],
) -> tuple[ServingTick, np.ndarray, np.ndarray]:
    """Two-model mode's second on the serving instances: (serving's second, what rollout adds to each serving
    iteration, the share of the device the rollout lane gets). ``ep``: the executor's policy on a co-hosting serving
    instance (None: no rollout there); ``sperf``, ``pperf``: the serving model's and the policy's step models there;
    ``sizes``: mean prompt, mean output and p99 prompt; ``rows``: rollout sequences running on each at mean context
    ``rows_ctx``; ``may_run``: a lease and the current weights; ``signals(d)``: the engine's Signals
    (``rollout_interference``)."""
    tau_r = pperf.decode_s(np.maximum(rows, 1), np.maximum(rows_ctx, 1.0))
    active = (rows > 0) & may_run if ep is not None else np.zeros(len(rate), dtype=bool)
    extra, wait, may = rollout_interference(ep, active, tau_r, turn_p90, signals)
    st = serving_tick(sperf, rate, *sizes, extra, wait, queue, dt, kv_tokens)
    lane_share = np.where(may_run, rollout_share(ep, st, extra, may), 0.0) if ep is not None else np.zeros(len(rate))
    return st, extra, lane_share
