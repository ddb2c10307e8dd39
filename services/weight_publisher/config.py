"""The weight publisher's configuration: `[bus]`, `[runtime]` and `[publisher]` in TOML, or ROSE_* variables."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.weight_layout import DEFAULT_SHARD_BYTES
from rose.shared.weight_store import DEFAULT_CHUNK_BYTES

DEFAULT_KEYFRAME_INTERVAL = 10
DEFAULT_KEEP_KEYFRAMES = 2
DEFAULT_TOPK_FRACTION = 0.01
MAX_KEYFRAME_INTERVAL = 512
DEFAULT_MAX_SOURCE_BYTES = 1 << 40


class PublisherSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    shard_bytes: Annotated[int, msgspec.Meta(ge=4096, le=4 << 30)] = DEFAULT_SHARD_BYTES
    keyframe_interval: Annotated[int, msgspec.Meta(ge=1, le=MAX_KEYFRAME_INTERVAL)] = DEFAULT_KEYFRAME_INTERVAL
    keep_keyframes: Annotated[int, msgspec.Meta(ge=1, le=16)] = DEFAULT_KEEP_KEYFRAMES
    lossy: bool = False  # bit-exact unless asked
    topk_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = DEFAULT_TOPK_FRACTION
    chunk_bytes: Annotated[int, msgspec.Meta(ge=64 << 10, le=8 << 20)] = DEFAULT_CHUNK_BYTES
    # Directories a publish request may name (a safetensors file or directory under one of them);
    # empty allows any path the service can read.
    allowed_roots: list[str] = msgspec.field(default_factory=list)
    max_source_bytes: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_SOURCE_BYTES
    # Ed25519 private key (PEM, mode 0600) that signs every manifest. Empty: $ROSE_STATE_DIR/keys/weights.key,
    # generated on first use (the embedded default); a path given here must exist (`rose security weights-key DIR`).
    signing_key_file: str = ""


class WeightPublisherConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    publisher: PublisherSettings = msgspec.field(default_factory=PublisherSettings)
