"""Executor credentials per instance: one executor's key cannot act as another executor, on a real server.

`init_credentials(instances={"executor": [...]})` (`rose security init --instance executor=NAME`)
makes a user per executor instance whose subjects are pinned to it: it serves only its own
`generate` subject and publishes metrics, weight events, heartbeats and registry keys only under
its own id. The generic `executor` user stays for instances nobody declared. A real executor
started the way the launchers start them (bench/fleet.py) runs on its instance's key.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from rose.contracts import GenerateReply, GenerateRequest, Heartbeat, SloAlert
from rose.contracts.registry import (
    EXECUTOR_METRICS,
    GENERATE,
    HEARTBEAT,
    SERVICE_REGISTRY,
    SLO_ALERT,
    TELEMETRY_STREAM,
    WEIGHT_APPLIED,
    WEIGHT_FAILED,
)
from rose.contracts.weights import WeightApplied, WeightFailed
from rose.shared.bus import Bus, Delivery, PermissionDenied
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, SEED_SUFFIX, USERS, Credentials, init_credentials, parse_instances, permissions, public_key
from rose.testing.polling import until

NOW = time.time()
A, B = "ex-a", "ex-b"


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    return init_credentials(tmp_path_factory.mktemp("instance-security") / "creds", instances={"executor": [A, B]})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, creds: Credentials):
    with NatsServer(tmp_path_factory.mktemp("nats-instances"), extra_config=creds.server_config()) as srv:
        yield srv


def _config(server: NatsServer, seed: Path) -> BusConfig:
    return BusConfig(url=server.url, nkey_seed_file=str(seed), initial_connect_deadline_s=10.0, request_timeout_s=10.0)


@pytest.fixture
async def operator(server, creds):
    async with Bus(_config(server, creds.seed_file(OPERATOR)), service=OPERATOR, instance="ops-inst") as bus:
        await provision(bus.js)
        yield bus


def _beat(instance: str) -> Heartbeat:
    return Heartbeat(service="executor", instance=instance, version="t", host="h", pid=1, started_at=NOW, sent_at=NOW, interval_s=1.0, state="ready")


def _metrics(executor_id: str):
    from rose.contracts import MetricsSnapshot

    return MetricsSnapshot(executor_id=executor_id, at=NOW, role="serving", interval_s=1.0)


def _reply(executor_id: str):
    async def generate(req: GenerateRequest, _d: Delivery) -> GenerateReply:
        return GenerateReply(request_id=req.request_id, executor_id=executor_id, status="ok", token_ids=[7])

    return generate


def test_instance_users_are_derived_from_the_registry_and_written_privately(creds):
    a = permissions("executor", instance=A)
    assert a.user == f"executor@{A}" and permissions(f"executor@{A}").publish == a.publish
    generic = permissions("executor")
    assert f"rose.executor.{A}.generate" in a.subscribe and "rose.executor.*.generate" in generic.subscribe
    assert not any(s.startswith("rose.executor.") and s != f"rose.executor.{A}.generate" for s in a.subscribe)
    for own in (
        f"rose.telemetry.executor.{A}",
        f"rose.events.weights.applied.{A}",
        f"rose.events.weights.failed.{A}",
        f"rose.svc.heartbeat.executor.{A}",
        f"$KV.rose_services.executor.{A}",
    ):
        assert own in a.publish, own
    assert not [
        s for s in a.publish if s.endswith(".*") and s.startswith(("rose.telemetry.", "rose.events.weights.", "rose.svc.", "$KV.rose_services."))
    ]
    assert len(a.publish) == len(generic.publish) and len(a.subscribe) == len(generic.subscribe)  # pinned, nothing added or lost

    for instance in (A, B):
        seed = creds.seed_file("executor", instance)
        assert seed.name == f"executor@{instance}{SEED_SUFFIX}" and stat.S_IMODE(os.stat(seed).st_mode) == 0o600
        assert f'nkey: "{public_key(seed)}"' in creds.server_include.read_text()
    assert creds.instances("executor") == [A, B]
    keys = {creds.seed_file(u).read_bytes() for u in USERS} | {creds.seed_file("executor", i).read_bytes() for i in (A, B)}
    assert len(keys) == len(USERS) + 2  # one identity each

    assert creds.env("executor", A)["ROSE_BUS__NKEY_SEED_FILE"] == str(creds.seed_file("executor", A))
    assert creds.env("executor", "undeclared")["ROSE_BUS__NKEY_SEED_FILE"] == str(creds.seed_file("executor"))  # the generic one
    assert creds.env("scheduler", "sch-1")["ROSE_BUS__NKEY_SEED_FILE"] == str(creds.seed_file("scheduler"))


def test_instance_names_are_checked_and_seeds_kept_across_runs(tmp_path):
    assert parse_instances(["executor=a,b", "executor=c", "executor=a"]) == {"executor": ["a", "b", "c"]}
    for bad in (["executor=../x"], ["executor=a.b"], ["scheduler=s1"], ["executor"], ["executor="]):
        with pytest.raises(ValueError):
            parse_instances(bad)
    with pytest.raises(ValueError):
        init_credentials(tmp_path / "c", instances={"executor": ["x/y"]})
    first = init_credentials(tmp_path / "c", instances={"executor": ["a"]})
    seed = first.seed_file("executor", "a").read_bytes()
    again = init_credentials(tmp_path / "c")  # a re-run without --instance keeps the instance's user
    assert again.seed_file("executor", "a").read_bytes() == seed and "# executor@a\n" in again.server_include.read_text()
    rotated = init_credentials(tmp_path / "c", force=True)
    assert rotated.seed_file("executor", "a").read_bytes() != seed


async def test_one_executors_key_cannot_act_as_another(server, creds, operator):
    async with (
        Bus(_config(server, creds.seed_file("executor", A)), service="executor", instance=A) as a,
        Bus(_config(server, creds.seed_file("executor", B)), service="executor", instance=B) as b,
        Bus(_config(server, creds.seed_file("rollout_worker")), service="rollout_worker", instance="rw-inst") as worker,
    ):
        # its own: serve, report, heartbeat
        await a.serve(GENERATE, _reply(A), executor_id=A)
        await b.serve(GENERATE, _reply(B), executor_id=B)
        req = GenerateRequest(request_id="g1", trajectory_id="t", turn_index=0, prompt_token_ids=[1])
        assert (await worker.request(GENERATE, req, executor_id=A)).executor_id == A
        await a.publish(EXECUTOR_METRICS, _metrics(A), executor_id=A)
        await a.publish(HEARTBEAT, _beat(A), service="executor", instance=A)
        await a.kv_put(SERVICE_REGISTRY, _beat(A), service="executor", instance=A)
        await a.publish(WEIGHT_APPLIED, WeightApplied(executor_id=A, model="p", version=1, at=NOW, pause_ms=0.1), executor_id=A)
        await a.subscribe(SLO_ALERT, lambda m, d: asyncio.sleep(0), executor_id=A)

        # not B's: intercepting its generate requests, in any form
        with pytest.raises(PermissionDenied) as err:
            await a.serve(GENERATE, _reply(B), executor_id=B)
        assert err.value.subject == f"rose.executor.{B}.generate" and err.value.operation == "subscription"
        for pattern in ("rose.executor.*.generate", "rose.executor.>", ">"):
            with pytest.raises(PermissionDenied), a.permission_errors(pattern):
                await a.nc.subscribe(pattern)
                await a.nc.flush()
                await a.nc.flush()  # nats-py's first PING may overtake the SUB (see Bus._processed)
        # ... nor speaking for it
        with pytest.raises(PermissionDenied):
            await a.publish(EXECUTOR_METRICS, _metrics(B), executor_id=B)
        with pytest.raises(PermissionDenied):
            await a.publish(HEARTBEAT, _beat(B), service="executor", instance=B)
        with pytest.raises(PermissionDenied):
            await a.kv_put(SERVICE_REGISTRY, _beat(B), service="executor", instance=B)
        with pytest.raises(PermissionDenied):
            await a.kv_delete(SERVICE_REGISTRY, service="executor", instance=B)
        with pytest.raises(PermissionDenied):
            await a.publish(WEIGHT_APPLIED, WeightApplied(executor_id=B, model="p", version=9, at=NOW, pause_ms=0.1), executor_id=B)
        with pytest.raises(PermissionDenied):
            await a.publish(WEIGHT_FAILED, WeightFailed(executor_id=B, model="p", version=9, at=NOW, reason="forged"), executor_id=B)
        with pytest.raises(PermissionDenied):  # nor listening to its SLO alerts
            await a.subscribe(SLO_ALERT, lambda m, d: asyncio.sleep(0), executor_id=B)
        with pytest.raises(PermissionDenied), a.permission_errors(f"_INBOX_executor.{B}.>"):  # nor reading B's replies
            await a.nc.subscribe(f"_INBOX_executor.{B}.>")
            await a.nc.flush()
            await a.nc.flush()
        assert a.nc.new_inbox().startswith(f"_INBOX_executor.{A}.")  # its own replies arrive under its name (its kv_put above got its answer there)
        with pytest.raises(PermissionDenied):  # the alert is the monitor's to send, as before
            await a.publish(SLO_ALERT, SloAlert(executor_id=A, at=NOW, severity="burst", reason="x"), executor_id=A)

        # B's requests still reach B, and only B
        assert (await worker.request(GENERATE, req, executor_id=B)).executor_id == B

    # nothing was written under B's name; A's own writes are there
    assert (await operator.js.get_last_msg(TELEMETRY_STREAM.name, f"rose.telemetry.executor.{A}")).data
    with pytest.raises(NotFoundError):
        await operator.js.get_last_msg(TELEMETRY_STREAM.name, f"rose.telemetry.executor.{B}")
    with pytest.raises(NotFoundError):
        await operator.js.get_last_msg("ROSE_EVENTS", f"rose.events.weights.applied.{B}")
    assert (await operator.kv_get(SERVICE_REGISTRY, service="executor", instance=A)).instance == A
    assert await operator.kv_get(SERVICE_REGISTRY, service="executor", instance=B) is None


async def test_the_generic_executor_key_still_serves_undeclared_instances(server, creds, operator):
    """The weaker option, for executors nobody declared (autoscaled ones): any executor id, as before."""
    async with (
        Bus(_config(server, creds.seed_file("executor")), service="executor", instance="auto-7") as auto,
        Bus(_config(server, creds.seed_file("rollout_worker")), service="rollout_worker", instance="rw-auto") as worker,
    ):
        await auto.serve(GENERATE, _reply("auto-7"), executor_id="auto-7")
        req = GenerateRequest(request_id="g2", trajectory_id="t", turn_index=0, prompt_token_ids=[1])
        assert (await worker.request(GENERATE, req, executor_id="auto-7")).executor_id == "auto-7"
        await auto.publish(EXECUTOR_METRICS, _metrics("auto-7"), executor_id="auto-7")
        await auto.publish(HEARTBEAT, _beat("auto-7"), service="executor", instance="auto-7")
        await auto.kv_put(SERVICE_REGISTRY, _beat("auto-7"), service="executor", instance="auto-7")
    assert (await operator.kv_get(SERVICE_REGISTRY, service="executor", instance="auto-7")).instance == "auto-7"


def test_launchers_give_each_executor_its_instance_key_and_refuse_an_undeclared_one(tmp_path, creds):
    from rose.bench.demo import SPEC, job_processes
    from rose.bench.fleet import executor_instances
    from rose.shared.workload import TRAINER

    names = executor_instances(SPEC, 2, 1)
    declared = init_credentials(tmp_path / "creds", instances={"executor": names})
    procs = job_processes(tmp_path / "state", "nats://127.0.0.1:1", tmp_path / "models", declared, SPEC, 2, 1, dict(TRAINER))
    executors = {n: p for n, p in procs.items() if p.service == "executor"}
    assert sorted(executors) == sorted(names)
    for name, proc in executors.items():
        assert proc.env["ROSE_BUS__NKEY_SEED_FILE"] == str(declared.seed_file("executor", name)), name
    for proc in procs.values():
        if proc.service != "executor":
            assert proc.env["ROSE_BUS__NKEY_SEED_FILE"] == str(declared.seed_file(proc.service)), proc.service
    with pytest.raises(RuntimeError, match="instances="):  # no quiet fall back on the shared executor key
        job_processes(tmp_path / "state", "nats://127.0.0.1:1", tmp_path / "models", init_credentials(tmp_path / "bare"), SPEC, 2, 1, dict(TRAINER))


@pytest.mark.timeout(180)
async def test_a_launched_executor_serves_and_heartbeats_on_its_instance_key(tmp_path, models_dir):
    """The executor process as `rose demo` / the benches start it (bench/fleet.py), on its own instance's key."""
    from rose.bench.fleet import FleetSpec, assign_credentials, executor_instances, fleet_processes

    spec = FleetSpec(prefix="inst")
    (name,) = executor_instances(spec, 1, 0)
    creds = init_credentials(tmp_path / "security", instances={"executor": [name]})
    with NatsServer(tmp_path / "nats", extra_config=creds.server_config()) as srv:
        procs = fleet_processes(tmp_path / "logs", srv.url, models_dir, spec, 1, 0)
        assign_credentials(procs, creds)
        executor = procs[name]
        executor.env["ROSE_STATE_DIR"] = str(tmp_path / "state")
        assert executor.env["ROSE_BUS__NKEY_SEED_FILE"] == str(creds.seed_file("executor", name))
        async with (
            Bus(_config(srv, creds.seed_file(OPERATOR)), service=OPERATOR, instance="ops-launch") as ops,
            Bus(_config(srv, creds.seed_file("rollout_worker")), service="rollout_worker", instance="rw-launch") as worker,
        ):
            await provision(ops.js)
            beats: list[Heartbeat] = []

            async def on_beat(beat: Heartbeat, _d: Delivery) -> None:
                beats.append(beat)

            await ops.subscribe(HEARTBEAT, on_beat, service="executor", instance=name)
            executor.start()
            try:
                await executor.wait_ready(ops, 150)
                reply = await worker.request(
                    GENERATE, GenerateRequest(request_id="g-l", trajectory_id="t", turn_index=0, prompt_token_ids=[1, 2]), executor_id=name
                )
                assert reply.executor_id == name and reply.request_id == "g-l"  # answered on its own subject (no lease: rejected)
                await until(lambda: any(b.state == "ready" for b in beats), 30, "a ready heartbeat on core NATS")
                await until(lambda: _has_metrics(ops, name), 30, "its metrics in the telemetry stream")
            finally:
                await asyncio.to_thread(executor.stop)
        log = executor.log_tail(100_000)
        assert "NATS refused" not in log and "PermissionDenied" not in log, log[-3000:]
        violations = [line for line in srv.log_file.read_text().splitlines() if "Violation" in line]
        assert violations == [], violations[:5]


async def _has_metrics(bus: Bus, name: str) -> bool:
    try:
        return bool((await bus.js.get_last_msg(TELEMETRY_STREAM.name, f"rose.telemetry.executor.{name}")).data)
    except NotFoundError:
        return False


async def test_health_on_an_instance_key_listens_to_that_instance_only(server, creds, operator):
    """`rose health executor --instance NAME` in an executor's container: its core NATS fallback hears NAME's heartbeats."""
    from rose.cli.health import _live_heartbeats

    seed = creds.seed_file("executor", A)
    async with (
        Bus(_config(server, seed), service="executor", instance="health-a") as checker,
        Bus(_config(server, seed), service="executor", instance=A) as live,
    ):
        listening = asyncio.create_task(_live_heartbeats(checker, "executor", 30.0, A))

        async def heard() -> bool:  # once the subscription is in place, it hears one
            await live.publish(HEARTBEAT, _beat(A), service="executor", instance=A)
            return listening.done()

        await until(heard, 30, "the fallback hearing a heartbeat", step=0.1)
        assert {b.instance for b in listening.result()} == {A}
        with pytest.raises(PermissionDenied):  # every executor's heartbeats: not on this key
            await _live_heartbeats(checker, "executor", 1.0)
