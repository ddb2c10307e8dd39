"""Prefix-cache retention for multi-turn rollouts, on the device and in host memory.

When a rollout turn finishes, its KV blocks stay in the rollout pool keyed by trajectory
id, with the exact tokens they hold and the policy version that computed them. The next
turn of that trajectory takes them over if its prompt starts with those tokens (checked
token by token, not trusted from the id) and the policy version is unchanged; then only
the new tokens are prefilled. Entries are evicted least-recently-used first when the
rollout pool must shrink.

The host tier (SGLang's HiCache, ``--enable-hierarchical-cache --hicache-write-policy
write_through``) keeps a copy of each retained entry in host memory, written when the
device entry is retained, so that neither an eviction nor a released pool (a revoked
lease) loses it and neither copies on its latency-critical path::

    RetainedPrefixes.retain ──put──▶ PrefixCache (pool blocks)      evicted LRU / released: gone
                           └─put──▶ HostTier (KVPayload on the CPU) evicted LRU within its bytes
    RetainedPrefixes.attach ──take──▶ PrefixCache hit, else HostTier hit ──▶ KVPool.write_blocks

``RetainedPrefixes`` owns both (one of each, for the rollout pool only); the rollout batcher
(batcher.py) calls it on the thread that runs rollout iterations, and nothing else does.
Both apply one matching rule (``reusable_tokens``); a weight swap clears both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from .kv_pool import KVPayload, KVPool
from .sequence import Sequence


def reusable_tokens(held: tuple[int, ...], held_version: int, prompt: tuple[int, ...], version: int) -> int:
    """How many leading tokens of ``prompt`` a retained prefix serves: 0 unless it was computed by ``version``;
    else the tokens equal to ``held``'s, position by position, leaving at least one prompt token to compute
    (the new turn needs its logits)."""
    if held_version != version:
        return 0
    limit = min(len(held), len(prompt) - 1)
    reused = 0
    while reused < limit and held[reused] == prompt[reused]:
        reused += 1
    return reused


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]  # the tokens whose KV the blocks hold, positions 0..len-1
    blocks: list[int]
    version: int


@dataclass(frozen=True)
class CacheHit:
    blocks: list[int]
    reused_tokens: int


class PrefixCache:
    def __init__(self) -> None:
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[str, CacheEntry]:
        """The retained entries by trajectory id, least recently retained first (the order eviction takes them): a copy, to read."""
        return dict(self._entries)

    @property
    def cached_blocks(self) -> int:
        return sum(len(e.blocks) for e in self._entries.values())

    def put(self, key: str, tokens: tuple[int, ...], blocks: list[int], version: int) -> list[int]:
        """Retain blocks; returns blocks of a replaced entry, which the caller frees."""
        old = self._entries.pop(key, None)
        self._entries[key] = CacheEntry(tokens, blocks, version)
        return old.blocks if old else []

    def take(self, key: str, prompt: tuple[int, ...], version: int, block_size: int) -> tuple[CacheHit | None, list[int]]:
        """Hand a matching entry to a new turn. Returns (hit or None, blocks to free).

        At least one prompt token is always left to compute, so the new turn gets logits.
        Blocks past the reused prefix are returned for freeing.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            self.misses += 1
            return None, []
        reused = reusable_tokens(entry.tokens, entry.version, prompt, version)
        if reused == 0:
            self.misses += 1
            return None, entry.blocks
        keep = -(-reused // block_size)
        self.hits += 1
        return CacheHit(entry.blocks[:keep], reused), entry.blocks[keep:]

    def evict_lru(self) -> list[int]:
        """Drop the least recently retained entry; returns its blocks (empty if none)."""
        if not self._entries:
            return []
        _, entry = self._entries.popitem(last=False)
        return entry.blocks

    def clear(self) -> list[int]:
        blocks = [b for e in self._entries.values() for b in e.blocks]
        self._entries.clear()
        return blocks


@dataclass(frozen=True)
class HostEntry:
    tokens: tuple[int, ...]  # the tokens whose KV the payload holds, positions 0..len-1
    version: int
    nbytes: int  # what it takes of the tier: its blocks x the pool's block bytes
    payload: KVPayload | None  # None: a pool without storage (an emulated device), where only bytes and time are real


@dataclass(frozen=True)
class HostHit:
    reused_tokens: int
    payload: KVPayload | None  # the whole entry's: the caller writes the blocks the reused tokens span


class HostTier:
    """Copies of retained prefixes in host memory, by trajectory id, least recently put first out,
    never more than ``capacity_bytes`` (0: off). Its entries outlive the device's: they go on an
    eviction of their own, a weight swap or a flush, never when the pool is evicted or released."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host KV tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[str, HostEntry]:
        """The entries by trajectory id, least recently put first (the order eviction takes them): a copy, to read."""
        return dict(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be held at all (asked before copying one off the device)."""
        return 0 < nbytes <= self.capacity_bytes

    def put(self, key: str, entry: HostEntry) -> None:
        """Hold ``entry`` for ``key`` in place of the one before (whose turn has moved on), evicting the least
        recently put until it fits; one larger than the whole tier is not held."""
        self._drop(key)
        if not self.fits(entry.nbytes):
            return
        while self.bytes_held + entry.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = entry
        self.bytes_held += entry.nbytes

    def take(self, key: str, prompt: tuple[int, ...], version: int, room_tokens: int | None = None) -> HostHit | None:
        """Hand a matching entry to a new turn (``reusable_tokens``' rule, as ``PrefixCache.take``): a hit takes
        it out; a stale version or a prompt that diverges at once drops it. ``room_tokens``: the most the caller
        can restore now; a longer match misses and the entry stays for a later turn."""
        entry = self._entries.get(key)
        reused = 0 if entry is None else reusable_tokens(entry.tokens, entry.version, prompt, version)
        if entry is None or reused == 0:
            self._drop(key)
            self.misses += 1
            return None
        if room_tokens is not None and reused > room_tokens:
            self.misses += 1
            return None
        self._drop(key)
        self.hits += 1
        return HostHit(reused, entry.payload)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_held = 0

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes_held -= entry.nbytes


class HostLoads(Protocol):
    """What a runner is told of a restore from the host tier (an emulated one prices the copy)."""

    def host_load(self, tokens: int) -> None: ...


class RetainedPrefixes:
    """The rollout pool's retained trajectory prefixes: entries on the device and their write-through copies
    in host memory (``host_bytes`` of it; 0: no host tier)."""

    def __init__(self, pool: KVPool, runner: HostLoads, host_bytes: int) -> None:
        self.pool, self.runner = pool, runner
        self.device = PrefixCache()
        self.host = HostTier(host_bytes)

    @property
    def cached_blocks(self) -> int:
        return self.device.cached_blocks

    def entry_blocks(self) -> list[int]:
        """Each device entry's block count, least recently retained first (the order eviction takes them)."""
        return [len(e.blocks) for e in self.device.entries().values()]

    def attach(self, seq: Sequence, trajectory_id: str, version: int) -> None:
        """Hand the trajectory's retained prefix to its new turn: the device's entry, else the host tier's copy."""
        prompt = tuple(seq.tokens)
        hit, to_free = self.device.take(trajectory_id, prompt, version, self.pool.block_size)
        self.pool.free(to_free)
        if hit is not None:
            seq.blocks, seq.num_cached, seq.prefix_cached_tokens = hit.blocks, hit.reused_tokens, hit.reused_tokens
        else:
            self._restore_from_host(seq, trajectory_id, prompt, version)

    def _restore_from_host(self, seq: Sequence, trajectory_id: str, prompt: tuple[int, ...], version: int) -> None:
        """Write the host tier's copy of the prefix into newly allocated blocks, only where the pool has them free
        within its budget now: a restore saves a prefill, which is not worth an eviction or a preemption (the
        entry then stays for a later turn). The runner prices the copy where the device is emulated."""
        pool = self.pool
        room = 0 if pool.released else pool.free_blocks * pool.block_size
        hit = self.host.take(trajectory_id, prompt, version, room_tokens=room)
        if hit is None:
            return
        blocks = pool.allocate(pool.blocks_for(hit.reused_tokens))
        pool.write_blocks(blocks, hit.payload.head(len(blocks)) if hit.payload is not None else None)
        self.runner.host_load(hit.reused_tokens)
        seq.blocks, seq.num_cached, seq.prefix_cached_tokens = blocks, hit.reused_tokens, hit.reused_tokens

    def retain(self, seq: Sequence, trajectory_id: str, version: int) -> None:
        """Keep a finished turn's computed prefix for the trajectory's next turn (and copy it to the host tier
        now, SGLang's write_through: its eviction and the pool's release, both on latency-critical paths, then
        have nothing to copy); the blocks past it are freed."""
        cached = tuple(seq.tokens[: seq.num_cached])
        keep = self.pool.blocks_for(seq.num_cached)
        self.pool.free(seq.blocks[keep:])
        blocks = seq.blocks[:keep]
        nbytes = len(blocks) * self.pool.block_bytes
        if self.host.fits(nbytes):
            self.host.put(trajectory_id, HostEntry(cached, version, nbytes, self.pool.read_blocks(blocks)))
        self.pool.free(self.device.put(trajectory_id, cached, blocks, version))

    def evict_lru(self) -> int:
        """Free the least recently retained device entry's blocks; how many."""
        blocks = self.device.evict_lru()
        self.pool.free(blocks)
        return len(blocks)

    def drop_device(self) -> int:
        """Free the blocks of every prefix retained on the device (the host tier keeps its copies); how many."""
        blocks = self.device.clear()
        self.pool.free(blocks)
        return len(blocks)

    def flush(self) -> int:
        """Drop every retained prefix, on the device and in the host tier; the number of device blocks freed."""
        self.host.clear()
        return self.drop_device()
