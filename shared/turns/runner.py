"""One turn, routed on its own: ask the scheduler where, generate there, retry elsewhere.

- a refusal (no lease, stale epoch, revoked, overloaded) or a failure (timeout, no
  responders: the executor died) excludes that executor and asks for a new route;
- an interrupted turn (the executor lost its lease mid-turn and returned the tokens so far)
  resumes elsewhere by recompute: its tokens are appended to the prompt and only the rest
  is generated, so nothing produced is lost or produced twice (unless `resume_interrupted` is
  off: then the turn starts over, as under an elastic baseline's whole-job preemption);
- a straggler gets a duplicate on another executor: at once when the scheduler's route says so
  (`TurnRoute.hedge_executor`: predicted late where it is placed), or when the worker sees it run
  past the time the route predicted (`TurnRoute.hedge_after_s`), else past the typical turn time,
  and the scheduler agrees (refused, a turn on leased capacity asks again as its age doubles:
  `hedge_ask_again_after`); the first complete result wins and the
  other copy is aborted on its executor (`GenerateRequest.abort_request_id`), freeing its slot;
- every token keeps the policy version that produced it (`TurnRecord.token_policy_versions`):
  a turn continued elsewhere, or on a newer version, mixes versions.

Each turn is a `rollout.turn` span; its route and generate requests (and so the scheduler's
and each executor's spans) are its children.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rose.contracts.executor import GenerateReply, GenerateRequest, SamplingParams
from rose.contracts.registry import GENERATE, ROUTE_TURN
from rose.contracts.rollout import RolloutTask, TurnRecord, TurnRoute, TurnRouteRequest
from rose.shared.bus import Bus
from rose.shared.errors import RoseError
from rose.shared.tracing import tracer

from .hedging import hedge_ask_again_after
from .settings import TurnSettings

log = logging.getLogger(__name__)

TYPICAL_WINDOW = 64  # recent turn durations behind the "typical turn time"


class TurnFailed(RoseError, RuntimeError):
    """No executor completed the turn before its deadline."""


@dataclass
class TurnSpec:
    task: RolloutTask
    trajectory_id: str
    turn_index: int
    prompt_token_ids: list[int]
    previous_executor: str
    max_tokens: int
    stop_token_ids: list[int]
    seed: int


@dataclass
class Attempt:
    executor_id: str
    reply: GenerateReply | None = None
    error: str = ""


@dataclass
class Progress:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempts: int = 0
    prefix_cached: int = -1  # of the attempt that completed the turn
    executor_id: str = ""
    lease_wait_s: float = 0.0  # waiting for an executor that may take the turn (no route: no lease, no free dedicated one)
    route_s: float = 0.0  # in the scheduler's route requests


class TurnRunner:
    def __init__(self, bus: Bus, settings: TurnSettings) -> None:
        self.bus, self.s = bus, settings
        self.durations: deque[float] = deque(maxlen=TYPICAL_WINDOW)
        self.stats = {
            "turns": 0,
            "refused": 0,
            "failed": 0,
            "resumed": 0,
            "discarded_tokens": 0,
            "hedges": 0,
            "hedge_wins": 0,
            "placed_hedges": 0,
            "aborted": 0,
        }
        self._aborts: set[asyncio.Task] = set()  # aborts of losing copies in flight (kept referenced until done)

    def typical(self) -> float:
        return statistics.median(self.durations) if len(self.durations) >= 4 else 0.0

    async def _route(self, spec: TurnSpec, progress: Progress, exclude: list[str], **hedge) -> TurnRoute | None:
        req = TurnRouteRequest(
            trajectory_id=spec.trajectory_id,
            turn_index=spec.turn_index,
            prompt_tokens=len(spec.prompt_token_ids) + len(progress.tokens),
            previous_executor=progress.executor_id or spec.previous_executor,
            task_id=spec.task.task_id,
            group_id=spec.task.group_id,
            group_size=spec.task.group_size,
            routing=spec.task.routing,
            exclude=list(exclude),
            batch_id=spec.task.batch_id,
            batch_size=spec.task.batch_size,
            **hedge,
        )
        try:
            return await self.bus.request(ROUTE_TURN, req, timeout=self.s.route_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # scheduler restarting or the bus reconnecting
            log.info("route request failed: %r", exc)
            return None

    def _request_id(self, spec: TurnSpec, tag: str) -> str:
        return f"{spec.trajectory_id}-t{spec.turn_index}-{tag}"

    def _abort_later(self, spec: TurnSpec, prompt: list[int], executor_id: str, tag: str) -> None:
        """Tell an executor to stop the copy of this turn it still runs (another copy won), without waiting;
        best effort: a lost abort only costs that executor the rest of the copy, whose reply is ignored."""
        request = GenerateRequest(
            request_id=self._request_id(spec, f"{tag}x"),
            trajectory_id=spec.trajectory_id,
            turn_index=spec.turn_index,
            prompt_token_ids=prompt,
            task_id=spec.task.task_id,
            abort_request_id=self._request_id(spec, tag),
        )
        task = asyncio.ensure_future(self._abort(request, executor_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, request: GenerateRequest, executor_id: str) -> None:
        try:
            reply = await self.bus.request(GENERATE, request, timeout=self.s.route_timeout_s, executor_id=executor_id)
            self.stats["aborted"] += reply.status == "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the executor is gone or slow: nothing left to stop there
            log.info("abort of %s on %s failed: %r", request.abort_request_id, executor_id, exc)

    async def _generate(self, spec: TurnSpec, progress: Progress, route: TurnRoute, tag: str) -> Attempt:
        remaining = spec.max_tokens - len(progress.tokens)
        request = GenerateRequest(
            request_id=self._request_id(spec, tag),
            trajectory_id=spec.trajectory_id,
            turn_index=spec.turn_index,
            prompt_token_ids=spec.prompt_token_ids + progress.tokens,
            sampling=SamplingParams(
                temperature=self.s.temperature, max_tokens=remaining, stop_token_ids=spec.stop_token_ids, seed=spec.seed + len(progress.tokens)
            ),
            task_id=spec.task.task_id,
            lease_id=route.lease_id,
            lease_epoch=route.lease_epoch,
        )
        try:
            reply = await self.bus.request(GENERATE, request, timeout=self.s.generate_timeout_s, executor_id=route.executor_id)
            return Attempt(route.executor_id, reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no responders (executor gone), timeout, reconnecting
            return Attempt(route.executor_id, error=repr(exc))

    async def _attempt_with_hedge(self, spec: TurnSpec, progress: Progress, route: TurnRoute, n: int) -> Attempt:
        """Run one attempt; with a duplicate at once if the route says so, or later if it straggles; first success wins."""
        started = time.monotonic()
        primary = asyncio.ensure_future(self._generate(spec, progress, route, f"a{n}"))
        if self.s.hedge and route.hedge_executor and route.hedge_executor != route.executor_id:
            placed = TurnRoute(
                trajectory_id=route.trajectory_id,
                turn_index=route.turn_index,
                executor_id=route.hedge_executor,
                lease_id=route.hedge_lease_id,
                lease_epoch=route.hedge_lease_epoch,
                role="dedicated",
                reason="hedge placed with the route",
            )
            self.stats["placed_hedges"] += 1
            return await self._first_of(spec, progress, primary, (route.executor_id, f"a{n}"), placed, n)
        typical = self.typical()
        leased = route.role != "dedicated"
        if not self.s.hedge or (typical <= 0 and route.hedge_after_s <= 0 and not leased):
            return await primary
        # late: past the time the scheduler predicted for this turn where it placed it, else past the typical turn time
        # (a leased turn with neither, early in a run: at hedge_min_s, since a burst may park it for seconds)
        wait_s = route.hedge_after_s if route.hedge_after_s > 0 else max(self.s.hedge_min_s, self.s.hedge_factor * typical)
        while True:
            done, _ = await asyncio.wait({primary}, timeout=wait_s)
            if done:
                return primary.result()
            elapsed = time.monotonic() - started
            typical = self.typical()  # as of now: early in a run, other turns may have finished since this one began
            hedge_route = await self._route(spec, progress, [route.executor_id], hedge=True, elapsed_s=elapsed, typical_turn_s=typical)
            if hedge_route is not None and hedge_route.executor_id:
                return await self._first_of(spec, progress, primary, (route.executor_id, f"a{n}"), hedge_route, n)
            if not leased or hedge_route is None:  # on a dedicated executor nothing stops a turn but its length
                return await primary
            wait_s = hedge_ask_again_after(elapsed)

    async def _first_of(
        self, spec: TurnSpec, progress: Progress, primary: asyncio.Future, primary_at: tuple[str, str], hedge_route: TurnRoute, n: int
    ) -> Attempt:
        """The primary and a duplicate on `hedge_route` race from the same prefix: the first complete result
        wins and the other copy is aborted on its executor. If neither completes, the failed attempt with the
        most tokens is returned, so that an interrupted copy's tokens still continue the turn."""
        self.stats["hedges"] += 1
        secondary = asyncio.ensure_future(self._generate(spec, progress, hedge_route, f"a{n}h"))
        where = {primary: primary_at, secondary: (hedge_route.executor_id, f"a{n}h")}
        pending = {primary, secondary}
        bad: list[Attempt] = []
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                attempt = task.result()
                if attempt.reply is not None and attempt.reply.status == "ok":
                    for other in pending:
                        other.cancel()  # its reply is no longer awaited; the executor is told to stop it
                        self._abort_later(spec, spec.prompt_token_ids + progress.tokens, *where[other])
                    if task is secondary:
                        self.stats["hedge_wins"] += 1
                    return attempt
                bad.append(attempt)
        return max(bad, key=lambda a: len(a.reply.token_ids) if a.reply is not None else -1)

    async def run(self, spec: TurnSpec) -> TurnRecord:
        """Complete the turn somewhere, or raise TurnFailed at the deadline (in a `rollout.turn` span)."""
        attributes: dict[str, AttributeValue] = {
            "rose.task_id": spec.task.task_id,
            "rose.trajectory_id": spec.trajectory_id,
            "rose.turn_index": spec.turn_index,
            "gen_ai.usage.input_tokens": len(spec.prompt_token_ids),
        }
        with tracer().start_as_current_span("rollout.turn", attributes=attributes) as span:
            record = await self._run(spec)
            span.set_attributes(
                {
                    "rose.executor_id": record.executor_id,
                    "rose.attempts": record.attempts,
                    "gen_ai.usage.output_tokens": len(record.token_ids),
                    "rose.policy_version": record.policy_version,
                    "rose.prefix_cached_tokens": record.prefix_cached_tokens,
                    "rose.finish_reason": record.finish_reason,
                }
            )
            return record

    async def _run(self, spec: TurnSpec) -> TurnRecord:
        started_at, t0 = time.time(), time.monotonic()
        progress = Progress()
        exclude: list[str] = []
        while True:
            if time.monotonic() - t0 > self.s.turn_deadline_s:
                raise TurnFailed(f"turn {spec.turn_index} of {spec.trajectory_id} found no executor in {self.s.turn_deadline_s:.0f}s")
            asked = time.monotonic()
            route = await self._route(spec, progress, exclude)
            progress.route_s += time.monotonic() - asked
            if route is None or not route.executor_id:
                exclude.clear()  # leases change: everyone is a candidate again
                waited = time.monotonic()
                await asyncio.sleep(route.retry_after_s if route and route.retry_after_s else self.s.retry_backoff_s)
                progress.lease_wait_s += time.monotonic() - waited
                continue
            progress.attempts += 1
            attempt = await self._attempt_with_hedge(spec, progress, route, progress.attempts)
            reply = attempt.reply
            if reply is None:
                self.stats["failed"] += 1
                exclude.append(attempt.executor_id)
                await asyncio.sleep(self.s.retry_backoff_s)
                continue
            if reply.token_ids and reply.status != "ok" and not self.s.resume_interrupted:  # preempted: its work is lost
                self.stats["discarded_tokens"] += len(reply.token_ids)
                reply = msgspec.structs.replace(reply, token_ids=[], logprobs=[])
            if reply.token_ids and reply.status != "ok":  # interrupted: keep its tokens, recompute the rest elsewhere
                self.stats["resumed"] += 1
            progress.tokens += reply.token_ids
            progress.logprobs += reply.logprobs
            same = len(reply.token_versions) == len(reply.token_ids)  # older executors send the last token's only
            progress.versions += list(reply.token_versions) if same else [reply.policy_version] * len(reply.token_ids)
            if reply.status == "ok" or len(progress.tokens) >= spec.max_tokens:
                progress.prefix_cached = reply.prefix_cached_tokens if progress.prefix_cached < 0 else progress.prefix_cached
                progress.executor_id = reply.executor_id
                break
            self.stats["refused" if reply.status == "rejected" else "failed"] += 1
            if progress.prefix_cached < 0:
                progress.prefix_cached = 0  # the first attempt did not complete: count no hit
            exclude.append(attempt.executor_id)
            progress.executor_id = ""
        self.durations.append(time.monotonic() - t0)
        self.stats["turns"] += 1
        # where the turn's time went before an executor ran it (the executor's span splits the rest: queue, prefill, decode)
        trace.get_current_span().set_attributes({"rose.lease_wait_ms": progress.lease_wait_s * 1e3, "rose.route_ms": progress.route_s * 1e3})
        return TurnRecord(
            turn_index=spec.turn_index,
            prompt_token_ids=spec.prompt_token_ids,
            token_ids=progress.tokens,
            logprobs=progress.logprobs,
            policy_version=min(progress.versions, default=0),
            token_policy_versions=progress.versions,
            executor_id=progress.executor_id,
            finish_reason=reply.finish_reason or "",
            prefix_cached_tokens=progress.prefix_cached,
            attempts=progress.attempts,
            started_at=started_at,
            finished_at=time.time(),
        )
