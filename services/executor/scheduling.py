"""Iteration-level planning: a pure function from the engine's state to what to run next.

One plan covers one iteration of one class (serving or rollout): which waiting sequences
to admit, which running ones prefill a chunk and which decode one token, how many blocks
each needs, and — when memory is short — how many retained prefix-cache blocks to evict
(LRU) and then which running sequences to preempt (youngest first; they keep their
tokens and are recomputed later). No torch, no clocks, no side effects: easy to test.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SeqView:
    seq_id: int
    num_tokens: int  # prompt + generated so far
    num_cached: int  # tokens whose K/V is already in the pool
    num_blocks: int  # blocks held now
    reserve_tokens: int  # hold blocks for at least this many tokens (serving: prompt + max_tokens)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_cached


@dataclass(frozen=True)
class Limits:
    max_batch: int
    prefill_tokens: int  # prefill-chunk budget per iteration, shared by prefilling sequences
    block_size: int


@dataclass(frozen=True, kw_only=True)
class Plan:
    admit: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()  # (seq_id, tokens to compute this iteration)
    decode: tuple[int, ...] = ()
    new_blocks: dict[int, int] = field(default_factory=dict)  # seq_id -> blocks to allocate
    evict_cached_blocks: int = 0  # free at least this many prefix-cache blocks first (LRU)
    preempt: tuple[int, ...] = ()  # then drop these sequences' KV

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def _blocks_needed(v: SeqView, tokens: int, block_size: int) -> int:
    target = max(v.reserve_tokens, v.num_cached + tokens)
    return max(0, -(-target // block_size) - v.num_blocks)


def plan_iteration(
    running: list[SeqView],
    waiting: list[SeqView],
    free_blocks: int,
    evictable_blocks: int,
    limits: Limits,
    admit: bool = True,
) -> Plan:
    """Plan one iteration. ``running`` and ``waiting`` are in admission (age) order."""
    budget = limits.prefill_tokens
    available = free_blocks + evictable_blocks
    active = list(running)
    preempt: list[int] = []
    steps: dict[int, int] = {}
    new_blocks: dict[int, int] = {}

    i = 0
    while i < len(active):
        v = active[i]
        tokens = 1 if v.remaining == 1 else min(v.remaining, budget)
        if tokens == 0:
            i += 1
            continue
        need = _blocks_needed(v, tokens, limits.block_size)
        while need > available and active[-1] is not v:
            victim = active.pop()
            preempt.append(victim.seq_id)
            available += victim.num_blocks + new_blocks.pop(victim.seq_id, 0)
            if victim.seq_id in steps and victim.remaining > 1:
                budget += steps[victim.seq_id]
            steps.pop(victim.seq_id, None)
        if need > available:  # even alone it does not fit: preempt it too
            active.pop()
            preempt.append(v.seq_id)
            available += v.num_blocks
            continue
        available -= need
        if need:
            new_blocks[v.seq_id] = need
        steps[v.seq_id] = tokens
        if v.remaining > 1:
            budget -= tokens
        i += 1

    admitted: list[int] = []
    if admit and not preempt:
        for v in waiting:
            if len(active) + len(admitted) >= limits.max_batch:
                break
            tokens = 1 if v.remaining == 1 else min(v.remaining, budget)
            if tokens == 0:
                break
            need = _blocks_needed(v, tokens, limits.block_size)
            if need > available:
                break  # first come, first served: no overtaking
            available -= need
            if need:
                new_blocks[v.seq_id] = need
            steps[v.seq_id] = tokens
            if v.remaining > 1:
                budget -= tokens
            admitted.append(v.seq_id)

    remaining = {v.seq_id: v.remaining for v in active} | {v.seq_id: v.remaining for v in waiting}
    prefill = tuple((sid, n) for sid, n in steps.items() if remaining[sid] > 1)
    decode = tuple(sid for sid in steps if remaining[sid] == 1)
    used = sum(new_blocks.values()) - sum(v.num_blocks for v in running if v.seq_id in preempt)
    evict = max(0, min(evictable_blocks, used - free_blocks))
    return Plan(admit=tuple(admitted), prefill=prefill, decode=decode, new_blocks=new_blocks, evict_cached_blocks=evict, preempt=tuple(preempt))


def plan_shrink(over_budget_blocks: int, cached_entry_blocks: list[int], running_blocks: list[tuple[int, int]]) -> tuple[int, tuple[int, ...]]:
    """How to give back ``over_budget_blocks``: evict the first N cache entries (LRU order),
    then preempt running sequences, youngest first. ``running_blocks`` is [(seq_id, blocks)]
    in age order. Returns (entries to evict, seq ids to preempt)."""
    freed = 0
    entries = 0
    for blocks in cached_entry_blocks:
        if freed >= over_budget_blocks:
            break
        freed += blocks
        entries += 1
    victims: list[int] = []
    for seq_id, blocks in reversed(running_blocks):
        if freed >= over_budget_blocks:
            break
        freed += blocks
        victims.append(seq_id)
    return entries, tuple(victims)
