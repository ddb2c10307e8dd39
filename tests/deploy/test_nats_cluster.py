"""The 3-node JetStream topology of docker compose, run as real local nats-server processes.

The compose node configs (deploy/compose/nats/*.conf) are the output of the renderer that
`NatsCluster` (and so `rose up --nats-cluster 3`) uses, and they run with auth on: each includes
the per-service authorization and, inside its cluster block, the route authorization and routes
that compose's `security-init` writes (`rose security init --cluster-route`). Here those files
form a cluster as they are (only addresses and store dirs changed), beside nothing but the two
includes that the compose nodes mount, with the include written by security-init's own command:
anonymous clients, unknown keys and routes without the password are refused, every service
connects with its own seed (and `rose health` passes on it), R3 storage works.

The `rose up --nats-cluster 3` topology runs with auth on too (every node has the `rose security
init` permissions, and its routes authenticate through the same kind of generated cluster include,
written for its local ports, the password never in a node's config), gets R3 storage from `rose provision --replicas 3` with the operator's
credentials (as in compose), a real ROSE service joins it with its own, and the leader of the
events stream is killed with SIGKILL: publishing, consuming, KV and the service's heartbeats must
carry on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import nats.errors
import nkeys
import pytest
import yaml
from nats.js.errors import APIError, NoStreamResponseError

from rose.contracts import RolloutTask
from rose.contracts.registry import ALL_SERVICES, KV_BUCKETS, OBJECT_STORES, ROLLOUT_TASK, SERVICE_EVENT, SERVICE_REGISTRY, STREAMS
from rose.contracts.service import Heartbeat, ServiceEvent
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess
from rose.shared.nats_server import (
    COMPOSE_AUTH_DIR,
    COMPOSE_CLIENT_PORT,
    COMPOSE_CLUSTER_PORT,
    COMPOSE_MONITOR_PORT,
    COMPOSE_STORE_DIR,
    NatsCluster,
    compose_node_configs,
    compose_route_addresses,
    find_binary,
    free_ports,
)
from rose.shared.security import CLUSTER_INCLUDE, OPERATOR, ROUTE_SECRET, ROUTE_USER, SEED_SUFFIX, SERVER_INCLUDE, init_credentials
from rose.testing.polling import retrying, until, within

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "deploy" / "compose" / "nats"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
RETRY_S = 30.0
NODES = ["nats-1", "nats-2", "nats-3"]


def test_compose_node_configs_are_the_rendered_template():
    on_disk = {p.name: p.read_text() for p in sorted(NATS_DIR.glob("*.conf"))}
    assert on_disk == compose_node_configs(3), (
        "deploy/compose/nats drifted from rose.shared.nats_server.render_config; regenerate with\n"
        "  python -c 'from rose.shared.nats_server import write_compose_configs; write_compose_configs(\"deploy/compose/nats\")'"
    )
    names = set()
    for name, text in on_disk.items():
        node = name.removesuffix(".conf")
        names.add(node)
        assert f'server_name: "{node}"' in text  # JetStream needs a unique name per node
        assert f'store_dir: "{COMPOSE_STORE_DIR}"' in text and COMPOSE_STORE_DIR.startswith("/data/")  # the volume
        cluster = text[text.index("cluster {") :].split("\n}")[0]
        assert f'include "{COMPOSE_AUTH_DIR}/{CLUSTER_INCLUDE}"' in cluster  # route auth and routes, inside the cluster block
        assert f'\ninclude "{COMPOSE_AUTH_DIR}/{SERVER_INCLUDE}"' in text  # clients' authorization, at top level
        assert "nats-route://" not in text and "password:" not in text  # routes carry the password: never in a committed file
    assert names == set(NODES)


def _compose_security_init(directory: Path, routes: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The compose service security-init's command, its volume at `directory`, routes renamed (nats-1:6222 -> ...)."""
    argv = [directory.as_posix() if arg == "/creds" else (routes or {}).get(arg, arg) for arg in COMPOSE["services"]["security-init"]["command"]]
    assert argv[0] == "rose"
    return _rose(*argv[1:])


def _node_dir(root: Path, node: str, creds: Path, text: str) -> Path:
    """What a compose node sees: its config and, beside it under auth/, the two includes compose mounts (no seed)."""
    node_dir = root / node
    (node_dir / COMPOSE_AUTH_DIR).mkdir(parents=True)
    (node_dir / "nats.conf").write_text(text)
    for include in (SERVER_INCLUDE, CLUSTER_INCLUDE):
        shutil.copy(creds / include, node_dir / COMPOSE_AUTH_DIR / include)
    assert not list(node_dir.rglob(f"*{SEED_SUFFIX}"))
    return node_dir


@pytest.mark.parametrize("conf", ["nats-1.conf", "nats-2.conf", "nats-3.conf"])
def test_compose_node_config_is_accepted_by_nats_server(conf, tmp_path):
    """With the includes security-init writes for compose (route hosts nats-1..3), beside it as compose mounts them."""
    creds = tmp_path / "creds"
    assert _compose_security_init(creds).returncode == 0
    node_dir = _node_dir(tmp_path, "node", creds, (NATS_DIR / conf).read_text())
    done = subprocess.run([find_binary(), "-t", "-c", str(node_dir / "nats.conf")], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _local(text: str, *, client: int, route: int, monitor: int, store: Path) -> str:
    """A compose node config on local ports and a local store: each of these lines changed exactly once, nothing else."""
    for old, new in (
        (f'listen: "0.0.0.0:{COMPOSE_CLIENT_PORT}"', f'listen: "127.0.0.1:{client}"'),
        (f'http: "0.0.0.0:{COMPOSE_MONITOR_PORT}"', f'http: "127.0.0.1:{monitor}"'),
        (f'listen: "0.0.0.0:{COMPOSE_CLUSTER_PORT}"', f'listen: "127.0.0.1:{route}"'),
        (f'store_dir: "{COMPOSE_STORE_DIR}"', f'store_dir: "{store}"'),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
        return json.load(reply)


def _healthy(proc: subprocess.Popen, log: Path, monitor: int) -> bool:
    assert proc.poll() is None, log.read_text()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _beat(service: str, instance: str) -> Heartbeat:
    now = time.time()
    return Heartbeat(
        service=service,
        instance=instance,
        version="0",
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=now,
        sent_at=now,
        interval_s=30.0,
        state="ready",
        load={},
        endpoints={},
        labels={},
    )


@pytest.mark.timeout(240)
async def test_compose_cluster_runs_with_auth_as_local_processes(tmp_path):
    free = free_ports("127.0.0.1", 12)
    ports = [tuple(free[i : i + 3]) for i in (0, 3, 6)]  # client, route, monitor of each node
    rogue_client, rogue_route, rogue_monitor = free[9:12]
    local_routes = {compose: f"127.0.0.1:{route}" for compose, (_, route, _) in zip(compose_route_addresses(3), ports)}

    # security-init, as compose runs it (routes to this machine's ports); a re-run changes no secret
    creds = tmp_path / "creds"
    done = _compose_security_init(creds, local_routes)
    assert done.returncode == 0, done.stdout + done.stderr
    secrets_before = {p.name: p.read_bytes() for p in creds.iterdir() if p.name not in (SERVER_INCLUDE, CLUSTER_INCLUDE)}
    assert _compose_security_init(creds, local_routes).returncode == 0
    assert {p.name: p.read_bytes() for p in creds.iterdir() if p.name not in (SERVER_INCLUDE, CLUSTER_INCLUDE)} == secrets_before
    password = re.search(r'password: "([^"]+)"', (creds / CLUSTER_INCLUDE).read_text()).group(1)

    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    try:
        for node, (client, route, monitor) in zip(NODES, ports):
            text = _local((NATS_DIR / f"{node}.conf").read_text(), client=client, route=route, monitor=monitor, store=tmp_path / "store" / node)
            node_dir = _node_dir(tmp_path / "nodes", node, creds, text)
            logs.append(node_dir / "nats.log")
            with open(logs[-1], "wb") as log:  # started elsewhere: the includes resolve against the config file's directory
                procs.append(subprocess.Popen([find_binary(), "-c", str(node_dir / "nats.conf")], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        for i, (node, (_, _, monitor)) in enumerate(zip(NODES, ports)):
            await until(lambda i=i, monitor=monitor: _healthy(procs[i], logs[i], monitor), 60, f"{node} healthy (log: {logs[i]})", step=0.2)
        for node, (_, _, monitor) in zip(NODES, ports):
            varz = _get(monitor, "/varz")
            assert varz["server_name"] == node and varz["max_payload"] == 8 << 20  # from the compose file
            peers = {r["remote_name"] for r in _get(monitor, "/routez")["routes"]}
            assert peers == set(NODES) - {node}, (node, peers)  # routes formed with the password (its own route ignored)
        assert not any(password in log.read_text() for log in logs)  # nats-server masks it in route URLs

        # a node that does not know the route password is not let in: neither without it nor with a wrong one
        rogue_dir = tmp_path / "rogue"
        rogue_dir.mkdir()
        (rogue_dir / "nats.conf").write_text(
            f'server_name: "rogue"\nlisten: "127.0.0.1:{rogue_client}"\nhttp: "127.0.0.1:{rogue_monitor}"\n'
            f'jetstream {{ store_dir: "{rogue_dir / "store"}" }}\n'
            f'cluster {{ name: "rose", listen: "127.0.0.1:{rogue_route}", routes: ['
            f'"nats-route://127.0.0.1:{ports[0][1]}", "nats-route://{ROUTE_USER}:wrong-{password[:8]}@127.0.0.1:{ports[1][1]}"] }}\n'
        )
        with open(rogue_dir / "nats.log", "wb") as log:
            procs.append(subprocess.Popen([find_binary(), "-c", str(rogue_dir / "nats.conf")], stdout=log, stderr=subprocess.STDOUT))

        def refused_by(node: int) -> bool:  # a route (rid), not a client (cid), failed authentication
            return re.search(r"rid:\d+ - authentication error", logs[node].read_text()) is not None

        assert not refused_by(0) and not refused_by(1)  # the cluster's own routes all authenticated

        await until(lambda: refused_by(0) and refused_by(1), RETRY_S, "nats-1 and nats-2 refusing the rogue's routes", step=0.2)
        for node, (_, _, monitor) in zip(NODES, ports):
            assert "rogue" not in {r["remote_name"] for r in _get(monitor, "/routez")["routes"]}, node
        assert _get(rogue_monitor, "/routez")["num_routes"] == 0

        url = ",".join(f"nats://127.0.0.1:{client}" for client, _, _ in ports)
        stranger = tmp_path / "stranger.nk"
        stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        for client, _, _ in ports:
            assert await _refused(f"nats://127.0.0.1:{client}"), f"node on {client} let a client without credentials in"
            assert await _refused(f"nats://127.0.0.1:{client}", nkeys_seed=str(stranger)), f"node on {client} let an unknown key in"

        # compose's provision: the operator's seed, R3
        operator = {"ROSE_BUS__NKEY_SEED_FILE": str(creds / f"{OPERATOR}{SEED_SUFFIX}")}
        provisioned = _rose("provision", "--replicas", "3", "--nats-url", url, env=operator)
        assert provisioned.returncode == 0 and "with 3 replica(s)" in provisioned.stdout, provisioned.stdout + provisioned.stderr

        # whose seed each container runs on: its service's, an executor its instance's (as compose's executor-1)
        executor = COMPOSE["services"]["executor-1"]["environment"]
        own = {service: (f"{service}-compose", f"{service}{SEED_SUFFIX}") for service in (*ALL_SERVICES, OPERATOR)}
        own["executor"] = (executor["ROSE_RUNTIME__INSTANCE"], Path(executor["ROSE_BUS__NKEY_SEED_FILE"]).name)

        def as_service(service: str) -> BusConfig:
            return BusConfig(url=url, replicas=3, initial_connect_deadline_s=10.0, nkey_seed_file=str(creds / own[service][1]))

        async with Bus(as_service(OPERATOR), service=OPERATOR, instance="compose-ops") as ops:
            for spec in STREAMS:
                info = await ops.js.stream_info(spec.name)
                assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, spec.name

        # every service on its own seed: its heartbeat into the R3 registry, then its container's healthcheck
        for service in ALL_SERVICES:
            instance = own[service][0]
            async with Bus(as_service(service), service=service, instance=instance) as bus:
                await _retry(
                    "heartbeat",
                    lambda bus=bus, service=service, instance=instance: bus.kv_put(
                        SERVICE_REGISTRY, _beat(service, instance), service=service, instance=instance
                    ),
                )

        def health(service: str) -> tuple[str, subprocess.CompletedProcess[str]]:
            env = {"ROSE_BUS__NKEY_SEED_FILE": str(creds / own[service][1])}  # what the compose container sets
            named = ["--instance", own[service][0]] if service == "executor" else []  # as the executors' healthchecks
            return service, _rose("health", service, "--local", *named, "--nats-url", url, "--timeout", "10", env=env)

        with ThreadPoolExecutor(max_workers=2) as pool:
            for service, checked in pool.map(health, ALL_SERVICES):
                assert checked.returncode == 0 and "healthy" in checked.stdout, (service, checked.stdout + checked.stderr)

        # R3 JetStream between two services: the trainer hands out a task, a worker consumes it
        async with (
            Bus(as_service("trainer"), service="trainer", instance="tr-compose") as trainer,
            Bus(as_service("rollout_worker"), service="rollout_worker", instance="rw-compose") as worker,
        ):
            got: list[str] = []

            async def on_task(task: RolloutTask, _delivery: Delivery) -> None:
                got.append(task.task_id)

            await worker.consume(ROLLOUT_TASK, on_task, durable="compose-workers")
            await trainer.publish(ROLLOUT_TASK, RolloutTask(task_id="compose-t1", env="conversation", prompt="hi"), msg_id="compose-t1")
            await until(lambda: got == ["compose-t1"], RETRY_S, "the task consumed")
            info = await worker.js.stream_info(ROLLOUT_TASK.stream.name)
            assert (
                info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2 and info.state.last_seq == 1
            )  # a work queue: acked, removed
    finally:
        _stop(procs)


# what JetStream answers while a new leader is elected (a node killed, a cluster still forming)
ELECTION_ERRORS = (
    TimeoutError,
    APIError,
    NoStreamResponseError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
)


async def _retry(what: str, fn, timeout: float = RETRY_S):
    """Call `fn()` until it succeeds: JetStream answers 503/timeouts while a new leader is elected."""
    return await retrying(fn, ELECTION_ERRORS, timeout, what, step=0.3)


def _rose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_") and k != "NATS_URL"}
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


async def _refused(url: str, **credentials: str) -> bool:
    """True when the server at `url` turns this client away (no credentials, or a key it does not know)."""

    async def quiet(_exc: Exception) -> None:
        return None

    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2.0, error_cb=quiet, **credentials)
    except nats.errors.Error as exc:
        return "authorization violation" in str(exc).lower()
    await nc.close()
    return False


def _heartbeat(sent_at: float) -> Heartbeat:
    return Heartbeat(
        service="r3probe",
        instance="probe-1",
        version="0",
        host="test",
        pid=os.getpid(),
        started_at=sent_at,
        sent_at=sent_at,
        interval_s=1.0,
        state="ready",
        load={},
        endpoints={},
        labels={},
    )


@pytest.mark.timeout(240)
async def test_r3_cluster_keeps_working_after_a_node_is_killed(tmp_path):
    # what `rose up --nats-cluster 3` does: auth on every node, routes authenticated with a generated password
    cluster = NatsCluster(tmp_path / "cluster", 3, log_dir=tmp_path / "logs")
    creds = init_credentials(tmp_path / "security", cluster_routes=cluster.route_addresses)
    cluster.use_auth(creds.server_config(), creds.cluster_include)
    cluster.start()  # healthy: the routes formed, with the password
    service: ServiceProcess | None = None
    operator = creds.env(OPERATOR)
    try:
        password = (tmp_path / "security" / ROUTE_SECRET).read_text().strip()
        for node in cluster.nodes:
            text = node.config_path.read_text()
            assert f'include "{os.path.relpath(creds.cluster_include, node.store_dir)}"' in text
            assert "nats-route://" not in text and password not in text  # the routes, with the password, only in the 0600 include
            assert stat.S_IMODE(os.stat(creds.cluster_include).st_mode) == 0o600
        stranger = tmp_path / "stranger.nk"
        stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        for url in cluster.urls:
            assert await _refused(url), f"{url} let a client without credentials in"
            assert await _refused(url, nkeys_seed=str(stranger)), f"{url} let an unknown key in"
        assert not await _refused(cluster.url, nkeys_seed=operator["ROSE_BUS__NKEY_SEED_FILE"])

        config = BusConfig(
            url=cluster.url, replicas=3, initial_connect_deadline_s=10.0, reconnect_wait_s=0.2, nkey_seed_file=operator["ROSE_BUS__NKEY_SEED_FILE"]
        )
        # What the compose `provision` service runs; a second run finds everything in place.
        first = _rose("provision", "--replicas", "3", "--nats-url", cluster.url, env=operator)
        assert first.returncode == 0 and "with 3 replica(s)" in first.stdout, first.stdout + first.stderr
        assert first.stdout.count("stream ") == len(STREAMS)
        again = _rose("provision", "--replicas", "3", "--nats-url", cluster.url, env=operator)
        assert again.returncode == 0 and "created nothing" in again.stdout, again.stdout + again.stderr
        conflict = _rose("provision", "--replicas", "1", "--nats-url", cluster.url, env=operator)
        assert conflict.returncode == 1 and "num_replicas=3" in conflict.stderr, conflict.stdout + conflict.stderr

        async with Bus(config, service=OPERATOR, instance="r3-tester") as bus:
            # Every stream, bucket and object store is replicated on all three nodes.
            for spec in STREAMS:
                info = await bus.js.stream_info(spec.name)
                assert info.config.num_replicas == 3, spec.name
                assert info.cluster is not None and info.cluster.leader and len(info.cluster.replicas or []) == 2, spec.name
            for kv_spec in KV_BUCKETS:
                status = await (await bus.js.key_value(kv_spec.bucket)).status()
                assert status.stream_info.config.num_replicas == 3, kv_spec.bucket
            for obj_spec in OBJECT_STORES:
                assert (await (await bus.js.object_store(obj_spec.bucket)).status()).replicas == 3, obj_spec.bucket

            # A real service on the cluster (it provisions again and must agree on R3).
            service = ServiceProcess(
                "slo_monitor",
                "slo-r3",
                {"NATS_URL": cluster.url, "ROSE_BUS__REPLICAS": "3", "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", **creds.env("slo_monitor")},
                tmp_path / "slo_monitor.log",
            ).start()
            await service.wait_ready(bus, timeout=90)

            before = [f"before-{i}" for i in range(5)]
            for reason in before:
                await bus.publish(
                    SERVICE_EVENT,
                    ServiceEvent(kind="up", service="r3probe", instance="probe-1", at=time.time(), reason=reason),
                    msg_id=reason,
                    kind="up",
                    service="r3probe",
                    instance="probe-1",
                )
            await bus.kv_put(SERVICE_REGISTRY, _heartbeat(1.0), service="r3probe", instance="probe-1")
            weights = await bus.js.object_store("rose_weights")
            await weights.put("r3-probe-object", b"x" * 300_000)

            # SIGKILL the node leading the events stream: a new leader must take over.
            events_info = await bus.js.stream_info(SERVICE_EVENT.stream.name)
            victim = cluster.node(events_info.cluster.leader)
            victim.stop(kill=True)
            killed_at = time.time()

            after = [f"after-{i}" for i in range(5)]
            for reason in after:
                event = ServiceEvent(kind="down", service="r3probe", instance="probe-1", at=time.time(), reason=reason)
                # msg_id: a publish retried after a lost ack is stored once
                await _retry(
                    "publish",
                    lambda event=event, reason=reason: bus.publish(
                        SERVICE_EVENT, event, msg_id=reason, kind="down", service="r3probe", instance="probe-1"
                    ),
                )

            new_info = await _retry("stream info", lambda: bus.js.stream_info(SERVICE_EVENT.stream.name))
            assert new_info.cluster.leader != victim.server_name

            await _retry("kv put", lambda: bus.kv_put(SERVICE_REGISTRY, _heartbeat(2.0), service="r3probe", instance="probe-1"))
            beat = await _retry("kv get", lambda: bus.kv_get(SERVICE_REGISTRY, service="r3probe", instance="probe-1"))
            assert beat.sent_at == 2.0

            blob = await _retry("object get", lambda: weights.get("r3-probe-object"))
            assert blob.data == b"x" * 300_000

            # A durable consumer created now gets every event, from before and after the kill, once.
            seen: list[str] = []

            async def collect(event: ServiceEvent, _delivery) -> None:
                seen.append(event.reason)

            await _retry("consumer", lambda: bus.consume(SERVICE_EVENT, collect, durable="r3-probe", service="r3probe"))
            await within(lambda: len(seen) >= len(before + after), RETRY_S, step=0.2)
            assert sorted(seen) == sorted(before + after)

            # The service kept heartbeating into the R3 KV bucket through the failover.
            async def heard_since_kill() -> bool:
                live = await _retry("kv get", lambda: bus.kv_get(SERVICE_REGISTRY, service="slo_monitor", instance="slo-r3"))
                return live is not None and live.sent_at > killed_at + 1.0

            await until(heard_since_kill, RETRY_S, f"a heartbeat since the kill (log: {service.log_path})", step=0.3)
            assert service.alive(), service.log_tail()
            health = _rose("health", "slo_monitor", "--instance", "slo-r3", "--nats-url", cluster.url, env=operator)
            assert health.returncode == 0, health.stdout + health.stderr

            # The killed node comes back and catches up: all three healthy again.
            victim.start()
            cluster.wait_healthy(60)
    finally:
        if service is not None:
            service.stop()
        cluster.stop()
