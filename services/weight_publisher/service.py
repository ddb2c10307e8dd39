"""The weight publisher on the bus: take publish requests, publish versions one model at a time, in order.

Requests are answered as soon as they are queued (`WeightPublishAccepted`); the result is the
version's manifest on the manifest stream, or a `WeightPublishFailed` event. One publisher
instance serves a model (its last version is the base of the next delta), so the request
endpoint has no queue group.

Each version is published in a `weights.publish` span that continues the trace of its request
(the context rides the queue with it), so the manifest, and every executor's apply of it,
belong to the trainer's publish trace.

A version that fails (its source unreadable, a store error) never stalls the model: it is
reported once (`WeightPublishFailed`, the failures counter, an error span), the model's worker
goes on with the next request, whose version is a delta against the last version that was
published (or a keyframe when one is due), and the failed number may be asked for again (a
framework that retries the same version after fixing its source) unless a newer one was
accepted meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rose.contracts.registry import WEIGHT_PUBLISH, WEIGHT_PUBLISH_FAILED, WEIGHTS_OBJECTS, WEIGHTS_STAGING_OBJECTS
from rose.contracts.weights import VERSION_NOT_NEWER, WeightPublishAccepted, WeightPublishFailed, WeightPublishRequest
from rose.shared.bus import Bus, Delivery
from rose.shared.tracing import tracer
from rose.shared.weight_signing import ManifestSigner
from rose.shared.weight_store import WeightStore

from . import sources
from .config import PublisherSettings
from .telemetry import PublisherMetrics
from .versions import ModelVersions, PublishError

log = logging.getLogger("rose.weight_publisher")

# A JetStream that cannot answer for a moment: a meta or stream leader election after a node died (503
# "JetStream system temporarily unavailable"), or the connection moving to another node. A version hit by
# one is staged and announced again, for up to TRANSIENT_RETRY_S, instead of failing: on docker compose's
# 3-node cluster a `docker kill` of one node failed a publish and ended the trainer's job (scripts/compose-check).
TRANSIENT_BUS_ERRORS: tuple[type[BaseException], ...] = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    asyncio.TimeoutError,
)
TRANSIENT_RETRY_S = 60.0
TRANSIENT_BACKOFF_S = (0.5, 4.0)  # first wait, longest wait (doubling)


def raise_if_cancelling(exc: BaseException) -> None:
    """Re-raise a cancel that ``exc`` stands in for: the current task is being cancelled (a stop), and an error
    raised on the way out (nats-py's timeout for a cancelled request, an error in a `finally`) hid it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


class WeightPublisher:
    def __init__(self, bus: Bus, settings: PublisherSettings) -> None:
        self.bus = bus
        self.settings = settings
        # Loaded at construction so that a missing or unsafe key stops the service at start.
        self.signer = ManifestSigner.from_settings(settings.signing_key_file)
        log.info("signing weight manifests with key %s", self.signer.key_id)
        self.store: WeightStore | None = None  # made once the bus is connected
        self.staging: WeightStore | None = None
        self.models: dict[str, ModelVersions] = {}
        self._queues: dict[str, asyncio.Queue[tuple[WeightPublishRequest, otel_context.Context]]] = {}
        self._accepted: dict[str, int] = {}
        self._workers: list[asyncio.Task[None]] = []
        self.published = 0
        self.metrics = PublisherMetrics()

    async def start(self) -> None:
        self.store = WeightStore(self.bus.js, WEIGHTS_OBJECTS.bucket, chunk_bytes=self.settings.chunk_bytes)
        self.staging = WeightStore(self.bus.js, WEIGHTS_STAGING_OBJECTS.bucket, chunk_bytes=self.settings.chunk_bytes)
        await self.bus.serve(WEIGHT_PUBLISH, self._on_request)

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def load(self) -> dict[str, float]:
        return {"queued": float(sum(q.qsize() for q in self._queues.values())), "published": float(self.published)}

    async def _on_request(self, request: WeightPublishRequest, delivery: Delivery) -> WeightPublishAccepted:
        if delivery.tokens.get("model") != request.model:
            raise PublishError(f"request for model {request.model!r} sent on the subject of {delivery.tokens.get('model')!r}")
        last = self._accepted.get(request.model)
        if last is not None and request.version <= last:
            raise PublishError(
                f"version {request.version} of {request.model} is not newer than {last}, already accepted",
                reason=VERSION_NOT_NEWER,
                data={"latest": last},
            )
        if request.source == "path":
            sources.check_path(request.path, self.settings)
        elif not request.object_name:
            raise PublishError("a staged source needs object_name")
        self._accepted[request.model] = request.version
        queue = self._queue(request.model)
        await queue.put((request, otel_context.get_current()))  # the request's trace goes along
        return WeightPublishAccepted(request_id=request.request_id, model=request.model, version=request.version, queued=queue.qsize() - 1)

    def _queue(self, model: str) -> asyncio.Queue[tuple[WeightPublishRequest, otel_context.Context]]:
        if model not in self._queues:
            self._queues[model] = asyncio.Queue()
            assert self.store is not None, "start() first"
            self.models[model] = ModelVersions(model, self.bus, self.store, self.settings, self.signer)
            self.metrics.serving(model)
            self._workers.append(asyncio.create_task(self._work(model), name=f"publish:{model}"))
        return self._queues[model]

    async def _work(self, model: str) -> None:
        queue, versions = self._queues[model], self.models[model]
        while True:
            request, ctx = await queue.get()
            token = otel_context.attach(ctx)
            try:
                attributes: dict[str, AttributeValue] = {
                    "rose.model": model,
                    "rose.weight_version": request.version,
                    "rose.weight_source": request.source,
                    "rose.request_id": request.request_id,
                }
                with tracer().start_as_current_span("weights.publish", attributes=attributes) as span:
                    try:
                        await self.publish_one(versions, request)
                    except Exception as exc:
                        span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256])
                        await self._failed(versions, request, exc)
                        raise_if_cancelling(exc)  # stopped mid-publish: an error from a `finally` hid the cancel
            finally:
                otel_context.detach(token)

    async def _failed(self, versions: ModelVersions, request: WeightPublishRequest, exc: Exception) -> None:
        """Report a failed version once and free its number; never raises, so the model's worker goes on."""
        model = request.model
        log.error(
            "publishing %s v%s failed: %s: %s (the next version is published against v%s)",
            model,
            request.version,
            type(exc).__name__,
            exc,
            versions.last_version,
            exc_info=not isinstance(exc, PublishError),
        )
        self.metrics.failed(model)
        if self._accepted.get(model) == request.version:  # nothing newer accepted: the number may be asked for again
            if versions.last_version is None:
                self._accepted.pop(model, None)
            else:
                self._accepted[model] = versions.last_version
        failed = WeightPublishFailed(
            request_id=request.request_id, model=model, version=request.version, at=time.time(), reason=f"{type(exc).__name__}: {exc}"
        )
        try:
            await self.bus.publish(WEIGHT_PUBLISH_FAILED, failed, model=model)
        except Exception as err:  # the bus is reconnecting: the log line and the counter still say it
            log.error("could not report the failure of %s v%s: %r", model, request.version, err)

    async def publish_one(self, versions: ModelVersions, request: WeightPublishRequest) -> None:
        assert self.staging is not None, "start() first"
        started = time.perf_counter()
        tensors, release = await sources.load(request, self.staging, self.settings)
        try:
            deadline, wait = time.monotonic() + TRANSIENT_RETRY_S, TRANSIENT_BACKOFF_S[0]
            while True:
                try:
                    manifest = await versions.publish(tensors, request.version, keyframe=request.keyframe)
                    break
                except TRANSIENT_BUS_ERRORS as exc:
                    raise_if_cancelling(exc)  # nats-py may turn a cancelled request into a timeout
                    if time.monotonic() + wait > deadline:
                        raise
                    log.warning("publishing %s v%s: %s: %s; again in %.1f s", request.model, request.version, type(exc).__name__, exc, wait)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, TRANSIENT_BACKOFF_S[1])
        finally:
            release()
            if request.source == "object" and request.delete_source:
                await self.staging.delete(request.object_name)
        self.published += 1
        self.metrics.published(manifest, time.perf_counter() - started)
        trace.get_current_span().set_attributes(
            {
                "rose.weight_kind": manifest.kind,
                "rose.wire_bytes": manifest.wire_bytes,
                "rose.full_bytes": manifest.full_bytes,
                "rose.changed_fraction": manifest.changed_fraction,
            }
        )
        log.info(
            "published %s v%d (%s): %d of %d bytes on the wire, %.2f%% changed",
            manifest.model,
            manifest.version,
            manifest.kind,
            manifest.wire_bytes,
            manifest.full_bytes,
            100 * manifest.changed_fraction,
        )
