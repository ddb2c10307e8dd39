"""`rose health`, the containers' healthcheck: what counts as healthy, and clear answers when not.

In a compose container it runs on the service's own credentials (ROSE_BUS__NKEY_SEED_FILE), not
the operator's: checked here against a real nats-server with the generated permissions.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from rose.cli.health import _heartbeat_problem, _live_heartbeats
from rose.contracts.registry import HEARTBEAT, SERVICE_REGISTRY
from rose.contracts.service import Heartbeat
from rose.shared.bus import Bus, PermissionDenied
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer, free_port
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, init_credentials
from rose.testing.polling import until


def _beat(*, service="scheduler", instance="scheduler-1", host="box", age=0.0, state="ready", interval=1.0) -> Heartbeat:
    now = time.time()
    return Heartbeat(
        service=service,
        instance=instance,
        version="0",
        host=host,
        pid=1,
        started_at=now - 60,
        sent_at=now - age,
        interval_s=interval,
        state=state,
        load={},
        endpoints={},
        labels={},
    )


def test_a_fresh_ready_heartbeat_is_healthy():
    assert _heartbeat_problem([_beat()], "scheduler", None, None) is None
    assert _heartbeat_problem([_beat()], "scheduler", "scheduler-1", "box") is None


def test_missing_stale_or_not_ready_is_unhealthy_with_the_reason():
    assert "no heartbeat from executor" in _heartbeat_problem([_beat()], "executor", None, None)
    assert "on host other" in _heartbeat_problem([_beat()], "scheduler", None, "other")  # --local in another container
    assert "stale" in _heartbeat_problem([_beat(age=10.0)], "scheduler", None, None)
    assert "starting, not ready" in _heartbeat_problem([_beat(state="starting")], "scheduler", None, None)
    # one ready instance among others is enough when no instance is named
    assert _heartbeat_problem([_beat(state="draining", instance="a"), _beat(instance="b")], "scheduler", None, None) is None


def _rose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_") and k != "NATS_URL"}
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def test_cli_exit_codes():
    assert _rose("health").returncode == 2  # neither a service nor --http
    closed = free_port()
    down = _rose("health", "scheduler", "--nats-url", f"nats://127.0.0.1:{closed}", "--timeout", "1")
    assert down.returncode == 1 and "cannot reach NATS" in down.stdout, down.stdout + down.stderr
    http = _rose("health", "--http", f"http://127.0.0.1:{closed}/healthz", "--timeout", "1")
    assert http.returncode == 1 and "unreachable" in http.stdout, http.stdout + http.stderr


def test_http_check_against_a_real_nats_monitor(tmp_path):
    """nats-server's own /healthz, as the compose NATS nodes are checked."""
    monitor = free_port()
    with NatsServer(tmp_path / "nats", monitor_port=monitor):
        ok = _rose("health", "--http", f"http://127.0.0.1:{monitor}/healthz")
        assert ok.returncode == 0 and "healthy" in ok.stdout, ok.stdout + ok.stderr


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):
    """A nats-server with the `rose security init` permissions, provisioned by the operator: (server, credentials)."""
    creds = init_credentials(tmp_path_factory.mktemp("health-security") / "creds")
    with NatsServer(tmp_path_factory.mktemp("health-nats"), extra_config=creds.server_config()) as server:

        async def setup() -> None:
            async with Bus(BusConfig(url=server.url, nkey_seed_file=str(creds.seed_file(OPERATOR))), service=OPERATOR, instance="ops") as bus:
                await provision(bus.js)

        asyncio.run(setup())
        yield server, creds


def _own(server: NatsServer, creds, service: str) -> BusConfig:
    return BusConfig(url=server.url, nkey_seed_file=str(creds.seed_file(service)), initial_connect_deadline_s=10.0)


def test_health_runs_on_the_services_own_seed(secured):
    """The compose healthcheck: `rose health executor --local` with only the executor's seed in the environment.

    The executor is no consumer of the registry, yet reading its bucket needs no consumer (stream
    info, then a get per key), and it connects on its own inbox prefix, the only one it may use.
    """
    server, creds = secured
    env = {"ROSE_BUS__NKEY_SEED_FILE": str(creds.seed_file("executor"))}
    missing = _rose("health", "executor", "--local", "--nats-url", server.url, env=env)
    assert missing.returncode == 1 and "no heartbeat from executor on host" in missing.stdout, missing.stdout + missing.stderr

    async def beat() -> None:
        async with Bus(_own(server, creds, "executor"), service="executor", instance="ex-health") as bus:
            await bus.kv_put(
                SERVICE_REGISTRY,
                _beat(service="executor", instance="ex-health", host=socket.gethostname(), interval=30.0),
                service="executor",
                instance="ex-health",
            )

    asyncio.run(beat())
    ok = _rose("health", "executor", "--local", "--nats-url", server.url, env=env)
    assert ok.returncode == 0 and "healthy" in ok.stdout, ok.stdout + ok.stderr
    anonymous = _rose("health", "executor", "--nats-url", server.url, "--timeout", "2")
    assert anonymous.returncode == 1 and "refused" in anonymous.stdout, anonymous.stdout + anonymous.stderr


async def test_the_core_nats_fallback_hears_only_the_services_own_heartbeats(secured):
    """While JetStream cannot answer, health listens on core NATS: each service may hear its own heartbeats, no one else's."""
    server, creds = secured
    async with (
        Bus(_own(server, creds, "rollout_worker"), service="rollout_worker", instance="rw-health") as checker,
        Bus(_own(server, creds, "rollout_worker"), service="rollout_worker", instance="rw-live") as live,
    ):
        listening = asyncio.create_task(_live_heartbeats(checker, "rollout_worker", 30.0))

        async def heard() -> bool:  # once the subscription is in place, it hears one
            await live.publish(HEARTBEAT, _beat(service="rollout_worker", instance="rw-live"), service="rollout_worker", instance="rw-live")
            return listening.done()

        await until(heard, 30, "the fallback hearing a heartbeat", step=0.1)
        assert "rw-live" in {b.instance for b in listening.result()}
        with pytest.raises(PermissionDenied):
            await checker.subscribe(HEARTBEAT, lambda *_: asyncio.sleep(0), service="scheduler")


def test_health_falls_back_to_the_operator_seed_of_the_state_dir(secured, tmp_path):
    """`rose health SERVICE --state-dir D` with no credentials in the environment: the operator's seed
    named in D/up.json (as `rose up` writes it) is used, for the server that `rose up` started."""
    server, creds = secured
    state = tmp_path / "state"
    state.mkdir()
    (state / "up.json").write_text(json.dumps({"nats_url": server.url, "operator_seed_file": str(creds.seed_file(OPERATOR))}))

    async def beat() -> None:
        async with Bus(_own(server, creds, "scheduler"), service="scheduler", instance="sched-up") as bus:
            await bus.kv_put(
                SERVICE_REGISTRY, _beat(service="scheduler", instance="sched-up", interval=30.0), service="scheduler", instance="sched-up"
            )

    asyncio.run(beat())
    ok = _rose("health", "scheduler", "--state-dir", str(state), "--timeout", "5")  # the URL comes from up.json too
    assert ok.returncode == 0 and "healthy" in ok.stdout, ok.stdout + ok.stderr
    # the same check without the state dir's seed is refused by the server: the fallback is what made it pass
    (state / "up.json").write_text(json.dumps({"nats_url": server.url}))
    refused = _rose("health", "scheduler", "--state-dir", str(state), "--timeout", "2")
    assert refused.returncode == 1 and "refused" in refused.stdout, refused.stdout + refused.stderr
