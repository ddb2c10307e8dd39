"""Publisher versions -> object store -> follower, against a real server: deltas, keyframes, joins, ranks, bad input."""

from __future__ import annotations

from rose.contracts.registry import WEIGHTS_OBJECTS
from rose.services.weight_publisher.config import PublisherSettings
from rose.services.weight_publisher.versions import ModelVersions
from rose.shared.weight_layout import layout_of
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import until
from rose.testing.weights import Executor, as_sources, make_state, rl_step, same

SMALL_SHARDS = PublisherSettings(shard_bytes=8192, keyframe_interval=100)
TIMEOUT = 10.0


def versions_for(bus, model: str, settings: PublisherSettings = SMALL_SHARDS) -> ModelVersions:
    return ModelVersions(model, bus, WeightStore(bus.js, WEIGHTS_OBJECTS.bucket), settings)


async def test_deltas_apply_bit_exact_and_report(bus, follower_bus, model_name, events):
    pub = versions_for(bus, model_name)
    states = [make_state(0)]
    await pub.publish(as_sources(states[0]), 1)
    executor = Executor(states[0], 1)
    follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply)
    await follower.start(executor.state, 1)
    try:
        for version in range(2, 6):
            states.append(rl_step(states[-1], version))
            manifest = await pub.publish(as_sources(states[-1]), version)
            assert not manifest.keyframe and manifest.base_version == version - 1
            assert {s.encoding for s in manifest.shards} <= {"sparse_delta", "unchanged", "xor_zstd"}
            assert await follower.wait_for_version(version, TIMEOUT) == version
            assert same(executor.state, states[-1])
        await until(lambda: len([e for e in events.applied if e.model == model_name]) == 4)
        assert all(e.pause_ms == 0.1 and e.executor_id == "ex-test" for e in events.applied if e.model == model_name)
        assert follower.stats.failed == 0
    finally:
        await follower.stop()


async def test_unchanged_shards_send_nothing_and_are_not_reapplied(bus, follower_bus, model_name):
    pub = versions_for(bus, model_name)
    v1 = make_state(1)
    await pub.publish(as_sources(v1), 1)
    v2 = dict(v1)
    v2["head.weight"] = rl_step({"h": v1["head.weight"]}, 3, lr=0.1)["h"]
    manifest = await pub.publish(as_sources(v2), 2)
    head_shard = next(t.shard_id for t in manifest.tensors if t.name == "head.weight")
    assert all((s.encoding == "unchanged") == (s.shard_id != head_shard) for s in manifest.shards)
    assert all(s.wire_bytes == 0 and s.object_name == "" for s in manifest.shards if s.encoding == "unchanged")
    executor = Executor(v1, 1)
    follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply)
    await follower.start(executor.state, 1)  # catches up from v1 (verified against its manifest)
    try:
        assert await follower.wait_for_version(2, TIMEOUT) == 2
        assert same(executor.state, v2)
        # Only the tensors of the changed shard are handed over again.
        assert executor.calls[-1][1] == sorted(t.name for t in manifest.tensors if t.shard_id == head_shard)
        assert len(executor.calls[-1][1]) < len(v2)
    finally:
        await follower.stop()


async def test_keyframes_let_a_new_executor_join(bus, follower_bus, model_name, events):
    pub = versions_for(bus, model_name, PublisherSettings(shard_bytes=8192, keyframe_interval=3, keep_keyframes=1))
    states = {1: make_state(2)}
    for version in range(1, 9):
        if version > 1:
            states[version] = rl_step(states[version - 1], version)
        manifest = await pub.publish(as_sources(states[version]), version)
        assert manifest.keyframe == (version in (1, 4, 7))
    # Pruned: nothing before the latest keyframe is left in the store.
    names = await WeightStore(bus.js, WEIGHTS_OBJECTS.bucket).names()
    assert not [n for n in names if n.startswith(f"{model_name}/v") and int(n.split("/")[1][1:]) < 7]
    # A fresh executor with other weights joins from keyframe 7 plus delta 8, in one apply.
    executor = Executor(make_state(99), None)
    follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply)
    await follower.start(executor.state, None)
    try:
        assert follower.version == 8 and same(executor.state, states[8])
        assert len(executor.calls) == 1
        await until(lambda: any(e.model == model_name and e.versions_behind == 1 for e in events.applied))
        # An executor whose weights are not what it claims joins from the keyframe too.
        liar = Executor(make_state(98), 7)
        second = WeightFollower(follower_bus, model=model_name, apply=liar.apply, executor_id="ex-liar")
        await second.start(liar.state, 7)
        assert second.version == 8 and same(liar.state, states[8])
        await second.stop()
    finally:
        await follower.stop()


async def test_two_ranks_fetch_only_their_shards(bus, follower_bus, model_name):
    pub = versions_for(bus, model_name)
    v1 = make_state(3)
    v2 = rl_step(v1, 4)
    await pub.publish(as_sources(v1), 1)
    # Split the tensors between two ranks along shard boundaries, as a tensor-parallel plan would.
    shard_of = {s.name: s.shard_id for s in layout_of(v1, SMALL_SHARDS.shard_bytes).slots}
    assert len(set(shard_of.values())) >= 2
    ranks = [lambda n: shard_of[n] % 2 == 0, lambda n: shard_of[n] % 2 == 1]
    executors, followers = [], []
    for rank, keep in enumerate(ranks):
        part = {n: t for n, t in v1.items() if keep(n)}
        executor = Executor(part, 1)
        follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply, tensor_filter=keep, executor_id=f"rank{rank}")
        await follower.start(executor.state, 1)
        executors.append(executor), followers.append(follower)
    try:
        manifest = await pub.publish(as_sources(v2), 2)
        for f in followers:
            assert await f.wait_for_version(2, TIMEOUT) == 2
        wire = {s.shard_id: s.wire_bytes for s in manifest.shards}
        for executor, follower, keep in zip(executors, followers, ranks, strict=True):
            assert set(executor.state) == {n for n in v2 if keep(n)}
            assert same(executor.state, {n: t for n, t in v2.items() if keep(n)})
            assert follower.stats.failed == 0
            assert follower.stats.fetched_bytes == sum(wire[s] for s in {shard_of[n] for n in executor.state})
        assert followers[0].stats.fetched_bytes < manifest.wire_bytes and followers[1].stats.fetched_bytes < manifest.wire_bytes
    finally:
        for f in followers:
            await f.stop()
