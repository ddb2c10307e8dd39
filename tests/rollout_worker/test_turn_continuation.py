"""A turn across real executors on the bus: continued after a revoke, and hedged at placement.

Two real engines (the executor's `Engine` behind its `LeaseGuard` and `RolloutApi`, served on the
test bus as `services/executor/main.py` serves them), one standing in for a serving executor under
a lease from the leases KV bucket, one dedicated; the scheduler is a stand-in that answers routes.

- Revoke mid-turn (the lease's KV entry goes to "revoked", as the scheduler writes it): the serving
  executor replies with the tokens it had; the worker continues on the dedicated executor from the
  prompt plus those tokens and generates only the rest. Greedy sampling makes the check exact: the
  continued turn is the turn the dedicated executor generates uninterrupted, logprobs aligned, and
  each token keeps the version that produced it.
- Revoked on a burst (`Lease.park_until`): the turn is parked (no compute, KV kept) and a new one is
  refused; the next lease resumes it in place; a park that runs out interrupts it, as above.
- A route that carries a hedge (`TurnRoute.hedge_executor`): the copy on the dedicated executor wins
  while the serving executor's rollout is held, and the other copy is aborted there: the held engine
  no longer has the turn (its queue and batch are empty while still paused).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rose.contracts.executor import GenerateReply, GenerateRequest, SamplingParams
from rose.contracts.lease import Lease
from rose.contracts.registry import GENERATE, LEASE, ROUTE_TURN
from rose.contracts.rollout import RolloutTask, TurnRoute, TurnRouteRequest
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.leases import DEDICATED_LEASE_ID, LeaseGuard
from rose.services.executor.rollout_api import RolloutApi
from rose.shared.models import load_model, load_tokenizer
from rose.shared.turns.runner import TurnRunner, TurnSpec
from rose.shared.turns.settings import TurnSettings
from rose.testing.polling import until, within

MIB = 1 << 20
CONFIG = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0)
SERVING, DEDICATED = "tc-serving", "tc-dedicated"
DEDICATED_VERSION = 4  # the dedicated executor runs a newer version (the same weights): tokens must say which produced them
TURN_TOKENS = 48
HEDGE_AFTER_S = 0.3
SETTINGS = TurnSettings(temperature=0.0, hedge=False, retry_backoff_s=0.05, generate_timeout_s=30.0)


class Executor:
    """One real executor's rollout side on the bus; every reply it sent is kept."""

    def __init__(self, models_dir, executor_id: str, dedicated: bool) -> None:
        self.engine = Engine(
            load_model(models_dir / "serving"),
            load_tokenizer(models_dir / "serving"),
            load_model(models_dir / "policy"),
            load_tokenizer(models_dir / "policy"),
            CONFIG,
            "rose",
        )
        self.guard = LeaseGuard(self.engine, executor_id, dedicated=dedicated, rollout_kv_bytes=CONFIG.rollout_kv_bytes)
        self.api = RolloutApi(self.engine, self.guard, executor_id)
        self.executor_id = executor_id
        self.requests: list[GenerateRequest] = []
        self.replies: list[GenerateReply] = []

    async def start(self, bus) -> None:
        self.engine.start()
        await self.guard.start(bus)

        async def generate(req: GenerateRequest, d):
            self.requests.append(req)
            reply = await self.api.generate(req, d)
            self.replies.append(reply)
            return reply

        await bus.serve(GENERATE, generate, executor_id=self.executor_id)

    async def stop(self) -> None:
        await self.engine.stop()  # as tests/executor/conftest.py's make_engine stops its engines


@pytest.fixture
async def executors(bus, models_dir):
    serving, dedicated = Executor(models_dir, SERVING, False), Executor(models_dir, DEDICATED, True)
    await serving.start(bus)
    await dedicated.start(bus)
    pause = await asyncio.wrap_future(dedicated.engine.apply_policy_weights(dedicated.engine.policy_state_dict(), DEDICATED_VERSION))
    assert pause >= 0 and dedicated.engine.policy_version == DEDICATED_VERSION
    yield serving, dedicated
    await serving.stop()
    await dedicated.stop()


def _lease(state: str) -> Lease:
    now = time.time()
    return Lease(
        lease_id="tc-lease",
        executor_id=SERVING,
        epoch=1,
        state=state,
        granted_at=now,
        expires_at=now + 120.0,  # type: ignore[arg-type]
        kv_bytes=CONFIG.rollout_kv_bytes,
        compute_share=1.0,
        max_rollout_batch=8,
    )


async def _grant(bus, serving: Executor) -> None:
    await bus.kv_put(LEASE, _lease("active"), executor_id=SERVING)
    await until(lambda: serving.guard.current is not None, 10, "the serving executor seeing its lease", step=0.02)


async def _scheduler(bus, hedge: str = "", seen: list[TurnRouteRequest] | None = None) -> None:
    """Routes to the serving executor under its lease, else (or for a hedge) to the dedicated one. `hedge`:
    "placed": the route names the dedicated executor to hedge on at once; "after": the route says the turn
    is late after HEDGE_AFTER_S (the worker then asks for a hedge)."""

    async def route(req: TurnRouteRequest, _d):
        if seen is not None:
            seen.append(req)
        base = dict(trajectory_id=req.trajectory_id, turn_index=req.turn_index)
        if SERVING not in req.exclude and not req.hedge:
            extra = {"placed": dict(hedge_executor=DEDICATED, hedge_lease_id=DEDICATED_LEASE_ID), "after": dict(hedge_after_s=HEDGE_AFTER_S)}.get(
                hedge, {}
            )
            return TurnRoute(**base, executor_id=SERVING, lease_id="tc-lease", lease_epoch=1, role="serving", **extra)
        return TurnRoute(**base, executor_id=DEDICATED, lease_id=DEDICATED_LEASE_ID, role="dedicated")

    await bus.serve(ROUTE_TURN, route)


def _spec(trajectory: str, prompt: list[int]) -> TurnSpec:
    task = RolloutTask(task_id=trajectory, env="conversation", prompt="hi", group_id="g", group_size=1, batch_id="tc-s3", batch_size=64)
    return TurnSpec(task, trajectory, 0, prompt, "", TURN_TOKENS, [], 7)


async def _full_length_reference(bus, ex: Executor) -> tuple[list[int], GenerateReply]:
    """A prompt whose greedy turn runs to max_tokens on the dedicated executor (no early end of text), and that turn."""
    for first in range(20, 400, 37):
        prompt = [first, first + 1, first + 2, first + 3]
        req = GenerateRequest(
            request_id=f"tc-ref-{first}",
            trajectory_id=f"tc-ref-{first}",
            turn_index=0,
            prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS),
            lease_id=DEDICATED_LEASE_ID,
        )
        reply = await bus.request(GENERATE, req, timeout=30.0, executor_id=DEDICATED)
        if reply.status == "ok" and len(reply.token_ids) == TURN_TOKENS:
            return prompt, reply
    raise AssertionError("no prompt ran to max_tokens")


async def test_revoked_turn_continues_elsewhere_from_its_tokens(bus, executors):
    serving, dedicated = executors
    prompt, reference = await _full_length_reference(bus, dedicated)
    await _scheduler(bus)
    await _grant(bus, serving)
    runner = TurnRunner(bus, SETTINGS)
    serving.engine.stats()  # start the engine's token count from here
    turn = asyncio.ensure_future(runner.run(_spec("tc-revoke", prompt)))
    await _tokens_on(serving, 3, turn)  # a few tokens on the serving executor, then the scheduler revokes its lease
    await bus.kv_put(LEASE, _lease("revoked"), executor_id=SERVING)
    record = await asyncio.wait_for(turn, timeout=60.0)

    cut = serving.replies[-1]
    k = len(cut.token_ids)
    assert cut.status == "rejected" and cut.reject_reason == "lease_revoked" and 3 <= k < TURN_TOKENS, (cut.status, k)
    resumed = dedicated.requests[-1]
    assert resumed.prompt_token_ids == prompt + cut.token_ids and resumed.sampling.max_tokens == TURN_TOKENS - k  # regenerate nothing
    rest = dedicated.replies[-1]
    assert record.token_ids == cut.token_ids + rest.token_ids and len(record.logprobs) == TURN_TOKENS
    assert record.logprobs == cut.logprobs + rest.logprobs
    # the same turn as one uninterrupted generation (greedy): recompute lost nothing and added nothing
    assert record.token_ids == reference.token_ids
    assert record.logprobs == pytest.approx(reference.logprobs, abs=1e-3)
    assert record.token_policy_versions == [0] * k + [DEDICATED_VERSION] * (TURN_TOKENS - k) and record.policy_version == 0
    assert record.executor_id == DEDICATED and record.attempts == 2 and runner.stats["resumed"] == 1


def _parked(park_until: float) -> Lease:
    """The lease as the scheduler writes it on a burst alert (scheduler/leases.py revoke_for_alert)."""
    return msgspec.structs.replace(_lease("revoked"), reason="burst: test", park_until=park_until)


async def _tokens_on(ex: Executor, at_least: float, turn: asyncio.Future) -> None:
    """Until `ex` has made `at_least` rollout tokens since its last stats() (or the turn is over)."""
    produced = 0.0

    def enough() -> bool:
        nonlocal produced
        s = ex.engine.stats()
        produced += s.rollout_tokens_per_s * s.interval_s
        return produced >= at_least or turn.done()

    await until(enough, 60, f"{at_least:.0f} rollout tokens on {ex.executor_id}", step=0.005)


async def _parked_turn(bus, executors, trajectory: str, park_s: float):
    """A turn on the serving executor; a few tokens in, the scheduler revokes the lease on a burst
    (parked for `park_s` from when the revocation is written: on a slow host the turn takes a while
    to get there). Rollout is held while the revocation lands, so the turn is surely mid-way when it
    does. Returns the turn's task, its runner, its prompt and the uninterrupted reference."""
    serving, dedicated = executors
    prompt, reference = await _full_length_reference(bus, dedicated)
    await _scheduler(bus)
    await _grant(bus, serving)
    runner = TurnRunner(bus, SETTINGS)
    serving.engine.stats()
    turn = asyncio.ensure_future(runner.run(_spec(trajectory, prompt)))
    await _tokens_on(serving, 3, turn)
    await asyncio.wrap_future(serving.engine.control.pause_generation("in_place"))
    try:
        park_until = time.time() + park_s
        await bus.kv_put(LEASE, _parked(park_until), executor_id=SERVING)
        await within(lambda: serving.guard.parked_until is not None, 5, step=0.01)
        assert serving.guard.parked_until == park_until and not turn.done()
    finally:
        serving.engine.control.continue_generation()  # the hold ends; the park alone keeps rollout from running now
    return turn, runner, prompt, reference


async def test_a_burst_revocation_parks_the_turn_and_a_new_lease_resumes_it_in_place(bus, executors):
    """Revoked on a burst (`park_until` ahead): the turn keeps its place and KV but runs no further, a
    new turn naming the lease is refused; the next lease resumes it there: one attempt, nothing recomputed."""
    serving, dedicated = executors
    turn, runner, prompt, reference = await _parked_turn(bus, executors, "tc-park", 60.0)
    serving.engine.stats()
    await asyncio.sleep(0.3)
    parked = serving.engine.stats()
    assert parked.rollout_tokens_per_s * parked.interval_s == 0 and parked.rollout_running == 1 and not turn.done()
    assert parked.rollout_parked  # what the metrics say: resident, computing nothing (a reclaim confirmed)
    refused = await bus.request(GENERATE, _late(prompt), timeout=30.0, executor_id=SERVING)
    assert refused.status == "rejected" and refused.reject_reason == "lease_revoked" and not refused.token_ids
    regrant = msgspec.structs.replace(_lease("active"), lease_id="tc-lease-e2", epoch=2)
    await bus.kv_put(LEASE, regrant, executor_id=SERVING)
    record = await asyncio.wait_for(turn, timeout=60.0)
    assert not serving.engine.stats().rollout_parked
    assert record.executor_id == SERVING and record.attempts == 1 and runner.stats["resumed"] == 0
    assert record.token_ids == reference.token_ids and not any(r.trajectory_id == "tc-park" for r in dedicated.requests)
    assert [r.status for r in serving.replies if r.request_id != "tc-late"] == ["ok"]


def _late(prompt: list[int]) -> GenerateRequest:
    """A new turn naming the revoked lease."""
    return GenerateRequest(
        request_id="tc-late",
        trajectory_id="tc-late",
        turn_index=0,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        lease_id="tc-lease",
        lease_epoch=1,
    )


async def test_a_park_that_runs_out_interrupts_and_the_turn_continues_elsewhere(bus, executors):
    """No new lease before `park_until`: the parked turn is cut there with its tokens and continues on
    the dedicated executor, as after any revocation."""
    serving, _dedicated = executors
    turn, _runner, _prompt, reference = await _parked_turn(bus, executors, "tc-park-out", 2.0)
    record = await asyncio.wait_for(turn, timeout=60.0)
    cut = next(r for r in serving.replies if r.request_id == serving.requests[0].request_id)
    k = len(cut.token_ids)
    assert cut.status == "rejected" and cut.reject_reason == "lease_revoked" and 3 <= k < TURN_TOKENS, (cut.status, k)
    assert record.executor_id == DEDICATED and record.attempts == 2 and record.token_ids == reference.token_ids


@pytest.mark.parametrize("hedge", ["placed", "after"])
async def test_hedge_from_the_route_wins_and_the_other_copy_is_aborted(bus, executors, hedge):
    serving, dedicated = executors
    prompt, reference = await _full_length_reference(bus, dedicated)
    routes: list[TurnRouteRequest] = []
    await _scheduler(bus, hedge=hedge, seen=routes)
    await _grant(bus, serving)
    await asyncio.wrap_future(serving.engine.control.pause_generation("in_place"))  # the leased copy is held: a straggler
    try:
        runner = TurnRunner(bus, msgspec.structs.replace(SETTINGS, hedge=True))  # no typical turn time yet: only the route's hint
        record = await asyncio.wait_for(runner.run(_spec("tc-hedge", prompt)), timeout=60.0)
        assert record.executor_id == DEDICATED and record.token_ids == reference.token_ids
        assert record.token_policy_versions == [DEDICATED_VERSION] * TURN_TOKENS
        assert runner.stats["hedge_wins"] == 1 and runner.stats["placed_hedges"] == (hedge == "placed")
        # the batch travels with every route request (the scheduler's tail rule); "after": one hedge request, once late
        assert all(r.batch_id == "tc-s3" and r.batch_size == 64 for r in routes)
        asked = [r for r in routes if r.hedge]
        assert len(asked) == (hedge == "after") and all(r.exclude == [SERVING] and r.elapsed_s >= HEDGE_AFTER_S * 0.9 for r in asked)
        # both copies started at once from the same prompt
        primary = next(r for r in serving.requests if r.trajectory_id == "tc-hedge" and not r.abort_request_id)
        hedge = next(r for r in dedicated.requests if r.trajectory_id == "tc-hedge")
        assert primary.prompt_token_ids == hedge.prompt_token_ids == prompt
        # the held copy was aborted on its executor: it answered "failed" and the engine no longer holds the turn
        dropped = await until(
            lambda: next((r for r in serving.replies if r.request_id == primary.request_id), None), 10, "the held copy's reply", step=0.02
        )
        assert dropped.status == "failed" and dropped.finish_reason == "abort" and "aborted by its worker" in dropped.error
        assert serving.engine.control.paused == "in_place"
        stats = serving.engine.stats()
        assert stats.rollout_running == 0 and stats.rollout_queue == 0
        assert runner.stats["aborted"] == 1
    finally:
        serving.engine.control.continue_generation()
