"""TRL's process on ROSE's bus: the connection both seams share, on an event-loop thread of its own.

TRL's trainers are synchronous (the rollout function, the rollout worker's protocol and the
weight transfer are plain calls from the training loop), ROSE's SDK is asyncio. So the bus runs
on its own thread with its own loop (`BusThread`), and TRL's calls hand it coroutines and wait
for them (`RoseConnection.call`), or leave them running there (`spawn`, the async rollout worker).
The bus thread keeps consuming trajectories and re-handing out failed members while TRL trains.

The three calls of ROSE's trainer SDK (services/trainer/trainer.py's module docstring), for TRL:

1. hand out `RolloutTask`s, a GRPO group's members sharing a group id (groups.py `GroupBook`);
2. consume `Trajectory`s from the durable stream (a consumer of this run's own, created before any
   task goes out, so none is missed; at least once, de-duplicated per member);
3. publish the policy through `WeightsClient` and wait until every executor can fetch it
   (`publish`). ROSE's version numbers go on after the last one on the manifest stream;
   `versions` records which ROSE version each of this run's publishes became, which is how a
   ROSE version maps to TRL's own count of weight syncs (`trl_version`).

The synchronous seam also waits until the executors run the version (`applied`) before it hands
tasks out, as TRL's own vLLM path syncs weights before it generates: a turn started on the previous
version would be a stale sample handed out again (groups.py). The fleet is the executors whose
headroom the SLO monitor published lately (`slo.headroom`), and what each runs comes from
`weights.applied`; the registry names the trainer a reader of both. A version that changed no
weight is applied like any other (the executors relabel, shared/weight_sync.py), so a token's
version is the version whose weights sampled it.

The process connects as the `trainer` service: with ROSE's authorisation on, give it the
trainer's credentials (`BusConfig(nkey_seed_file=...)`); it needs no other right.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import re
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from rose.client.weights import WeightsClient
from rose.contracts.registry import HEADROOM, ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY, WEIGHT_APPLIED
from rose.contracts.rollout import RolloutTask, Trajectory
from rose.contracts.slo import Headroom
from rose.contracts.training import TrainingStep
from rose.contracts.weights import VERSION_NOT_NEWER, WeightApplied
from rose.shared.bus import Bus, Delivery, RemoteError
from rose.shared.config import BusConfig

from .groups import MAX_ATTEMPTS, MEMBER_TIMEOUT_S, GroupBook
from .tasks import TaskTable

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MODEL = "policy"  # the executors' policy model name (the reference trainer's publish.model default)
TRAJECTORY_FETCH_BATCH = 64  # trajectories per fetch, as the reference trainer consumes them
EXPIRE_POLL_S = 1.0  # how often members past `member_timeout_s` are looked for (the timeout is minutes)
# A publisher still starting refuses or does not answer: retried every 0.2 s (as the reference trainer retries) for as long
# as a fleet started together with the trainer may take to come up (`rose up`, `rose demo`: a minute or two on a busy box).
PUBLISH_RETRY_S, PUBLISH_RETRY_DEADLINE_S = 0.2, 180.0
PUBLISHED_TIMEOUT_S = 600.0  # the SDK's default wait for a version's manifest (client/weights.py)
# The fleet: executors whose headroom the monitor published within 5 of its intervals (slo_monitor headroom_interval_s,
# 1 s by default); an executor unheard of for that long has stopped or left.
FLEET_FRESH_S = 5.0
# How long tasks wait for every executor to run a new version. Executors apply one within a second here (weights.applied
# fetch_apply_ms 50-640 ms on the 2-core box); one that has not in 30 s failed the version (weights.failed) or is down,
# and the tasks go out anyway: its stale samples are handed out again.
APPLY_WAIT_S = 30.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class BusThread:
    """An asyncio loop on a daemon thread: TRL's threads run coroutines on it and wait, or leave them running."""

    def __init__(self, name: str = "rose-bus") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


class RoseConnection:
    """One TRL run's connection to ROSE: the bus (on its own thread), its groups in flight, its policy versions.

    `run_id` (default a fresh `trl-XXXXXXXX`) must be new for every run: task ids derive from it, and JetStream
    drops a task id it has seen within its duplicate window (2 minutes) as a redelivery.

    with RoseConnection("nats://127.0.0.1:4222", tasks) as rose:
        trainer = GRPOTrainer(..., rollout_func=RoseRolloutFunc(rose))
    """

    def __init__(
        self,
        bus: BusConfig | str,
        tasks: TaskTable,
        *,
        model: str = DEFAULT_MODEL,
        run_id: str = "",
        staging_dir: str | Path | None = None,
        member_timeout_s: float = MEMBER_TIMEOUT_S,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.config = bus if isinstance(bus, BusConfig) else BusConfig(url=bus)
        self.tasks, self.model, self.staging_dir = tasks, model, staging_dir
        self.run_id = _UNSAFE.sub("-", run_id)[:64] if run_id else f"trl-{uuid.uuid4().hex[:8]}"
        self.member_timeout_s, self.max_attempts = member_timeout_s, max_attempts
        self.thread = BusThread(f"rose-bus-{self.run_id}")
        self.version = 0  # ROSE's newest version of the policy: the manifest stream's at open, then each publish's
        self.versions: list[int] = []  # the ROSE version of each of this run's publishes, in order
        self._bus: Bus | None = None
        self._weights: WeightsClient | None = None
        self._book: GroupBook | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._fleet: dict[str, float] = {}  # executor id -> when its headroom was last heard (monotonic)
        self._running: dict[str, int] = {}  # executor id -> the newest version it applied
        self._heard = asyncio.Event()  # set on every headroom or applied event: `applied` looks again
        self._fleet_heard = asyncio.Event()  # set on the first headroom: the fleet is known

    def __enter__(self) -> RoseConnection:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def book(self) -> GroupBook:
        if self._book is None:
            raise RuntimeError("RoseConnection is not open: use it as a context manager or call open() first")
        return self._book

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._book.stats) if self._book is not None else {}

    def open(self) -> RoseConnection:
        self.thread.start()
        self.call(self._open())
        return self

    def close(self) -> None:
        if self._bus is not None:
            self.call(self._close())
        self.thread.stop()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.thread.call(coro, timeout)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.thread.spawn(coro)

    async def _open(self) -> None:
        self._bus = Bus(self.config, service="trainer", instance=f"{self.run_id}-trl")
        await self._bus.connect()
        self._weights = WeightsClient(self._bus, self.model, staging_dir=self.staging_dir)
        await self._weights.start()
        self.version = await self._weights.last_version() or 0
        self._book = GroupBook(
            self._publish_task,
            max_turns=self.tasks.max_turns,
            max_tokens=self.tasks.max_tokens,
            member_timeout_s=self.member_timeout_s,
            max_attempts=self.max_attempts,
        )
        # this run's own durable consumer, created before any task goes out: every trajectory of its tasks reaches it
        await self._bus.consume(TRAJECTORY, self._on_trajectory, durable=f"trl_{self.run_id}", deliver_new=True, batch=TRAJECTORY_FETCH_BATCH)
        self._expiry = asyncio.create_task(self._expire_loop(), name="trl:expire")
        await self._bus.subscribe(HEADROOM, self._on_headroom)
        # the registry names the trainer a reader: refused, the NATS server still runs an older registry's rights (its
        # authorisation include is rewritten at every `rose up`: restart it) and PermissionDenied says so
        await self._bus.subscribe(WEIGHT_APPLIED, self._on_applied)
        log.info("TRL run %s on %s: policy %r at v%d", self.run_id, self.config.display_url(), self.model, self.version)

    async def _close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._bus is not None:
            await self._bus.close()
            self._bus = None

    async def _publish_task(self, task: RolloutTask) -> None:
        assert self._bus is not None
        await self._bus.publish(ROLLOUT_TASK, task, msg_id=task.task_id)

    async def _on_trajectory(self, trajectory: Trajectory, _delivery: Delivery) -> None:
        await self.book.on_trajectory(trajectory)

    async def report(self, step: TrainingStep) -> None:
        """A step of this run on `rose.events.training.{run_id}`, as ROSE's own trainer reports its steps."""
        assert self._bus is not None
        await self._bus.publish(TRAINING_STEP, step, run_id=self.run_id)

    async def _on_headroom(self, headroom: Headroom, _delivery: Delivery) -> None:
        self._fleet[headroom.executor_id] = time.monotonic()
        self._fleet_heard.set()
        self._heard.set()

    async def _on_applied(self, applied: WeightApplied, _delivery: Delivery) -> None:
        if applied.model == self.model:
            self._running[applied.executor_id] = max(applied.version, self._running.get(applied.executor_id, 0))
            self._heard.set()

    def behind(self, version: int) -> list[str]:
        """The fleet's executors not running `version` yet."""
        now = time.monotonic()
        return sorted(e for e, seen in self._fleet.items() if now - seen <= FLEET_FRESH_S and self._running.get(e, 0) < version)

    async def applied(self, version: int, timeout: float = APPLY_WAIT_S) -> list[str]:
        """Wait until every executor of the fleet runs `version` (at most `timeout`); the executors still behind then."""
        deadline = time.monotonic() + timeout
        if not self._fleet:  # just connected: hear the monitor once, so that the fleet is known
            try:
                await asyncio.wait_for(self._fleet_heard.wait(), FLEET_FRESH_S)
            except TimeoutError:
                log.warning("no executor's headroom heard in %.0f s (is the SLO monitor up?): not waiting for v%d to apply", FLEET_FRESH_S, version)
                return []
        while behind := self.behind(version):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("executors %s do not run v%d after %.0f s: handing tasks out anyway", behind, version, timeout)
                return behind
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), left)
            except TimeoutError:
                pass
        return []

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_POLL_S)
            await self.book.expire(time.monotonic())

    # ---- weights ------------------------------------------------------------------------

    async def publish(self, state: Mapping[str, torch.Tensor]) -> int:
        """Publish `state` as the policy's next version; return it once every executor can fetch it."""
        assert self._weights is not None
        version = self.version + 1
        deadline = time.monotonic() + PUBLISH_RETRY_DEADLINE_S
        while True:
            try:
                await self._weights.publish(state, version)
                break
            except RemoteError as exc:
                taken = exc.data.get("latest") if exc.reason == VERSION_NOT_NEWER else None
                if isinstance(taken, int) and taken >= version:  # another publisher (or run) took it: the next free one
                    log.warning("v%d of %s is taken at the publisher: publishing as v%d", version, self.model, taken + 1)
                    version = taken + 1
                    continue
                raise  # the publisher answered and refused: its reason, at once
            except Exception:  # no publisher answered yet (it may be starting with the fleet)
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(PUBLISH_RETRY_S)
        await self._weights.published(version, timeout=PUBLISHED_TIMEOUT_S)
        self.version = version
        self.versions.append(version)
        return version

    def trl_version(self, rose_version: int) -> int:
        """TRL's count of weight syncs whose weights ROSE's `rose_version` ran (0 before this run's first publish)."""
        return bisect.bisect_right(self.versions, rose_version)
