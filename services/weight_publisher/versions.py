"""One model's version history on the publishing side: delta against the last version, keyframes, lossy mode.

The publisher keeps, per model, the bytes followers hold for the last published version
(its shards). A new version is laid out the same way, each shard encoded against the held
one (the smallest of sparse delta / XOR / dense, or nothing when unchanged), stored, and then
announced by its manifest — so a follower never sees a manifest whose objects are not all
there. A keyframe (every `keyframe_interval` versions, on request, on the first version
after a start, or when the set of tensors changes) holds every shard dense.

Lossy mode makes what followers hold an approximation: per tensor only the top-k largest
pending changes are applied (error feedback keeps the rest pending); keyframes are exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rose.contracts.registry import MANIFESTS_STREAM, WEIGHT_MANIFEST
from rose.contracts.weights import VERSION_NOT_NEWER, ShardInfo, TensorInfo, WeightManifest
from rose.shared.bus import Bus, RequestRefused
from rose.shared.weight_codec import Divergence, EncodedShard, encode_shard, topk_sparsify
from rose.shared.weight_layout import FLOAT_DTYPES, Layout, itemsize, pack_shards, plan_layout
from rose.shared.weight_signing import ManifestSigner
from rose.shared.weight_store import WeightStore

from .config import PublisherSettings

log = logging.getLogger("rose.weight_publisher")

# A source tensor: (dtype name, shape, its bytes as a uint8 array).
Tensors = Mapping[str, tuple[str, tuple[int, ...], np.ndarray]]


class PublishError(RequestRefused):
    """A version that cannot be published (stale, malformed); nothing of it was stored."""


@dataclass
class _Last:
    version: int
    layout: Layout
    shards: dict[int, np.ndarray]  # what followers hold
    digests: dict[int, str]
    keyframe_version: int


@dataclass
class Staged:
    """A version whose objects are stored, and its manifest, not yet announced."""

    manifest: WeightManifest
    last: _Last


def object_name(model: str, version: int, shard_id: int) -> str:
    return f"{model}/v{version}/s{shard_id}"


def _version_of(name: str, model: str) -> int | None:
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != model or not parts[1].startswith("v") or not parts[1][1:].isdigit():
        return None
    return int(parts[1][1:])


def _encode_all(layout: Layout, shards: dict[int, np.ndarray], last: _Last | None) -> tuple[dict[int, EncodedShard], dict[int, str]]:
    encoded, digests = {}, {}
    for sid, buf in shards.items():
        base = last.shards[sid] if last is not None else None
        encoded[sid] = encode_shard(buf, base, layout.segments(sid))
        digests[sid] = last.digests[sid] if encoded[sid].encoding == "unchanged" and last else hashlib.sha256(buf.data).hexdigest()
    return encoded, digests


class ModelVersions:
    def __init__(self, model: str, bus: Bus, store: WeightStore, settings: PublisherSettings, signer: ManifestSigner | None = None) -> None:
        """`signer` signs every manifest (executors refuse unsigned ones by default); None: unsigned."""
        self.model = model
        self.signer = signer
        self.bus = bus
        self.store = store
        self.settings = settings
        self._last: _Last | None = None

    @property
    def last_version(self) -> int | None:
        return self._last.version if self._last else None

    def check(self, version: int) -> None:
        if self._last is not None and version <= self._last.version:
            raise PublishError(
                f"version {version} of {self.model} is not newer than the last published, {self._last.version}",
                reason=VERSION_NOT_NEWER,
                data={"latest": self._last.version},
            )

    async def publish(self, tensors: Tensors, version: int, *, keyframe: bool = False) -> WeightManifest:
        """Encode, store and announce `version`; returns its manifest."""
        staged = await self.stage(tensors, version, keyframe=keyframe)
        await self.announce(staged)
        return staged.manifest

    async def stage(self, tensors: Tensors, version: int, *, keyframe: bool = False) -> Staged:
        """Encode and store every object of `version`; nothing is visible to followers yet."""
        self.check(version)
        if not tensors:
            raise PublishError("no tensors to publish")
        started = time.perf_counter()
        layout = plan_layout(((n, d, s) for n, (d, s, _) in tensors.items()), self.settings.shard_bytes)
        last = self._last
        keyframe = keyframe or last is None or last.layout != layout or version - last.keyframe_version >= self.settings.keyframe_interval
        base = None if keyframe else last
        shards, divergence = await asyncio.to_thread(self._held_shards, layout, tensors, base)
        encoded, digests = await asyncio.to_thread(_encode_all, layout, shards, base)
        encode_s = time.perf_counter() - started
        await asyncio.gather(
            *(self.store.put(object_name(self.model, version, sid), e.payload) for sid, e in encoded.items() if e.encoding != "unchanged")
        )
        manifest = self._manifest(version, layout, encoded, digests, base, divergence, encode_s)
        if self.signer is not None:
            manifest = self.signer.sign(manifest)
        keyframe_version = version if base is None else base.keyframe_version
        return Staged(manifest, _Last(version, layout, shards, digests, keyframe_version))

    async def announce(self, staged: Staged) -> None:
        """Publish the manifest: from now on followers take this version, and it is the next base."""
        m = staged.manifest
        self.check(m.version)
        # one manifest per version and content: announced again after a lost ack (service.py's retry), the stream keeps one
        content = hashlib.sha256("".join(s.sha256 for s in m.shards).encode()).hexdigest()[:16]
        msg_id = f"{self.model}-v{m.version}-{content}"
        await self.bus.publish(WEIGHT_MANIFEST, m, msg_id=msg_id, model=self.model, kind=m.kind, version=str(m.version))
        self._last = staged.last
        if m.keyframe:
            await self._prune()

    def _held_shards(self, layout: Layout, tensors: Tensors, base: _Last | None) -> tuple[dict[int, np.ndarray], Divergence]:
        """The shard bytes followers will hold: the true weights, or (lossy) held + top-k of the change."""
        sources = {n: arr for n, (_, _, arr) in tensors.items()}
        divergence = Divergence()
        if base is not None and self.settings.lossy:
            held = {}
            for slot in layout.slots:
                prev = base.shards[slot.shard_id][slot.offset : slot.offset + slot.nbytes]
                if slot.dtype in FLOAT_DTYPES and slot.nbytes:
                    width = itemsize(slot.dtype)
                    true = sources[slot.name].view(f"u{width}")
                    new, div = topk_sparsify(true, prev.view(f"u{width}"), slot.dtype, self.settings.topk_fraction)
                    held[slot.name] = new.view(np.uint8)
                    divergence.add(div)
                else:
                    held[slot.name] = sources[slot.name]
            sources = held
        return pack_shards(layout, sources), divergence

    def _manifest(self, version, layout, encoded, digests, base, divergence, encode_s) -> WeightManifest:
        shards = [
            ShardInfo(
                shard_id=sid,
                encoding=e.encoding,
                object_name="" if e.encoding == "unchanged" else object_name(self.model, version, sid),
                wire_bytes=e.wire_bytes,
                decoded_bytes=layout.shard_sizes[sid],
                sha256=digests[sid],
                base_version=None if base is None else base.version,
                changed_elements=e.changed,
                elements=e.elements,
            )
            for sid, e in sorted(encoded.items())
        ]
        elements = sum(s.elements for s in shards)
        return WeightManifest(
            model=self.model,
            version=version,
            base_version=None if base is None else base.version,
            keyframe=base is None,
            created_at=time.time(),
            bucket=self.store.bucket,
            shards=shards,
            tensors=[
                TensorInfo(name=s.name, dtype=s.dtype, shape=list(s.shape), shard_id=s.shard_id, offset=s.offset, nbytes=s.nbytes)
                for s in layout.slots
            ],
            lossy=self.settings.lossy and base is not None,
            max_divergence=divergence.max_abs,
            mean_divergence=divergence.mean_abs,
            shard_bytes=self.settings.shard_bytes,
            full_bytes=sum(layout.shard_sizes),
            wire_bytes=sum(s.wire_bytes for s in shards),
            changed_fraction=(sum(s.changed_elements for s in shards) / elements) if elements else 0.0,
            encode_s=encode_s,
        )

    async def _prune(self) -> None:
        """Drop the manifests and objects older than the `keep_keyframes`-th latest keyframe.

        Joiners need only the latest keyframe and the deltas after it; one more keyframe
        window is kept so that a follower in the middle of a catch-up is not cut off.
        """
        js, stream = self.bus.js, MANIFESTS_STREAM.name
        pattern = WEIGHT_MANIFEST.pattern(model=self.model, kind="keyframe")
        try:
            info = await js.stream_info(stream, subjects_filter=pattern)
            versions = sorted(int(subj.rsplit(".", 1)[1]) for subj in (info.state.subjects or {}))
            if len(versions) < self.settings.keep_keyframes:
                return
            cutoff = versions[-self.settings.keep_keyframes]
            keep_from = await js.get_last_msg(stream, WEIGHT_MANIFEST.subject(model=self.model, kind="keyframe", version=str(cutoff)))
            await js.purge_stream(stream, subject=WEIGHT_MANIFEST.pattern(model=self.model), seq=keep_from.seq)
            for name in await self.store.names():
                v = _version_of(name, self.model)
                if v is not None and v < cutoff:
                    await self.store.delete(name)
        except Exception as exc:  # pruning is housekeeping: never fail a publish over it
            log.warning("pruning old versions of %s failed: %r", self.model, exc)
