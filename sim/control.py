"""The control plane's effects on the simulated executors (engine.py): leases applied, parked and taken back, and the
headroom the monitor hands on."""

from __future__ import annotations

import math

import numpy as np
import simpy

from rose.contracts.slo import Headroom
from rose.services.scheduler.fleet import Fleet
from rose.services.trainer.capacity import RolloutCapacity

from .config import SimConfig
from .counters import Counters
from .instances import Instances
from .policies import FleetPolicy
from .sizing import ServingSetup, SizedFleet
from .turns import TurnTable


class ControlPlane:
    """What the scheduler's lease actions and the executors' lease guards do to the instances and the turns on them,
    and where the monitor's headroom goes (the scheduler's ``Fleet`` and the trainer's ``RolloutCapacity``).

    It exists so the policies' hooks (policies.py ``control``, ``on_alert``), the monitor (monitor.py) and the clock's
    lease enforcement (``enforce``) change an instance's lease one way: its caps, its park, its turns and its prefix
    cache together.
    """

    def __init__(
        self,
        env: simpy.Environment,
        cfg: SimConfig,
        policy: FleetPolicy,
        sized: SizedFleet,
        serving: ServingSetup,
        inst: Instances,
        turns: TurnTable,
        fleet: Fleet,
        capacity: RolloutCapacity,
        counts: Counters,
    ) -> None:
        self.env, self.cfg, self.policy = env, cfg, policy
        self.sized, self.serving = sized, serving
        self.inst, self.turns, self.counts = inst, turns, counts
        self.fleet = fleet  # the scheduler's fleet view, where leases live (``Router.fleet``)
        self.capacity = capacity

    def apply_lease(self, kind: str, lease, reason: str) -> None:
        """A lease action (granted, renewed, revoked, expired) reaches its executor."""
        d = self.inst.index[lease.executor_id]
        self.fleet.on_lease(lease, self.env.now)
        if kind == "revoked" and lease.park_until > self.env.now:
            self.park_device(d, lease.park_until)
        elif kind in ("revoked", "expired"):
            self.revoke_device(d, reason, keep_tokens=self.policy.keep_tokens)
        elif self.serving.cohosting:  # the executor clamps a lease to its rollout pool
            self.inst.set_caps(d, lease.max_rollout_batch, min(float(lease.kv_bytes), max(0.0, self.sized.memory.cohost_free_bytes)))
        self.counts.control.lease(kind)

    def park_device(self, d: int, until: float) -> None:
        """A burst's revocation (``Lease.park_until``): device d runs and admits nothing, its turns keep
        their place and KV until a new lease (``apply_lease``) resumes them or ``until`` interrupts
        them (``revoke_device``, checked each tick in ``enforce``)."""
        self.inst.set_caps(d, 0, self.inst.kvcap[d])
        self.inst.park_until[d] = until
        self.counts.control.parks += 1

    def revoke_device(self, d: int, reason: str, keep_tokens: bool) -> None:
        """Rollout taken back from device d: in-flight turns are interrupted (keep_tokens: resumed
        elsewhere by recompute, else lost: whole-job preemption) and its prefix cache dropped."""
        self.inst.set_caps(d, 0, 0)
        t = self.turns
        on = np.flatnonzero((t.dev == d) & (t.state > 0))
        for i in on:
            done = float(t.gen_turn[i] - t.dec_left[i]) if t.state[i] == 2 else 0.0
            t.state[i], t.dev[i] = 0, -1
            if keep_tokens:
                self.counts.turns.interrupted += 1
                t.events[i].succeed(("interrupted", max(0.0, math.floor(done))))
            else:
                self.counts.turns.aborted += 1
                t.events[i].succeed(("aborted", 0.0))
        t.drop_instance_cache(d, keep_host=self.cfg.host_kv_ratio > 0)

    def enforce(self, now: float) -> None:
        """The end of a tick: each executor enforces its lease's expiry itself, and a park ends at its deadline (what
        is left is interrupted) or once nothing is left there."""
        pol, inst, turns = self.policy, self.inst, self.turns
        for d in np.flatnonzero(inst.lent()).tolist():
            if not pol.is_active(self.fleet.info(inst.ids[d]).lease, now):
                self.revoke_device(d, "lease expired", keep_tokens=pol.keep_tokens)
        parked = np.flatnonzero(inst.parked())
        if parked.size:
            held = np.bincount(turns.dev[turns.state > 0], minlength=inst.D) if (turns.state > 0).any() else np.zeros(inst.D)
            for d in parked.tolist():
                if now >= inst.park_until[d] or held[d] == 0:
                    self.revoke_device(d, "park ended", keep_tokens=pol.keep_tokens)

    def report(self, headroom: Headroom) -> None:
        """The monitor's headroom goes to the scheduler's fleet and to the trainer's capacity view."""
        self.fleet.on_headroom(headroom)
        self.capacity.observe(headroom, self.env.now)
