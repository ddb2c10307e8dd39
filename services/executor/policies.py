"""Co-serving policies: how rollout shares the device with serving. Chosen once.

Each policy answers four questions the engine asks at rollout quantum boundaries, so the
hot loop has no mode flags:
- ``admits_rollout``: is rollout work accepted at all?
- ``shares_serving_lane``: does rollout run on the serving lane (same stream / thread,
  strict FIFO alternation) instead of its own low-priority lane?
- ``may_run_rollout(signals)``: may the next rollout quantum start now?
  (and ``may_prefill_rollout(signals)``: may its iterations prefill, or only decode?)
- ``quantum_ms``: the time budget of one rollout quantum; the engine runs iterations
  while the next one is expected to fit (at least one). None = unbounded: the whole
  current batch runs to completion.
and ``yields_on_arrival``: does a serving arrival ask the rollout lane to yield? and
``widens_when_serving_idle``: may rollout use the whole device while serving has no work?
and ``yields_to_alerts``: does the executor's lease guard take rollout back at once on an
SLO alert for this executor (naive_share ignores the SLO, alerts included)?
and ``rollout_cpu_idle``: on CPU, does rollout's forward process run at the OS's idle priority,
on CPU time nothing else wants (``rollout_process.py``; only where rollout is a guest of a
serving executor: ``EngineConfig.rollout_is_guest``)?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from rose.shared.bursts import first_token_wait_ms

from .slo_guard import SETPOINT

PolicyName = Literal["serving_only", "naive_share", "static_partition", "rose"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
DEFAULT_QUANTUM_MS = 10.0
# rose's fast-path thresholds all derive from the SLO, the closed loop's setpoint (slo_guard.py) and
# its share (1 while the tails are calm, smaller as they near the setpoint):
# - TPOT: rollout pauses while the serving step (~ the TPOT of the tokens being made) is past
#   share x setpoint x the TPOT SLO: the p99 target itself, read live.
DEFAULT_GUARD_FRACTION = SETPOINT
# - TTFT: rollout pauses once a first token is projected to land past share x setpoint x the TTFT SLO:
#   the oldest one's wait plus a serving iteration for it and for each first token queued behind it.
DEFAULT_TTFT_GUARD_FRACTION = SETPOINT
# - Without a TTFT SLO there is nothing to project against: beside serving, rollout pauses once two
#   first tokens wait (more than one means the serving lane is not keeping up), where the lanes overlap at one.
NO_SLO_BACKLOG = 2
# - A filling serving batch, where rollout's forwards share the serving lane's interpreter (a GPU
#   without rollout graphs; a CPU executor without its rollout forward process): rollout pauses once the
#   batch's free slots would fill at the recent arrival rate within the margin the setpoint leaves,
#   (1 - setpoint) x the TTFT SLO, or once the serving step is past half the TPOT threshold (two threads
#   alternating one interpreter lock can double a step).
FILL_LEAD_FRACTION = round(1.0 - SETPOINT, 9)  # (rounded: 0.2, not 0.19999999999999996)
INTERPRETER_SLOWDOWN = 2.0
DEFAULT_STATIC_SHARE = 0.5
DEFAULT_STATIC_PERIOD_MS = 100.0


@dataclass(frozen=True, kw_only=True)
class Signals:
    """What the engine knows about serving right now (read at a quantum boundary)."""

    now: float  # monotonic seconds
    serving_prefill_pending: int  # serving requests not yet past prefill (TTFT at stake)
    serving_running: int
    serving_iteration_ms: float  # recent serving iteration time (EMA) ~ current TPOT
    slo_tpot_ms: float | None
    lanes_overlap: bool = True  # rollout competes with serving for compute (GPU SMs, or shared CPU cores)
    serving_max_batch: int = 0  # the serving engine's batch limit (0: unknown)
    shares_interpreter: bool = True  # rollout's forwards run in the serving lane's interpreter (not in a process of their own)
    slo_ttft_ms: float | None = None
    serving_oldest_wait_ms: float = 0.0  # the longest wait of a serving request not yet past prefill
    priority_streams: bool = False  # the device runs serving's kernels ahead of rollout's (CUDA stream priorities)
    rollout_decode_graphs: bool = False  # rollout decode steps are CUDA graph replays: one launch, little interpreter time
    rollout_share: float = 1.0  # the closed loop's share of the device for rollout while serving has work (slo_guard.py)
    serving_arrival_rate_rps: float = 0.0  # serving arrivals per second over the burst detector's short window


class _PrefillsFreely:
    """Policies whose rollout quanta may always prefill (only rose tells prefill from decode)."""

    def may_prefill_rollout(self, s: Signals) -> bool:
        return True


class ServingOnly(_PrefillsFreely):
    name = "serving_only"
    admits_rollout = False
    shares_serving_lane = False
    yields_on_arrival = False
    widens_when_serving_idle = False
    yields_to_alerts = True
    rollout_cpu_idle = False

    def may_run_rollout(self, s: Signals) -> bool:
        return False

    quantum_ms = 0.0


class NaiveShare(_PrefillsFreely):
    """Rollout at equal priority on the same lane, unbounded quanta: whole batches run
    to completion before serving gets the lane back (no SLO awareness)."""

    name = "naive_share"
    admits_rollout = True
    shares_serving_lane = True
    yields_on_arrival = False
    widens_when_serving_idle = False
    yields_to_alerts = False
    rollout_cpu_idle = False  # equal priority is what naive sharing means

    def may_run_rollout(self, s: Signals) -> bool:
        return True

    quantum_ms = None


class StaticPartition(_PrefillsFreely):
    """A fixed duty cycle for rollout on its own lane, whatever the serving load."""

    name = "static_partition"
    admits_rollout = True
    shares_serving_lane = False
    yields_on_arrival = False
    widens_when_serving_idle = False
    yields_to_alerts = True
    rollout_cpu_idle = False  # a fixed partition: its share of the device whatever else runs

    def __init__(
        self, share: float = DEFAULT_STATIC_SHARE, period_ms: float = DEFAULT_STATIC_PERIOD_MS, quantum_ms: float = DEFAULT_QUANTUM_MS
    ) -> None:
        self.share, self.period_ms, self.quantum_ms = share, period_ms, quantum_ms

    def may_run_rollout(self, s: Signals) -> bool:
        return (s.now * 1000.0) % self.period_ms < self.share * self.period_ms


class Rose:
    """Rollout on its own low-priority lane in bounded quanta; where it competes with serving
    for compute it yields to every serving arrival until its prefill is done (TTFT), and it
    pauses while the serving iteration time is past the setpoint of the TPOT SLO.

    On a GPU the two lanes always share the SMs; serving's stream has the higher priority, and
    rollout's decode steps are graph replays, so a quantum yields at each serving arrival and
    then goes on decoding (not prefilling: ``may_prefill_rollout``) unless first tokens are at
    risk (their wait is past the TTFT margin). On CPU the rollout lane has cores of its own
    and widens over the serving lane's core whenever serving has no work (``core_lending.py``);
    an arrival takes the core back at the rollout forward's next layer safepoint. Beside
    serving the rollout lane pauses only when first tokens are at risk (the oldest one's wait,
    plus an iteration per first token queued behind it, is past the margin) or, where rollout's
    forwards share the serving lane's interpreter, when a burst fills the serving batch. The
    engine asks the same question during a rollout forward: while the answer is no, the forward
    holds at its next layer safepoint.

    The closed loop (``slo_guard.py``) sets ``rollout_share``: the TTFT and TPOT thresholds scale with
    it (at 0 rollout waits whenever serving has work). See the module constants for how each
    threshold derives from the SLO."""

    name = "rose"
    admits_rollout = True
    shares_serving_lane = False
    yields_on_arrival = True
    widens_when_serving_idle = True  # CPU: spans the serving core while serving has no work; narrows at a layer safepoint (core_lending.py)
    yields_to_alerts = True
    rollout_cpu_idle = True  # CPU: the OS preempts rollout for serving and anything else on the host (rollout_process.py)

    def __init__(
        self,
        quantum_ms: float = DEFAULT_QUANTUM_MS,
        guard_fraction: float = DEFAULT_GUARD_FRACTION,
        ttft_guard_fraction: float = DEFAULT_TTFT_GUARD_FRACTION,
    ) -> None:
        self.quantum_ms, self.guard_fraction, self.ttft_guard_fraction = quantum_ms, guard_fraction, ttft_guard_fraction

    def may_run_rollout(self, s: Signals) -> bool:
        if s.lanes_overlap and s.serving_prefill_pending and not s.priority_streams:
            return False  # CPU, widened over serving's core: give the core back now
        if s.serving_prefill_pending and self._first_tokens_at_risk(s):
            return False
        if not s.rollout_decode_graphs and self._batch_filling(s):
            return False
        return not (s.slo_tpot_ms is not None and s.serving_running and s.serving_iteration_ms > self._tpot_threshold_ms(s))

    def may_prefill_rollout(self, s: Signals) -> bool:
        """Where rollout decodes by graph replay (GPU), its quanta may go on decoding beside serving's
        first tokens (a replay is one launch, on the low-priority stream), but its prefill is still
        eager, about a thousand launches from the interpreter the serving lane launches from: that
        waits until no serving request awaits its first token and no burst is filling the batch."""
        if not s.rollout_decode_graphs:
            return True  # every rollout step is eager alike: may_run_rollout has judged it
        return not s.serving_prefill_pending and not self._batch_filling(s)

    def _tpot_threshold_ms(self, s: Signals) -> float:
        assert s.slo_tpot_ms is not None
        return self.guard_fraction * s.rollout_share * s.slo_tpot_ms

    def _first_tokens_at_risk(self, s: Signals) -> bool:
        if s.slo_ttft_ms is None:
            return s.serving_prefill_pending >= (1 if s.lanes_overlap else NO_SLO_BACKLOG)
        projected = first_token_wait_ms(s.serving_oldest_wait_ms, s.serving_prefill_pending, s.serving_iteration_ms)
        return projected >= self.ttft_guard_fraction * s.rollout_share * s.slo_ttft_ms

    def _batch_filling(self, s: Signals) -> bool:
        if not s.shares_interpreter or not s.serving_running:
            return False
        if s.slo_tpot_ms is not None and s.serving_iteration_ms * INTERPRETER_SLOWDOWN > self._tpot_threshold_ms(s):
            return True
        if not s.serving_max_batch or s.slo_ttft_ms is None:
            return False
        return s.serving_max_batch - s.serving_running <= s.serving_arrival_rate_rps * FILL_LEAD_FRACTION * s.slo_ttft_ms / 1000.0


def make_policy(
    name: str, quantum_ms: float = DEFAULT_QUANTUM_MS, guard_fraction: float = DEFAULT_GUARD_FRACTION, static_share: float = DEFAULT_STATIC_SHARE
):
    if name == "serving_only":
        return ServingOnly()
    if name == "naive_share":
        return NaiveShare()
    if name == "static_partition":
        return StaticPartition(static_share, DEFAULT_STATIC_PERIOD_MS, quantum_ms)
    if name == "rose":
        return Rose(quantum_ms, guard_fraction)
    raise ValueError(f"unknown co-serving policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
