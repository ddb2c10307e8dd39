"""The 3-node JetStream topology of docker compose, run as real local nats-server processes.

The compose node configs (deploy/compose/nats/*.conf) start a cluster here as they are (only
addresses and store dirs overridden), and they are the output of the renderer that
`NatsCluster` (and so `rose up --nats-cluster 3`) uses; here that cluster runs with auth on, as
`rose up --nats-cluster 3` does (every node has the `rose security init` permissions: a client
without credentials, or with a key the cluster does not know, is refused on every node), gets R3
storage from `rose provision --replicas 3` with the operator's credentials (as in compose), a real
ROSE service joins it with its own, and the leader of the events stream is killed with SIGKILL:
publishing, consuming, KV and the service's heartbeats must carry on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nkeys
import pytest
from polling import until
from nats.js.errors import APIError, NoStreamResponseError

from rose.contracts.registry import KV_BUCKETS, OBJECT_STORES, SERVICE_EVENT, SERVICE_REGISTRY, STREAMS
from rose.contracts.service import Heartbeat, ServiceEvent
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess
from rose.shared.nats_server import COMPOSE_STORE_DIR, NatsCluster, compose_node_configs, find_binary, free_ports
from rose.shared.security import OPERATOR, init_credentials

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "deploy" / "compose" / "nats"
RETRY_S = 30.0


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
        peers = {f"nats-{i}" for i in (1, 2, 3)} - {node}
        assert all(f'"nats-route://{peer}:6222"' in text for peer in peers)
    assert names == {"nats-1", "nats-2", "nats-3"}


@pytest.mark.parametrize("conf", ["nats-1.conf", "nats-2.conf", "nats-3.conf"])
def test_compose_node_config_is_accepted_by_nats_server(conf):
    done = subprocess.run([find_binary(), "-t", "-c", str(NATS_DIR / conf)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


async def test_compose_node_configs_start_a_cluster_as_local_processes(tmp_path):
    """The files compose mounts, included unchanged; only addresses and store dirs are overridden.

    Inside compose the nodes find each other as nats-1..3 on fixed ports and keep JetStream on
    /data; here the same files run side by side on free local ports (a wrapper config includes
    each one and overrides listen, http, cluster listen/routes and store_dir, nothing else).
    """
    free = free_ports("127.0.0.1", 9)
    ports = [tuple(free[i : i + 3]) for i in (0, 3, 6)]  # client, route, monitor of each node
    procs: list[subprocess.Popen] = []
    try:
        for i, (client, route, monitor) in enumerate(ports, start=1):
            node_dir = tmp_path / f"nats-{i}"
            node_dir.mkdir()
            shutil.copy(NATS_DIR / f"nats-{i}.conf", node_dir / "compose.conf")
            routes = ", ".join(f'"nats-route://127.0.0.1:{r}"' for j, (_, r, _) in enumerate(ports, start=1) if j != i)
            (node_dir / "local.conf").write_text(
                'include "compose.conf"\n'
                f'listen: "127.0.0.1:{client}"\n'
                f'http: "127.0.0.1:{monitor}"\n'
                f'jetstream {{ store_dir: "{node_dir / "store"}" }}\n'
                f'cluster {{ name: "rose", listen: "127.0.0.1:{route}", routes: [{routes}] }}\n'
            )
            with open(node_dir / "nats.log", "wb") as log:
                procs.append(subprocess.Popen([find_binary(), "-c", str(node_dir / "local.conf")], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30

        def healthy(node: int, monitor: int) -> bool:
            assert procs[node - 1].poll() is None, (tmp_path / f"nats-{node}" / "nats.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False

        for i, (_, _, monitor) in enumerate(ports, start=1):
            await until(lambda: healthy(i, monitor), max(0.1, deadline - time.monotonic()), f"nats-{i} healthy (log: {tmp_path / f'nats-{i}' / 'nats.log'})", step=0.2)
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=2) as reply:
                varz = json.load(reply)
            assert varz["server_name"] == f"nats-{i}" and varz["max_payload"] == 8 << 20  # from the compose file

        url = ",".join(f"nats://127.0.0.1:{client}" for client, _, _ in ports)
        async with Bus(BusConfig(url=url, initial_connect_deadline_s=10.0), service="tester", instance="compose-files") as bus:
            await _retry("add stream", lambda: bus.js.add_stream(name="R3PROBE", subjects=["r3probe.>"], num_replicas=3))
            ack = await _retry("publish", lambda: bus.js.publish("r3probe.x", b"hello"))
            info = await bus.js.stream_info("R3PROBE")
            assert ack.seq == 1 and info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _retry(what: str, fn, timeout: float = RETRY_S):
    """Call `fn()` until it succeeds: JetStream answers 503/timeouts while a new leader is elected."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fn()
        except (APIError, NoStreamResponseError, nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError, asyncio.TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} still failing {timeout:.0f}s after the node kill: {exc!r}") from exc
            await asyncio.sleep(0.3)


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
        service="r3probe", instance="probe-1", version="0", host="test", pid=os.getpid(), started_at=sent_at, sent_at=sent_at,
        interval_s=1.0, state="ready", load={}, endpoints={}, labels={},
    )


@pytest.mark.timeout(240)
async def test_r3_cluster_keeps_working_after_a_node_is_killed(tmp_path):
    creds = init_credentials(tmp_path / "security")  # what `rose up --nats-cluster 3` does: auth on every node
    cluster = NatsCluster(tmp_path / "cluster", 3, log_dir=tmp_path / "logs", extra_config=creds.server_config()).start()
    service: ServiceProcess | None = None
    operator = creds.env(OPERATOR)
    try:
        stranger = tmp_path / "stranger.nk"
        stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        for url in cluster.urls:
            assert await _refused(url), f"{url} let a client without credentials in"
            assert await _refused(url, nkeys_seed=str(stranger)), f"{url} let an unknown key in"
        assert not await _refused(cluster.url, nkeys_seed=operator["ROSE_BUS__NKEY_SEED_FILE"])

        config = BusConfig(url=cluster.url, replicas=3, initial_connect_deadline_s=10.0, reconnect_wait_s=0.2, nkey_seed_file=operator["ROSE_BUS__NKEY_SEED_FILE"])
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
                "slo_monitor", "slo-r3",
                {"NATS_URL": cluster.url, "ROSE_BUS__REPLICAS": "3", "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", **creds.env("slo_monitor")},
                tmp_path / "slo_monitor.log",
            ).start()
            await service.wait_ready(bus, timeout=90)

            before = [f"before-{i}" for i in range(5)]
            for reason in before:
                await bus.publish(SERVICE_EVENT, ServiceEvent(kind="up", service="r3probe", instance="probe-1", at=time.time(), reason=reason),
                                  msg_id=reason, kind="up", service="r3probe")
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
                await _retry("publish", lambda: bus.publish(SERVICE_EVENT, event, msg_id=reason, kind="down", service="r3probe"))

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
            deadline = time.monotonic() + RETRY_S
            while len(seen) < len(before + after) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
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
