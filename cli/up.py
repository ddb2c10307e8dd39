"""`rose up`: the embedded default. A nats-server (unless NATS_URL is set) and every service, supervised.

`--nats-cluster 3` starts a 3-node JetStream cluster instead (the docker compose topology, as
local processes on free ports); streams and buckets then get 3 replicas, and every service is
told so (ROSE_BUS__REPLICAS) and given all three URLs. With auth on, its routes authenticate with
a generated password, as compose's do (`rose security init --cluster-route`).

With auth on, every service gets its own NKey and the executor one of its own instance: it runs
under a fixed instance name (`executor-<host>`, or ROSE_RUNTIME__INSTANCE when set), kept across
its restarts, whose user (`executor@<name>`) may only serve, report and heartbeat as that instance.

Each service runs as `python -m rose.cli.main run NAME` in its own process group, so Ctrl-C
reaches only this supervisor, which then stops the services (SIGTERM, drain) before NATS.
A service that dies is restarted with backoff.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from rose.shared.clock import TIME_SCALE_ENV
from rose.shared.config import ConfigError
from rose.shared.errors import RoseError
from rose.shared.nats_server import NatsCluster, NatsServer, state_dir
from rose.shared.provisioning import ProvisioningConflict
from rose.shared.security import INSTANCE_TOKENS, OPERATOR, Credentials, init_credentials, instance_user

from .provision import bus_config_from_env, provision_storage
from .service_table import ON_DEMAND_SERVICES, SERVICE_MODULES
from .status import UP_FILE, live_services, operator_config

STOP_TIMEOUT_S = 20.0
MAX_RESTART_DELAY_S = 30.0


@dataclass
class Supervised:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:  # the child holds its own copy of the descriptor
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def instance_names(names: list[str]) -> dict[str, str]:
    """The fixed instance name of each service here whose instances get users of their own (the executor).

    ROSE_RUNTIME__INSTANCE when set, else `<service>-<host>`: the same name across restarts, known
    before the server starts, so that its user is in the server's config.
    """
    given = os.environ.get("ROSE_RUNTIME__INSTANCE")
    return {name: given or re.sub(r"[^A-Za-z0-9_-]", "-", f"{name}-{socket.gethostname()}")[:128] for name in names if name in INSTANCE_TOKENS}


def emulated_job(args: argparse.Namespace):
    """`--emulate 8xH100:7B[+POLICY]` as the emulated fleet's job (bench/emulated.py), or None."""
    spec = getattr(args, "emulate", None)
    if not spec:
        return None
    from rose.bench.emulated import EmulatedJob
    from rose.services.executor.group import EmulatedFleet

    fleet = EmulatedFleet.parse(spec)
    return EmulatedJob(
        gpus=fleet.gpus,
        device=fleet.device,
        model=fleet.serving_model,
        policy_model=fleet.policy_model,
        dedicated_ratio=args.dedicated_ratio,
        time_scale=args.time_scale,
        trace=getattr(args, "trace", None) or "",
    )


def emulated_groups(args: argparse.Namespace) -> list:
    """The executor groups of `--emulate` (serving, dedicated), sized as the simulator sizes the fleet; [] without it."""
    from rose.bench.emulated import executor_groups

    job = emulated_job(args)
    return executor_groups(job) if job is not None else []


def emulated_monitor_env(args: argparse.Namespace) -> dict[str, str]:
    from rose.bench.emulated import monitor_env

    job = emulated_job(args)
    return monitor_env(job) if job is not None else {}


class UpRefused(RoseError, ValueError):
    """`rose up` was asked for something it cannot start; the message says what to change (exit status 2)."""


@dataclass(frozen=True)
class UpPlan:
    """What `rose up` was asked to start, checked before anything starts."""

    root: Path  # the state dir: logs, the embedded NATS store, credentials, up.json
    names: list[str]  # the services
    nodes: int  # --nats-cluster: 1 is a single embedded server
    nats_url: str  # NATS_URL: an external server ("" starts one here)
    tls: bool  # TLS on the embedded server (never with NATS_URL)
    instances: dict[str, str]  # service -> its fixed instance name (instance_names)
    groups: list  # the emulated executor groups of --emulate ([] without it)

    @property
    def declared(self) -> dict[str, list[str]]:
        """The instances that get a user of their own: the fixed ones, and with --emulate every executor of every group."""
        declared = {service: [name] for service, name in self.instances.items()}
        if self.groups:
            declared["executor"] = [member for g in self.groups for member in g.members]
        return declared


@dataclass
class Nats:
    """The NATS the services use: an embedded server or cluster started here (stopped here), or NATS_URL's."""

    url: str
    replicas: int | None  # None (an external NATS_URL): what the environment says (ROSE_BUS__REPLICAS), else 1
    server: NatsServer | None = None
    cluster: NatsCluster | None = None

    @property
    def embedded(self) -> bool:
        return self.server is not None or self.cluster is not None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.stop()


def up(args: argparse.Namespace) -> int:
    """Start NATS (unless NATS_URL is set) and every service, supervise them until Ctrl-C, then stop them all."""
    console = Console()
    try:
        plan = _plan(args)
    except UpRefused as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    cluster = None
    if not plan.nats_url and plan.nodes > 1:  # its ports now: the route include (auth on) names them
        cluster = NatsCluster(plan.root / f"nats-cluster-{plan.nodes}", plan.nodes, log_dir=plan.root / "logs")
    creds, route_include = _credentials(args, plan, cluster)
    nats = _start_nats(plan, cluster, creds, route_include)
    operator = creds.env(OPERATOR, tls=plan.tls) if creds is not None else {}
    try:
        asyncio.run(_provision(nats.url, nats.replicas, operator))
    except (ConnectionError, ConfigError, ProvisioningConflict, RuntimeError) as exc:
        console.print(f"[red]cannot provision JetStream storage on {nats.url}: {exc}[/red]")
        nats.stop()
        return 1
    children = _children(args, plan, nats, creds)
    _write_up_file(plan, nats, operator)
    _run(console, args, plan, nats, children, creds, route_include)
    return 0


def _plan(args: argparse.Namespace) -> UpPlan:
    """The services, the NATS and the instances asked for; `UpRefused` when they cannot be started as asked."""
    root = Path(args.state_dir).resolve() if args.state_dir else state_dir()
    (root / "logs").mkdir(parents=True, exist_ok=True)
    names = args.services if args.services is not None else sorted(set(SERVICE_MODULES) - set(ON_DEMAND_SERVICES))
    unknown = sorted(set(names) - set(SERVICE_MODULES))
    if unknown:
        raise UpRefused(f"unknown services {unknown}; available: {sorted(SERVICE_MODULES)}")
    nodes = getattr(args, "nats_cluster", 1)
    nats_url = os.environ.get("NATS_URL", "")
    if not 1 <= nodes <= 5:
        raise UpRefused(f"--nats-cluster takes 1 to 5 nodes (3 is the compose topology), not {nodes}")
    if nodes > 1 and nats_url:
        raise UpRefused(f"--nats-cluster {nodes} starts its own cluster, but NATS_URL={nats_url} is set: unset one of them")
    instances = instance_names(names)
    try:
        for service, name in instances.items():
            instance_user(service, name)
        groups = emulated_groups(args) if "executor" in names else []
    except ValueError as exc:
        raise UpRefused(str(exc)) from exc
    tls = bool(getattr(args, "tls", False)) and not nats_url
    return UpPlan(root, names, nodes, nats_url, tls, instances, groups)


def _credentials(args: argparse.Namespace, plan: UpPlan, cluster: NatsCluster | None) -> tuple[Credentials | None, Path | None]:
    """The services' credentials, and the cluster's route include written for its ports (None: no cluster, or no auth).

    Auth is on by default: the embedded server gets per-service permissions and each service its own seed
    (kept under the state dir, or --credentials DIR, and reused). With NATS_URL, --credentials DIR names the
    `rose security init` output the external server was configured with.
    """
    if not plan.nats_url and not getattr(args, "no_auth", False):
        creds = init_credentials(
            getattr(args, "credentials", None) or plan.root / "security",
            tls_hosts=["127.0.0.1", "localhost"] if plan.tls else None,
            cluster_routes=cluster.route_addresses if cluster is not None else None,
            instances=plan.declared,
        )
        return creds, creds.cluster_include if cluster is not None else None  # written just now for this cluster's ports
    if getattr(args, "credentials", None):  # an external server's: instance seeds are used where the directory has them
        return Credentials(Path(args.credentials).resolve()), None
    return None, None


def _start_nats(plan: UpPlan, cluster: NatsCluster | None, creds: Credentials | None, route_include: Path | None) -> Nats:
    """The embedded cluster or server started (with the credentials' permissions), or NATS_URL's server as it is."""
    auth_config = creds.server_config(tls=plan.tls) if creds is not None and not plan.nats_url else ""
    if cluster is not None:
        cluster.use_auth(auth_config, route_include)
        cluster.start()
        return Nats(cluster.url, plan.nodes, cluster=cluster)
    if not plan.nats_url:
        server = NatsServer(plan.root / "nats", log_file=plan.root / "logs" / "nats-server.log", extra_config=auth_config).start()
        return Nats(server.url, 1, server=server)  # one server holds one replica, whatever the environment says
    return Nats(plan.nats_url, None)


def _children(args: argparse.Namespace, plan: UpPlan, nats: Nats, creds: Credentials | None) -> list[Supervised]:
    """A supervised process per service (with --emulate, one per executor group instead of the executor)."""
    env = {**os.environ, "NATS_URL": nats.url, "ROSE_STATE_DIR": str(plan.root)}
    if nats.replicas is not None:
        env["ROSE_BUS__REPLICAS"] = str(nats.replicas)
    groups, instances, tls = plan.groups, plan.instances, plan.tls
    if groups:
        env[TIME_SCALE_ENV] = f"{args.time_scale:g}"
    children = [
        Supervised(
            name,
            [sys.executable, "-m", "rose.cli.main", "run", name],
            plan.root / "logs" / f"{name}.log",
            {
                **env,
                **({"ROSE_RUNTIME__INSTANCE": instances[name]} if name in instances else {}),
                **(creds.env(name, instances.get(name), tls=tls) if creds else {}),
                **(emulated_monitor_env(args) if groups and name == "slo_monitor" else {}),
            },
        )
        for name in plan.names
        if not (groups and name == "executor")
    ]
    children += [
        Supervised(
            g.name,
            [sys.executable, "-m", "rose.cli.main", "run", "executor", *g.args],
            plan.root / "logs" / f"{g.name}.log",
            {**env, **g.env, **(creds.env("executor", g.members[0], tls=tls) if creds else {})},
        )
        for g in groups
    ]
    return children


def _write_up_file(plan: UpPlan, nats: Nats, operator: dict[str, str]) -> None:
    """up.json in the state dir: where `rose status` and `rose health` find this NATS and the operator's credentials."""
    (plan.root / UP_FILE).write_text(
        json.dumps(
            {
                "nats_url": nats.url,
                "pid": os.getpid(),
                "embedded_nats": nats.embedded,
                "nats_nodes": plan.nodes if nats.cluster is not None else 1,
                "services": plan.names,
                # where `rose status` / `rose health` find the operator's credentials (paths only, never secrets)
                "operator_seed_file": operator.get("ROSE_BUS__NKEY_SEED_FILE", ""),
                "tls_ca_file": operator.get("ROSE_BUS__TLS_CA_FILE", ""),
            },
            indent=2,
        )
    )


def _run(
    console: Console,
    args: argparse.Namespace,
    plan: UpPlan,
    nats: Nats,
    children: list[Supervised],
    creds: Credentials | None,
    route_include: Path | None,
) -> None:
    """Start the services, say where everything is, supervise until SIGINT or SIGTERM; then stop the services, then NATS."""
    stop = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for child in children:
            child.start()
        _announce(console, plan, nats, creds, route_include)
        _wait_ready(console, nats.url, plan.names, args.ready_timeout, stop, plan.root)
        console.print("[green]ROSE is up.[/green] `rose status` lists the services; Ctrl-C stops everything.")
        _supervise(console, children, stop)
    finally:
        console.print("stopping services ...")
        for child in children:
            child.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.wait(deadline)
        nats.stop()
        (plan.root / UP_FILE).unlink(missing_ok=True)
        console.print("stopped.")


def _announce(console: Console, plan: UpPlan, nats: Nats, creds: Credentials | None, route_include: Path | None) -> None:
    """Where NATS, the logs and the credentials are."""
    if nats.cluster is not None:
        console.print(f"NATS: {nats.url} (embedded {plan.nodes}-node JetStream cluster, R{plan.nodes}, stores under {nats.cluster.root})")
    else:
        console.print(f"NATS: {nats.url} ({'embedded, store ' + str(plan.root / 'nats') if nats.server else 'external'})")
    console.print(f"logs: {plan.root / 'logs'}  services: {', '.join(plan.names) or '(none)'}")
    if creds is not None:
        own = [f"{s} {i}" for s, i in plan.instances.items() if creds.seed_file(s, i).exists()]
        console.print(
            f"auth: per-service NKeys in {creds.directory}{' + TLS' if plan.tls else ''}"
            f"{' (' + ', '.join(own) + ': its own instance key)' if own else ''}"
            f"{'; cluster routes authenticated' if route_include is not None else ''} (`rose run trainer` needs "
            f"ROSE_BUS__NKEY_SEED_FILE={creds.seed_file('trainer')}; `rose security permissions` lists what each may do)"
        )


async def _provision(url: str, replicas: int | None, operator: dict[str, str]) -> None:
    """Create every stream, bucket and store before the services start (they only check: creating is the operator's right).

    With the environment's bus settings (credentials, TLS, ROSE_BUS__REPLICAS), as the services use,
    or the operator's credentials when auth is on.
    """
    config = bus_config_from_env(url=url, replicas=replicas)
    if operator:
        config = msgspec.structs.replace(
            config, nkey_seed_file=operator["ROSE_BUS__NKEY_SEED_FILE"], tls_ca_file=operator.get("ROSE_BUS__TLS_CA_FILE", config.tls_ca_file)
        )
    await provision_storage(config)


def _wait_ready(console: Console, url: str, names: list[str], timeout: float, stop: dict[str, bool], root: Path) -> None:
    """Until every started service has a 'ready' heartbeat; then print where each one is."""
    deadline = time.monotonic() + timeout
    beats = []
    config = operator_config(url, str(root))  # up.json is written: the operator's credentials, when auth is on
    while not stop["now"] and time.monotonic() < deadline and names:
        beats = asyncio.run(live_services(url, config))
        ready = {b.service for b in beats if b.state == "ready"}
        if set(names) <= ready:
            break
        time.sleep(0.5)
    else:
        if names and not stop["now"]:
            console.print(f"[yellow]not every service reported ready within {timeout:.0f}s; see the logs[/yellow]")
    if beats:
        table = Table(title="services")
        for col in ("service", "instance", "state", "endpoints"):
            table.add_column(col)
        for b in beats:
            table.add_row(b.service, b.instance, b.state, " ".join(f"{k}={v}" for k, v in b.endpoints.items()))
        console.print(table)


def _supervise(console: Console, children: list[Supervised], stop: dict[str, bool]) -> None:
    while not stop["now"]:
        now = time.monotonic()
        for child in children:
            if child.alive():
                continue
            if child.next_start == 0.0:
                code = child.process.returncode if child.process else None
                delay = min(MAX_RESTART_DELAY_S, 2.0 ** min(child.restarts, 5))
                if now - child.started_at > 60:
                    delay = 1.0  # it ran a good while: restart promptly
                child.next_start = now + delay
                console.print(f"[red]{child.name} exited ({code}); restarting in {delay:.0f}s (see {child.log_path})[/red]")
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
        time.sleep(0.2)
