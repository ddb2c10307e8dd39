"""Weight versions: manifests that describe sharded (delta-encoded) objects, publish requests, apply results."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Fraction, Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds

ShardEncoding = Literal["unchanged", "dense", "sparse_delta", "xor_zstd"]
ManifestKind = Literal["keyframe", "delta"]
FailureKind = Literal[
    "digest",  # a decoded shard's SHA-256 differs from the manifest's
    "corrupt",  # a truncated or damaged chunk, or a payload that does not decode
    "missing_base",  # a delta on a version this executor does not hold
    "missing",  # an object the manifest names is not in the store
    "stale",  # a version not newer than the one applied
    "unknown_tensor",  # the manifest names a tensor the model does not have
    "shape",  # a tensor with another shape or dtype than the model's
    "oversized",  # a shard bigger than the executor accepts, or than its manifest says
    "apply",  # the executor refused the state dict
    "signature",  # unsigned, signed by a key the executor does not trust, or not matching its signature
    "other",
]


class TensorInfo(msgspec.Struct, kw_only=True):
    """Where a tensor lives: its shard and its byte range in the decoded shard."""

    name: str
    dtype: str
    shape: list[NonNegInt]
    shard_id: NonNegInt
    offset: NonNegInt
    nbytes: NonNegInt


class ShardInfo(msgspec.Struct, kw_only=True):
    """One shard of a version: its object in the store, its encoding and its decoded digest.

    An `unchanged` shard has no object (`object_name` is empty): it is bit-identical to the
    same shard of `base_version`, whose digest it repeats.
    """

    shard_id: NonNegInt
    encoding: ShardEncoding
    object_name: str
    wire_bytes: NonNegInt
    decoded_bytes: NonNegInt
    sha256: str
    base_version: NonNegInt | None = None
    changed_elements: NonNegInt = 0
    elements: NonNegInt = 0


class WeightManifest(Message):
    """Everything needed to rebuild a version from the object store, and to verify it.

    A keyframe (`base_version` None) holds every shard dense; a delta holds each shard as a
    change against the same shard of `base_version`, the version published just before.
    """

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
    signature: str = ""  # Ed25519 over the canonical bytes (shared/weight_signing.py), base64
    key_id: str = ""  # which key signed it: the first 16 hex digits of SHA-256 of the raw public key
    shard_bytes: NonNegInt = 0
    full_bytes: NonNegInt = 0  # decoded bytes of all shards
    wire_bytes: NonNegInt = 0  # stored bytes of this version's objects
    changed_fraction: Fraction = 0.0  # of elements, against base_version
    encode_s: NonNegFloat = 0.0

    @property
    def kind(self) -> ManifestKind:
        return "keyframe" if self.keyframe else "delta"


class WeightApplied(Message):
    executor_id: Identifier
    model: Identifier
    version: NonNegInt
    at: UnixSeconds
    pause_ms: NonNegFloat
    fetched_bytes: NonNegInt = 0
    fetch_apply_ms: NonNegFloat = 0.0  # from the manifest's arrival to the new version being live
    versions_behind: NonNegInt = 0  # intermediate versions folded into this one (a catch-up)
    params_sha256: str = ""  # digest of the live parameters after the swap, when the executor is asked to report it


class WeightFailed(Message):
    executor_id: Identifier
    model: Identifier
    version: NonNegInt
    at: UnixSeconds
    reason: str
    kind: FailureKind = "other"
    kept_version: NonNegInt | None = None  # the version that keeps serving
    next_step: Literal["refetch", "catch_up", "wait_keyframe", "none"] = "none"


class WeightPublishRequest(Message):
    """Trainer -> publisher: publish this version of `model` from a shared path or a staged object."""

    request_id: Identifier
    model: Identifier
    version: NonNegInt
    source: Literal["path", "object"]
    path: str = ""  # a safetensors file or a directory of them, readable by the publisher
    object_name: str = ""  # a safetensors blob in the staging bucket
    keyframe: bool = False  # force a full snapshot
    delete_source: bool = False  # remove the staged object / file once read


VERSION_NOT_NEWER = "version_not_newer"
"""Refusal reason of a publish request whose version is not above the last one the publisher
accepted; the refusal's data is `{"latest": <that version>}` (a trainer restarting mid-publish
moves on to `latest + 1`)."""


class WeightPublishAccepted(Message):
    request_id: Identifier
    model: Identifier
    version: NonNegInt
    queued: NonNegInt = 0  # requests ahead of this one


class WeightPublishFailed(Message):
    """The publisher accepted a version but could not publish it; nothing of it is visible."""

    request_id: Identifier
    model: Identifier
    version: NonNegInt
    at: UnixSeconds
    reason: str
