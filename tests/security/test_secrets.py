"""Secrets never logged: a service started with its credentials prints no seed and publishes none in its heartbeat."""

from __future__ import annotations

import os

import msgspec

from rose.contracts.registry import SERVICE_REGISTRY
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess

READY_TIMEOUT_S = 60.0


async def test_a_service_with_credentials_logs_and_announces_no_secret(secured_server, credentials, operator, tmp_path):
    seed = credentials.seed_file("slo_monitor").read_text().strip()
    private_half = seed[2:]  # whatever part of the seed would show up
    env = {
        "NATS_URL": secured_server.url,
        "ROSE_BUS__NKEY_SEED_FILE": str(credentials.seed_file("slo_monitor")),
        "ROSE_RUNTIME__LOG_LEVEL": "DEBUG",  # the most a service ever writes
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
        "ROSE_RUNTIME__METRICS_PORT": "-1",
    }
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROSE_") and k != "NATS_URL"}, **env}
    proc = ServiceProcess("slo_monitor", "mon-secrets", env, tmp_path / "monitor.log")
    try:
        proc.start()
        await proc.wait_ready(operator, READY_TIMEOUT_S)
        beat = await operator.kv_get(SERVICE_REGISTRY, service="slo_monitor", instance="mon-secrets")
    finally:
        proc.stop()
    log = proc.log_path.read_text()
    assert "connected to" in log  # it did log, at DEBUG
    announced = msgspec.json.encode(beat).decode()
    for text in (log, announced):
        assert seed not in text and private_half[:16] not in text
        assert str(credentials.seed_file("slo_monitor")) not in announced


def test_passwords_stay_out_of_reprs_and_urls():
    cfg = BusConfig(url="nats://svc:hunter2-pw@10.0.0.1:4222,nats://10.0.0.2:4222", user="svc", password="hunter2-pw")
    for text in (repr(cfg), str(cfg), f"{cfg}", cfg.display_url()):
        assert "hunter2-pw" not in text
    assert cfg.display_url() == "nats://***@10.0.0.1:4222,nats://10.0.0.2:4222"


async def test_a_refused_connection_names_no_secret(secured_server):
    cfg = BusConfig(url=secured_server.url.replace("nats://", "nats://svc:hunter2-pw@"), initial_connect_deadline_s=3.0)
    try:
        await Bus(cfg, service="executor", instance="pw").connect()
    except ConnectionError as exc:
        assert "hunter2-pw" not in str(exc) and "***@" in str(exc)
    else:
        raise AssertionError("a user the server does not know was let in")
