"""A LoRA policy's versions through the real weight publisher service, as the trainer publishes them: each version is
the adapter's tensors (peft names) after a real AdamW step of a peft model over a frozen tiny Qwen2 base, cast to
bf16, sent with the trainer SDK; a real `WeightFollower` that trusts only the publisher's key takes them signed,
delta-encoded after the first, and bit-exact, handing its executor tensors it can parse as adapter pairs."""

from __future__ import annotations

import asyncio

import torch
from peft import PeftModel

from rose.client import WeightsClient
from rose.services.trainer.lora import trainable_parameters, trained_state
from rose.services.weight_publisher.config import PublisherSettings, WeightPublisherConfig
from rose.services.weight_publisher.main import run
from rose.shared.config import RuntimeConfig
from rose.shared.lora import Adapter, LoraShape, adapter_targets, model_fingerprint, new_adapter, read_adapter, write_adapter
from rose.shared.models import ModelShape, build_model
from rose.shared.weight_signing import ManifestVerifier, generate_keypair
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import retrying
from rose.testing.weights import Executor, same

TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
VOCAB = 256
LORA = LoraShape(rank=4, alpha=8.0)
VERSIONS = 5
TIMEOUT = 15.0


def lm_step(model, optimizer, seed: int) -> None:
    """One real AdamW step of the peft model (LM loss on random tokens): every adapter element moves."""
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


async def test_adapter_versions_go_through_signed_delta_encoded_and_bit_exact(bus_config, bus, follower_bus, model_name, tmp_path):
    keys = generate_keypair(tmp_path / "keys")
    publisher = asyncio.create_task(
        run(
            WeightPublisherConfig(
                bus=bus_config,
                runtime=RuntimeConfig(instance="wp-adapter", heartbeat_interval_s=0.5),
                publisher=PublisherSettings(shard_bytes=8192, signing_key_file=str(keys.private)),
            )
        )
    )
    torch.manual_seed(0)
    base = build_model(TINY, VOCAB, 1, seed=0)
    version0 = Adapter(shape=LORA, tensors=new_adapter(base, LORA, seed=1), base="base", base_fingerprint=model_fingerprint(base.state_dict()))
    policy_dir = write_adapter(tmp_path / "policy", version0)
    policy = PeftModel.from_pretrained(base, str(policy_dir), is_trainable=True)  # the trainer's path (services/trainer/lora.py)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2, weight_decay=0.0)
    # the executor holds version 0 as it read it from the policy directory, in the dtype versions come in
    executor = Executor({n: t.to(torch.bfloat16) for n, t in read_adapter(policy_dir).tensors.items()}, 0)
    follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply, verifier=ManifestVerifier([keys.public]))
    await follower.start(executor.state, 0)
    try:
        async with WeightsClient(bus, model_name) as weights:
            for version in range(1, VERSIONS + 1):
                lm_step(policy, optimizer, version)
                state = {n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in trained_state(policy).items()}  # Trainer.publish
                await retrying(lambda s=state, v=version: weights.publish(s, v), Exception, 10, "publishing (the service still starting)")
                manifest = await weights.published(version, timeout=TIMEOUT)
                assert manifest.signature and manifest.key_id == keys.key_id
                assert manifest.keyframe == (version == 1)
                if version > 1:  # a delta against the version before
                    assert manifest.base_version == version - 1 and {s.encoding for s in manifest.shards} <= {"sparse_delta", "xor_zstd", "dense"}
                assert {t.name for t in manifest.tensors} == set(version0.tensors)
                assert await follower.wait_for_version(version, TIMEOUT) == version
                assert same(executor.state, state)  # bit-exact
        assert follower.stats.failed == 0 and follower.stats.applied == VERSIONS
        pairs = adapter_targets(executor.state)  # what the executor got parses as the adapter's pairs
        assert len(pairs) == TINY.num_layers * len(LORA.targets) and all(a.shape[0] == LORA.rank for a, _ in pairs.values())
    finally:
        await follower.stop()
        publisher.cancel()
        await asyncio.wait([publisher], timeout=10)
