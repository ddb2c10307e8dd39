"""The worker's turn logic against stand-in executors and a stand-in scheduler on the real bus:
retry elsewhere on refusal, resume an interrupted turn by recompute, hedge a straggler (first wins)."""

from __future__ import annotations

import asyncio

from rose.contracts.executor import GenerateReply, GenerateRequest
from rose.contracts.registry import GENERATE, ROUTE_TURN
from rose.contracts.rollout import RolloutTask, TurnRoute, TurnRouteRequest
from rose.shared.turns.runner import TurnRunner, TurnSpec
from rose.shared.turns.settings import TurnSettings
from rose.testing.polling import until

SETTINGS = TurnSettings(hedge_min_s=0.3, hedge_factor=1.5, generate_timeout_s=20.0, retry_backoff_s=0.05)


def spec(trajectory: str, max_tokens: int = 6) -> TurnSpec:
    task = RolloutTask(task_id=trajectory, env="conversation", prompt="hi", group_id="g", group_size=4)
    return TurnSpec(task, trajectory, 1, [10, 11, 12], "", max_tokens, [], 7)


async def _stand_in_scheduler(bus, plan: dict[str, list[str]], seen: list[TurnRouteRequest]):
    async def route(req: TurnRouteRequest, _d):
        seen.append(req)
        for ex in plan["routes"]:
            if ex not in req.exclude:
                return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id=ex, lease_id=f"{ex}-e1", lease_epoch=1)
        return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, retry_after_s=0.05)

    await bus.serve(ROUTE_TURN, route)


def _ok(req: GenerateRequest, ex: str, tokens: list[int], status: str = "ok", **kw) -> GenerateReply:
    return GenerateReply(
        request_id=req.request_id, executor_id=ex, status=status, token_ids=tokens, logprobs=[-0.5] * len(tokens), policy_version=3, **kw
    )  # type: ignore[arg-type]


async def test_refusal_interrupt_and_hedge(bus):
    seen_routes: list[TurnRouteRequest] = []
    received: dict[str, list[GenerateRequest]] = {"tw-refuse": [], "tw-cut": [], "tw-fast": [], "tw-slow": []}
    plan = {"routes": ["tw-refuse", "tw-cut", "tw-fast"]}
    await _stand_in_scheduler(bus, plan, seen_routes)

    async def refuse(req, _d):
        received["tw-refuse"].append(req)
        return GenerateReply(request_id=req.request_id, executor_id="tw-refuse", status="rejected", reject_reason="stale_lease_epoch")

    async def cut(req, _d):  # loses its lease after 2 tokens
        received["tw-cut"].append(req)
        return _ok(req, "tw-cut", [101, 102], status="rejected", reject_reason="lease_revoked", finish_reason="abort")

    async def fast(req, _d):
        received["tw-fast"].append(req)
        return _ok(req, "tw-fast", list(range(200, 200 + req.sampling.max_tokens)), finish_reason="length", prefix_cached_tokens=3)

    async def slow(req, _d):
        received["tw-slow"].append(req)
        await asyncio.sleep(3.0)
        return _ok(req, "tw-slow", [9] * req.sampling.max_tokens, finish_reason="length")

    for ex, handler in (("tw-refuse", refuse), ("tw-cut", cut), ("tw-fast", fast), ("tw-slow", slow)):
        await bus.serve(GENERATE, handler, executor_id=ex)

    runner = TurnRunner(bus, SETTINGS)
    record = await runner.run(spec("traj-tw-1"))
    # refused -> excluded; interrupted after 2 tokens -> resumed on tw-fast with those tokens in the prompt
    assert [r.exclude for r in seen_routes[:3]] == [[], ["tw-refuse"], ["tw-refuse", "tw-cut"]]
    resumed = received["tw-fast"][0]
    assert resumed.prompt_token_ids == [10, 11, 12, 101, 102] and resumed.sampling.max_tokens == 4
    assert record.token_ids == [101, 102, 200, 201, 202, 203] and len(record.logprobs) == 6
    assert (
        record.executor_id == "tw-fast" and record.attempts == 3 and runner.stats["resumed"] == 1 and runner.stats["refused"] == 2
    )  # the interrupted reply is a refusal too

    # a straggler: the primary (tw-slow) hangs past 1.5 x the typical turn time; the hedge on tw-fast wins
    for _ in range(4):
        runner.durations.append(0.1)
    seen_routes.clear()
    plan["routes"] = ["tw-slow", "tw-fast"]
    record = await asyncio.wait_for(runner.run(spec("traj-tw-2", max_tokens=3)), timeout=30.0)
    assert record.executor_id == "tw-fast" and record.token_ids == [200, 201, 202]
    assert len(received["tw-slow"]) == 1 and runner.stats["hedges"] == 1 and runner.stats["hedge_wins"] == 1
    hedge = [r for r in seen_routes if r.hedge]
    assert len(hedge) == 1 and hedge[0].exclude == ["tw-slow"] and hedge[0].typical_turn_s > 0 and hedge[0].elapsed_s >= SETTINGS.hedge_min_s * 0.9


async def test_redelivered_task_resumes_from_its_checkpoints(bus, models_dir):
    """At least once, idempotent by (task id, turn index): checkpointed turns are not generated again."""
    from rose.contracts.registry import TRAJECTORY, TURN_CHECKPOINT
    from rose.contracts.rollout import TurnCheckpoint
    from rose.services.rollout_worker.episode import EpisodeRunner, trajectory_id_of
    from rose.shared.agentic.envs import ENVIRONMENTS
    from rose.shared.bus import Delivery
    from rose.shared.models import load_tokenizer

    seen: list[TurnRouteRequest] = []
    await _stand_in_scheduler(bus, {"routes": ["ep-fast"]}, seen)
    received: list[GenerateRequest] = []

    async def fast(req, _d):
        received.append(req)
        return _ok(req, "ep-fast", [300 + req.turn_index] * 2, finish_reason="length")

    await bus.serve(GENERATE, fast, executor_id="ep-fast")
    tokenizer = load_tokenizer(models_dir / "policy")
    episodes = EpisodeRunner(bus, TurnRunner(bus, SETTINGS), tokenizer, "w-test", max_tokens=2, max_deliver=5)
    task = RolloutTask(task_id=f"ep-{asyncio.get_running_loop().time():.0f}", env="conversation", prompt="hello", max_turns=3)

    # an earlier delivery got through turn 0 and died: only its checkpoint is left
    first_prompt = episodes.encode(ENVIRONMENTS["conversation"].reset(task))
    from rose.contracts.rollout import TurnRecord

    turn0 = TurnRecord(
        turn_index=0,
        prompt_token_ids=first_prompt,
        token_ids=[42, 43],
        logprobs=[-1.0, -1.0],
        policy_version=1,
        executor_id="ep-old",
        finish_reason="length",
        observation=ENVIRONMENTS["conversation"].step(task, 0, "", "length", []).observation,
    )
    await bus.kv_put(
        TURN_CHECKPOINT, TurnCheckpoint(task_id=task.task_id, trajectory_id=trajectory_id_of(task), turn=turn0), task_id=task.task_id, turn_index="0"
    )

    published: list = []

    async def on_trajectory(t, _d):
        if t.task_id == task.task_id:
            published.append(t)

    await bus.subscribe(TRAJECTORY, on_trajectory)
    await episodes.handle(task, Delivery("test", attempt=2))
    stored = (await bus.js.stream_info(TRAJECTORY.stream.name)).state.messages
    await episodes.handle(task, Delivery("test", attempt=3))  # delivered once more: nothing is generated again
    await asyncio.sleep(0.3)
    assert [r.turn_index for r in received] == [1, 2]  # turn 0 came from its checkpoint, and nothing twice
    assert received[0].prompt_token_ids[: len(first_prompt) + 2] == first_prompt + [42, 43]
    assert len(published) == 2 and all(
        t.status == "completed" and [r.token_ids for r in t.turns] == [[42, 43], [301, 301], [302, 302]] for t in published
    )
    assert published[0].trajectory_id == published[1].trajectory_id
    # core subscribers see both publishes; the durable stream kept one (Nats-Msg-Id de-duplication)
    assert (await bus.js.stream_info(TRAJECTORY.stream.name)).state.messages == stored


async def test_a_parked_leased_turn_asks_for_a_hedge_again_until_granted(bus):
    """A turn on a lease hangs (a burst parked it). The scheduler refuses the first hedge (no dedicated slot free
    yet) and grants the second: the worker asks again once the turn's age has doubled, and the duplicate wins.
    A turn on a dedicated executor asks once."""
    asks: list[TurnRouteRequest] = []
    grant_from = {"traj-pk-1": 2, "traj-pk-2": 2, "traj-pk-3": 1}  # the ask (1-based) the stand-in scheduler first grants

    async def route(req: TurnRouteRequest, _d):
        if not req.hedge:
            role = "dedicated" if req.trajectory_id == "traj-pk-2" else "serving"
            return TurnRoute(
                trajectory_id=req.trajectory_id,
                turn_index=req.turn_index,
                executor_id="pk-parked",
                lease_id="pk-e1",
                lease_epoch=1,
                role=role,
                hedge_after_s=0.0 if req.trajectory_id == "traj-pk-3" else 0.2,  # pk-3: a run's start, no turn size known
            )
        asks.append(req)
        if sum(a.trajectory_id == req.trajectory_id for a in asks) >= grant_from[req.trajectory_id]:
            return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id="pk-free", role="dedicated")
        return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, reason="no dedicated slot free", retry_after_s=0.5)

    await bus.serve(ROUTE_TURN, route)
    released = asyncio.Event()

    async def parked(req, _d):  # holds its turn until the test releases it (the park's end)
        await released.wait()
        return _ok(req, "pk-parked", [9] * req.sampling.max_tokens, finish_reason="length")

    async def free(req, _d):
        return _ok(req, "pk-free", list(range(300, 300 + req.sampling.max_tokens)), finish_reason="length")

    await bus.serve(GENERATE, parked, executor_id="pk-parked")
    await bus.serve(GENERATE, free, executor_id="pk-free")
    runner = TurnRunner(bus, SETTINGS)
    for _ in range(4):
        runner.durations.append(0.1)
    record = await asyncio.wait_for(runner.run(spec("traj-pk-1", max_tokens=3)), timeout=10.0)
    assert record.executor_id == "pk-free" and record.token_ids == [300, 301, 302] and runner.stats["hedge_wins"] == 1
    first, second = asks
    assert first.elapsed_s >= 0.2 and second.elapsed_s >= 2 * first.elapsed_s * 0.95  # asked again at twice the age

    # on a dedicated executor: one refused ask, then the turn waits for its primary
    waiting = asyncio.ensure_future(runner.run(spec("traj-pk-2", max_tokens=3)))

    first_ask = await until(lambda: next((a for a in asks if a.trajectory_id == "traj-pk-2"), None), 10, "its first ask (at the 0.2 s hint)")
    await asyncio.sleep(3 * first_ask.elapsed_s + 0.5)  # past the next doubling of its age, with room to spare
    assert [a.trajectory_id for a in asks].count("traj-pk-2") == 1 and not waiting.done()
    released.set()
    record = await asyncio.wait_for(waiting, timeout=10.0)
    assert record.executor_id == "pk-parked" and record.token_ids == [9, 9, 9]

    # early in a run: no hint from the scheduler and no typical turn yet; a leased turn still asks, at hedge_min_s
    released.clear()  # pk-parked holds turns again
    fresh = TurnRunner(bus, SETTINGS)
    record = await asyncio.wait_for(fresh.run(spec("traj-pk-3", max_tokens=3)), timeout=10.0)
    released.set()
    assert record.executor_id == "pk-free" and fresh.stats["hedge_wins"] == 1
    assert [a.elapsed_s for a in asks if a.trajectory_id == "traj-pk-3"][0] >= SETTINGS.hedge_min_s * 0.95
