"""Weight versions: manifests that describe sharded (delta-encoded) objects, and apply results."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds

ShardEncoding = Literal["unchanged", "dense", "sparse_delta", "xor_zstd"]


class TensorInfo(msgspec.Struct, kw_only=True):
    name: str
    dtype: str
    shape: list[NonNegInt]
    shard_id: NonNegInt
    offset: NonNegInt
    nbytes: NonNegInt


class ShardInfo(msgspec.Struct, kw_only=True):
    """One shard of a version: its object in the store, its encoding and its decoded digest."""

    shard_id: NonNegInt
    encoding: ShardEncoding
    object_name: str
    wire_bytes: NonNegInt
    decoded_bytes: NonNegInt
    sha256: str
    base_version: NonNegInt | None = None


class WeightManifest(Message):
    """Everything needed to rebuild a version from the object store, and to verify it."""

    model: Identifier
    version: NonNegInt
    base_version: NonNegInt | None
    keyframe: bool
    created_at: UnixSeconds
    bucket: str
    shards: list[ShardInfo]
    tensors: list[TensorInfo]
    lossy: bool = False
    max_divergence: NonNegFloat = 0.0
    mean_divergence: NonNegFloat = 0.0
    signature: str = ""


class WeightApplied(Message):
    executor_id: Identifier
    model: Identifier
    version: NonNegInt
    at: UnixSeconds
    pause_ms: NonNegFloat
    fetched_bytes: NonNegInt = 0


class WeightFailed(Message):
    executor_id: Identifier
    model: Identifier
    version: NonNegInt
    at: UnixSeconds
    reason: str
    kind: Literal["digest", "corrupt", "missing_base", "stale", "shape", "oversized", "other"] = "other"
