"""Key-value buckets: typed put / get / compare-and-set / delete / list, and watches that survive a server restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from rose.contracts.registry import Channel

from .bus_dead_letters import BusDeadLetters
from .bus_errors import KvConflict
from .codec import PayloadError, decode, encode
from .config import BusConfig

log = logging.getLogger("rose.bus")


@dataclass
class _KvWatch:
    """A `Bus.kv_watch`: what it watches and for whom, and the task delivering it now (replaced on reconnect)."""

    channel: Channel
    keys: str
    handler: Callable[[str, Any | None], Awaitable[None]]
    loop: asyncio.Task[None] | None = None
    restart: asyncio.Future[None] | None = None


class BusKeyValue(BusDeadLetters):
    """The registry's KV channels: each a bucket, opened once per connection."""

    def __init__(self, config: BusConfig, *, service: str, instance: str) -> None:
        super().__init__(config, service=service, instance=instance)
        self._kv: dict[str, KeyValue] = {}
        self._watches: list[_KvWatch] = []

    async def _bucket(self, channel: Channel) -> KeyValue:
        assert channel.kv is not None, f"channel {channel.name!r} is not a KV channel"
        kv = self._kv.get(channel.kv.bucket)
        if kv is None:
            kv = self._kv[channel.kv.bucket] = await self.js.key_value(channel.kv.bucket)
        return kv

    def _kv_refusals(self, channel: Channel, key: str | None = None) -> Any:
        assert channel.kv is not None, f"channel {channel.name!r} is not a KV channel"
        return self.permission_errors(f"$KV.{channel.kv.bucket}.{key}" if key else None, stream=f"KV_{channel.kv.bucket}")

    async def kv_put(self, channel: Channel, message: Any, **tokens: str) -> int:
        key = channel.subject(**tokens)
        with self._kv_refusals(channel, key):
            kv = await self._bucket(channel)
            return await kv.put(key, encode(message, channel.encoding))

    async def kv_entry(self, channel: Channel, **tokens: str) -> tuple[Any | None, int]:
        """The decoded value (None when absent or deleted) and the key's revision (0 when it never existed),
        for a compare-and-set with `kv_swap`. An undecodable value reads as None at its revision."""
        assert channel.payload is not None
        key = channel.subject(**tokens)
        with self._kv_refusals(channel, key):
            kv = await self._bucket(channel)
            try:
                entry = await kv.get(key)
            except KeyNotFoundError as exc:  # absent, or deleted (a delete marker has a revision too)
                return None, int(getattr(getattr(exc, "entry", None), "revision", 0) or 0)
        try:
            return decode(entry.value or b"", channel.payload, channel.encoding), int(entry.revision or 0)
        except PayloadError:
            return None, int(entry.revision or 0)

    async def kv_swap(self, channel: Channel, message: Any, *, revision: int, **tokens: str) -> int:
        """Write only if the key is still at `revision` (0: only if it does not exist); returns the new revision.

        Raises `KvConflict` when another writer got there first: the caller re-reads and decides again.
        """
        key = channel.subject(**tokens)
        data = encode(message, channel.encoding)
        with self._kv_refusals(channel, key):
            kv = await self._bucket(channel)
            try:
                if revision:
                    return await kv.update(key, data, last=revision)
                return await kv.create(key, data)
            except KeyWrongLastSequenceError as exc:
                raise KvConflict(key, revision) from exc

    async def kv_get(self, channel: Channel, **tokens: str) -> Any | None:
        """The decoded value, or None when the key is absent or deleted."""
        assert channel.payload is not None
        self.reads.add(channel.name)
        with self._kv_refusals(channel):
            kv = await self._bucket(channel)
            try:
                entry = await kv.get(channel.subject(**tokens))
            except KeyNotFoundError:
                return None
        if entry.value is None:
            return None
        return decode(entry.value, channel.payload, channel.encoding)

    async def kv_delete(self, channel: Channel, **tokens: str) -> None:
        key = channel.subject(**tokens)
        with self._kv_refusals(channel, key):
            kv = await self._bucket(channel)
            try:
                await kv.delete(key)
            except KeyNotFoundError:
                pass

    async def kv_values(self, channel: Channel) -> list[Any]:
        """Every live value in the channel's bucket; undecodable entries are skipped with a warning.

        Keys come from the bucket's stream info, not from a watch: reading a bucket then needs
        no JetStream consumer, a right services only get on storage they cannot write.
        """
        assert channel.payload is not None and channel.kv is not None
        prefix = f"$KV.{channel.kv.bucket}."
        out = []
        self.reads.add(channel.name)
        with self._kv_refusals(channel):
            kv = await self._bucket(channel)
            info = await self.js.stream_info(f"KV_{channel.kv.bucket}", subjects_filter=f"{prefix}>")
            for subject in sorted(info.state.subjects or {}):
                key = subject[len(prefix) :]
                try:
                    entry = await kv.get(key)
                except KeyNotFoundError:  # deleted (or purged) since the listing
                    continue
                if entry.value:
                    try:
                        out.append(decode(entry.value, channel.payload, channel.encoding))
                    except PayloadError as exc:
                        log.warning("skipping KV entry %s: %s", key, exc.reason)
        return out

    async def kv_watch(self, channel: Channel, handler: Callable[[str, Any | None], Awaitable[None]], **tokens: str) -> None:
        """Call `handler(key, value)` for the current value and every change; value None means deleted.

        Tokens not given match any key. An undecodable value is dead-lettered and skipped. After a
        reconnect the watch starts over from the current values (`_rewatch`), so a handler may see a
        value twice: handlers apply state, which makes that harmless.
        """
        self.reads.add(channel.name)
        watch = _KvWatch(channel, channel.pattern(**tokens) if len(tokens) < len(channel.tokens) else channel.subject(**tokens), handler)
        await self._start_watch(watch)  # refused or unreachable now: the caller hears it
        self._watches.append(watch)

    async def _start_watch(self, watch: _KvWatch) -> None:
        with self._kv_refusals(watch.channel):
            kv = await self._bucket(watch.channel)
            watcher = await kv.watch(watch.keys)

        async def loop() -> None:
            try:
                async for entry in watcher:
                    if entry is None:  # end of the initial values
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        await watch.handler(entry.key, None)
                        continue
                    try:
                        value = await self._accept(watch.channel, entry.value, f"$KV.{watch.channel.kv.bucket}.{entry.key}", None)  # type: ignore[union-attr]
                    except PayloadError:
                        continue
                    try:
                        await watch.handler(entry.key, value)
                    except Exception:
                        log.exception("KV watch handler for %s failed", entry.key)
            finally:
                try:
                    await watcher.stop()
                except Exception:
                    pass

        self._tasks[:] = [t for t in self._tasks if not t.done()]
        watch.loop = asyncio.create_task(loop(), name=f"kv-watch:{watch.channel.name}")
        self._tasks.append(watch.loop)

    async def _rewatch(self, watch: _KvWatch) -> None:
        """Replace a watch after a reconnect, retrying until JetStream answers again.

        Why: nats.py's ordered consumer notices that its consumer is gone (a restarted server keeps the
        bucket, not the ephemeral consumer) only after two missed idle heartbeats, 10-20 s. An executor's
        lease watch was that stale after a NATS restart (`rose bench elastic`, 2026-12-05: the scheduler
        granted leases the executor did not hear of for 11-14 s, and it refused every turn routed there).
        """
        if watch.loop is not None:
            watch.loop.cancel()
        delay = 0.1
        while not self._closing:
            try:
                await self._start_watch(watch)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # JetStream not back yet, or the connection dropped again
                log.info("re-watching %s after a reconnect: %r; again in %.1fs", watch.keys, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    def _rewatch_all(self) -> None:
        """After a reconnect: every watch starts over (`_rewatch`), replacing a restart still under way."""
        for watch in self._watches:
            if watch.restart is not None:
                watch.restart.cancel()
            watch.restart = asyncio.ensure_future(self._rewatch(watch))

    def _stop_rewatching(self) -> None:
        """Closing: no watch starts over any more."""
        for watch in self._watches:
            if watch.restart is not None:
                watch.restart.cancel()
