"""Rollout end to end on real processes: multi-turn episodes routed turn by turn, under leases and on
the dedicated executor; then chaos (kill -9 the opportunistic executor and the worker mid-rollout,
restart the NATS server) with nothing lost and nothing duplicated. Also: a turn in flight when its
lease is revoked comes back at once with the tokens it made, to be resumed elsewhere by recompute;
and external agents' episodes through the rollout gateway process, which is killed mid-episode."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec

from rose.contracts.executor import GenerateRequest, SamplingParams
from rose.contracts.registry import AGENT_TASK, EPISODE_EVENT, GENERATE, LEASE, ROLLOUT_TASK, SERVICE_REGISTRY
from rose.contracts.rollout import RolloutTask
from rose.shared.task_queue import still_queued
from rose.testing.fleet import DEDICATED, GATEWAY, SERVING
from rose.testing.polling import until, within

TRAJECTORY_TIMEOUT_S = 150.0


async def _publish_tasks(bus, n: int, turns: int, tag: str, routing: str = "affinity", max_tokens: int = 8) -> set[str]:
    ids = set()
    for i in range(n):
        task = RolloutTask(
            task_id=f"{tag}-{i}",
            env="conversation",
            prompt=f"Tell me about item {i}.",
            max_turns=turns,
            group_id=tag,
            group_size=n,
            routing=routing,
            created_at=time.time(),
            env_args={"max_tokens": str(max_tokens)},  # type: ignore[arg-type]
        )
        await bus.publish(ROLLOUT_TASK, task)
        ids.add(task.task_id)
    return ids


def _check_trajectory(t, turns: int, max_tokens: int = 8) -> None:
    assert t.status == "completed", t.reason
    assert [r.turn_index for r in t.turns] == list(range(turns))
    for prev, cur in zip(t.turns, t.turns[1:]):
        # token-in, token-out: each prompt extends the previous prompt and its completion exactly
        assert cur.prompt_token_ids[: len(prev.prompt_token_ids) + len(prev.token_ids)] == prev.prompt_token_ids + prev.token_ids
    for r in t.turns:
        assert r.executor_id in (SERVING, DEDICATED) and 1 <= len(r.token_ids) <= max_tokens and len(r.logprobs) == len(r.token_ids)


async def _active_lease(bus) -> bool:
    """The scheduler lends the idle serving executor to rollout."""
    lease = await bus.kv_get(LEASE, executor_id=SERVING)
    return lease is not None and lease.state == "active"


async def test_multi_turn_episodes_run_on_leased_and_dedicated_executors(fleet):
    await until(lambda: _active_lease(fleet.bus), 30, "a lease on the idle serving executor", step=0.2)
    ids = await _publish_tasks(fleet.bus, 8, 3, f"basic-{uuid.uuid4().hex[:6]}")
    got = await fleet.wait_trajectories(ids, TRAJECTORY_TIMEOUT_S)
    assert set(got) == ids
    for t in got.values():
        _check_trajectory(t, 3)
    executors = {r.executor_id for t in got.values() for r in t.turns}
    assert executors == {SERVING, DEDICATED}, executors  # opportunistic and dedicated both took turns
    later = [r for t in got.values() for r in t.turns[1:]]
    hits = sum(r.prefix_cached_tokens > 0 for r in later)
    assert hits >= len(later) // 2, f"only {hits} of {len(later)} later turns hit the prefix cache"


async def test_revoked_lease_interrupts_the_turn_with_its_tokens(fleet):
    bus = fleet.bus

    async def lasting_lease():
        lease = await bus.kv_get(LEASE, executor_id=SERVING)
        return lease if lease is not None and lease.state == "active" and lease.expires_at > time.time() + 1 else None

    lease = await until(lasting_lease, 30, "an active lease on the serving executor, a second from its expiry or more", step=0.2)
    long_turn = GenerateRequest(
        request_id=f"long-{time.monotonic_ns()}",
        trajectory_id=f"long-{time.monotonic_ns()}",
        turn_index=0,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=SamplingParams(temperature=1.0, max_tokens=1500, seed=1),
        lease_id=lease.lease_id,
        lease_epoch=lease.epoch,
    )
    pending = asyncio.ensure_future(bus.request(GENERATE, long_turn, timeout=60.0, executor_id=SERVING))
    await asyncio.sleep(1.0)
    assert not pending.done(), "the long turn finished before the revocation"
    await bus.kv_put(LEASE, msgspec.structs.replace(lease, state="revoked", reason="test revoke"), executor_id=SERVING)
    reply = await asyncio.wait_for(pending, timeout=10.0)
    assert reply.status == "rejected" and reply.reject_reason == "lease_revoked"
    assert reply.finish_reason == "abort" and 0 < len(reply.token_ids) < 1500 and len(reply.logprobs) == len(reply.token_ids)


async def test_chaos_kill_executor_and_worker_restart_nats_nothing_lost(fleet):
    tag = f"chaos-{uuid.uuid4().hex[:6]}"
    total, turns = 12, 6
    await until(lambda: _active_lease(fleet.bus), 30, "a lease on the idle serving executor", step=0.2)
    # random routing spreads the turns over both executors whatever their load: the placement rules would keep
    # them all on the dedicated one while it has room (its prefix cache), and the kill must meet leased work
    ids = await _publish_tasks(fleet.bus, total, turns, tag, routing="random", max_tokens=16)
    before = len(fleet.trajectories)

    def done() -> int:
        return len({t.task_id for t in fleet.trajectories if t.task_id in ids})

    async def until_done(n: int) -> None:  # or a minute passed: the checks after it say what happened
        await within(lambda: done() >= n, 60)

    def serving_took_a_turn() -> bool:
        return any(r.executor_id == SERVING for t in fleet.trajectories[before:] if t.task_id in ids for r in t.turns)

    # the chaos must meet work on both executors: a finished episode with a turn on the opportunistic one
    assert await within(serving_took_a_turn, 60), "the serving executor took no turn of these tasks in a minute"
    fleet.proc("serving").kill()  # kill -9 the opportunistic executor mid-rollout
    fleet.proc("worker").kill()  # and the worker holding unacked tasks
    assert done() < total, "the chaos came too late: every task had finished"
    fleet.proc("worker").start()
    await until_done(done() + 1)
    assert done() < total
    await asyncio.to_thread(fleet.server.restart)  # the NATS server goes away and comes back (file storage)
    fleet.proc("serving").start()
    got = await fleet.wait_trajectories(ids, TRAJECTORY_TIMEOUT_S)
    late = await still_queued(fleet.bus, ids - set(got))
    if late:  # late, not lost: the work queue still holds them (unacked); on a starved box their redelivery takes longer
        got = await fleet.wait_trajectories(ids, TRAJECTORY_TIMEOUT_S)
    lost = ids - set(got)
    assert lost == set(), f"tasks lost: {sorted(lost)} (still in the task queue: {sorted(await still_queued(fleet.bus, lost))})"
    for t in got.values():
        _check_trajectory(t, turns, max_tokens=16)
    mine = [t for t in fleet.trajectories[before:] if t.task_id in ids]
    assert len(mine) == len({t.trajectory_id for t in mine}), "a trajectory was published twice"


async def test_agents_through_the_gateway_survive_its_kill(fleet):
    """Agent tasks on the real gateway process: kill -9 it once some turns are checkpointed, start it again;
    every episode ends with its four turns, each extending the last token for token, the turns checkpointed
    before the kill answered from their records (the relaunched agent replays them), none published twice."""
    bus, tag = fleet.bus, f"agents-{uuid.uuid4().hex[:6]}"
    ended: list = []

    async def on_event(event, _d):
        if event.kind == "ended":
            ended.append(event)

    await bus.subscribe(EPISODE_EVENT, on_event)
    ids = set()
    for i in range(4):
        task = RolloutTask(task_id=f"{tag}-{i}", env="arithmetic", prompt=f"What is {i}+{i}?", max_turns=6, group_id=tag, group_size=4)
        task.env_args.update({"seed": str(i), "max_tokens": "8"})
        await bus.publish(AGENT_TASK, task, msg_id=task.task_id)
        ids.add(task.task_id)
    before = len(fleet.trajectories)

    async def turns_checkpointed() -> bool:  # some episode has turns checkpointed, none has finished
        beat = await bus.kv_get(SERVICE_REGISTRY, service="gateway", instance=GATEWAY)
        return beat is not None and beat.load.get("turns", 0) >= 3

    await within(turns_checkpointed, 30)  # or not yet: the kill comes anyway
    fleet.proc("gateway").kill()
    assert not {t.task_id for t in fleet.trajectories[before:]} & ids, "an episode finished before the kill"
    fleet.proc("gateway").start()
    got = await fleet.wait_trajectories(ids, TRAJECTORY_TIMEOUT_S)
    assert set(got) == ids
    for t in got.values():
        assert t.status == "completed" and t.reward == 1.0 and len(t.turns) == 4 and t.segment_breaks == [], t.reason
        for prev, cur in zip(t.turns, t.turns[1:]):
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids) + len(prev.token_ids)] == prev.prompt_token_ids + prev.token_ids
        assert all(r.executor_id in (SERVING, DEDICATED) and len(r.logprobs) == len(r.token_ids) for r in t.turns)
    later = [r for t in got.values() for r in t.turns[1:]]  # routed with cache affinity on the episode's growing prefix
    assert sum(r.prefix_cached_tokens > 0 for r in later) >= len(later) // 2, [r.prefix_cached_tokens for r in later]
    mine = [t for t in fleet.trajectories[before:] if t.task_id in ids]
    assert len(mine) == len(ids), "a trajectory was published twice"
    beat = await bus.kv_get(SERVICE_REGISTRY, service="gateway", instance=GATEWAY)
    assert beat.load["restored_turns"] >= 1 and beat.load["replayed_turns"] >= 1, beat.load
    assert {e.episode_id for e in ended} >= ids
