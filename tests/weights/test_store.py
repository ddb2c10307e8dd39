"""The object-store transport against a real server: standard layout both ways, and bad objects."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os

import pytest
from nats.js import api
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE
from nats.nuid import NUID

from rose.contracts.registry import WEIGHTS_OBJECTS
from rose.shared import weight_store
from rose.shared.errors import WeightError
from rose.shared.weight_store import WeightStore
from rose.testing.weights import craft

BUCKET = WEIGHTS_OBJECTS.bucket


@pytest.mark.parametrize("size", [0, 1, 65_536, 1_000_003])
async def test_nats_py_reads_ours_and_we_read_theirs(bus, size):
    data = os.urandom(size)
    store = WeightStore(bus.js, BUCKET, chunk_bytes=64 << 10)
    theirs = await bus.js.object_store(BUCKET)
    info = await store.put(f"ours-{size}", data)
    assert info.chunks == (size + (64 << 10) - 1) // (64 << 10)
    assert (await theirs.get(f"ours-{size}")).data == data
    await theirs.put(f"theirs-{size}", data)
    assert bytes(await store.get(f"theirs-{size}")) == data
    # Replacing an object removes the old chunks, as nats-py does.
    await store.put(f"ours-{size}", data[::-1])
    assert (await theirs.get(f"ours-{size}")).data == data[::-1]


async def test_a_truncated_object_is_refused(bus, monkeypatch):
    monkeypatch.setattr(weight_store, "REPLICA_LAG_S", 0.3)  # chunks that never come: refused after the replicas' grace
    data = os.urandom(300_000)
    await craft(bus.js, "truncated", [data[:100_000], data[100_000:200_000]], size=len(data), digest_of=data)
    with pytest.raises(WeightError, match="truncated") as err:
        await WeightStore(bus.js, BUCKET).get("truncated")
    assert err.value.kind == "corrupt"


async def test_chunks_a_replica_has_not_applied_yet_are_asked_for_again(bus):
    """A direct get may be answered by a follower behind the leader: the meta is there, the last chunk not yet
    (docker compose's 3-node cluster, scripts/compose-check). The reader asks again and gets the whole object."""
    data = os.urandom(300_000)
    nuid = NUID().next().decode()
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=nuid)
    await bus.js.publish(chunks, data[:200_000])
    info = api.ObjectInfo(
        name="lagging",
        bucket=BUCKET,
        nuid=nuid,
        size=len(data),
        chunks=2,
        digest="SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode(),
        options=api.ObjectMetaOptions(max_chunk_size=200_000),
    )
    meta = OBJ_META_PRE_TEMPLATE.format(bucket=BUCKET, obj=base64.urlsafe_b64encode(b"lagging").decode())
    await bus.js.publish(meta, json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    reading = asyncio.ensure_future(WeightStore(bus.js, BUCKET).get("lagging"))
    await asyncio.sleep(0.5)
    assert not reading.done()  # waiting for the rest, not refusing a truncated object
    await bus.js.publish(chunks, data[200_000:])
    assert bytes(await asyncio.wait_for(reading, 10)) == data


async def test_a_corrupted_chunk_is_refused(bus):
    data = os.urandom(300_000)
    damaged = bytearray(data)
    damaged[150_000] ^= 0x40
    await craft(bus.js, "corrupted", [bytes(damaged[:200_000]), bytes(damaged[200_000:])], size=len(data), digest_of=data)
    with pytest.raises(WeightError, match="corrupted chunk") as err:
        await WeightStore(bus.js, BUCKET).get("corrupted")
    assert err.value.kind == "corrupt"


async def test_oversized_and_missing_objects_are_refused_before_fetching(bus):
    store = WeightStore(bus.js, BUCKET)
    await store.put("big", os.urandom(10_000))
    with pytest.raises(WeightError) as err:
        await store.get("big", max_bytes=9_999)
    assert err.value.kind == "oversized"
    with pytest.raises(WeightError) as err:
        await store.fetch("big", lambda n: None, expect_size=5_000)  # type: ignore[arg-type]
    assert err.value.kind == "oversized"
    with pytest.raises(WeightError) as err:
        await store.get("never-written")
    assert err.value.kind == "missing"
