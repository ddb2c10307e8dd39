"""The trainer's ack ledger alone (ledger.py), with stand-in deliveries: a trajectory of an open group
is held until its group is trained on and a checkpoint covers it; anything else is acked at once;
a redelivery of a group trained on is acked and counted once, never trained on again."""

from __future__ import annotations

from rose.contracts.rollout import Trajectory, TurnRecord
from rose.services.trainer.groups import GroupCollector
from rose.services.trainer.ledger import USED_GROUPS_KEPT, AckLedger, group_id


class FakeDelivery:
    def __init__(self) -> None:
        self.acked = 0
        self.kept_alive = 0

    async def ack(self) -> None:
        self.acked += 1

    async def in_progress(self) -> None:
        self.kept_alive += 1


def traj(tid: str, group: str) -> Trajectory:
    turn = TurnRecord(turn_index=0, prompt_token_ids=[1, 2], token_ids=[3], logprobs=[-1.0], policy_version=0, executor_id="ex")
    return Trajectory(task_id=tid, trajectory_id=f"{tid}-traj", env="arithmetic", status="completed", group_id=group, reward=1.0, turns=[turn])


def ledger_of(groups_per_step: int = 2) -> AckLedger:
    return AckLedger(GroupCollector(max_staleness=2), group_size=2, groups_per_step=groups_per_step, ack_wait_s=15.0)


async def test_a_group_is_held_until_trained_on_and_settled():
    ledger = ledger_of()
    gid = group_id("run", 0, 0)
    assert gid == "run-s0-g0"
    ledger.open(gid)
    a, b, stranger = FakeDelivery(), FakeDelivery(), FakeDelivery()
    await ledger.on_trajectory(traj("t0", gid), a)
    await ledger.on_trajectory(traj("t1", gid), b)
    await ledger.on_trajectory(traj("x", "other-run-s0-g0"), stranger)
    assert (a.acked, b.acked, stranger.acked) == (0, 0, 1)  # a group of no step of this run: acked at once
    assert ledger.held_trajectories() == 2 and ledger.outstanding() == [(gid, 2)]
    assert ledger.settled_stats()["received"] == 1  # the open group's two are counted again when redelivered
    ledger.use([gid])
    assert ledger.held_trajectories() == 2 and ledger.outstanding() == [] and ledger.used_groups() == [gid]
    await ledger.settle()  # a checkpoint covers the step
    assert (a.acked, b.acked) == (1, 1) and ledger.held_trajectories() == 0
    again = FakeDelivery()
    await ledger.on_trajectory(traj("t0", gid), again)  # redelivered after a restart: acked, counted once
    assert again.acked == 1 and ledger.collector.stats["already_used"] == 1


async def test_a_resumed_ledger_holds_the_groups_of_steps_it_may_not_have_handed_out():
    ledger = ledger_of(groups_per_step=2)
    ledger.restore("run", outstanding=[("run-s1-g1", 2)], used_groups=["run-s1-g0"], emit_from=2, emitted_steps=3)
    assert [gid for gid, _ in ledger.outstanding()] == ["run-s1-g1", "run-s2-g0", "run-s2-g1"]
    later, beyond, used = FakeDelivery(), FakeDelivery(), FakeDelivery()
    await ledger.on_trajectory(traj("t", "run-s7-g1"), later)  # a step after the checkpoint's cursor: held
    await ledger.on_trajectory(traj("u", "run-s7-g2"), beyond)  # no such group index: acked
    await ledger.on_trajectory(traj("v", "run-s1-g0"), used)  # trained on before the restart: acked
    assert (later.acked, beyond.acked, used.acked) == (0, 1, 1) and "run-s7-g1" in ledger.collector.groups


def test_the_groups_remembered_are_bounded():
    ledger = ledger_of()
    ledger.use([f"g{i}" for i in range(USED_GROUPS_KEPT + 5)])
    assert len(ledger.used) == USED_GROUPS_KEPT and next(iter(ledger.used)) == "g5"
