"""``rose bench faults``: fault injection on the whole system, as real processes on the real bus.

The demo's fleet (bench/demo.py: two serving executors taking a replayed serving trace over
HTTP, a dedicated executor, the SLO monitor, the scheduler, the weight publisher, a rollout
worker and the reference GRPO trainer, with auth on) runs an RL job while faults are injected
one after another, each followed by a wait until the affected part is healthy again:

- ``nats_restart``: ``kill -9`` of the NATS server (file storage), restarted at once;
- ``kill_<service>``: ``kill -9`` of one process of each service kind mid-operation (a serving
  executor while the trace runs and rollouts flow; its serving traffic meanwhile goes to the
  other serving executor, as a load balancer would), restarted a second later, as it was (the
  trainer resumes from its checkpoint: it must keep its run id, go on at the step after its
  checkpoint, not warm-start again, and train on the groups the killed process held; the steps
  it redoes are reported as ``trainer_steps_lost``, 0 expected with a checkpoint every step);
- ``partition_executor``: the dedicated executor SIGSTOP'd for a few seconds, then SIGCONT;
- ``slow_consumer``: the rollout worker SIGSTOP'd for longer (tasks pile up, nothing is acked),
  then SIGCONT;
- ``stream_byte_limit``: a small stream with ``max_bytes`` (discard new) filled past its limit:
  the publish past it must fail with a clear error and nothing stored before may be lost;
- ``corrupt_weights``: with the trainer held (SIGSTOP), the bench stores a new policy version
  (a keyframe, signed with the run's publisher key, as the publisher would) whose largest shard
  object it then overwrites with garbage, and announces it: every executor must refuse it and
  keep the version it runs; the trainer is then killed and restarted (it resumes as for
  ``kill_trainer`` and numbers its versions after the spoiled one) and every executor must apply
  its next version.

Recovery of a fault: from its injection until the affected part is healthy again: its
process's ``ready`` heartbeat (new pid, sent after the fault was healed), trajectories flowing
again, and for a serving executor a served request; for the NATS restart every service's
heartbeat; for the trainer its first weight version and its first training step after the restart; for the corrupted
version every executor applying the next good one; for the byte limit, from the refused publish
until one is accepted again after the operator raised the limit (the fleet must keep producing
trajectories meanwhile, which is not part of that time). Trajectories arrive in bursts (the
trainer hands out a step's tasks at once), so "flowing again" can wait for the next burst.

Not injected: a full disk (the byte limit of a stream stands in for it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rose.contracts.registry import SERVICE_REGISTRY, TRAJECTORIES_STREAM, TRAJECTORY, WEIGHT_APPLIED, WEIGHT_FAILED
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.models import init_models
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, init_credentials

from . import demo
from .fleet import drive_serving, executor_instances, p99, serving_trace

SPEC = replace(demo.SPEC, prefix="faults")
SERVING, DEDICATED = 2, 1  # executors of the fleet
TRAINER = {**demo.TRAINER, "ROSE_SFT__STEPS": "80"}  # learning is not the point here; a shorter warm start
QUICK_SFT_STEPS = "10"
# A restarted trainer resumes from its checkpoint (every step by default, under the run's state dir):
# same run id, the next step, no second warm start, versions after the last published one.
START_TIMEOUT_S = 240.0
FIRST_TRAJECTORY_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 90.0
RESTART_AFTER_S = 1.0
SETTLE_S = 3.0  # after a recovery, before the next fault (quick: 1 s)
PARTITION_S, SLOW_CONSUMER_S = 5.0, 8.0  # how long the executor and the worker stay SIGSTOP'd (quick: 3 s and 5 s)
TRACE_CAP_S = 900.0  # serving trace generated this long; cut when the faults are done
TTFT_CLIP = 20  # the plot's TTFT axis stops at this many SLOs
PROBE_STREAM = "ROSE_FAULTS_PROBE"
PROBE_SUBJECT = "faults.probe.bytes"
PROBE_MAX_BYTES = 64 * 1024

FULL = (
    "nats_restart",
    "kill_executor",
    "partition_executor",
    "kill_slo_monitor",
    "kill_scheduler",
    "slow_consumer",
    "kill_rollout_worker",
    "stream_byte_limit",
    "kill_weight_publisher",
    "corrupt_weights",
    "kill_trainer",
)
# One fault per mechanism (restart, kill -9 and restart, SIGSTOP, backlog, stream limit); the kill is the
# scheduler's, a one-second restart: an executor's (torch, models, its forward child) takes half a minute
# on a loaded 2-core box, and tests/rollout_worker/test_rollout_e2e.py kills one mid-rollout anyway.
QUICK = ("nats_restart", "kill_scheduler", "partition_executor", "slow_consumer", "stream_byte_limit")


@dataclass
class Faults:
    """What the bench sees besides the demo's observer (local receive times)."""

    arrivals: list[tuple[float, str]] = field(default_factory=list)  # (t, task id) of each trajectory delivery
    applied: list[tuple[float, str, int, int]] = field(default_factory=list)  # (t, executor, version, versions behind)
    failed: list[tuple[float, str, int, str]] = field(default_factory=list)  # (t, executor, version, kind)
    records: list[dict] = field(default_factory=list)
    duplicates: int = 0


async def extra_observers(bus: Bus, f: Faults, tag: str) -> None:
    seen: set[str] = set()

    async def on_trajectory(t, _d):
        if t.task_id in seen:
            f.duplicates += 1
        seen.add(t.task_id)
        f.arrivals.append((time.time(), t.task_id))

    async def on_applied(a, _d):
        f.applied.append((time.time(), a.executor_id, a.version, a.versions_behind))

    async def on_failed(e, _d):
        f.failed.append((time.time(), e.executor_id, e.version, e.kind))

    await bus.consume(TRAJECTORY, on_trajectory, durable=f"faults_traj_{tag}")
    await bus.consume(WEIGHT_APPLIED, on_applied, durable=f"faults_applied_{tag}")
    await bus.consume(WEIGHT_FAILED, on_failed, durable=f"faults_failed_{tag}")


class Injector:
    """Injects the faults one at a time and waits for each recovery."""

    def __init__(
        self,
        bus: Bus,
        server: NatsServer,
        procs: dict[str, ServiceProcess],
        obs: demo.Observed,
        f: Faults,
        urls: dict[str, str],
        down: set[str],
        seed: int,
        recovery_timeout_s: float,
        console: Console,
    ) -> None:
        self.bus, self.server, self.procs, self.obs, self.f, self.urls, self.down = bus, server, procs, obs, f, urls, down
        self.seed, self.timeout, self.console = seed, recovery_timeout_s, console
        self.restarts = 0
        self.quick = False
        self.corrupted: set[int] = set()  # versions the bench spoiled on purpose
        self.state: Path | None = None
        self.models: Path | None = None
        self.serving = sorted(n for n in procs if n.startswith(f"{SPEC.prefix}-serving-"))
        self.dedicated = sorted(n for n in procs if n.startswith(f"{SPEC.prefix}-dedicated-"))

    # ---- health checks -----------------------------------------------------------------

    async def fresh(self, key: str, since: float) -> bool:
        proc = self.procs[key]
        try:
            beat = await self.bus.kv_get(SERVICE_REGISTRY, service=proc.service, instance=proc.instance)
        except Exception:  # the bus is still reconnecting
            return False
        return beat is not None and beat.state == "ready" and proc.alive() and beat.pid == proc.pid and beat.sent_at >= since

    def flowing(self, since: float) -> bool:
        return any(t >= since for t, _ in self.f.arrivals[-200:])

    def served(self, ex: str, since: float) -> bool:
        return any(r["executor"] == ex and r["ok"] and r["t"] >= since for r in self.obs.serving.requests[-400:])

    async def until(self, check, deadline: float) -> bool:
        while time.time() < deadline:
            if await check():
                return True
            await asyncio.sleep(0.25)
        return False

    # ---- faults ------------------------------------------------------------------------

    async def run(self, name: str) -> dict:
        rec: dict = {"fault": name, "injected_at": time.time()}
        self.console.print(f"[bold]fault[/bold] {name} ...")
        try:
            detail = await getattr(self, f"_{name.split('_', 1)[0]}")(name, rec)
            rec.update(detail)
        except Exception as exc:  # an injection that itself failed is reported, not hidden
            rec.update(survived=False, outcome=f"error: {type(exc).__name__}: {exc}")
        rec.setdefault("recovered_at", None)
        rec["recovery_s"] = round(rec["recovered_at"] - rec["injected_at"], 3) if rec["recovered_at"] else None
        if rec.get("healed_at") and rec["recovered_at"]:
            rec["recovery_after_heal_s"] = round(rec["recovered_at"] - rec["healed_at"], 3)
        # a fault is survived only if every process of the fleet is still alive afterwards
        dead = [k for k, p in self.procs.items() if not p.alive()]
        if dead:
            rec["survived"] = False
            rec["outcome"] = f"{rec.get('outcome', '')}; processes dead afterwards: {dead}".lstrip("; ")
            for k in dead:  # keep the run going: restart what died as a side effect
                await self._restart(k)
        colour = "green" if rec.get("survived") else "red"
        self.console.print(f"  [{colour}]{rec.get('outcome')}[/{colour}] (recovery {rec['recovery_s']} s)")
        self.f.records.append(rec)
        return rec

    async def _restart(self, key: str) -> None:
        proc = self.procs[key]
        if proc.service == "trainer":
            self.restarts += 1  # as it was: the trainer finds its checkpoint and resumes
        proc.start()

    def trainer_before(self) -> tuple[float, int, str]:
        """(now, the last step the trainer reported, its run id), just before it is killed."""
        last = max(self.obs.steps, key=lambda s: s.step, default=None)
        return time.time(), (last.step if last else 0), (last.run_id if last else "")

    def first_step_after(self, killed_at: float):
        return next((s for s in self.obs.steps if s.at > killed_at), None)

    async def trainer_resume(self, killed_at: float, step_before: int, run_before: str, wait_s: float) -> dict:
        """How the restarted trainer resumed: its run id, the step it resumed from, steps redone, a warm start repeated."""
        await self.until(lambda: asyncio.sleep(0, self.first_step_after(killed_at) is not None), time.time() + wait_s)
        first = self.first_step_after(killed_at)
        proc = self.procs["trainer"]
        try:
            beat = await self.bus.kv_get(SERVICE_REGISTRY, service=proc.service, instance=proc.instance)
        except Exception:
            beat = None
        load = beat.load if beat is not None and beat.pid == proc.pid else {}
        resumed = first.resumed_from_step if first is not None else None
        out = {
            "trainer_step_before": step_before,
            "trainer_run_id_before": run_before,
            "trainer_first_step_after": first.step if first else None,
            "trainer_run_id_after": first.run_id if first else None,
            "trainer_resumed_from_step": resumed,
            "trainer_steps_lost": (max(0, step_before - resumed) if resumed is not None else step_before) if first else None,
            "trainer_warm_start_repeated": bool(load.get("warm_started")) if load else None,
        }
        out["trainer_resumed"] = bool(
            first and resumed is not None and first.run_id == run_before and first.step == resumed + 1 and out["trainer_warm_start_repeated"] is False
        )
        return out

    async def _nats(self, name: str, rec: dict) -> dict:
        before = await self._stream_msgs(TRAJECTORIES_STREAM.name)
        await asyncio.to_thread(self.server.restart, kill=True)  # kill -9, then the same config and store dir
        healed = time.time()
        rec["healed_at"] = healed

        async def ok() -> bool:
            beats = await asyncio.gather(*(self.fresh(k, healed) for k in self.procs))
            return all(beats) and self.flowing(healed)

        recovered = await self.until(ok, healed + self.timeout)
        after = await self._stream_msgs(TRAJECTORIES_STREAM.name)
        kept = before is not None and after is not None and after >= before
        stale = [k for k in self.procs if not await self.fresh(k, healed)]
        return {
            "target": "nats-server",
            "recovered_at": time.time() if recovered else None,
            "trajectory_stream_msgs_before": before,
            "trajectory_stream_msgs_after": after,
            "survived": recovered and kept,
            "outcome": "every service ready again, trajectories flowing, stream kept"
            if recovered and kept
            else f"not recovered in {self.timeout:.0f} s (stale heartbeats: {stale}, stream kept: {kept})",
        }

    async def _stream_msgs(self, stream: str) -> int | None:
        for _ in range(40):
            try:
                return (await self.bus.js.stream_info(stream)).state.messages
            except Exception:
                await asyncio.sleep(0.25)
        return None

    async def _kill(self, name: str, rec: dict) -> dict:
        kind = name.split("_", 1)[1]
        key = {
            "executor": self.serving[0] if self.serving else self.dedicated[0],
            "slo_monitor": "monitor",
            "scheduler": "scheduler",
            "weight_publisher": "publisher",
            "rollout_worker": "worker",
            "trainer": "trainer",
        }[kind]
        proc = self.procs[key]
        rec["target"] = proc.instance
        serving = key in self.serving
        if proc.service == "executor":  # mid-operation: while it runs rollout (bounded wait)
            for _ in range(40):
                last = [s for s in self.obs.snapshots if s[1] == key]
                if last and last[-1][3] > 0:
                    break
                await asyncio.sleep(0.25)
        published_before = max(self.obs.manifests, default=0)
        if serving:
            self.down.add(key)  # the load balancer stops sending it traffic
        rec["injected_at"] = time.time()
        killed_at, step_before, run_before = self.trainer_before()
        await asyncio.to_thread(proc.kill)
        await asyncio.sleep(RESTART_AFTER_S)
        await self._restart(key)
        healed = rec["healed_at"] = time.time()
        ready_at: list[float] = []

        async def ok() -> bool:
            if not ready_at:
                if not await self.fresh(key, healed):
                    return False
                ready_at.append(time.time())
                if serving:
                    beat = await self.bus.kv_get(SERVICE_REGISTRY, service=proc.service, instance=proc.instance)
                    if beat is None:  # `fresh` has just read it
                        raise RuntimeError(f"{key}: heartbeat gone right after a fresh one")
                    self.urls[key] = beat.endpoints["http"]  # a new process, a new port
                    self.down.discard(key)
            if serving and not self.served(key, ready_at[0]):
                return False
            if proc.service == "trainer":  # it resumed: a version and a training step after the restart
                return max(self.obs.manifests, default=0) > published_before and self.first_step_after(killed_at) is not None
            return self.flowing(ready_at[0])

        recovered = await self.until(ok, healed + self.timeout)
        self.down.discard(key)
        if proc.service == "trainer":
            resume = await self.trainer_resume(killed_at, step_before, run_before, 1.0)
            survived = recovered and resume["trainer_resumed"]
            outcome = (
                f"resumed run {resume['trainer_run_id_after']} at step {resume['trainer_first_step_after']} (checkpoint of step "
                f"{resume['trainer_resumed_from_step']}; {resume['trainer_steps_lost']} steps redone), no warm start, publishing again"
                if survived
                else f"{'recovered' if recovered else f'not recovered in {self.timeout:.0f} s'} but not resumed: {resume}"
            )
            return {"recovered_at": time.time() if recovered else None, "survived": survived, "outcome": outcome, **resume}
        what = {"executor": "ready, serving and rollouts flowing"}.get(proc.service, "ready, trajectories flowing")
        return {
            "recovered_at": time.time() if recovered else None,
            "survived": recovered,
            "outcome": f"restarted: {what}" if recovered else f"not recovered in {self.timeout:.0f} s (ready: {bool(ready_at)})",
        }

    async def _pause(self, key: str, hold_s: float, rec: dict) -> tuple[bool, float]:
        proc = self.procs[key]
        rec["target"] = proc.instance
        rec["paused_s"] = hold_s
        rec["injected_at"] = time.time()
        proc.pause()
        try:
            await asyncio.sleep(hold_s)
        finally:
            proc.resume()
        healed = rec["healed_at"] = time.time()

        async def ok() -> bool:
            return await self.fresh(key, healed) and self.flowing(healed)

        return await self.until(ok, healed + self.timeout), healed

    async def _partition(self, name: str, rec: dict) -> dict:
        key = self.dedicated[0] if self.dedicated else self.serving[-1]
        recovered, _ = await self._pause(key, 3.0 if self.quick else PARTITION_S, rec)
        return {
            "recovered_at": time.time() if recovered else None,
            "survived": recovered,
            "outcome": "SIGCONT: heartbeats and trajectories back" if recovered else f"not recovered in {self.timeout:.0f} s",
        }

    async def _slow(self, name: str, rec: dict) -> dict:
        dup_before = self.f.duplicates
        recovered, _ = await self._pause("worker", 5.0 if self.quick else SLOW_CONSUMER_S, rec)
        return {
            "recovered_at": time.time() if recovered else None,
            "survived": recovered,
            "duplicates_during": self.f.duplicates - dup_before,
            "outcome": "backlog consumed after SIGCONT" if recovered else f"not recovered in {self.timeout:.0f} s",
        }

    async def _corrupt(self, name: str, rec: dict) -> dict:
        """A signed new version with a garbage shard: refused everywhere, the old version kept, the next one applied."""
        import os

        import torch

        from rose.contracts.registry import WEIGHT_MANIFEST, WEIGHTS_OBJECTS
        from rose.services.weight_publisher.config import PublisherSettings
        from rose.services.weight_publisher.versions import ModelVersions
        from rose.shared.models import load_model
        from rose.shared.weight_layout import dtype_name, tensor_bytes
        from rose.shared.weight_signing import KEYS_DIRNAME, ManifestSigner, ensure_keypair
        from rose.shared.weight_store import WeightStore

        assert self.state is not None and self.models is not None
        trainer = self.procs["trainer"]
        model = trainer.env.get("ROSE_PUBLISH__MODEL", "policy")
        trainer.pause()  # no version of its own meanwhile
        try:
            last, stable_since = max(self.obs.manifests, default=0), time.time()
            while time.time() - stable_since < 2.0:  # a publish already in flight lands first
                await asyncio.sleep(0.25)
                if max(self.obs.manifests, default=0) != last:
                    last, stable_since = max(self.obs.manifests, default=0), time.time()
            executors = [k for k, p in self.procs.items() if p.service == "executor"]
            before = {ex: max((v for _, e, v, _ in self.f.applied if e == ex), default=0) for ex in executors}
            version = last + 1
            self.corrupted.add(version)
            rec.update(target=f"{model} v{version}", kept_versions=before)
            dtype = getattr(torch, TRAINER.get("ROSE_PUBLISH__DTYPE", "bfloat16"))
            policy = await asyncio.to_thread(load_model, self.models / "policy")
            state = policy.state_dict()  # what a trainer publishes (tied weights included)
            tensors = {n: (dtype_name(dtype), tuple(t.shape), tensor_bytes(t.to(dtype).contiguous())) for n, t in state.items()}
            signer = ManifestSigner.from_file(ensure_keypair(self.state / KEYS_DIRNAME))
            store = WeightStore(self.bus.js, WEIGHTS_OBJECTS.bucket)
            staged = await ModelVersions(model, self.bus, store, PublisherSettings(), signer).stage(tensors, version, keyframe=True)
            shard = max((sh for sh in staged.manifest.shards if sh.object_name), key=lambda sh: sh.wire_bytes)
            data = bytearray(await store.get(shard.object_name))
            mid = len(data) // 2
            data[mid : mid + 256] = os.urandom(len(data[mid : mid + 256]))  # garbage in the stored object
            await store.put(shard.object_name, data)
            rec["injected_at"] = time.time()
            m = staged.manifest
            await self.bus.publish(WEIGHT_MANIFEST, m, model=model, kind=m.kind, version=str(version))

            async def refused() -> bool:
                return all(any(e == ex and v == version for _, e, v, _ in self.f.failed) for ex in executors)

            all_refused = await self.until(refused, time.time() + 30.0)
            await asyncio.sleep(0.5)
            took = sorted({e for _, e, v, _ in self.f.applied if v == version})
            kinds = sorted({k for _, e, v, k in self.f.failed if v == version})
            serving_ok = all(self.served(ex, rec["injected_at"]) for ex in self.serving if ex not in self.down)
        finally:
            killed_at, step_before, run_before = self.trainer_before()
            trainer.kill()  # the held trainer is restarted: it resumes and numbers its versions after the spoiled one
            await self._restart("trainer")
        healed = rec["healed_at"] = time.time()

        async def next_applied() -> bool:  # every executor takes the next good version
            return all(any(e == ex and v > version and t >= healed for t, e, v, _ in self.f.applied) for ex in executors)

        recovered = all_refused and not took and await self.until(next_applied, healed + self.timeout + 30.0)
        recovered_at = time.time() if recovered else None
        survived = all_refused and not took and serving_ok and recovered
        resume = await self.trainer_resume(killed_at, step_before, run_before, self.timeout)  # reported, not part of the recovery
        return {
            **resume,
            "recovered_at": recovered_at,
            "survived": survived,
            "refusal_kinds": kinds,
            "applied_by": took,
            "outcome": (
                f"refused by every executor ({', '.join(kinds)}), old versions kept, serving on; next version applied everywhere"
                if survived
                else f"refused by all: {all_refused}, applied by: {took}, serving meanwhile: {serving_ok}, next version applied: {recovered}"
            ),
        }

    async def _stream(self, name: str, rec: dict) -> dict:
        """Fill a small stream (discard new) past its byte limit: a clear refusal, nothing stored lost."""
        from nats.js.api import DiscardPolicy, StorageType, StreamConfig
        from nats.js.errors import APIError

        js = self.bus.js
        rec["target"] = PROBE_STREAM
        await js.add_stream(
            StreamConfig(name=PROBE_STREAM, subjects=[PROBE_SUBJECT], max_bytes=PROBE_MAX_BYTES, discard=DiscardPolicy.NEW, storage=StorageType.FILE)
        )
        acked: list[bytes] = []
        error = ""
        read: list[bytes] = []
        stored_after = -1
        try:
            for i in range(1000):
                payload = f"{i:06d}".encode() * 170  # ~1 KiB
                try:
                    await js.publish(PROBE_SUBJECT, payload)
                except APIError as exc:
                    error = f"{type(exc).__name__} {exc.code}/{exc.err_code}: {exc.description}"
                    break
                acked.append(payload)
            refused_at = rec["injected_at"] = time.time()  # the fault proper: the limit is hit
            info = await js.stream_info(PROBE_STREAM)
            sub = await js.pull_subscribe(PROBE_SUBJECT, durable=None, stream=PROBE_STREAM)
            while len(read) < len(acked):
                try:
                    msgs = await sub.fetch(100, timeout=2.0)
                except TimeoutError:
                    break
                read += [m.data for m in msgs]
            await sub.unsubscribe()
            # the operator makes room (a bigger limit): publishing works again, with what was stored still there
            config = info.config
            config.max_bytes = 2 * PROBE_MAX_BYTES
            await js.update_stream(config)
            await js.publish(PROBE_SUBJECT, b"after the limit was raised")
            accepted_at = time.time()
            stored_after = (await js.stream_info(PROBE_STREAM)).state.messages
        finally:
            await js.delete_stream(PROBE_STREAM)
        intact = read == acked and info.state.messages == len(acked) and stored_after == len(acked) + 1
        clear = bool(error) and ("maximum bytes" in error.lower() or "resource" in error.lower() or "limit" in error.lower())

        async def ok() -> bool:  # and the fleet does not mind (not part of the recovery time)
            return self.flowing(rec["injected_at"])

        fleet_ok = await self.until(ok, time.time() + self.timeout)
        survived = bool(error) and intact and fleet_ok
        return {
            "healed_at": accepted_at,
            "recovered_at": accepted_at,
            "refused_at": refused_at,
            "survived": survived,
            "max_bytes": PROBE_MAX_BYTES,
            "acked_before_limit": len(acked),
            "stored_when_refused": info.state.messages,
            "read_back_intact": intact,
            "error": error,
            "error_is_clear": clear,
            "fleet_trajectories_flowing": fleet_ok,
            "outcome": (
                f"publish past the limit refused ({error or 'no error!'}); {len(acked)} stored messages intact; accepted again once the limit was "
                "raised"
                if intact
                else f"stored messages lost or altered (acked {len(acked)}, stored {info.state.messages}, read back {len(read)})"
            )
            + ("" if fleet_ok else f"; no trajectory in {self.timeout:.0f} s afterwards"),
        }


# ---- the run ---------------------------------------------------------------------------


async def _run(out: Path, seed: int, quick: bool, models_dir: Path | None, console: Console) -> dict:
    faults = QUICK if quick else FULL
    timeout = 45.0 if quick else 60.0
    root = out.parent / f"{out.stem}-run"
    state = root / "state"
    shutil.rmtree(state, ignore_errors=True)
    (state / "logs").mkdir(parents=True)
    models = models_dir or root / "models"
    if not (models / "policy" / "config.json").exists():
        console.print(f"building the models under {models} ...")
        await asyncio.to_thread(init_models, models, 0, demo.DEMO_POLICY)
    creds = init_credentials(state / "security", instances={"executor": executor_instances(SPEC, SERVING, DEDICATED)})  # each executor its own NKey
    logs = state / "logs"
    server = NatsServer(state / "nats", log_file=logs / "nats-server.log", extra_config=creds.server_config()).start()
    bus = Bus(
        BusConfig(url=server.url, initial_connect_deadline_s=20.0, nkey_seed_file=str(creds.seed_file(OPERATOR))),
        service="cli",
        instance=f"faults-{seed}",
    )
    await bus.connect()
    await provision(bus.js)
    obs, f = demo.Observed(), Faults()
    await demo.observe(bus, obs)
    await extra_observers(bus, f, f"{seed}_{int(time.time())}")
    procs = demo.job_processes(
        state,
        server.url,
        models,
        creds,
        SPEC,
        SERVING,
        DEDICATED,
        {**TRAINER, **({"ROSE_SFT__STEPS": QUICK_SFT_STEPS} if quick else {}), "ROSE_TASKS__SEED": str(seed)},
    )
    serving = sorted(n for n in procs if n.startswith(f"{SPEC.prefix}-serving-"))
    executors = {n: ("serving" if n in serving else "dedicated") for n in procs if procs[n].service == "executor"}
    down: set[str] = set()
    try:
        console.print(f"starting {len(procs)} services on {server.url} (logs in {logs}) ...")
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        urls = {n: (await procs[n].wait_ready(bus, 10.0))["http"] for n in serving}
        t0, t0_mono = time.time(), time.monotonic()
        trace = serving_trace(serving, TRACE_CAP_S, SPEC, seed, obs.serving, t0)
        driver = asyncio.ensure_future(drive_serving(trace, urls, down, SPEC, obs.serving, t0_mono, seed))
        deadline = time.time() + FIRST_TRAJECTORY_TIMEOUT_S
        while not f.arrivals and time.time() < deadline:  # the warm start, then the first rollouts
            await asyncio.sleep(0.5)
        if not f.arrivals:
            raise RuntimeError(f"no trajectory within {FIRST_TRAJECTORY_TIMEOUT_S:.0f} s of the start:\n{procs['trainer'].log_tail()}")
        console.print(f"fleet ready, trajectories flowing after {time.time() - t0:.0f} s; injecting {len(faults)} faults")
        await asyncio.sleep(3.0)
        injector = Injector(bus, server, procs, obs, f, urls, down, seed, timeout, console)
        injector.state, injector.models, injector.quick = state, models, quick
        for name in faults:
            await injector.run(name)
            await asyncio.sleep(1.0 if quick else SETTLE_S)
        faults_end = time.time()
        cut = next((i for i, (at, _) in enumerate(trace) if at > time.monotonic() - t0_mono + 1.0), len(trace))
        del trace[cut:]  # the driver iterates this list: it sends what is left and returns
        await asyncio.to_thread(procs["trainer"].stop)  # no new tasks; those handed out must still come back
        await driver
        console.print("draining: every task handed out must come back as a trajectory ...")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not obs.published <= set(obs.trajectories) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # the last weight versions and events in flight
        end = time.time()
        return report(out, obs, f, executors, serving, t0, faults_end, end, injector.corrupted, dict(seed=seed, quick=quick, logs=str(logs)), console)
    finally:
        await asyncio.to_thread(stop_all, list(procs.values()))
        await bus.close()
        server.stop()


# ---- the report ------------------------------------------------------------------------


def _attributed(r: dict, records: list[dict]) -> bool:
    """A serving request on an executor that a fault hit, while that fault lasted (+2 s)."""
    for rec in records:
        end = rec.get("recovered_at") or rec["injected_at"] + 60.0
        if rec.get("target") == r["executor"] and rec["injected_at"] <= r["t"] <= end + 2.0:
            return True
    return False


def weight_versions_lost(obs: demo.Observed, f: Faults, corrupted: set[int]) -> list[int]:
    """Published versions that no executor applied, directly or on its way to a later one (a catch-up)."""
    covered: set[int] = set()
    for _, _, version, behind in f.applied:
        covered.update(range(version - behind, version + 1))
    return sorted(v for v in obs.manifests if v not in covered and v not in corrupted)


def report(
    out: Path,
    obs: demo.Observed,
    f: Faults,
    executors: dict[str, str],
    serving: list[str],
    t0: float,
    faults_end: float,
    end: float,
    corrupted: set[int],
    params: dict,
    console: Console,
) -> dict:
    records = f.records
    reqs = obs.serving.requests
    failed = [r for r in reqs if not r["ok"]]
    unaffected = [r for r in reqs if not _attributed(r, records)]
    met = lambda rs: [r["ok"] and r["ttft_ms"] <= SPEC.slo_ttft_ms and r["tpot_ms"] <= SPEC.slo_tpot_ms for r in rs]  # noqa: E731
    m_all, m_unaff = met(reqs), met(unaffected)
    lost = sorted(obs.published - set(obs.trajectories))
    recoveries = [r["recovery_s"] for r in records if r.get("recovery_s") is not None]
    redone = [r["trainer_steps_lost"] for r in records if r.get("trainer_steps_lost") is not None]
    versions_lost = weight_versions_lost(obs, f, corrupted)
    for r in records:  # serving during each fault, on every executor
        during = [q for q in reqs if r["injected_at"] <= q["t"] <= (r.get("recovered_at") or end)]
        m = met(during)
        r["serving_requests_during"] = len(during)
        r["serving_failed_during"] = sum(1 for q in during if not q["ok"])
        r["serving_slo_attainment_during"] = round(sum(m) / len(m), 4) if m else None
    quiet = [q for q in reqs if not any(r["injected_at"] <= q["t"] <= (r.get("recovered_at") or end) for r in records)]
    png = out.with_suffix(".png")
    plot(png, obs, f, records, serving, t0, end)
    result = {
        **params,
        "faults_injected": len(records),
        "faults_survived": sum(1 for r in records if r.get("survived")),
        "trajectories_lost": len(lost),
        "weight_versions_lost": len(versions_lost),
        "serving_requests_failed": len(failed),
        "recovery_s_p99": p99(recoveries),
        "trainer_steps_lost": sum(redone) if redone else None,  # steps redone after the trainer's restarts (kill_trainer, corrupt_weights)
        "trainer_restarts_resumed": sum(1 for r in records if r.get("trainer_resumed")),
        "faults": records,
        "serving_requests": len(reqs),
        "serving_requests_failed_outside_faulted_executor": sum(1 for r in failed if not _attributed(r, records)),
        "serving_slo_attainment": sum(m_all) / len(m_all) if m_all else None,
        "serving_slo_attainment_outside_faulted_executor": sum(m_unaff) / len(m_unaff) if m_unaff else None,
        "serving_ttft_p99_ms": p99([r["ttft_ms"] for r in reqs if r["ok"]]),
        "serving_slo_attainment_outside_faults": (sum(met(quiet)) / len(quiet)) if quiet else None,
        "weight_versions_corrupted": sorted(corrupted),
        "trajectories_published": len(obs.published),
        "trajectories_received": len(obs.trajectories),
        "trajectories_failed": sum(1 for t in obs.trajectories.values() if t.status != "completed"),
        "trajectories_redelivered": f.duplicates,
        "lost_task_ids": lost[:50],
        "weight_versions_published": len(obs.manifests),
        "weight_versions_lost_list": versions_lost,
        "weight_refusals": [{"executor": ex, "version": v, "kind": k} for _, ex, v, k in f.failed],
        "training_steps": len(obs.steps),
        "faults_window_s": round(faults_end - t0, 1),
        "timeline_png": str(png),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    table = Table(title="rose bench faults")
    for col in ("fault", "target", "outcome", "recovery s"):
        table.add_column(col, no_wrap=col != "outcome")
    for r in records:
        colour = "green" if r.get("survived") else "red"
        table.add_row(
            r["fault"],
            str(r.get("target", "")),
            f"[{colour}]{r.get('outcome', '')}[/{colour}]",
            f"{r['recovery_s']:.1f}" if r.get("recovery_s") is not None else "-",
        )
    console.print(table)
    summary = Table(title="summary")
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    for key in (
        "faults_injected",
        "faults_survived",
        "trajectories_lost",
        "weight_versions_lost",
        "serving_requests_failed",
        "serving_requests_failed_outside_faulted_executor",
        "recovery_s_p99",
        "trainer_steps_lost",
        "trainer_restarts_resumed",
        "serving_slo_attainment",
        "serving_slo_attainment_outside_faulted_executor",
        "trajectories_published",
        "weight_versions_published",
        "training_steps",
    ):
        v = result[key]
        summary.add_row(key, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(summary)
    console.print(f"JSON: {out}  timeline: {png}")
    return result


def plot(path: Path, obs: demo.Observed, f: Faults, records: list[dict], serving: list[str], t0: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    for ex, colour in zip(serving, ("tab:blue", "tab:purple", "tab:cyan", "tab:olive")):
        rs = [r for r in obs.serving.requests if r["executor"] == ex]
        ok = [r for r in rs if r["ok"]]
        ax1.scatter(
            [r["t"] - t0 for r in ok],
            [min(max(1.0, r["ttft_ms"]), TTFT_CLIP * SPEC.slo_ttft_ms) for r in ok],
            s=3,
            c=colour,
            label=f"{ex} TTFT (clipped at top)",
        )
        bad = [r for r in rs if not r["ok"]]
        ax1.scatter(
            [r["t"] - t0 for r in bad],
            [TTFT_CLIP * SPEC.slo_ttft_ms] * len(bad),
            s=24,
            marker="x",
            c="red",
            zorder=5,
            label=f"{ex} failed" if bad else None,
        )
    ax1.axhline(SPEC.slo_ttft_ms, c="red", ls="--", lw=1, label="TTFT SLO")
    ax1.set_yscale("log")
    ax1.set_ylim(1.0, 2 * TTFT_CLIP * SPEC.slo_ttft_ms)
    ax1.set_ylabel("serving TTFT ms (client)")
    ax1.legend(loc="upper left", fontsize=7, ncol=3)
    width = 2.0
    bins = max(1, int((end - t0) / width) + 1)
    counts = [0] * bins
    for t, _ in f.arrivals:
        if t0 <= t < t0 + bins * width:
            counts[int((t - t0) / width)] += 1
    ax2.plot([i * width for i in range(bins)], [c / width for c in counts], c="tab:green")
    ax2.set_ylabel("trajectories/s received")
    ax2.set_xlabel("seconds (shaded: fault injected -> recovered; red shading: not recovered)")
    for ax in (ax1, ax2):
        for r in records:
            a = r["injected_at"] - t0
            b = (r.get("recovered_at") or end) - t0
            ax.axvspan(a, b, color="tab:orange" if r.get("survived") else "tab:red", alpha=0.2)
    for r in records:
        ax1.text(r["injected_at"] - t0, 1.8 * TTFT_CLIP * SPEC.slo_ttft_ms, r["fault"], fontsize=7, rotation=90, va="top")
    fig.suptitle("ROSE fault injection: serving latency and trajectory throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True, kw_only=True)
class FaultsOptions:
    """What a `rose bench faults` run injects: every fault, or with ``quick`` the subset QUICK; ``seed`` of the serving
    trace and the RL job."""

    seed: int = 0
    quick: bool = False


def run_faults_bench(options: FaultsOptions, out_json: str, model_dir: str | None = None, console: Console | None = None) -> dict:
    """The demo's fleet under the faults; the result (also written to ``out_json``). ``model_dir``: models to reuse
    (default: tiny models built on the spot)."""
    console = console or Console()
    models = Path(model_dir).resolve() if model_dir else None
    return asyncio.run(_run(Path(out_json).resolve(), options.seed, options.quick, models, console))
