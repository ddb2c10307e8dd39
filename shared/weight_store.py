"""Weight shards in a JetStream Object Store: the standard layout, our own fast paths.

Objects are written exactly as nats-py (and the Go client) write them: chunks on
`$O.<bucket>.C.<nuid>`, then one meta message on `$O.<bucket>.M.<base64(name)>` with the
nats-py `ObjectInfo` JSON and a rollup header, so `js.object_store(bucket).get(name)` from
any client reads our shards, and we read theirs.

Why not nats-py's own `put`/`get` (measured, anchors.md and `rose bench weights`): `put` waits
for an ack per 128 KiB chunk (~120 MB/s on loopback) and `get` runs the ordered push consumer
and builds the object with `bytes +=` (quadratic; ~58 MB/s even with `writeinto`). Here:

* `put` publishes big chunks (`DEFAULT_CHUNK_BYTES`, under the server's 8 MiB max_payload)
  with `publish_async`, keeping a window of bytes in flight instead of one chunk.
* `fetch` asks the stream for the chunks with a batched *direct get* (no consumer to create
  or delete, any number of readers), writes each chunk into a preallocated buffer at its
  offset and tells the sink, which decodes what is complete while the rest is in flight.
  Size and SHA-256 are checked against the object's meta; an object larger than the caller
  allows is refused before a byte of it is fetched.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)

from rose.contracts.weights import FailureKind

from .errors import WeightError

DEFAULT_CHUNK_BYTES = 2 << 20  # fastest on loopback in our measurements (1, 2 and 4 MiB tried)
PUT_WINDOW_BYTES = 64 << 20  # unacknowledged bytes in flight per put
FETCH_WINDOW_BYTES = 48 << 20  # bytes asked for per direct-get batch (the subscription holds them)
FETCH_TIMEOUT_S = 10.0  # longest silence while a batch is streaming in
# A direct get is answered by any replica of the stream, and a follower may not have applied chunks the
# leader has committed (the meta, read from another replica, already names them): "no messages" before
# the object is complete is asked again, from the same sequence, for this long before it counts as a
# truncated object. Seen on docker compose's 3-node cluster (R3): "chunks hold 0 bytes" for a version
# the leader had stored (scripts/compose-check, 4 December 2026).
REPLICA_LAG_S = 5.0
REPLICA_RETRY_S = 0.05
STATUS_NO_MESSAGES = ("404", "408")
STATUS_END_OF_BATCH = "204"


class Sink(Protocol):
    """Where a fetch writes: a preallocated buffer, and a callback as it fills."""

    buffer: bytearray

    def advance(self, filled: int) -> None: ...


class _BufferSink:
    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)

    def advance(self, filled: int) -> None:
        pass


def _meta_subject(bucket: str, name: str) -> str:
    return OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())


def _digest(h: hashlib._Hash) -> str:
    return OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(h.digest()).decode())


class WeightStore:
    """Fast put/fetch of objects in one object-store bucket (which provisioning created)."""

    def __init__(self, js: JetStreamContext, bucket: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= 8 << 20:
            raise ValueError(f"chunk_bytes must be in 1..{8 << 20} (the server's max_payload), got {chunk_bytes}")
        self.js = js
        self.bucket = bucket
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        self.chunk_bytes = chunk_bytes
        self._objects = ObjectStore(bucket, self.stream, js)  # nats-py's, for info/delete/list

    # ---- writing ---------------------------------------------------------------------

    async def put(self, name: str, data: bytes | bytearray | memoryview, *, description: str | None = None) -> api.ObjectInfo:
        """Store `data` under `name` (replacing any previous object of that name)."""
        view = memoryview(data).cast("B")
        nuid = self.js._nc._nuid.next().decode()
        chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=nuid)
        try:
            previous = await self._objects.get_info(name)
        except (ObjectNotFoundError, NotFoundError):
            previous = None
        h = hashlib.sha256()
        inflight: deque[tuple[asyncio.Future, int]] = deque()
        pending = 0
        chunks = 0
        try:
            for start in range(0, len(view), self.chunk_bytes):
                piece = view[start : start + self.chunk_bytes]
                h.update(piece)
                inflight.append((await self.js.publish_async(chunk_subject, piece.tobytes()), len(piece)))
                pending += len(piece)
                chunks += 1
                while pending > PUT_WINDOW_BYTES:
                    future, size = inflight.popleft()
                    await future
                    pending -= size
            for future, _ in inflight:
                await future
            info = api.ObjectInfo(
                name=name,
                description=description,
                bucket=self.bucket,
                nuid=nuid,
                size=len(view),
                chunks=chunks,
                mtime=datetime.now(UTC).isoformat(),
                digest=_digest(h),
                options=api.ObjectMetaOptions(max_chunk_size=self.chunk_bytes),
            )
            await self.js.publish(
                _meta_subject(self.bucket, name),
                json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
            )
        except BaseException:
            for future, _ in inflight:
                future.cancel()
            await self.js.purge_stream(self.stream, subject=chunk_subject)
            raise
        if previous is not None and not previous.deleted:
            await self.js.purge_stream(self.stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=previous.nuid))
        return info

    async def delete(self, name: str) -> None:
        try:
            await self._objects.delete(name)
        except (ObjectNotFoundError, NotFoundError):
            pass

    async def names(self) -> list[str]:
        """Names of the live objects of the bucket."""
        try:
            return [i.name for i in await self._objects.list(ignore_deletes=True) if not i.deleted]
        except nats.js.errors.NotFoundError:
            return []

    # ---- reading ---------------------------------------------------------------------

    async def info(self, name: str) -> api.ObjectInfo:
        try:
            return await self._objects.get_info(name)
        except (ObjectNotFoundError, NotFoundError):
            raise WeightError("missing", f"object {name!r} is not in bucket {self.bucket!r}") from None
        except nats.js.errors.BadObjectMetaError as exc:
            raise WeightError("corrupt", f"object {name!r} has unreadable meta: {exc!r}") from exc

    async def get(self, name: str, *, max_bytes: int | None = None) -> bytearray:
        """The whole object in one buffer."""
        sink: list[_BufferSink] = []

        def make(size: int) -> _BufferSink:
            sink.append(_BufferSink(size))
            return sink[0]

        await self.fetch(name, make, max_bytes=max_bytes)
        return sink[0].buffer

    async def fetch(
        self,
        name: str,
        make_sink: Callable[[int], Sink],
        *,
        max_bytes: int | None = None,
        expect_size: int | None = None,
        verify_digest: bool = True,
    ) -> api.ObjectInfo:
        """Stream object `name` into `make_sink(size)`, calling `sink.advance(filled)` per chunk.

        `verify_digest=False` skips the object's own SHA-256 for callers that verify a digest
        of the very same bytes themselves (a dense shard's content digest), so a keyframe is
        hashed once, not twice.

        Raises WeightError: `missing` (no such object), `oversized` (bigger than `max_bytes`, or
        than `expect_size` when given), `corrupt` (chunks that do not add up to the meta's size
        or digest, i.e. a truncated or damaged chunk).
        """
        info = await self.info(name)
        if info.options is not None and info.options.link is not None:
            raise WeightError("corrupt", f"object {name!r} is a link; weight shards are never links")
        size = int(info.size or 0)
        if max_bytes is not None and size > max_bytes:
            raise WeightError("oversized", f"object {name!r} has {size} bytes, more than the allowed {max_bytes}")
        if expect_size is not None and size != expect_size:
            kind: FailureKind = "oversized" if size > expect_size else "corrupt"
            raise WeightError(kind, f"object {name!r} has {size} bytes, the manifest says {expect_size}")
        sink = make_sink(size)
        view = memoryview(sink.buffer)
        h = hashlib.sha256() if verify_digest else None
        filled = 0
        if size:
            filled = await self._stream_chunks(name, info, view, h, sink)
        if filled != size:
            raise WeightError("corrupt", f"object {name!r}: chunks hold {filled} bytes, its meta says {size} (truncated)")
        want = (info.digest or "").replace(OBJ_DIGEST_TYPE, "").replace(OBJ_DIGEST_TYPE.upper(), "")
        if h is not None and base64.urlsafe_b64decode(want) != h.digest():
            raise WeightError("corrupt", f"object {name!r}: SHA-256 of its chunks does not match its meta (a corrupted chunk)")
        return info

    async def _stream_chunks(self, name: str, info: api.ObjectInfo, view: memoryview, h: hashlib._Hash | None, sink: Sink) -> int:
        nc = self.js._nc
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
        api_subject = f"{api.DEFAULT_PREFIX}.DIRECT.GET.{self.stream}"
        chunk_hint = max(1, int(info.options.max_chunk_size) if info.options and info.options.max_chunk_size else self.chunk_bytes)
        size, filled, seq = len(view), 0, 1
        lagging_since: float | None = None  # a replica answered "no messages" before the object was complete
        while filled < size:
            batch = max(1, FETCH_WINDOW_BYTES // chunk_hint)
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, pending_bytes_limit=2 * FETCH_WINDOW_BYTES + (16 << 20), pending_msgs_limit=-1)
            try:
                request = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": FETCH_WINDOW_BYTES}
                await nc.publish(api_subject, json.dumps(request).encode(), reply=inbox)
                got_any = False
                while True:
                    try:
                        msg = await sub.next_msg(timeout=FETCH_TIMEOUT_S)
                    except nats.errors.TimeoutError:
                        raise WeightError("corrupt", f"object {name!r}: no chunk within {FETCH_TIMEOUT_S}s at byte {filled} of {size}") from None
                    status = (msg.headers or {}).get(api.Header.STATUS)
                    if status == STATUS_END_OF_BATCH or (status in STATUS_NO_MESSAGES and got_any):
                        break
                    if status in STATUS_NO_MESSAGES:
                        now = asyncio.get_running_loop().time()
                        lagging_since = now if lagging_since is None else lagging_since
                        if now - lagging_since >= REPLICA_LAG_S:
                            return filled  # no (more) chunks on any replica asked: truncated
                        break  # a follower behind the leader, maybe: ask again (below)
                    if status:
                        raise WeightError("corrupt", f"object {name!r}: direct get answered {status} {msg.headers}")
                    got_any, lagging_since = True, None
                    n = len(msg.data)
                    if filled + n > size:
                        raise WeightError("corrupt", f"object {name!r}: chunks exceed its meta size of {size} bytes")
                    view[filled : filled + n] = msg.data
                    if h is not None:
                        h.update(msg.data)
                    filled += n
                    sink.advance(filled)
                    seq = int((msg.headers or {}).get("Nats-Sequence", seq)) + 1
                    if filled == size:
                        break
            finally:
                await sub.unsubscribe()
            if lagging_since is not None and filled < size:
                await asyncio.sleep(REPLICA_RETRY_S)
        return filled
