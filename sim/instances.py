"""The fleet's instances as the simulator tracks them (engine.py): who is who, and what each may run now."""

from __future__ import annotations

import numpy as np


class Instances:
    """Per-instance arrays over the whole fleet, serving instances first (``s0``, ``s1``, ...), then the
    dedicated rollout pool (``d0``, ...), then in the lane pool's run (``SimConfig.lane_pool``) one
    instance per serving instance's rollout lane (``l0``, ...); ``d`` indexes them everywhere in the simulator.
    A lane instance is placed on as the dedicated pool is (``is_ded``) and runs on serving GPUs
    (``on_serving_gpus``: the serving instance's step model, its weights link, its lent KV).

    It exists so the clock, the rollout model and the lease hooks share one record of what each
    instance's rollout lane may hold now (its lease, or the dedicated pool's whole engine), when
    it has the current weights, and each serving instance's queue.
    """

    def __init__(self, n_serv: int, n_ded: int, n_lane: int = 0) -> None:
        self.n_serv = n_serv
        self.D = n_serv + n_ded + n_lane
        self.ids = [f"s{i}" for i in range(n_serv)] + [f"d{j}" for j in range(n_ded)] + [f"l{k}" for k in range(n_lane)]
        self.index = {e: i for i, e in enumerate(self.ids)}
        self.is_ded = np.zeros(self.D, dtype=bool)
        self.is_ded[n_serv:] = True
        self.on_serving_gpus = np.zeros(self.D, dtype=bool)
        self.on_serving_gpus[:n_serv] = True
        self.on_serving_gpus[n_serv + n_ded :] = True
        self.is_lane = self.on_serving_gpus & self.is_ded
        self.slots = np.zeros(self.D)  # rollout sequences allowed now
        self.kvcap = np.zeros(self.D)  # rollout KV bytes allowed now
        self.park_until = np.zeros(self.D)  # a lease revoked on a burst: its turns are parked (KV kept) until then
        self.ready_at = np.zeros(self.D)  # rollout may run from this time (weights of the current version)
        self.queue = np.zeros(n_serv)  # serving requests waiting, per serving instance
        self.prev_iter_ms = np.zeros(n_serv)  # each serving instance's last iteration time (its executor's signals)

    def set_caps(self, d: int, slots: float, kv_bytes: float) -> None:
        self.slots[d], self.kvcap[d] = slots, max(0.0, kv_bytes)
        self.park_until[d] = 0.0

    def parked(self) -> np.ndarray:
        """Which instances hold turns parked by a burst's revocation (running and admitting nothing)."""
        return (self.slots <= 0) & (self.park_until > 0)

    def lent(self) -> np.ndarray:
        """Which serving instances hold a lease now (their rollout lane is open)."""
        return self.slots[: self.n_serv] > 0
