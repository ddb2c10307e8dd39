"""Every stream, KV bucket and object store of the registry is provisioned, idempotently; conflicts fail loudly."""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy, StreamConfig

from rose.contracts.registry import CHANNELS, KV_BUCKETS, OBJECT_STORES, STREAMS, stream_subject_owner
from rose.shared.provisioning import ProvisioningConflict, provision


async def test_everything_in_the_registry_exists_after_provisioning(bus):
    result = await provision(bus.js)
    assert result.created == []  # the fixture already provisioned: second run creates nothing
    for spec in STREAMS:
        info = await bus.js.stream_info(spec.name)
        assert sorted(info.config.subjects) == sorted(spec.subjects)
    for kv in KV_BUCKETS:
        await bus.js.key_value(kv.bucket)
    for obj in OBJECT_STORES:
        await bus.js.object_store(obj.bucket)


def test_every_stream_channel_subject_is_captured_by_its_stream():
    for channel in CHANNELS:
        if channel.stream is None:
            continue
        example = channel.subject(**{t: "x" for t in channel.tokens})
        assert stream_subject_owner(example) == channel.stream, channel.name


async def test_conflicting_existing_stream_fails_loudly(bus):
    await bus.js.delete_stream("ROSE_TELEMETRY")
    await bus.js.add_stream(StreamConfig(name="ROSE_TELEMETRY", subjects=["rose.telemetry.>"], retention=RetentionPolicy.INTEREST))
    try:
        with pytest.raises(ProvisioningConflict, match="ROSE_TELEMETRY.*retention"):
            await provision(bus.js)
    finally:
        await bus.js.delete_stream("ROSE_TELEMETRY")
        await provision(bus.js)
