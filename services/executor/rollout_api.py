"""Rollout generation over the bus: one `GenerateRequest` per turn, admitted only under the lease.

Each turn runs in an `executor.rollout` span (a child of the bus's `reply` span, so it sits in
the rollout task's trace) that says how the turn ended and what it produced, and splits its time
(milliseconds, so a dashboard can stack them): `rose.admit_ms` (lease and request checks until
the engine took it), `rose.queue_ms` (engine queue until first scheduled, which includes waiting
for the lease's KV and batch slots), `rose.prefill_ms` (scheduled to first token), `rose.decode_ms`
(first token to the last), with `rose.ttft_ms`, `rose.total_ms` and `rose.preemptions`.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rose.contracts.executor import GenerateReply, GenerateRequest, GenerateTimings, RejectReason
from rose.shared.bus import Delivery
from rose.shared.tracing import tracer

from .backend import CoServingEngine
from .leases import LeaseGuard
from .protocol import EngineSampling, GenerationRequest, InvalidRequest, RolloutRejected, WorkClass
from .telemetry import Telemetry


class RolloutApi:
    def __init__(self, engine: CoServingEngine, guard: LeaseGuard, executor_id: str, telemetry: Telemetry | None = None) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.guard = guard
        self.executor_id = executor_id
        self.inflight: dict[str, object] = {}  # request id -> engine handle
        self.interrupted: dict[str, RejectReason] = {}  # request id -> why
        self.owners: dict[str, tuple[str, int]] = {}  # request id -> (trajectory id, turn index): who may abort it
        self.aborted: set[str] = set()  # request ids their worker aborted (a hedge's slower copy)
        guard.on_revoke.append(self.interrupt_all)

    def interrupt_all(self, reason: RejectReason) -> None:
        """The lease is gone: stop in-flight turns now; each replies with its tokens so far."""
        for request_id, handle in list(self.inflight.items()):
            self.interrupted[request_id] = reason
            handle.cancel()  # type: ignore[attr-defined]

    def _rejected(self, request: GenerateRequest, reason: RejectReason, detail: str) -> GenerateReply:
        return GenerateReply(
            request_id=request.request_id,
            executor_id=self.executor_id,
            status="rejected",
            reject_reason=reason,
            error=detail,
        )

    def abort(self, request: GenerateRequest) -> GenerateReply:
        """Stop one in-flight turn of the same trajectory and turn (its worker no longer wants it: another copy
        won), so that it frees its slot now. The aborted turn answers its own request as "failed" with its tokens."""
        target = request.abort_request_id
        found = self.owners.get(target) == (request.trajectory_id, request.turn_index) and target in self.inflight
        if found:
            self.aborted.add(target)
            self.inflight[target].cancel()  # type: ignore[attr-defined]
        return GenerateReply(
            request_id=request.request_id,
            executor_id=self.executor_id,
            status="ok" if found else "failed",
            finish_reason="abort",
            error="" if found else f"no turn {target!r} of {request.trajectory_id} turn {request.turn_index} in flight here",
        )

    async def generate(self, request: GenerateRequest, _delivery: Delivery) -> GenerateReply:
        if request.abort_request_id:
            return self.abort(request)
        attributes: dict[str, AttributeValue] = {
            "rose.executor_id": self.executor_id,
            "rose.trajectory_id": request.trajectory_id or "",
            "rose.turn_index": request.turn_index,
            "rose.lease_id": request.lease_id or "",
            "rose.lease_epoch": request.lease_epoch,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        }
        with tracer().start_as_current_span("executor.rollout", attributes=attributes) as span:
            reply = await self._generate(request, time.perf_counter())
            outcome = "ok" if reply.status == "ok" else ("interrupted" if reply.token_ids else "rejected")
            span.set_attributes(
                {
                    "rose.outcome": outcome,
                    "rose.reject_reason": reply.reject_reason or "",
                    "gen_ai.usage.output_tokens": len(reply.token_ids),
                    "rose.policy_version": reply.policy_version,
                    "rose.prefix_cached_tokens": reply.prefix_cached_tokens,
                    "rose.finish_reason": reply.finish_reason or "",
                }
            )
            if self.telemetry is not None:
                self.telemetry.rollout_answered(outcome, reply.reject_reason or "")
            return reply

    async def _generate(self, request: GenerateRequest, started: float) -> GenerateReply:
        refused = self.guard.admission_error(request)
        if refused is not None:
            return self._rejected(request, *refused)
        if self.engine.policy_version < request.min_policy_version:
            return self._rejected(
                request, "overloaded", f"policy version {self.engine.policy_version} is older than the requested {request.min_policy_version}"
            )
        engine_request = GenerationRequest(
            request_id=request.request_id,
            work_class=WorkClass.ROLLOUT,
            prompt_token_ids=tuple(request.prompt_token_ids),
            sampling=EngineSampling.from_wire(request.sampling),
            trajectory_id=request.trajectory_id,
            stream=False,
        )
        try:
            handle = self.engine.submit(engine_request)
        except RolloutRejected as exc:
            return self._rejected(request, exc.reason, str(exc))
        except InvalidRequest as exc:
            return self._rejected(request, "invalid", str(exc))
        self.inflight[request.request_id] = handle
        self.owners[request.request_id] = (request.trajectory_id, request.turn_index)
        admit_ms = (time.perf_counter() - started) * 1000.0
        try:
            result = await handle.result()
        except InvalidRequest as exc:  # refused by a backend server after admission (its model disagrees with ours)
            return self._rejected(request, "invalid", str(exc))
        finally:
            self.inflight.pop(request.request_id, None)
            self.owners.pop(request.request_id, None)
            why = self.interrupted.pop(request.request_id, None)
            aborted = request.request_id in self.aborted
            self.aborted.discard(request.request_id)
        t = result.timings
        _split_turn(admit_ms, t)
        # an interrupted turn is refused with what it produced, to be resumed elsewhere by recompute
        interrupted = why is not None and result.finish_reason == "abort"
        dropped = aborted and not interrupted and result.finish_reason == "abort"  # its worker took another copy's result
        return GenerateReply(
            request_id=request.request_id,
            executor_id=self.executor_id,
            status="rejected" if interrupted else "failed" if dropped else "ok",
            reject_reason=why if interrupted else None,
            error=f"interrupted after {len(result.token_ids)} tokens: {why}"
            if interrupted
            else f"aborted by its worker after {len(result.token_ids)} tokens"
            if dropped
            else "",
            token_ids=list(result.token_ids),
            logprobs=list(result.logprobs),
            finish_reason=result.finish_reason,
            policy_version=result.policy_version,
            token_versions=list(result.token_versions),
            prefix_cached_tokens=result.prefix_cached_tokens,
            timings=GenerateTimings(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, total_ms=t.total_ms, preemptions=t.preemptions),
        )


def _split_turn(admit_ms: float, t) -> None:
    """Where the turn's time went, on the current `executor.rollout` span.

    The three parts add up to `rose.total_ms` exactly, so a dashboard can stack them: the
    instants are clamped into order (a turn with no token yet has ttft 0, a preempted one may
    have been scheduled after its first token), never counted twice.
    """
    queued = min(max(t.queue_ms, 0.0), t.total_ms)
    first_token = min(max(t.ttft_ms, queued), t.total_ms)
    trace.get_current_span().set_attributes(
        {
            "rose.admit_ms": admit_ms,
            "rose.queue_ms": queued,
            "rose.prefill_ms": first_token - queued,
            "rose.decode_ms": t.total_ms - first_token,
            "rose.ttft_ms": t.ttft_ms,
            "rose.total_ms": t.total_ms,
            "rose.preemptions": t.preemptions,
        }
    )
