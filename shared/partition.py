"""Which instance of a service owns which executor: rendezvous hashing over the live instances.

Why: one SLO monitor and one scheduler hold a fleet of about a thousand executors (measured by
`rose bench control-plane`); past that, or to survive the loss of one, several instances of each
run side by side and split the executors between them, the NATS way: no coordinator, every
instance sees the others' heartbeats and computes the same owner for every executor
(highest random weight of `blake2b(instance, executor)`), so adding or losing an instance moves
only that instance's share. A dead instance is dropped after `misses` heartbeat intervals of
silence (a draining one at once); its executors then belong to the survivors. Leases stay in
the one KV bucket and every write of a lease is a compare-and-set on its revision
(`Bus.kv_swap`), so even two instances that briefly both believe they own an executor cannot
both grant it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from rose.contracts.service import Heartbeat


@dataclass
class Peer:
    seen_at: float
    interval_s: float


def weight(instance: str, executor_id: str) -> int:
    """The rendezvous weight: the same in every process (Python's own hash() is salted per process)."""
    digest = hashlib.blake2b(f"{instance}\x00{executor_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Partition:
    """The live instances of one service, and which of them owns an executor."""

    def __init__(self, instance: str, misses: float = 3.0) -> None:
        self.instance = instance
        self.misses = misses
        self.peers: dict[str, Peer] = {}

    def on_heartbeat(self, beat: Heartbeat, now: float | None = None) -> None:
        if beat.instance == self.instance:
            return
        if beat.state == "draining":
            self.peers.pop(beat.instance, None)  # it hands its share over as it stops
            return
        self.peers[beat.instance] = Peer(time.time() if now is None else now, beat.interval_s)

    def live(self, now: float | None = None) -> list[str]:
        """This instance and every peer heard from within `misses` of its heartbeat intervals, sorted."""
        now = time.time() if now is None else now
        alive = [name for name, p in self.peers.items() if now - p.seen_at <= self.misses * p.interval_s]
        return sorted([self.instance, *alive])

    def owner(self, executor_id: str, now: float | None = None) -> str:
        return max(self.live(now), key=lambda inst: weight(inst, executor_id))

    def owns(self, executor_id: str, now: float | None = None) -> bool:
        if not self.peers:
            return True  # alone: everything is ours (the common case, no hashing)
        return self.owner(executor_id, now) == self.instance
