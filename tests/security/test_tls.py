"""TLS by configuration: a CA made at test time, a server that requires TLS, the bus connecting through it."""

from __future__ import annotations

import ssl

import nats
import pytest

from rose.contracts import Heartbeat
from rose.contracts.registry import SERVICE_REGISTRY
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, generate_tls, render_tls


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, credentials):
    d = tmp_path_factory.mktemp("tls")
    ca, _ca_key, cert, key = generate_tls(["127.0.0.1", "localhost"])
    (d / "ca.pem").write_bytes(ca)
    (d / "server-cert.pem").write_bytes(cert)
    (d / "server-key.pem").write_bytes(key)
    config = credentials.server_config() + render_tls(d / "server-cert.pem", d / "server-key.pem")
    with NatsServer(d / "nats", extra_config=config) as server:
        yield server, d / "ca.pem"


async def test_services_connect_over_tls_with_the_ca_and_their_credentials(tls_server, credentials):
    server, ca = tls_server
    operator = BusConfig(url=server.url, nkey_seed_file=str(credentials.seed_file(OPERATOR)), tls_ca_file=str(ca), initial_connect_deadline_s=5.0)
    async with Bus(operator, service="cli", instance="tls-ops") as bus:
        await provision(bus.js)
        assert bus.nc.connected_url is not None and bus.nc._transport is not None
        assert bus.nc._transport._io_writer.get_extra_info("ssl_object") is not None  # the socket is TLS
    monitor = BusConfig(url=server.url, nkey_seed_file=str(credentials.seed_file("slo_monitor")), tls_ca_file=str(ca), initial_connect_deadline_s=5.0)
    beat = Heartbeat(
        service="slo_monitor", instance="m-tls", version="t", host="h", pid=1, started_at=1.0, sent_at=1.0, interval_s=1.0, state="ready"
    )
    async with Bus(monitor, service="slo_monitor", instance="m-tls") as bus:
        await bus.kv_put(SERVICE_REGISTRY, beat, service="slo_monitor", instance="m-tls")
        assert (await bus.kv_get(SERVICE_REGISTRY, service="slo_monitor", instance="m-tls")).instance == "m-tls"


async def test_without_the_ca_or_without_tls_the_connection_is_refused(tls_server, credentials):
    server, _ca = tls_server
    seed = str(credentials.seed_file(OPERATOR))
    with pytest.raises(ConnectionError):  # a server certificate no trusted CA signed
        other_ca = server.store_dir.parent / "other-ca.pem"
        other_ca.write_bytes(generate_tls(["127.0.0.1"])[0])
        await Bus(
            BusConfig(url=server.url, nkey_seed_file=seed, tls_ca_file=str(other_ca), initial_connect_deadline_s=2.0), service="cli", instance="x"
        ).connect()
    with pytest.raises((nats.errors.Error, ssl.SSLError, OSError)):  # plaintext: the server requires TLS
        await nats.connect(server.url, nkeys_seed=seed, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
