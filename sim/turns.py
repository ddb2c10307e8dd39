"""The turns in flight in the simulator (engine.py), as columns, with the prefix cache they leave behind."""

from __future__ import annotations

from typing import Any

import numpy as np


class TurnTable:
    """One row per simulated trajectory's active turn (rows ``N + i``: its hedge), one array per field.

    It exists because the rollout model advances every turn on every instance each tick with
    numpy, so a turn is a row (state, instance, prefill and decode left, context, admission order,
    the event its worker waits on) rather than an object. It also keeps the prefix cache a
    finished turn leaves on its instance for the trajectory's next turn, and how many bytes of
    such caches each instance holds. Each simulated trajectory stands for ``bundle`` sequences.
    """

    def __init__(self, D: int) -> None:
        self.D = D  # instances (Instances.D)
        self.bundle = 1  # sequences per simulated trajectory (the batch's bundle)
        self.seq_counter = 0  # submissions so far: the admission order (FIFO per instance)
        self.retained = np.zeros(D)  # prefix-cache bytes retained by idle trajectories per instance
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
        self.cache_dev = np.full(n, -1, dtype=np.int64)
        self.cache_bytes = np.zeros(n)
        self.events: list = [None] * n
        self.finished_at = np.zeros(n)
        self.retained[:] = 0.0

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

    def finish(self, i: int, kvb: float) -> None:
        """Row ``i``'s turn is done: its context stays cached on its instance for the next turn."""
        d = int(self.dev[i])
        self.state[i], self.dev[i] = 0, -1
        self.cache_dev[i] = d
        self.cache_bytes[i] = self.bundle * self.ctx[i] * kvb
        self.retained[d] += self.cache_bytes[i]

    def mean_ctx(self, mask: np.ndarray) -> np.ndarray:
        """Mean context of the rows in ``mask``, per instance."""
        if not mask.any():
            return np.zeros(self.D)
        cnt = np.bincount(self.dev[mask], minlength=self.D)
        s = np.bincount(self.dev[mask], weights=self.ctx[mask], minlength=self.D)
        return s / np.maximum(cnt, 1)

    def kv_in_use(self, d: int, kvb: float) -> float:
        """KV bytes the running turns on instance ``d`` hold."""
        on = (self.dev == d) & (self.state == 2)
        return float((self.bundle * (self.ctx[on] + self.dec_left[on]) * kvb).sum())

    def drop_cache(self, i: int) -> None:
        d = self.cache_dev[i]
        if d >= 0:
            self.retained[d] = max(0.0, self.retained[d] - self.cache_bytes[i])
        self.cache_dev[i], self.cache_bytes[i] = -1, 0.0

    def move_cache(self, src: int, dst: int) -> None:
        """The hedge in row ``src`` won: its prefix cache becomes row ``dst``'s."""
        self.cache_dev[dst], self.cache_bytes[dst] = self.cache_dev[src], self.cache_bytes[src]
        self.cache_dev[src], self.cache_bytes[src] = -1, 0.0

    def drop_instance_cache(self, d: int) -> None:
        """Instance ``d`` lost its rollout pool: every prefix cache on it is gone."""
        lost = self.cache_dev == d
        self.retained[d] = 0.0
        self.cache_dev[lost] = -1
        self.cache_bytes[lost] = 0.0
