"""A published version that changed no weight (a trainer step whose groups all had equal rewards, or one that moved
nothing at bf16) still moves the engine's version label: tokens sampled after it record it, tokens of a turn in flight
record the old label up to the iteration boundary and the new one after, and nothing is copied.

Real parts: the weight publisher's own versioning (`ModelVersions`) on a real nats-server stores the version as a delta
with every shard unchanged; a real `WeightFollower` hands it to the executor's `PolicyUpdates` as an empty state; a real
engine: a full-weight policy, and a LoRA policy in the co-batched and the two-model mode. Before the fix the follower
skipped the engine when no tensor changed, and the engine went on labelling tokens with the older version (~3 s for
the three).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import time

import pytest
import torch

from rose.contracts.registry import WEIGHTS_OBJECTS
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.policy_updates import PolicyUpdates
from rose.services.executor.weights import AdapterPolicyWeights
from rose.services.weight_publisher.config import PublisherSettings
from rose.services.weight_publisher.versions import ModelVersions
from rose.shared.bus import Bus
from rose.shared.lora import Adapter, LoraShape, model_fingerprint, new_adapter
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.engine import req
from rose.testing.polling import until
from rose.testing.weights import as_sources

MIB = 1 << 20
TIMEOUT_S = 10.0
SHARDS = PublisherSettings(shard_bytes=1 << 16, keyframe_interval=100)  # several shards, every one unchanged in the second version
LONG_TOKENS = 1500  # a turn still running while the version lands (stopped by the test)
AFTER_TOKENS = 20  # streamed after the label moved: more than the deltas still in delivery then
_models = itertools.count()


def lora_engine(loaded, mode: str) -> Engine:
    """An engine whose policy is a LoRA adapter of the session's serving model (B not zero: a trained one): co-batched
    (rows in serving's batches, versions in adapter slots) or two-model (folded into a copy of the base)."""
    model, tok = loaded["serving"]
    shape = LoraShape(rank=2, alpha=4.0)
    tensors = {n: t + 0.05 if ".lora_B." in n else t for n, t in new_adapter(model, shape, seed=1).items()}
    adapter = Adapter(shape=shape, tensors=tensors, base="", base_fingerprint=model_fingerprint(model.state_dict()))
    config = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0, rollout_mode=mode)
    engine = Engine(model, tok, copy.deepcopy(model) if mode == "two_model" else None, tok, config, adapter=adapter)
    engine.start()
    return engine


def live_identity(engine: Engine) -> tuple:
    """Where the live policy's weights are: a real swap re-points parameters (full) or flips the adapter's slot (LoRA)."""
    if isinstance(engine.weights, AdapterPolicyWeights):
        return ("slot", engine.weights.live)
    return ("params", tuple(p.data_ptr() for p in engine.rollout.model.parameters()))


@pytest.mark.parametrize("kind", ["full", "co_batched", "two_model"])
async def test_a_version_that_changed_no_weight_moves_the_label_and_copies_nothing(kind, bus, bus_config, make_engine, loaded):
    """`kind`: a full-weight policy, or a LoRA policy co-batched or folded into its own base copy (two-model)."""
    engine = make_engine(fresh_policy=True) if kind == "full" else lora_engine(loaded, kind)
    engine.set_rollout_lease(engine.config.rollout_kv_bytes, time.monotonic() + 3600.0)
    model = f"unchanged-{kind}-{next(_models)}-{os.getpid()}"
    versions = ModelVersions(model, bus, WeightStore(bus.js, WEIGHTS_OBJECTS.bucket), SHARDS)
    state = {n: t.detach().clone() for n, t in engine.policy_state_dict().items()}
    await versions.publish(as_sources(state), 1)  # a keyframe: the engine's own weights, swapped in as any version
    async with Bus(bus_config, service="executor", instance=f"ex-{model}") as follower_bus:
        follower = WeightFollower(follower_bus, model=model, apply=PolicyUpdates(engine).apply)
        initial = live_identity(engine)
        await follower.start(engine.policy_state_dict(), None)
        try:
            assert follower.version == 1 and engine.policy_version == 1
            before = live_identity(engine)
            assert before != initial  # a version with tensors is swapped in: what a relabel must not do
            long = engine.submit(req(engine, f"long-{kind}", max_tokens=LONG_TOKENS, ignore_eos=True, stream=True))
            received = [0]  # tokens streamed so far, read as they come

            async def read() -> None:
                async for delta in long:
                    received[0] += len(delta.token_ids)

            reader = asyncio.ensure_future(read())
            await until(lambda: received[0] > 0, TIMEOUT_S, "the turn to start on version 1")

            manifest = await versions.publish(as_sources(state), 2)  # the same weights again
            assert not manifest.keyframe and manifest.changed_fraction == 0.0
            assert {s.encoding for s in manifest.shards} == {"unchanged"}
            assert await follower.wait_for_version(2, TIMEOUT_S) == 2
            assert engine.policy_version == 2  # was 1: the follower never told the engine
            assert live_identity(engine) == before  # nothing copied, nothing swapped

            at_relabel = received[0]  # every token after these (and the few in delivery) came after the relabel
            await until(lambda: received[0] > at_relabel + AFTER_TOKENS, TIMEOUT_S, "the turn in flight to go on")
            long.cancel()
            cut = await asyncio.wait_for(long.result(), TIMEOUT_S)
            reader.cancel()
            labels = list(cut.token_versions)
            assert labels == sorted(labels) and set(labels) == {1, 2}  # the old label up to an iteration boundary, then the new
            fresh = await engine.submit(req(engine, f"fresh-{kind}", max_tokens=4, ignore_eos=True, stream=False)).result()
            assert set(fresh.token_versions) == {2} and fresh.policy_version == 2
            assert all(torch.equal(t, state[n]) for n, t in engine.policy_state_dict().items())
        finally:
            await follower.stop()
            if kind != "full":
                await engine.stop()
