"""GRPO's pieces: advantages, the loss's sign and clip, trajectories to sequences, the staleness bound."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from rose.contracts.rollout import Trajectory, TurnRecord
from rose.services.trainer.batch import Sequence, pad, sequences_of, token_logprobs
from rose.services.trainer.config import GrpoSettings
from rose.services.trainer.groups import GroupCollector
from rose.services.trainer.grpo import group_advantages, grpo_loss, grpo_step
from rose.services.trainer.trainer import warmed_up_lr
from rose.shared.models import ModelShape, build_model

TINY = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
VOCAB = 64


def turn(index: int, prompt: list[int], tokens: list[int], version: int = 0) -> TurnRecord:
    return TurnRecord(
        turn_index=index, prompt_token_ids=prompt, token_ids=tokens, logprobs=[-1.0] * len(tokens), policy_version=version, executor_id="ex"
    )


def traj(tid: str, group: str, reward: float, version: int = 0, status: str = "completed") -> Trajectory:
    return Trajectory(
        task_id=tid,
        trajectory_id=f"{tid}-traj",
        env="arithmetic",
        status=status,
        group_id=group,
        reward=reward,  # type: ignore[arg-type]
        turns=[turn(0, [1, 2, 3], [4, 5], version)],
    )


def test_group_advantages_are_normalised_and_zero_without_spread():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(group_advantages([0.2, 0.9, 0.4])) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]


def test_a_multi_turn_trajectory_is_one_sequence_masked_on_generated_tokens():
    t0 = turn(0, [1, 2], [3, 4])
    t1 = turn(1, [1, 2, 3, 4, 9, 9], [5, 6], version=2)
    t = Trajectory(task_id="a", trajectory_id="a-traj", env="e", status="completed", turns=[t0, t1])
    (seq,) = sequences_of(t)
    assert seq.tokens == [1, 2, 3, 4, 9, 9, 5, 6]
    assert seq.mask == [False, False, True, True, False, False, True, True]
    assert seq.version == 0  # the oldest version any token came from
    # Turns that do not line up (another producer) fall back to one sequence per turn.
    t1b = turn(1, [7, 7, 7], [5, 6])
    assert len(sequences_of(Trajectory(task_id="b", trajectory_id="b-traj", env="e", status="completed", turns=[t0, t1b]))) == 2


def test_the_loss_raises_good_tokens_and_lowers_bad_ones():
    torch.manual_seed(0)
    model = build_model(TINY, VOCAB, 0, seed=0)
    good = Sequence([1, 2, 3, 4, 5], [False, False, True, True, True], [0.0] * 5, advantage=1.0)
    bad = Sequence([1, 2, 6, 7, 8], [False, False, True, True, True], [0.0] * 5, advantage=-1.0)
    for s in (good, bad):  # behaviour logprobs = this policy's
        b = pad([s], 0)
        with torch.no_grad():
            s.old_logprobs = [0.0] + (token_logprobs(model, b)[0] * b.mask[0]).tolist()
    batch = pad([good, bad], 0)
    with torch.no_grad():
        before = (token_logprobs(model, batch) * batch.mask).sum(-1)
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.5), [batch], clip_eps=0.2, max_grad_norm=10.0)
    with torch.no_grad():
        after = (token_logprobs(model, batch) * batch.mask).sum(-1)
    assert after[0] > before[0] and after[1] < before[1]
    assert stats.mean_ratio == pytest.approx(1.0, abs=1e-4) and stats.tokens == 6


def test_the_clip_stops_the_gradient_past_the_trust_region():
    old = torch.zeros(1, 3)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    batch = pad([Sequence([1, 2, 3, 4], [False, False, True, True], [0.0] * 4)], 0)
    batch.old_logprobs, batch.mask = old, mask
    for advantage, clipped in ((1.0, True), (-1.0, False)):
        new = torch.full((1, 3), math.log(1.5), requires_grad=True)  # ratio 1.5 > 1 + 0.2
        batch.advantages = torch.tensor([advantage])
        loss, stats = grpo_loss(new, batch, clip_eps=0.2)
        loss.backward()
        assert (new.grad.abs().sum() == 0) == clipped
        assert stats.clip_fraction == 1.0 and stats.mean_ratio == pytest.approx(1.5)


def test_staleness_bound_drops_or_masks_and_everything_is_counted():
    c = GroupCollector(max_staleness=1)
    c.expect("g", 4)
    for t in (traj("a", "g", 1.0, 5), traj("b", "g", 0.0, 4), traj("c", "g", 1.0, 3), traj("d", "g", 0.0, 5, status="failed")):
        c.add(t)
    c.add(traj("a", "g", 1.0, 5))  # redelivered
    c.add(traj("x", "other", 1.0, 5))
    groups = c.ready()
    assert [g.group_id for g in groups] == ["g"]
    seqs = c.sequences(groups, current_version=5)
    assert len(seqs) == 2 and sorted(s.advantage for s in seqs) == pytest.approx([-1.0, 1.0], abs=1e-4)
    assert c.stats.items() >= {"received": 6, "duplicates": 1, "unknown_group": 1, "failed": 1, "stale_dropped": 1, "groups_used": 1}.items()

    masked = GroupCollector(max_staleness=1, stale_policy="mask")
    masked.expect("g", 3)
    for t in (traj("a", "g", 1.0, 5), traj("b", "g", 0.0, 5), traj("c", "g", 0.0, 2)):
        masked.add(t)
    seqs = masked.sequences(masked.ready(), current_version=5)
    assert len(seqs) == 2 and masked.stats["stale_masked"] == 1  # in the baseline, not in the loss
    assert max(s.advantage for s in seqs) == pytest.approx(group_advantages([1.0, 0.0, 0.0])[0])


def test_incomplete_and_uninformative_groups():
    c = GroupCollector(max_staleness=4, group_timeout_s=10.0)
    c.expect("g", 3)
    c.add(traj("a", "g", 1.0))
    c.add(traj("b", "g", 0.0))
    assert c.ready(now=c.groups["g"].created + 1) == []  # waits for its third member
    groups = c.ready(now=c.groups["g"].created + 11)  # ... until the timeout, with two usable
    assert len(groups) == 1 and len(c.sequences(groups, 0)) == 2
    assert c.stats["missing"] == 1  # the third never came: lost (the alert RoseTrajectoriesLost counts it)
    c.expect("h", 2)
    c.add(traj("c", "h", 1.0))
    c.add(traj("d", "h", 1.0))
    assert c.sequences(c.ready(), 0) == [] and c.stats["zero_variance_groups"] == 1
    assert c.stats["missing"] == 1  # a complete group misses nothing


async def test_a_step_takes_exactly_its_groups_oldest_first_and_leaves_the_rest_ready():
    """Trainer.next_groups on a real collector: when a prefetched batch completes early, a step takes only
    `groups_per_step` groups (the oldest); the others stay ready for the next step, none is lost."""
    import asyncio
    from types import SimpleNamespace

    from rose.services.trainer.trainer import Trainer

    collector = GroupCollector(max_staleness=2)
    for i, gid in enumerate(("s0-g0", "s0-g1", "s1-g0", "s1-g1")):
        collector.expect(gid, 1)
        collector.groups[gid].created = float(i)  # handed out in this order
    for gid in ("s1-g1", "s0-g1", "s1-g0", "s0-g0"):  # complete out of order
        collector.add(traj(f"t-{gid}", gid, 1.0))
    owner = SimpleNamespace(
        config=SimpleNamespace(grpo=SimpleNamespace(groups_per_step=2)), collector=collector, version=0, ledger=SimpleNamespace(use=lambda ids: None)
    )
    first = await Trainer.next_groups(owner, asyncio.Event())
    assert [g.group_id for g in first] == ["s0-g0", "s0-g1"]
    assert sorted(collector.groups) == ["s1-g0", "s1-g1"]  # back in the collector, still complete
    second = collector.ready()  # with the next step's new groups, it fills that step
    assert [g.group_id for g in second] == ["s1-g0", "s1-g1"] and collector.groups == {}
    stopped = asyncio.Event()
    stopped.set()
    collector.expect("s2-g0", 1)
    collector.add(traj("t-s2", "s2-g0", 1.0))
    assert await Trainer.next_groups(owner, stopped) == [] and list(collector.groups) == ["s2-g0"]


def test_the_lr_warms_up_linearly_from_the_step_count():
    """grpo.lr_warmup_steps: step k (0-based) trains at lr x (k + 1) / warmup, then at lr; 0 turns it off.
    Derived from the step count alone, so a resumed run continues the ramp where the checkpoint left it."""
    assert [warmed_up_lr(1e-3, 4, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmed_up_lr(1e-3, 0, 0) == 1e-3
    assert msgspec.convert({"lr_warmup_steps": 10}, GrpoSettings).lr_warmup_steps == 10
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"lr_warmup_steps": -1}, GrpoSettings)


async def test_over_provisioned_groups_roll_on_into_the_next_step_and_their_cost_is_counted():
    """grpo.over_provision: the first step hands out N + k groups (ledger `groups_in`), a step trains on the
    first N complete; an unfinished group rolls on, its later turns on the next version, and is trained a
    step later with its lag counted; the length bias compares what was trained with what completed."""
    import asyncio
    from types import SimpleNamespace

    from rose.services.trainer.groups import partial_rollout_costs
    from rose.services.trainer.ledger import AckLedger
    from rose.services.trainer.trainer import Trainer

    collector = GroupCollector(max_staleness=1)
    ledger = AckLedger(collector, group_size=2, groups_per_step=2, ack_wait_s=5.0, over_provision=1)
    assert [ledger.groups_in(s) for s in (0, 1, 2)] == [3, 2, 2]
    for i in range(ledger.groups_in(0)):
        ledger.open(f"r-s0-g{i}")
        collector.groups[f"r-s0-g{i}"].created = float(i)
    for gid in ("r-s0-g1", "r-s0-g2", "r-s0-g0"):  # short trajectories finish first; g0 waits for its long one
        collector.add(traj(f"{gid}-a", gid, 1.0 if gid != "r-s0-g0" else 0.0))
        if gid != "r-s0-g0":
            collector.add(traj(f"{gid}-b", gid, 0.0))
    owner = SimpleNamespace(
        config=SimpleNamespace(grpo=SimpleNamespace(groups_per_step=2)), collector=collector, version=0, ledger=SimpleNamespace(use=lambda ids: None)
    )
    first = await Trainer.next_groups(owner, asyncio.Event())
    assert sorted(g.group_id for g in first) == ["r-s0-g1", "r-s0-g2"]  # the step does not wait for g0
    assert len(collector.sequences(first, current_version=0)) == 4
    # g0's long trajectory finishes on the next version: its first turn sampled on v0, its second on v1
    long = Trajectory(
        task_id="long", trajectory_id="long-traj", env="arithmetic", status="completed", group_id="r-s0-g0", reward=1.0,  # type: ignore[arg-type]
        turns=[turn(0, [1, 2, 3], [4, 5, 6, 7], 0), turn(1, [1, 2, 3, 4, 5, 6, 7, 9], [8, 9, 10, 11], 1)],
    )  # fmt: skip
    collector.add(long)
    owner.version = 1
    second = collector.ready()  # with the next step's new groups, it fills that step
    assert [g.group_id for g in second] == ["r-s0-g0"]
    assert len(collector.sequences(second, current_version=1)) == 1 + len(sequences_of(long))
    costs = partial_rollout_costs(collector.stats)
    assert collector.stats["max_trained_lag"] == 1 and costs["trained_staleness_mean"] == pytest.approx(2 / 6)  # g0's two, a version old
    assert costs["length_bias"] == pytest.approx(1.0)  # everything that completed was trained
    # had a 20-token trajectory completed and not been trained yet, the trained ones would be shorter than what completed
    later = {**collector.stats, "completed": 7, "completed_tokens": collector.stats["completed_tokens"] + 20}
    assert partial_rollout_costs(later)["length_bias"] == pytest.approx((18 / 6) / (38 / 7))
