"""Prefix-cache retention for multi-turn rollouts.

When a rollout turn finishes, its KV blocks stay in the rollout pool keyed by trajectory
id, with the exact tokens they hold and the policy version that computed them. The next
turn of that trajectory takes them over if its prompt starts with those tokens (checked
token by token, not trusted from the id) and the policy version is unchanged; then only
the new tokens are prefilled. Entries are evicted least-recently-used first when the
rollout pool must shrink.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


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
        if entry.version != version:
            self.misses += 1
            return None, entry.blocks
        limit = min(len(entry.tokens), len(prompt) - 1)
        reused = 0
        while reused < limit and entry.tokens[reused] == prompt[reused]:
            reused += 1
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
