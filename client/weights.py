"""The trainer's side of weight sync: hand a version to the weight publisher, learn when it is out.

    async with WeightsClient.connect(nats_url, model="policy", staging_dir="/shared/rose") as weights:
        await weights.publish(model.state_dict(), version=step)   # or a safetensors directory
        manifest = await weights.published(step)                  # every executor can now fetch it

How the bytes reach the publisher (it diffs, encodes and stores them; the trainer does not):

* A **path** (a safetensors file or directory, e.g. from `save_pretrained`) is passed by name:
  the publisher memory-maps it. This is the fast, default deployment — the publisher runs
  beside the trainer (the same host or a shared volume), so the dense weights never cross
  the network; only the encoded deltas do, once, to the object store.
* A **state dict** with `staging_dir` set is written there as one safetensors file (no extra
  copy, atomic rename) and passed by path, then deleted by the publisher once read.
* A **state dict** without a shared path is uploaded to the staging object store
  (`rose_weights_staging`, with the fast pipelined put) and fetched by the publisher — it
  works across hosts but moves the dense bytes twice, so use it when nothing is shared.

`publish` returns once the publisher has queued the request (it refuses a version that is
not newer than the last); `published(version)` waits for the version's manifest on the
manifest stream, or raises `PublishFailedError` with the publisher's reason.

Each `publish` runs in a `weights.client_publish` producer span (staging included): a child of
the caller's current span, or the root of the version's trace, which goes on through the
publisher to every executor's apply (rose.shared.tracing says how a framework joins it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from rose.contracts.registry import MANIFESTS_STREAM, WEIGHT_MANIFEST, WEIGHT_PUBLISH, WEIGHT_PUBLISH_FAILED, WEIGHTS_STAGING_OBJECTS
from rose.contracts.weights import WeightManifest, WeightPublishAccepted, WeightPublishFailed, WeightPublishRequest
from rose.shared.bus import Bus, Delivery
from rose.shared.codec import decode
from rose.shared.config import BusConfig
from rose.shared.errors import RoseError
from rose.shared.tracing import tracer
from rose.shared.weight_layout import safetensors_blob, save_safetensors
from rose.shared.weight_store import WeightStore

DEFAULT_PUBLISHED_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 30.0
KEEP_RESULTS = 1024  # outcomes remembered per client (versions)


class PublishFailedError(RoseError, RuntimeError):
    """The publisher accepted the version but could not publish it."""


class WeightsClient:
    def __init__(self, bus: Bus, model: str, *, staging_dir: str | Path | None = None, own_bus: bool = False) -> None:
        self.bus = bus
        self.model = model
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self._own_bus = own_bus
        self._results: dict[int, asyncio.Future[WeightManifest]] = {}
        self._started = False

    @classmethod
    def connect(cls, nats_url: str, model: str, *, staging_dir: str | Path | None = None, instance: str | None = None) -> WeightsClient:
        """A client with its own bus connection (closed with the client)."""
        bus = Bus(BusConfig(url=nats_url), service="trainer", instance=instance or f"trainer-{uuid.uuid4().hex[:8]}")
        return cls(bus, model, staging_dir=staging_dir, own_bus=True)

    async def __aenter__(self) -> WeightsClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Listen for outcomes before anything is sent, so none is missed."""
        if self._started:
            return
        if self._own_bus:
            await self.bus.connect()
        await self.bus.subscribe(WEIGHT_MANIFEST, self._on_manifest, model=self.model)
        await self.bus.subscribe(WEIGHT_PUBLISH_FAILED, self._on_failed, model=self.model)
        self._started = True

    async def close(self) -> None:
        if self._own_bus:
            await self.bus.close()

    def _future(self, version: int) -> asyncio.Future[WeightManifest]:
        if version not in self._results:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
            self._results[version] = future
            while len(self._results) > KEEP_RESULTS:
                del self._results[min(self._results)]
        return self._results[version]

    async def _on_manifest(self, manifest: WeightManifest, delivery: Delivery) -> None:
        future = self._future(manifest.version)
        if not future.done():
            future.set_result(manifest)

    async def _on_failed(self, failed: WeightPublishFailed, delivery: Delivery) -> None:
        future = self._future(failed.version)
        if not future.done():
            future.set_exception(PublishFailedError(f"{failed.model} v{failed.version}: {failed.reason}"))

    async def publish(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int, *, keyframe: bool = False) -> WeightPublishAccepted:
        """Hand `weights` (a state dict, or a safetensors file/directory) to the publisher as `version`."""
        await self.start()
        attributes: dict[str, AttributeValue] = {"rose.model": self.model, "rose.weight_version": version, "rose.keyframe": keyframe}
        with tracer().start_as_current_span("weights.client_publish", kind=SpanKind.PRODUCER, attributes=attributes):
            return await self._publish(weights, version, keyframe)

    async def _publish(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int, keyframe: bool) -> WeightPublishAccepted:
        request_id = uuid.uuid4().hex
        earlier = self._results.get(version)
        if earlier is not None and earlier.done() and (earlier.cancelled() or earlier.exception() is not None):
            del self._results[version]  # asked for again after it failed: wait for this attempt's outcome
        self._future(version)
        if isinstance(weights, (str, Path)):
            request = WeightPublishRequest(
                request_id=request_id, model=self.model, version=version, source="path", path=str(Path(weights).resolve()), keyframe=keyframe
            )
        elif self.staging_dir is not None:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            path = await asyncio.to_thread(save_safetensors, weights, self.staging_dir / f"{self.model}-v{version}-{request_id[:8]}.safetensors")
            request = WeightPublishRequest(
                request_id=request_id,
                model=self.model,
                version=version,
                source="path",
                path=str(path.resolve()),
                keyframe=keyframe,
                delete_source=True,
            )
        else:
            blob = await asyncio.to_thread(safetensors_blob, weights)
            name = f"{self.model}/v{version}-{request_id[:8]}.safetensors"
            await WeightStore(self.bus.js, WEIGHTS_STAGING_OBJECTS.bucket).put(name, blob)
            request = WeightPublishRequest(
                request_id=request_id, model=self.model, version=version, source="object", object_name=name, keyframe=keyframe, delete_source=True
            )
        return await self.bus.request(WEIGHT_PUBLISH, request, timeout=REQUEST_TIMEOUT_S, model=self.model)

    async def published(self, version: int, timeout: float = DEFAULT_PUBLISHED_TIMEOUT_S) -> WeightManifest:
        """The manifest of `version` once it is published (also if another client published it)."""
        await self.start()
        future = self._future(version)
        if not future.done():
            stored = await self._stored(version)
            if stored is not None:
                return stored
        return await asyncio.wait_for(asyncio.shield(future), timeout)

    async def last_version(self) -> int | None:
        """The newest version of this model on the manifest stream (whoever published it), None if there is none.

        The stream, not the publisher, is the record: a restarted publisher forgets what it
        accepted, executors do not (they refuse a version not newer than the one they run), so a
        trainer that resumes or starts a new run numbers its next version after this one.
        """
        info = await self.bus.js.stream_info(MANIFESTS_STREAM.name, subjects_filter=WEIGHT_MANIFEST.pattern(model=self.model))
        versions = [int(v) for v in (s.rsplit(".", 1)[-1] for s in (info.state.subjects or {})) if v.isdigit()]
        return max(versions, default=None)

    async def _stored(self, version: int) -> WeightManifest | None:
        for kind in ("delta", "keyframe"):
            try:
                msg = await self.bus.js.get_last_msg(
                    MANIFESTS_STREAM.name, WEIGHT_MANIFEST.subject(model=self.model, kind=kind, version=str(version))
                )
            except Exception:
                continue
            return decode(msg.data or b"", WeightManifest, WEIGHT_MANIFEST.encoding)
        return None
