"""The executor side of weight sync: follow a model's versions and apply each one whole, or not at all.

    follower = WeightFollower(bus, model="policy", apply=apply, tensor_filter=None)
    await follower.start(current_state_dict, current_version)
    ...
    await follower.stop()

`apply(state_dict, version)` is the executor's coroutine: it gets the *whole* tensors of every
shard that changed (only those passing `tensor_filter`, e.g. a tensor-parallel rank's slice),
swaps them in at an iteration boundary and returns the pause in ms (or None). It may raise to
refuse the version. A version that changed no shard this follower holds (a trainer step that
moved no weight, or none of this rank's) still reaches it, as an empty state dict: the executor
then labels its later tokens with the new version, between iterations as any swap, copying nothing.

How a version is taken (`_advance`): check the manifest against the model (names, shapes,
dtypes, shard sizes) before fetching anything; fetch only the shards holding wanted tensors,
decoding each as its chunks arrive; rebuild every shard from the held base (a delta) or from
scratch (a keyframe) into *new* buffers; verify the SHA-256 of every decoded shard. Only then
is `apply` called, and only when it returns are the new buffers held. With a `verifier`, the
manifest's Ed25519 signature is checked before anything else (shared/weight_signing.py): an
unsigned, untrusted or altered manifest is refused (kind `signature`) and dead-lettered
(`unauthorised`) without fetching a byte. Any failure publishes a
`WeightFailed` with a kind and a reason, keeps the previous version serving, and then:
refetches once (a damaged transfer), catches up from the latest keyframe plus the deltas
after it (a missing base), or waits for the next keyframe (a chain that cannot be repaired).

A new executor joins the same way: the manifest stream keeps one subject per version, so the
latest keyframe is one lookup, and each later delta another. The follower publishes
`WeightApplied` / `WeightFailed` itself.

Each manifest taken runs in a `weights.apply` span that continues the trace of the manifest's
publish (the context rides the queue with the manifest), so one trace goes from a trainer's
publish through the publisher to every executor's apply and its `WeightApplied` event. The
initial sync (a joining executor's catch-up) runs in one too, in the trace of the version it
catches up to (the context read back from the stored manifest's headers).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import get_args

import numpy as np
import torch
from nats.js.errors import NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.util.types import AttributeValue

from rose.contracts.registry import MANIFESTS_STREAM, WEIGHT_APPLIED, WEIGHT_FAILED, WEIGHT_MANIFEST, WEIGHTS_OBJECTS
from rose.contracts.weights import FailureKind, ShardInfo, WeightApplied, WeightFailed, WeightManifest

from .bus import Bus, Delivery
from .codec import PayloadError, decode, encode
from .errors import WeightError
from .metrics import LATENCY_BUCKETS_S, meter, metric_name
from .tracing import tracer
from .weight_codec import CodecError, ShardDecoder
from .weight_layout import dtype_name, fits_live, tensor_bytes, tensor_from_bytes
from .weight_signing import ManifestVerifier, SignatureError
from .weight_store import WeightStore

log = logging.getLogger("rose.weight_sync")

DEFAULT_MAX_SHARD_BYTES = 4 << 30  # refuse shards bigger than this (decoded or on the wire)
FETCH_CONCURRENCY = 4  # shards fetched at once
REFETCH_ATTEMPTS = 1  # after a damaged transfer or a wrong digest
STOP_GRACE_S = 5.0  # how long stop() lets the version in hand finish

ApplyFn = Callable[[dict[str, torch.Tensor], int], Awaitable[float | None]]

_m = meter()
APPLIED = _m.create_counter(
    metric_name("weights.applied"), unit="{version}", description="Weight versions verified and swapped in, per executor and model."
)
FAILED = _m.create_counter(
    metric_name("weights.failed"), unit="{version}", description="Weight versions refused, per executor, model and failure kind."
)
FETCHED = _m.create_counter(
    metric_name("weights.fetched"), unit="By", description="Weight bytes fetched from the object store (on the wire), per executor."
)
APPLY_LATENCY = _m.create_histogram(
    metric_name("weights.apply_latency"),
    unit="s",
    description="Manifest received to version serving (fetch, decode, verify, swap).",
    explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
)

TensorFilter = Callable[[str], bool]


@dataclass
class Held:
    """A verified version: its manifest and the decoded bytes of every shard this follower needs."""

    version: int
    manifest: WeightManifest
    shards: dict[int, np.ndarray]


@dataclass
class FollowerStats:
    applied: int = 0
    failed: int = 0
    fetched_bytes: int = 0
    last_pause_ms: float = 0.0
    failures: list[WeightFailed] = field(default_factory=list)


def _sha256(buf: np.ndarray) -> str:
    return hashlib.sha256(buf.data.cast("B")).hexdigest()


class WeightFollower:
    def __init__(
        self,
        bus: Bus,
        *,
        model: str,
        apply: ApplyFn,
        tensor_filter: TensorFilter | None = None,
        executor_id: str | None = None,
        bucket: str = WEIGHTS_OBJECTS.bucket,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        refetch_attempts: int = REFETCH_ATTEMPTS,
        digest: Callable[[], Awaitable[str]] | None = None,
        verifier: ManifestVerifier | None = None,
    ) -> None:
        """`digest`, when given, is awaited after each swap and reported as `params_sha256`.

        `verifier`, when given, must accept a manifest's signature before anything of it is
        fetched; None takes unsigned manifests (library use and tests; the executor service
        passes one unless `weights.require_signed` is false).
        """
        self.bus = bus
        self.verifier = verifier
        self._dead_lettered: set[tuple[int, str, str]] = set()
        self._digest_fn = digest
        self.model = model
        self.executor_id = executor_id or bus.instance
        self._apply_fn = apply
        self._filter = tensor_filter or (lambda name: True)
        self.store = WeightStore(bus.js, bucket)
        self.max_shard_bytes = max_shard_bytes
        self.refetch_attempts = refetch_attempts
        self.stats = FollowerStats()
        self.version: int | None = None  # the version serving now
        self._held: Held | None = None  # its shard bytes, once known
        self._initial: dict[str, np.ndarray] = {}  # the start state, until laid out as shards
        self._known: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape) of the model
        self._queue: asyncio.Queue[tuple[WeightManifest, float, otel_context.Context] | None] = asyncio.Queue()
        self._stopping = False
        self._worker: asyncio.Task[None] | None = None
        self._synced_at = 0.0
        self._changed = asyncio.Condition()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, current_state_dict: Mapping[str, torch.Tensor] | None, current_version: int | None) -> None:
        """Follow from the executor's current weights; catch up with what was published meanwhile."""
        state = {n: t for n, t in (current_state_dict or {}).items() if self._filter(n)}
        self._known = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}
        self._initial = {n: tensor_bytes(t).copy() for n, t in state.items()}
        self.version = current_version
        labels = {"executor": self.executor_id, "model": self.model}
        for counter in (APPLIED, FETCHED):  # exported at 0 from the start: a dashboard shows 0, not "No data"
            counter.add(0, labels)
        for kind in get_args(FailureKind):
            FAILED.add(0, {**labels, "kind": kind})
        await self.bus.subscribe(WEIGHT_MANIFEST, self._on_manifest, model=self.model)
        await self._initial_sync()
        self._worker = asyncio.create_task(self._work(), name=f"weight-follower:{self.model}")

    async def stop(self) -> None:
        """Finish the version in hand (up to `STOP_GRACE_S`), then stop taking new ones.

        Stopping is a sentinel in the queue rather than only `cancel()`: on Python 3.11 a
        cancellation that lands as a nats-py request completes can be swallowed by
        `asyncio.wait_for`, which would leave the worker waiting forever.
        """
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._stopping = True
        self._queue.put_nowait(None)
        done, _ = await asyncio.wait([worker], timeout=STOP_GRACE_S)
        while not done:
            worker.cancel()
            done, _ = await asyncio.wait([worker], timeout=0.5)

    async def wait_for_version(self, version: int, timeout: float) -> int | None:
        """Wait until at least `version` is serving (or the timeout); returns the version serving."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version is not None and self.version >= version), timeout)
            except TimeoutError:
                pass
        return self.version

    # ---- receiving -------------------------------------------------------------------

    async def _on_manifest(self, manifest: WeightManifest, delivery: Delivery) -> None:
        if not self._stopping:
            self._queue.put_nowait((manifest, time.perf_counter(), otel_context.get_current()))  # the publish's trace goes along

    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None or self._stopping:
                return
            manifest, arrived, ctx = item
            token = otel_context.attach(ctx)
            try:
                with tracer().start_as_current_span(
                    "weights.apply",
                    attributes={
                        "rose.executor_id": self.executor_id,
                        "rose.model": self.model,
                        "rose.weight_version": manifest.version,
                        "rose.weight_kind": manifest.kind,
                        "rose.wire_bytes": manifest.wire_bytes,
                    },
                ):
                    try:
                        await self._take(manifest, arrived)
                    except Exception as exc:  # a bug must not stop the follower; report and go on
                        log.exception("taking version %s failed", manifest.version)
                        await self._fail(manifest.version, WeightError("other", f"{type(exc).__name__}: {exc}"), "none")
            finally:
                otel_context.detach(token)

    async def _take(self, m: WeightManifest, arrived: float) -> None:
        if self.version is not None and m.version <= self.version:
            if arrived >= self._synced_at:  # not merely overtaken by a catch-up
                await self._fail(m.version, WeightError("stale", f"version {m.version} is not newer than the serving version {self.version}"), "none")
            return
        attempts = 0
        while True:
            try:
                held = await self._advance(m, await self._base(m.base_version))
                break
            except WeightError as err:
                if err.kind == "signature":
                    await self._fail(m.version, err, "none")  # the next version signed by a trusted key is taken
                    return
                if err.kind == "missing_base":
                    await self._fail(m.version, err, "catch_up")
                    await self._catch_up(arrived)
                    return
                if err.kind in ("digest", "corrupt", "missing") and attempts < self.refetch_attempts:
                    attempts += 1
                    await self._fail(m.version, err, "refetch")
                    continue
                await self._fail(m.version, err, "wait_keyframe")
                return
        await self._commit(held, arrived, behind=0)

    # ---- joining and catching up -----------------------------------------------------

    async def _initial_sync(self) -> None:
        """Join at the latest version, in a `weights.apply` span of that version's publish trace
        (its context is in the manifest's headers), so a late joiner's apply is in the trace too."""
        latest, headers = await self._lookup_with_headers(kind=None)
        if latest is None or (self.version is not None and latest.version <= self.version):
            self._synced_at = time.perf_counter()
            return
        attributes: dict[str, AttributeValue] = {
            "rose.executor_id": self.executor_id,
            "rose.model": self.model,
            "rose.weight_version": latest.version,
            "rose.weight_kind": latest.kind,
            "rose.wire_bytes": latest.wire_bytes,
            "rose.catch_up": True,
        }
        with tracer().start_as_current_span("weights.apply", context=propagate.extract(headers or {}), attributes=attributes):
            await self._catch_up(time.perf_counter())

    async def _catch_up(self, arrived: float) -> None:
        """Reach the latest published version: from the held one if its chain is intact, else from the latest keyframe."""
        latest = await self._lookup(kind=None)
        keyframe = await self._lookup(kind="keyframe")
        self._synced_at = time.perf_counter()
        if latest is None or (self.version is not None and latest.version <= self.version):
            return
        base = await self._base(self.version)
        chain_from = base
        if base is None or (keyframe is not None and keyframe.version > base.version):
            if keyframe is None:
                log.warning("no keyframe of %s published yet; waiting for one", self.model)
                return
            try:
                chain_from = await self._advance(keyframe, None)
            except WeightError as err:
                await self._fail(keyframe.version, err, "wait_keyframe")
                return
        assert chain_from is not None
        held, behind = chain_from, 0
        for version in range(chain_from.version + 1, latest.version + 1):
            m = await self._lookup(version=version)
            if m is None:
                break
            try:
                held = await self._advance(m, held)
            except WeightError as err:
                await self._fail(version, err, "wait_keyframe")
                break
            behind += 1
        if self.version is None or held.version > self.version:
            await self._commit(held, arrived, behind)

    async def _base(self, version: int | None) -> Held | None:
        """The held version; at first, the start weights laid out as `version`'s shards (if they verify)."""
        if self._held is None and self._initial:
            self._held = await self._establish(version)
        return self._held

    async def _lookup(self, *, kind: str | None = None, version: int | None = None) -> WeightManifest | None:
        """The last manifest of the model (of a kind), or the one of a version; None if not there."""
        return (await self._lookup_with_headers(kind=kind, version=version))[0]

    async def _lookup_with_headers(
        self, *, kind: str | None = None, version: int | None = None
    ) -> tuple[WeightManifest | None, dict[str, str] | None]:
        """`_lookup`, and the headers the manifest was published with (its publish's trace context)."""
        if version is not None:
            subjects = [WEIGHT_MANIFEST.subject(model=self.model, kind=k, version=str(version)) for k in ("delta", "keyframe")]
        elif kind is not None:
            subjects = [WEIGHT_MANIFEST.pattern(model=self.model, kind=kind)]
        else:
            subjects = [WEIGHT_MANIFEST.pattern(model=self.model)]
        for subject in subjects:
            try:
                msg = await self.bus.js.get_last_msg(MANIFESTS_STREAM.name, subject)
            except NotFoundError:
                continue
            try:
                return decode(msg.data or b"", WeightManifest, WEIGHT_MANIFEST.encoding), msg.headers
            except PayloadError as exc:
                log.warning("unreadable manifest on %s: %s", subject, exc.reason)
        return None, None

    # ---- one version -----------------------------------------------------------------

    def _wanted(self, m: WeightManifest) -> tuple[dict[str, tuple[int, int, int]], set[int]]:
        """Check the manifest against the model; the wanted tensors' (shard, offset, nbytes) and shards."""
        sizes = {s.shard_id: s for s in m.shards}
        if len(sizes) != len(m.shards):
            raise WeightError("corrupt", f"version {m.version} lists a shard twice")
        slots: dict[str, tuple[int, int, int]] = {}
        for t in m.tensors:
            if not self._filter(t.name):
                continue
            if self._known and t.name not in self._known:
                raise WeightError("unknown_tensor", f"version {m.version} names tensor {t.name!r}, which the model does not have")
            if self._known and (tuple(t.shape) != self._known[t.name][1] or not fits_live(t.dtype, self._known[t.name][0])):
                dtype, shape = self._known[t.name]
                raise WeightError("shape", f"version {m.version}: tensor {t.name!r} is {t.dtype}{list(t.shape)}, the model has {dtype}{list(shape)}")
            shard = sizes.get(t.shard_id)
            if shard is None or t.offset + t.nbytes > shard.decoded_bytes:
                raise WeightError("corrupt", f"version {m.version}: tensor {t.name!r} lies outside its shard {t.shard_id}")
            slots[t.name] = (t.shard_id, t.offset, t.nbytes)
        missing = sorted(set(self._known) - set(slots))
        if m.keyframe and missing:
            raise WeightError("shape", f"keyframe {m.version} lacks tensors the model has: {missing[:5]}")
        shard_ids = {sid for sid, _, _ in slots.values()}
        for sid in shard_ids:
            s = sizes[sid]
            if max(s.decoded_bytes, s.wire_bytes) > self.max_shard_bytes:
                raise WeightError(
                    "oversized",
                    f"version {m.version}: shard {sid} has {max(s.decoded_bytes, s.wire_bytes)} bytes, the limit is {self.max_shard_bytes}",
                )
        return slots, shard_ids

    async def _advance(self, m: WeightManifest, base: Held | None) -> Held:
        """Build and verify version `m` from `base` (None: only a keyframe can be built)."""
        await self._check_signature(m)
        slots, shard_ids = self._wanted(m)
        if not m.keyframe and (base is None or m.base_version != base.version):
            have = "nothing" if base is None else f"version {base.version}"
            raise WeightError("missing_base", f"version {m.version} is a delta on {m.base_version}, this executor holds {have}")
        infos = {s.shard_id: s for s in m.shards}
        gate = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def one(sid: int) -> tuple[int, np.ndarray]:
            async with gate:
                return sid, await self._shard(m, infos[sid], base)

        shards = dict(await asyncio.gather(*(one(sid) for sid in sorted(shard_ids))))
        return Held(m.version, m, shards)

    async def _shard(self, m: WeightManifest, info: ShardInfo, base: Held | None) -> np.ndarray:
        old = None if base is None or m.keyframe else base.shards.get(info.shard_id)
        if not m.keyframe and old is None:
            raise WeightError("missing_base", f"version {m.version}: no base for shard {info.shard_id}")
        if info.encoding == "unchanged":
            assert base is not None and old is not None
            before = {s.shard_id: s.sha256 for s in base.manifest.shards}.get(info.shard_id)
            if before != info.sha256:
                raise WeightError(
                    "digest", f"version {m.version}: shard {info.shard_id} is marked unchanged but its digest differs from version {base.version}'s"
                )
            return old
        if m.keyframe and info.encoding != "dense":
            raise WeightError("corrupt", f"keyframe {m.version}: shard {info.shard_id} is {info.encoding}, not dense")
        decoder: list[ShardDecoder] = []

        def sink(size: int) -> ShardDecoder:
            decoder.append(ShardDecoder(size, old, self.max_shard_bytes))
            return decoder[0]

        try:
            # A dense shard's digest covers the same bytes as the object's own: hash them once.
            dense = info.encoding == "dense"
            await self.store.fetch(info.object_name, sink, max_bytes=self.max_shard_bytes, expect_size=info.wire_bytes, verify_digest=not dense)
            out, digest = await asyncio.to_thread(self._finish, decoder[0])
        except WeightError as err:
            raise WeightError(err.kind, f"version {m.version}, shard {info.shard_id}: {err.reason}") from None
        except CodecError as err:
            raise WeightError("corrupt", f"version {m.version}, shard {info.shard_id}: {err}") from None
        self.stats.fetched_bytes += info.wire_bytes
        FETCHED.add(info.wire_bytes, {"executor": self.executor_id, "model": self.model})
        if out.size != info.decoded_bytes:
            raise WeightError(
                "corrupt", f"version {m.version}: shard {info.shard_id} decodes to {out.size} bytes, the manifest says {info.decoded_bytes}"
            )
        if digest != info.sha256:
            raise WeightError(
                "digest", f"version {m.version}: shard {info.shard_id} has SHA-256 {digest[:16]}…, the manifest says {info.sha256[:16]}…"
            )
        return out

    async def _check_signature(self, m: WeightManifest) -> None:
        """Refuse (and dead-letter, once per manifest) a manifest the verifier does not accept."""
        if self.verifier is None:
            return
        try:
            self.verifier.check(m)
        except SignatureError as exc:
            seen = (m.version, m.key_id, m.signature)
            if seen not in self._dead_lettered:
                self._dead_lettered.add(seen)
                subject = WEIGHT_MANIFEST.subject(model=self.model, kind=m.kind, version=str(m.version))
                await self.bus.dead_letter(subject, "unauthorised", str(exc), encode(m, WEIGHT_MANIFEST.encoding), None)
            raise WeightError("signature", str(exc)) from None

    @staticmethod
    def _finish(decoder: ShardDecoder) -> tuple[np.ndarray, str]:
        out = decoder.finish()
        return out, _sha256(out)

    async def _establish(self, version: int | None) -> Held | None:
        """Lay the start state out as the shards of `version` and verify it; None if it does not match."""
        if version is None or version != self.version or not self._initial:
            return None
        m = await self._lookup(version=version)
        if m is None:
            return None
        try:
            await self._check_signature(m)
            slots, shard_ids = self._wanted(m)
        except WeightError:
            return None
        infos = {s.shard_id: s for s in m.shards}
        shards = {sid: np.zeros(infos[sid].decoded_bytes, dtype=np.uint8) for sid in shard_ids}
        covered = {sid: 0 for sid in shard_ids}
        for name, (sid, offset, nbytes) in slots.items():
            shards[sid][offset : offset + nbytes] = self._initial[name]
            covered[sid] += nbytes
        # A shard that also holds tensors this follower does not have cannot be rebuilt here.
        whole = {t.shard_id: 0 for t in m.tensors}
        for t in m.tensors:
            whole[t.shard_id] += t.nbytes
        if any(covered[sid] != whole.get(sid, 0) for sid in shard_ids):
            return None
        digests = await asyncio.to_thread(lambda: {sid: _sha256(buf) for sid, buf in shards.items()})
        if any(digests[sid] != infos[sid].sha256 for sid in shard_ids):
            log.warning("the start weights are not version %s as published; joining from a keyframe", version)
            return None
        self._initial = {}
        return Held(version, m, shards)

    # ---- applying --------------------------------------------------------------------

    async def _commit(self, held: Held, arrived: float, behind: int) -> None:
        # Unchanged shards are the very same buffers as the held version's: skip their tensors.
        before = self._held.shards if self._held is not None else {}
        state: dict[str, torch.Tensor] = {}
        for t in held.manifest.tensors:
            shard = held.shards.get(t.shard_id)
            if shard is not None and shard is not before.get(t.shard_id) and self._filter(t.name):
                buf = held.shards[t.shard_id][t.offset : t.offset + t.nbytes]
                state[t.name] = tensor_from_bytes(buf, t.dtype, tuple(t.shape))
        try:
            pause_ms = await self._apply_fn(state, held.version)  # {}: the version changed nothing here, only its label moves
        except Exception as exc:
            await self._fail(held.version, WeightError("apply", f"the executor refused version {held.version}: {exc}"), "wait_keyframe")
            return
        self._held, self._initial = held, {}
        async with self._changed:
            self.version = held.version
            self._changed.notify_all()
        self.stats.applied += 1
        self.stats.last_pause_ms = float(pause_ms or 0.0)
        latency_s = time.perf_counter() - arrived
        APPLIED.add(1, {"executor": self.executor_id, "model": self.model})
        APPLY_LATENCY.record(latency_s, {"executor": self.executor_id, "model": self.model})
        trace.get_current_span().set_attributes(
            {"rose.outcome": "applied", "rose.applied_version": held.version, "rose.pause_ms": float(pause_ms or 0.0)}
        )
        event = WeightApplied(
            executor_id=self.executor_id,
            model=self.model,
            version=held.version,
            at=time.time(),
            pause_ms=float(pause_ms or 0.0),
            fetched_bytes=self.stats.fetched_bytes,
            fetch_apply_ms=(time.perf_counter() - arrived) * 1000.0,
            versions_behind=behind,
            params_sha256=await self._digest_fn() if self._digest_fn is not None else "",
        )
        await self.bus.publish(WEIGHT_APPLIED, event, executor_id=self.executor_id)

    async def _fail(self, version: int, err: WeightError, next_step: str) -> None:
        log.warning("weights %s v%s refused (%s): %s; next: %s", self.model, version, err.kind, err.reason, next_step)
        event = WeightFailed(
            executor_id=self.executor_id,
            model=self.model,
            version=version,
            at=time.time(),
            reason=err.reason,
            kind=err.kind,
            kept_version=self.version,
            next_step=next_step,  # type: ignore[arg-type]
        )
        self.stats.failed += 1
        self.stats.failures.append(event)
        FAILED.add(1, {"executor": self.executor_id, "model": self.model, "kind": err.kind})
        span = trace.get_current_span()
        span.add_event(
            "weights.failed",
            {"rose.weight_version": version, "rose.failure_kind": err.kind, "rose.reason": err.reason[:256], "rose.next_step": next_step},
        )
        span.set_attribute("rose.outcome", "failed")
        try:
            await self.bus.publish(WEIGHT_FAILED, event, executor_id=self.executor_id)
        except Exception as exc:
            log.error("could not publish WeightFailed: %r", exc)
