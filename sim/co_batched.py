"""Co-batched rollout on a serving instance, per second, as a fluid model (``SimConfig.rollout_mode`` "co_batched").

The policy is a LoRA adapter of the serving model (shared/lora.py), so rollout sequences are extra rows in serving's
own iterations: one packed forward reads the base weights once for every row, reads every row's KV, and runs the
adapter's kernels for the rollout rows (``Roofline.mixed_s`` with ``adapted_tokens``, shared/devices.py). Which rows
ride is the executor's rule (shared/co_batch.py ``co_batch_rows``), called here with the roofline as its predictor:

- a serving decode iteration: the most rollout rows, then the most rollout prefill tokens, that keep it under the
  guard's threshold (``guard_threshold_s``); a rollout row's token comes at that iteration's time;
- an iteration that carries one of serving's prefill chunks is serving's alone: its chunk goes first (TTFT), and rows
  riding it would stretch serving's prefill share, which every serving token waits through (``serving_tick``: TPOT is
  the iteration over 1 - the prefill share). So rollout gets the share of the busy time serving does not prefill in;
- no serving work: every row rides, the quantum bounds the prefill beside them (``serving_busy`` False).

Serving's latency (``coserve.serving_tick``) takes the rows' cost: each decode iteration is ``extra_s`` longer, its
batch grows by Little's law, and an arrival waits for one such iteration before its prefill. Serving's batch and the
iteration depend on each other: the rule prices each candidate at the serving batch the iteration settles at.

The guard is a closed loop (services/executor/slo_guard.py): the share halves while the window's p99 is past the
setpoint and grows back only below ``RELAX_BELOW`` x the setpoint. The fluid model takes its settled state: the
threshold at which the p99 TPOT (the iteration stretched by the prefill share, plus one chunk) sits at that relax
line, at most the share-1 threshold ``SETPOINT`` x the SLO. The lease's keep line (0.8 x the SLO) sits above it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rose.services.executor.slo_guard import RELAX_BELOW, SETPOINT
from rose.shared.co_batch import co_batch_rows
from rose.shared.lora import LoraShape

from .coserve import MAX_SERVING_BATCH, ServingTick, serving_tick


class AdaptedSteps:
    """A LoRA policy's step times where every token goes through its adapter (base + adapter: a co-batched job's
    dedicated instances, and its rollout alone on a serving instance): ``base``'s times plus ``base.adapter_s``.
    The same interface as the step models of shared/devices.py."""

    def __init__(self, base, lora: LoraShape) -> None:
        self.base, self.lora = base, lora

    def decode_s(self, batch, ctx):
        return self.base.decode_s(batch, ctx) + self.base.adapter_s(batch, self.lora)

    def prefill_s(self, tokens, cached=0.0):
        p = np.asarray(tokens, dtype=float)
        return np.where(p > 0, self.base.prefill_s(p, cached) + self.base.adapter_s(p, self.lora), 0.0)

    def mixed_s(self, batch, ctx, chunk, cached=0.0):
        adapted = np.asarray(batch, dtype=float) + np.asarray(chunk, dtype=float)
        return self.base.mixed_s(batch, ctx, chunk, cached, adapted_tokens=adapted, lora=self.lora)

    def forward_s(self, decode_contexts, prefill_chunks) -> float:
        adapted = float(len(decode_contexts)) + float(sum(p for p, _ in prefill_chunks))
        return self.base.forward_s(decode_contexts, prefill_chunks, adapted_tokens=adapted, lora=self.lora)

    def host_load_s(self, tokens):
        return self.base.host_load_s(tokens)

    @property
    def rollout_prefill_tokens(self) -> int:
        return self.base.rollout_prefill_tokens

    def label(self) -> str:
        return f"{self.base.label()} + LoRA rank {self.lora.rank}"


@dataclass(frozen=True)
class CoBatchPlan:
    """One second of co-batched serving instances (arrays over them): serving's figures with the rollout rows in its
    iterations, and what rollout gets from each kind of iteration."""

    serving: ServingTick
    extra_s: np.ndarray  # what rollout's rows and prefill add to a serving decode iteration
    rows: np.ndarray  # rollout rows riding a serving decode iteration
    prefill_tokens: np.ndarray  # rollout prompt tokens riding one
    iteration_s: np.ndarray  # that iteration, rollout included
    idle_rows: np.ndarray  # with no serving work: every row
    idle_prefill_tokens: np.ndarray
    idle_iteration_s: np.ndarray

    def rollout_time_share(self) -> np.ndarray:
        """The share of each second rollout's forwards run in: serving's decode iterations and its idle time."""
        busy = np.asarray(self.serving.busy, dtype=float)
        return np.maximum(0.0, busy - np.minimum(self.serving.prefill_frac, busy)) + (1.0 - busy)

    def per_second(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rollout row-tokens, rollout prompt tokens, device seconds rollout added) per second: decode iterations fill
        the busy time serving does not prefill in, and rollout runs alone in the idle time."""
        st = self.serving
        busy = np.asarray(st.busy, dtype=float)
        decoding = np.maximum(0.0, busy - np.minimum(st.prefill_frac, busy))
        n_decode = np.where(self.iteration_s > 0, decoding / np.maximum(self.iteration_s, 1e-12), 0.0)
        n_idle = np.where(self.idle_iteration_s > 0, (1.0 - busy) / np.maximum(self.idle_iteration_s, 1e-12), 0.0)
        row_tokens = self.rows * n_decode + self.idle_rows * n_idle
        prefill = self.prefill_tokens * n_decode + self.idle_prefill_tokens * n_idle
        device = self.extra_s * n_decode + self.idle_iteration_s * n_idle
        return row_tokens, prefill, device


def guard_threshold_s(st: ServingTick, slo_tpot_s: float) -> np.ndarray:
    """The guard's bound on a serving decode iteration at its loop's settled share (module doc), read off ``st``
    (serving alone): the iteration whose p99 TPOT (stretched by the prefill share, plus the chunk stall
    ``serving_tick`` adds) sits at ``RELAX_BELOW`` x ``SETPOINT`` x the SLO, at most ``SETPOINT`` x the SLO."""
    room = np.maximum(0.05, 1.0 - st.prefill_frac)  # as serving_tick's TPOT
    stall = np.maximum(0.0, st.tpot_p99_s - st.iteration_s / room)
    return np.clip((RELAX_BELOW * SETPOINT * slo_tpot_s - stall) * room, 0.0, SETPOINT * slo_tpot_s)


def co_batch_plan(
    perf,
    lora: LoraShape,
    rate,
    prompt: float,
    output: float,
    prompt_p99: float,
    queue,
    dt: float,
    kv_tokens,
    *,
    rows,
    rows_ctx,
    prefill_tokens,
    prefill_cached,
    slo_tpot_s: float,
    quantum_s: float,
    guarded: bool = True,
) -> CoBatchPlan:
    """Serving instances at ``rate`` requests/s each (the ``serving_tick`` inputs) with ``rows`` rollout sequences ready
    to decode at mean context ``rows_ctx`` and up to ``prefill_tokens`` rollout prompt tokens a decode iteration may
    take (after ``prefill_cached``), on ``perf`` (the serving model's roofline) with the ``lora`` adapter. ``guarded``
    False: no guard (naive_share's equal priority: every row rides every decode iteration).

    The rows are the rule's (``co_batch_rows``) with the iteration priced at the serving batch it settles at: a longer
    iteration keeps serving's requests in flight longer (Little's law, as ``serving_tick``), and the guard's loop
    steers by tails that include that."""
    rate = np.asarray(rate, dtype=float)
    rows = np.maximum(np.asarray(rows, dtype=np.int64), 0) + np.zeros(rate.shape, dtype=np.int64)
    tokens = np.maximum(np.asarray(prefill_tokens, dtype=np.int64), 0) + np.zeros(rate.shape, dtype=np.int64)
    rows_ctx = np.maximum(np.asarray(rows_ctx, dtype=float), 1.0)
    ctx_s = prompt + output / 2.0  # serving's mean context, as serving_tick's
    alone = serving_tick(perf, rate, prompt, output, prompt_p99, 0.0, 0.0, queue, dt, kv_tokens)
    cap_b = np.clip(np.asarray(kv_tokens, dtype=float) / max(1.0, prompt + output), 1.0, MAX_SERVING_BATCH)  # as serving_tick's
    flow = rate * output / np.maximum(0.05, 1.0 - alone.prefill_frac)  # serving requests in flight per second of iteration

    def iteration_at(batch, r, p):
        """A decode iteration of ``batch`` serving rows, r rollout rows and p rollout prefill tokens."""
        b = batch + r
        return perf.mixed_s(b, (batch * ctx_s + r * rows_ctx) / b, p, prefill_cached, adapted_tokens=r + p, lora=lora)

    def settled(r, p):
        """(the decode iteration with r rows and p prefill tokens riding, the serving batch it settles at): the batch
        solves batch = flow x iteration(batch), the iteration linear in the batch within a roofline regime (its
        weights and rows fixed, each serving row one token and its KV), so two prices give the line."""
        batch0 = np.maximum(alone.batch, 1.0)  # a busy instance decodes at least one request
        at0 = iteration_at(batch0, r, p)
        slope = iteration_at(batch0 + 1.0, r, p) - at0
        batch = np.clip(flow * (at0 - slope * batch0) / np.maximum(1.0 - flow * slope, 1e-9), 1.0, cap_b)
        return iteration_at(batch, r, p), batch

    threshold = guard_threshold_s(alone, slo_tpot_s) if guarded else np.full(rate.shape, np.inf)
    busy = co_batch_rows(lambda r, p: settled(r, p)[0], threshold_s=threshold, max_rows=rows, max_prefill_tokens=tokens)
    iteration, batch = settled(busy.rows, busy.prefill_tokens)
    extra = iteration - perf.decode_s(batch, ctx_s)

    def idle_pass(r, p):
        return perf.mixed_s(r, rows_ctx, p, prefill_cached, adapted_tokens=r + p, lora=lora)

    idle = co_batch_rows(idle_pass, threshold_s=quantum_s, max_rows=rows, max_prefill_tokens=tokens, serving_busy=False)
    return CoBatchPlan(
        serving=serving_tick(perf, rate, prompt, output, prompt_p99, extra, 0.0, queue, dt, kv_tokens),
        extra_s=extra,
        rows=busy.rows,
        prefill_tokens=busy.prefill_tokens,
        iteration_s=iteration,
        idle_rows=idle.rows,
        idle_prefill_tokens=idle.prefill_tokens,
        idle_iteration_s=np.asarray(idle_pass(idle.rows, idle.prefill_tokens), dtype=float),
    )


def co_batched_second(
    perf,
    lora: LoraShape,
    rate: np.ndarray,
    sizes: tuple[float, float, float],
    queue: np.ndarray,
    dt: float,
    kv_tokens: float,
    ready: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    active: np.ndarray,
    *,
    chunk_tokens: int,
    slo_tpot_s: float,
    quantum_s: float,
    guarded: bool,
) -> tuple[ServingTick, np.ndarray, np.ndarray, CoBatchPlan | None]:
    """Co-batched mode's second on the serving instances: (serving's second, what rollout adds to each serving
    iteration, the share of the device rollout's forwards get, the plan the rollout engines then follow; None: nothing
    rides). ``ready``: per instance, the sequences ready to decode, their mean context, the mean context cached before
    the prompt tokens still to prefill, and whether a turn waits for its prefill or its admission
    (``TurnTable.ready_to_ride``); ``active``: a lease and the current weights. The rows, and a chunk of
    ``chunk_tokens`` of prefill where turns wait for theirs (the executor's rollout chunk), ride serving's iterations
    under the guard (``co_batch_plan``; ``guarded`` False: naive_share's rows ride unguarded)."""
    n = len(rate)
    decoding, ctx, cached, waiting = ready
    rows = np.where(active, decoding, 0)
    chunk = np.where(active & waiting, chunk_tokens, 0)
    if not (rows.any() or chunk.any()):  # nothing rides: serving alone
        return serving_tick(perf, rate, *sizes, 0.0, 0.0, queue, dt, kv_tokens), np.zeros(n), np.zeros(n), None
    plan = co_batch_plan(
        perf,
        lora,
        rate,
        *sizes,
        queue,
        dt,
        kv_tokens,
        rows=rows,
        rows_ctx=ctx,
        prefill_tokens=chunk,
        prefill_cached=cached,
        slo_tpot_s=slo_tpot_s,
        quantum_s=quantum_s,
        guarded=guarded,
    )
    return plan.serving, plan.extra_s, np.where(active, plan.rollout_time_share(), 0.0), plan
