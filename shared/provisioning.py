"""Create every stream, KV bucket and object store the registry declares, idempotently.

Create if missing; if present, compare the settings that matter and fail loudly on a
conflict (someone else's stream on our subjects, a different retention, fewer replicas), so a
misconfigured cluster is noticed at start and not after data was lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BucketNotFoundError, NotFoundError

from rose.contracts.registry import KV_BUCKETS, OBJECT_STORES, STREAMS, KeyValueSpec, ObjectStoreSpec, Retention, StreamSpec
from rose.shared.errors import RoseError

log = logging.getLogger("rose.provisioning")


class ProvisioningConflict(RoseError, RuntimeError):
    """Existing JetStream storage has settings that contradict the registry."""


@dataclass(frozen=True)
class Provisioned:
    streams: list[str]
    kv_buckets: list[str]
    object_stores: list[str]
    created: list[str]


_RETENTION = {Retention.LIMITS: RetentionPolicy.LIMITS, Retention.WORK_QUEUE: RetentionPolicy.WORK_QUEUE}


def stream_config(spec: StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=spec.max_age_s,
        max_msg_size=spec.max_msg_size,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.OLD,
    )


def _check(kind: str, name: str, field: str, have: object, want: object) -> None:
    if have != want:
        raise ProvisioningConflict(
            f"{kind} {name!r} exists with {field}={have!r} but ROSE needs {field}={want!r}; "
            f"delete or fix it (e.g. `nats {kind.split()[0]} rm {name}`) and start again"
        )


async def _ensure_stream(js: JetStreamContext, spec: StreamSpec, replicas: int) -> bool:
    want = stream_config(spec, replicas)
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        await js.add_stream(want)
        return True
    have = info.config
    _check("stream", spec.name, "subjects", sorted(have.subjects or []), sorted(want.subjects or []))
    _check("stream", spec.name, "retention", have.retention, want.retention)
    _check("stream", spec.name, "storage", have.storage, want.storage)
    _check("stream", spec.name, "num_replicas", have.num_replicas, replicas)
    return False


async def _ensure_kv(js: JetStreamContext, spec: KeyValueSpec, replicas: int) -> bool:
    try:
        kv = await js.key_value(spec.bucket)
    except BucketNotFoundError:
        await js.create_key_value(
            KeyValueConfig(
                bucket=spec.bucket,
                description=spec.description,
                history=spec.history,
                ttl=spec.ttl_s or None,
                storage=StorageType.FILE,
                replicas=replicas,
            )
        )
        return True
    status = await kv.status()
    cfg = status.stream_info.config
    _check("kv bucket", spec.bucket, "history", cfg.max_msgs_per_subject, spec.history)
    _check("kv bucket", spec.bucket, "ttl", float(cfg.max_age or 0.0), float(spec.ttl_s))
    _check("kv bucket", spec.bucket, "replicas", cfg.num_replicas, replicas)
    return False


async def _ensure_objects(js: JetStreamContext, spec: ObjectStoreSpec, replicas: int) -> bool:
    try:
        store = await js.object_store(spec.bucket)
    except (BucketNotFoundError, NotFoundError):
        await js.create_object_store(
            spec.bucket,
            ObjectStoreConfig(
                bucket=spec.bucket,
                description=spec.description,
                ttl=spec.ttl_s or None,
                storage=StorageType.FILE,
                replicas=replicas,
            ),
        )
        return True
    status = await store.status()
    _check("object store", spec.bucket, "replicas", status.replicas, replicas)
    return False


async def provision(js: JetStreamContext, *, replicas: int = 1) -> Provisioned:
    """Make the server hold everything in the registry; safe to call from every service at start."""
    created: list[str] = []
    for spec in STREAMS:
        if await _ensure_stream(js, spec, replicas):
            created.append(f"stream {spec.name}")
    for kv in KV_BUCKETS:
        if await _ensure_kv(js, kv, replicas):
            created.append(f"kv {kv.bucket}")
    for obj in OBJECT_STORES:
        if await _ensure_objects(js, obj, replicas):
            created.append(f"objects {obj.bucket}")
    if created:
        log.info("provisioned %s", ", ".join(created))
    return Provisioned(
        streams=[s.name for s in STREAMS],
        kv_buckets=[k.bucket for k in KV_BUCKETS],
        object_stores=[o.bucket for o in OBJECT_STORES],
        created=created,
    )
