"""One work class's requests through the engine's iterations: receive -> plan -> (forward) -> process.

A ``Batcher`` owns everything of one work class (serving or rollout) that changes while requests run:
its queues (``inbox`` -> ``waiting`` -> ``running``), each ``Sequence`` in them, their KV blocks in
its ``pool``, and, for rollout, the trajectory prefixes retained between turns (``prefixes``). Only
the thread that runs the class's iterations calls its steps (``receive``, ``plan``, ``advance``,
``process``, ``shrink``, ``finish_all``); the event loop only appends to ``inbox`` and ``aborts``
(``queue``, ``cancel``) and reads counts. The forward itself is the caller's: a lane runs one
batcher's work alone (``iterate``), the co-batched lane packs two batchers' work into one forward
(co_batched.py).

Results leave through ``_deliver``: each delta and final result is handed to the caller's event loop
with ``call_soon_threadsafe``; the lane thread never touches a ``RequestHandle``'s queue or future.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .forward_item import ForwardItem
from .kv_pool import KVPool
from .metrics import EngineMetrics
from .prefix_cache import RetainedPrefixes
from .protocol import FinishReason, GenerationResult, StreamDelta, WorkClass, next_delta, timings_since
from .sampling import SamplerState, find_stop
from .scheduling import Limits, plan_iteration, plan_shrink
from .sequence import Sequence
from .slo_guard import SloGuard

Work = list[tuple[Sequence, int]]  # the sequences of one iteration, each with the tokens it computes
Ready = list[tuple[Sequence, int, float]]  # the sequences that sampled, with their new token and its logprob
EMA_ALPHA = 0.2  # weight of the latest iteration in ``iteration_ms``


class Batcher:
    """Everything one work class owns: its model, tokenizer, KV pool, forward runner, limits, lane and queues."""

    def __init__(
        self,
        work_class: WorkClass,
        model: Any,
        tokenizer: Any,
        pool: KVPool,
        runner: Any,
        limits: Limits,
        lane: Any,
        *,
        metrics: EngineMetrics,
        version: Callable[[], int],
        guard: SloGuard | None = None,
        prefixes: RetainedPrefixes | None = None,
        wakeup: threading.Event | None = None,
        pool_index: int = 0,
        adapter_slot: Callable[[], int | None] | None = None,
    ) -> None:
        self.work_class = work_class
        self.model, self.tokenizer, self.pool, self.runner, self.limits, self.lane = model, tokenizer, pool, runner, limits, lane
        self.metrics = metrics
        self.version = version  # the version of the weights this class's tokens come from (serving: always 0)
        self.guard = guard  # serving: the SLO guard that learns from each finished request
        self.prefixes = prefixes  # rollout: the trajectory prefixes retained between turns
        self.inbox: deque[Sequence] = deque()
        self.aborts: deque[str] = deque()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.wakeup = wakeup or threading.Event()  # set on new work; the co-batched mode's two batchers share one thread's
        self.pool_index = pool_index  # which of the runner's KV pools holds this class's blocks (co-batched rollout: 1)
        self.adapter_slot = adapter_slot or _no_adapter  # the adapter slot this class's rows go through now (a LoRA policy)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.decode = text_decoder(tokenizer)
        self.iteration_ms = 0.0  # EMA of this class's iterations
        self.unprefilled = 0  # running sequences not past prefill (read by the other lane)
        self.unprefilled_since: float | None = None  # the oldest one's arrival (monotonic), None when none

    # ---- read from any thread
    @property
    def max_batch(self) -> int:
        """The most sequences of this class one iteration runs."""
        return self.limits.max_batch

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_lengths(self) -> tuple[int, int]:
        """(running, queued): queued counts those submitted and not yet running."""
        return len(self.running), len(self.inbox) + len(self.waiting)

    def prefill_pending(self) -> int:
        """Requests not past their prefill: queued, or running and not through it."""
        return len(self.inbox) + len(self.waiting) + self.unprefilled

    def oldest_wait_ms(self, now: float) -> float:
        """How long the longest-waiting request not yet past prefill has waited (0 if none). Read from another
        lane's thread: the queues may change under it, so each head is read once."""
        oldest = self.unprefilled_since
        for queue in (self.waiting, self.inbox):
            try:
                arrival = queue[0].arrival
            except IndexError:
                continue
            oldest = arrival if oldest is None else min(oldest, arrival)
        return 0.0 if oldest is None else (now - oldest) * 1000.0

    # ---- the event loop's side
    def queue(self, seq: Sequence) -> None:
        self.inbox.append(seq)
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self.wakeup.set()

    def all_request_ids(self) -> list[str]:
        return [s.request.request_id for s in itertools.chain(list(self.inbox), list(self.waiting), list(self.running))]

    # ---- the iteration's steps (the lane thread only)
    def count_unprefilled(self) -> None:
        """Running sequences whose prompt is not all in the KV cache yet, and the oldest one's arrival (their
        first tokens are at stake: the other lane's TTFT guard reads both)."""
        pending = [s.arrival for s in self.running if s.num_cached < s.prompt_len]
        self.unprefilled, self.unprefilled_since = len(pending), min(pending, default=None)

    def receive(self) -> None:
        """Take aborts and new requests (a rollout turn takes over its trajectory's retained prefix)."""
        while self.aborts:
            rid = self.aborts.popleft()
            for queue in (self.inbox, self.waiting, self.running):
                for seq in [s for s in queue if s.request.request_id == rid]:
                    queue.remove(seq)
                    self.abort(seq)
        while self.inbox:
            seq = self.inbox.popleft()
            if self.prefixes is not None and seq.request.trajectory_id is not None:
                self.prefixes.attach(seq, seq.request.trajectory_id, self.version())
            self.waiting.append(seq)

    def plan(self, admit: bool, limits: Limits | None = None, rows: int | None = None) -> Work:
        """Plan this iteration (``scheduling.plan_iteration``) and carry out its bookkeeping: preempt, evict
        retained prefixes, admit, allocate blocks. Returns the work to forward.

        ``rows``: the most sequences this iteration may step (the co-batched budget): the oldest running ones
        first, then admissions while rows are left; the running ones left out keep their KV and wait."""
        limits = limits or self.limits
        running = self.running
        if rows is not None:
            running = self.running[:rows]
            room = limits.max_batch - len(self.running)  # the batch cap still holds for every running sequence
            limits = replace(limits, max_batch=len(running) + max(0, min(rows - len(running), room)))
        plan = plan_iteration(
            [s.view() for s in running],
            [s.view() for s in self.waiting],
            self.pool.free_blocks,
            self.prefixes.cached_blocks if self.prefixes is not None else 0,
            limits,
            admit,
        )
        by_id = {s.seq_id: s for s in itertools.chain(self.running, self.waiting)}
        for seq_id in plan.preempt:
            self.preempt(by_id[seq_id])
        freed = 0
        while freed < plan.evict_cached_blocks and self.prefixes is not None:
            freed += self.prefixes.evict_lru()
        now = time.monotonic()
        for seq_id in plan.admit:
            seq = by_id[seq_id]
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        for seq_id, n in plan.new_blocks.items():
            by_id[seq_id].blocks.extend(self.pool.allocate(n))
        return [(by_id[sid], n) for sid, n in plan.prefill] + [(by_id[sid], 1) for sid in plan.decode]

    def forward_items(self, work: Work) -> list[ForwardItem]:
        """The forward's slice of each sequence: its new tokens after those cached, in this class's pool of the
        runner, through the named adapter's slot it was given, else this class's adapter slot now (None: the base
        weights alone)."""
        pool, adapter = self.pool_index, self.adapter_slot()
        return [
            ForwardItem(s.blocks, s.num_cached, s.tokens[s.num_cached : s.num_cached + n], pool, adapter if s.adapter is None else s.adapter[0])
            for s, n in work
        ]

    @staticmethod
    def sample_rows(work: Work, offset: int = 0) -> list[tuple[int, SamplerState]]:
        """The rows (from ``offset`` in the forward's batch) whose item reaches its sequence's end: those sample."""
        return [(offset + row, s.sampler) for row, (s, n) in enumerate(work) if s.num_cached + n == len(s.tokens)]

    @staticmethod
    def advance(work: Work, tokens: list[int], logprobs: list[float]) -> Ready:
        """The forward ran: each sequence's computed tokens are cached; the sampled ones (in ``sample_rows`` order)
        come back with their token and logprob."""
        ends = [s for s, n in work if s.num_cached + n == len(s.tokens)]
        for seq, n in work:
            seq.num_cached += n
        return list(zip(ends, tokens, logprobs))

    def iterate(self, admit: bool, limits: Limits | None = None, **steer: Any) -> None:
        """One iteration of this class alone: plan, one packed forward of its prefill chunks and decode steps,
        process. ``steer`` (``should_stop``, ``should_hold``) reaches the runner's layer safepoints: a forward
        abandoned there advances nothing (the rollout lane yields to serving)."""
        work = self.plan(admit, limits)
        self.count_unprefilled()
        if not work:
            return
        prefill = sum(n for s, n in work if n > 1 or s.num_cached + n < len(s.tokens)) if self.work_class is WorkClass.ROLLOUT else 0
        started = time.perf_counter()
        sampled = self.runner.forward_sample(self.forward_items(work), self.sample_rows(work), **steer)
        if sampled is not None:
            if prefill:
                self.metrics.rollout_prefilled(prefill, time.perf_counter() - started)
            self.process(self.advance(work, *sampled))
        self.count_unprefilled()

    def time_iteration(self, started: float) -> None:
        """Fold an iteration that began at ``started`` (``time.perf_counter``) into ``iteration_ms``."""
        self.iteration_ms += EMA_ALPHA * ((time.perf_counter() - started) * 1000.0 - self.iteration_ms)

    def process(self, ready: Ready) -> None:
        """Append each sampled token; finish, stream or keep going; deliver to the callers' loops."""
        if not ready:
            return
        now = time.monotonic()
        version = self.version()
        outbox = []
        for seq, token, lp in ready:
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            seq.versions.append(version if seq.adapter is None else seq.adapter[1])
            seq.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self.retire_kv(seq)
                outbox.append(self.finish(seq, reason, deliver=False))
            elif seq.request.stream and _delta_due(seq):
                delta = self._delta(seq, final=False)
                if delta is not None:
                    outbox.append((seq.handle, delta, None))
        if self.work_class is WorkClass.SERVING:
            self.metrics.tokens(len(ready), 0)
        else:
            self.metrics.tokens(0, len(ready))
        _deliver(outbox)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (token == self.eos_id and not p.ignore_eos):
            return "stop"
        if p.stop:
            seq.text = self.decode(seq.output)
            longest = max(len(s) for s in p.stop)
            at = find_stop(seq.text, p.stop, seq.emitted_text - longest)
            if at != -1:
                seq.text, seq.text_final = seq.text[:at], True
                return "stop"
        elif seq.request.stream and _delta_due(seq):
            seq.text = self.decode(seq.output)
        if len(seq.output) >= p.max_tokens or len(seq.tokens) >= self.runner.max_positions:
            return "length"
        return None

    def _delta(self, seq: Sequence, final: bool) -> StreamDelta | None:
        """New tokens and text since the last delta (see protocol.next_delta)."""
        delta, seq.emitted_text = next_delta(
            seq.request,
            seq.output,
            seq.logprobs,
            seq.text,
            seq.emitted_tokens,
            seq.emitted_text,
            final,
            seq.finish_reason,
            seq.sampler.top_logprobs,
        )
        if delta is not None:
            seq.emitted_tokens = len(seq.output)
        return delta

    def retire_kv(self, seq: Sequence) -> None:
        """Free a finished sequence's KV, or retain it for the trajectory's next turn."""
        if self.prefixes is not None and seq.request.trajectory_id is not None and seq.num_cached > 0:
            self.prefixes.retain(seq, seq.request.trajectory_id, self.version())
        else:
            self.pool.free(seq.blocks)
        seq.blocks = []

    def finish(self, seq: Sequence, reason: FinishReason, deliver: bool = True):
        """Finish ``seq`` (already off its queue, its KV already freed or retained): its final delta and result,
        delivered now or returned for the caller's batch (``deliver=False``)."""
        seq.finish_reason = reason
        if not seq.text_final:
            seq.text = self.decode(seq.output)
        delta = (
            self._delta(seq, final=True)
            if seq.request.stream
            else StreamDelta(
                request_id=seq.request.request_id,
                token_ids=tuple(seq.output),
                logprobs=tuple(seq.logprobs),
                text=seq.text,
                finished=True,
                finish_reason=reason,
                top_logprobs=tuple(seq.sampler.top_logprobs),
            )
        )
        result = self._result(seq, reason)
        if self.work_class is WorkClass.SERVING and reason != "abort":
            t = result.timings
            tpot = t.tpot_ms if len(seq.output) > 1 else None
            self.metrics.serving_finished(t.ttft_ms, tpot, len(seq.output))
            if self.guard is not None:
                self.guard.observe(t.ttft_ms, tpot, time.monotonic())
        item = (seq.handle, delta, result)
        if deliver:
            _deliver([item])
        return item

    def _result(self, seq: Sequence, reason: FinishReason) -> GenerationResult:
        timings = timings_since(seq.arrival, seq.token_times, seq.first_scheduled, seq.preemptions, time.monotonic())
        versions = tuple(seq.versions)
        return GenerationResult(
            request_id=seq.request.request_id,
            work_class=seq.request.work_class,
            token_ids=tuple(seq.output),
            logprobs=tuple(seq.logprobs),
            text=seq.text,
            finish_reason=reason,
            token_versions=versions,
            policy_version=versions[-1] if versions else self.version() if seq.adapter is None else seq.adapter[1],
            prefix_cached_tokens=seq.prefix_cached_tokens,
            timings=timings,
            top_logprobs=tuple(seq.sampler.top_logprobs),
        )

    def abort(self, seq: Sequence) -> None:
        """Free a sequence's KV (taken off its queue by the caller) and finish it with "abort"."""
        self.pool.free(seq.blocks)
        seq.blocks = []
        self.finish(seq, "abort")

    def abort_running(self) -> int:
        """Abort every running sequence (an iteration that raised: its batch is lost); how many."""
        running, self.running = self.running, []
        for seq in running:
            self.abort(seq)
        return len(running)

    def finish_all(self) -> None:
        """The engine stops: every request not finished ends with "abort"."""
        for seq in list(self.inbox) + list(self.waiting) + list(self.running):
            self.finish(seq, "abort")
        self.inbox.clear()
        self.waiting.clear()
        self.running.clear()

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV (it keeps its tokens) and put it first in line: it is recomputed later."""
        self.running.remove(seq)
        self.pool.free(seq.drop_kv())
        self.waiting.appendleft(seq)
        self.metrics.preempted()

    def preempt_all(self) -> None:
        for seq in list(self.running):
            self.preempt(seq)

    def shrink(self) -> None:
        """Give back the blocks over the pool's budget: evict retained prefixes (LRU), then preempt the youngest."""
        entries = self.prefixes.entry_blocks() if self.prefixes is not None else []
        n_evict, victims = plan_shrink(self.pool.over_budget_blocks, entries, [(s.seq_id, len(s.blocks)) for s in self.running])
        for _ in range(n_evict):
            assert self.prefixes is not None  # plan_shrink evicts only entries it was given
            self.prefixes.evict_lru()
        for seq_id in victims:
            self.preempt(next(s for s in self.running if s.seq_id == seq_id))

    def drop_waiting_kv(self) -> None:
        """Free what waiting sequences hold (a turn's retained prefix, handed over at receive)."""
        for seq in self.waiting:
            if seq.blocks:
                self.pool.free(seq.drop_kv())

    def limited(self, **changes: int) -> Limits:
        """This class's limits with some changed (a rollout iteration that may not prefill: ``prefill_tokens=0``)."""
        return replace(self.limits, **changes)


def _no_adapter() -> None:
    return None


def _delta_due(seq: Sequence) -> bool:
    """A streamed request's deltas go out with its first token, then every ``stream_interval`` tokens."""
    n = len(seq.output)
    return n == 1 or n - seq.emitted_tokens >= seq.request.stream_interval


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, straight from the fast (Rust) tokenizer where that is
    the same thing: transformers' wrapper converts every id in Python first, which cost a streamed serving token
    more than the rest of its bookkeeping (tests/executor/test_engine.py checks the two agree)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


def _deliver(items: list) -> None:
    """Hand deltas/results to their event loops, one callback per loop per iteration."""
    by_loop: dict = {}
    for handle, delta, result in items:
        by_loop.setdefault(handle._loop, []).append((handle, delta, result))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_on_loop, batch)
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is listening


def _deliver_on_loop(batch: list) -> None:
    for handle, delta, result in batch:
        handle.deliver(delta, result)
