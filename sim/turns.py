"""The turns in flight in the simulator (engine.py), as columns, with the prefix cache they leave behind."""

from __future__ import annotations

from typing import Any

import numpy as np


class TurnTable:
    """One row per simulated trajectory's active turn (rows ``N + i``: its hedge), one array per field.

    It exists because the rollout model advances every turn on every instance each tick with
    numpy, so a turn is a row (state, instance, prefill and decode left, context, admission order,
    the event its worker waits on) rather than an object. It also keeps the prefix caches finished
    turns leave behind, as the executor's ``PrefixCache`` and ``HostTier`` do
    (services/executor/prefix_cache.py): one entry per trajectory and instance, its tokens and the
    policy version that computed them, kept when the trajectory's next turn runs elsewhere (a later
    turn back there reuses it in part) and taken by the next turn that runs there. An entry is
    written through to the instance's host tier when it is retained; its device copy goes first
    when running turns need the memory (least recently retained first) and with the rollout pool
    when a lease is revoked, its host copy when the host tier is full (the same order).
    Each simulated trajectory stands for ``bundle`` sequences.
    """

    def __init__(self, D: int) -> None:
        self.D = D  # instances (Instances.D)
        self.bundle = 1  # sequences per simulated trajectory (the batch's bundle)
        self.seq_counter = 0  # submissions so far: the admission order (FIFO per instance)
        self.alloc(0)

    def alloc(self, n: int) -> None:
        """Rows for ``n`` trajectories and their hedges: no turn in flight, no prefix cache retained."""
        self.N = n  # slots i < n: a trajectory's turn; n + i: its hedge
        n = 2 * n
        self.state = np.zeros(n, dtype=np.int8)  # 0 none, 1 queued, 2 running
        self.dev = np.full(n, -1, dtype=np.int64)
        self.pf_left = np.zeros(n)
        self.pf_tokens = np.zeros(n)
        self.pf_cached = np.zeros(n)
        self.dec_left = np.zeros(n)
        self.gen_turn = np.zeros(n)
        self.ctx = np.zeros(n)
        self.seq = np.zeros(n, dtype=np.int64)
        # the prefix-cache entries, per row and instance: tokens (0: none), bytes, policy version, when retained,
        # and whether the device copy is still there (else only the host tier's)
        self.cache_tokens = np.zeros((n, self.D))
        self.cache_bytes = np.zeros((n, self.D))
        self.cache_version = np.zeros((n, self.D), dtype=np.int64)
        self.cache_at = np.zeros((n, self.D))
        self.cache_on_device = np.zeros((n, self.D), dtype=bool)
        self.events: list = [None] * n
        self.finished_at = np.zeros(n)

    def submit(self, i: int, d: int, ev: Any, pf_tokens: float, cached: float, gen_left: float, ctx_now: float) -> None:
        """Row ``i`` queues on instance ``d``; ``ev`` fires with the outcome."""
        self.state[i], self.dev[i] = 1, d
        self.pf_tokens[i], self.pf_cached[i] = max(1.0, pf_tokens), cached
        self.dec_left[i] = self.gen_turn[i] = max(1.0, gen_left)
        self.ctx[i] = ctx_now
        self.seq[i] = self.seq_counter
        self.seq_counter += 1
        self.events[i] = ev

    def cancel(self, i: int) -> None:
        """The slower copy of a hedged turn: the worker ignores it; the executor drops it."""
        self.state[i], self.dev[i] = 0, -1

    def finish(self, i: int, kvb: float, version: int, at: float) -> None:
        """Row ``i``'s turn is done at ``at``: its context stays cached on its instance, computed by ``version``."""
        d = int(self.dev[i])
        self.state[i], self.dev[i] = 0, -1
        self.take(i, d)  # replaced, as PrefixCache.put replaces the trajectory's entry
        self.cache_tokens[i, d] = self.ctx[i]
        self.cache_bytes[i, d] = self.bundle * self.ctx[i] * kvb
        self.cache_version[i, d] = version
        self.cache_at[i, d] = at
        self.cache_on_device[i, d] = True

    def where(self, i: int, d: int, kv_in_use: float, kv_capacity: float, host_capacity: float) -> str:
        """Where row ``i``'s entry on ``d`` is now: "device", "host" or "" (evicted from both, or none). Eviction
        takes the least recently retained first, so the entry is on the device while the running turns' KV and the
        device copies retained since it (itself included) fit the instance's rollout KV, and in the host tier while
        every entry retained since it fits that."""
        if self.cache_tokens[i, d] <= 0:
            return ""
        since = (self.cache_tokens[:, d] > 0) & (self.cache_at[:, d] >= self.cache_at[i, d])
        if self.cache_on_device[i, d] and kv_in_use + float(self.cache_bytes[since & self.cache_on_device[:, d], d].sum()) <= kv_capacity:
            return "device"
        if float(self.cache_bytes[since, d].sum()) <= host_capacity:
            return "host"
        return ""

    def take(self, i: int, d: int) -> tuple[float, int]:
        """Row ``i``'s entry on instance ``d``, removed (a turn sent there takes it, hit or miss, as
        ``PrefixCache.take``): (tokens, version); (0, 0) when there is none."""
        tokens, version = float(self.cache_tokens[i, d]), int(self.cache_version[i, d])
        self.cache_tokens[i, d] = self.cache_bytes[i, d] = 0.0
        self.cache_on_device[i, d] = False
        return tokens, version

    def mean_ctx(self, mask: np.ndarray) -> np.ndarray:
        """Mean context of the rows in ``mask``, per instance."""
        if not mask.any():
            return np.zeros(self.D)
        cnt = np.bincount(self.dev[mask], minlength=self.D)
        s = np.bincount(self.dev[mask], weights=self.ctx[mask], minlength=self.D)
        return s / np.maximum(cnt, 1)

    def ready_to_ride(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per instance, what a co-batched iteration may take (sim/co_batched.py): running turns past their prefill and
        their mean context, prompt tokens still to prefill and the mean context cached before them (weighted by what is
        left), and whether a turn waits for its prefill or its admission."""
        run = self.state == 2
        dec, pre = run & (self.pf_left <= 1e-9), run & (self.pf_left > 1e-9)
        decoding = np.bincount(self.dev[dec], minlength=self.D)
        ctx = np.bincount(self.dev[dec], weights=self.ctx[dec], minlength=self.D) / np.maximum(decoding, 1)
        pending = np.bincount(self.dev[pre], weights=self.pf_left[pre], minlength=self.D)
        cached = np.bincount(self.dev[pre], weights=self.pf_cached[pre] * self.pf_left[pre], minlength=self.D) / np.maximum(pending, 1e-30)
        waiting = (pending > 0) | (np.bincount(self.dev[self.state == 1], minlength=self.D) > 0)
        return decoding, ctx, pending, cached, waiting

    def kv_in_use(self, d: int, kvb: float) -> float:
        """KV bytes the running turns on instance ``d`` hold."""
        on = (self.dev == d) & (self.state == 2)
        return float((self.bundle * (self.ctx[on] + self.dec_left[on]) * kvb).sum())

    def drop_cache(self, i: int) -> None:
        """The trajectory in row ``i`` ended: its entries go first when memory is short (LRU), so none counts."""
        self.cache_tokens[i] = self.cache_bytes[i] = 0.0
        self.cache_on_device[i] = False

    def move_cache(self, src: int, dst: int) -> None:
        """The hedge in row ``src`` won: its entries become row ``dst``'s (the trajectory's, on those instances)."""
        on = self.cache_tokens[src] > 0
        for a in (self.cache_tokens, self.cache_bytes, self.cache_version, self.cache_at, self.cache_on_device):
            a[dst, on] = a[src, on]
        self.drop_cache(src)

    def drop_instance_cache(self, d: int, keep_host: bool) -> None:
        """Instance ``d`` lost its rollout pool (a revoked lease): every device copy there is gone; the host tier's
        stay (``keep_host``: the executor has one) for the lease's return."""
        self.cache_on_device[:, d] = False
        if not keep_host:
            self.cache_tokens[:, d] = self.cache_bytes[:, d] = 0.0
