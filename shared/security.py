"""Who may do what on the bus: per-service NATS credentials and subject permissions derived from the registry.

Every service gets its own NATS user, authenticated by an NKey (an Ed25519 key pair: the
server config holds only public keys, each service holds its own seed in a 0600 file, nothing
secret crosses the wire). Its permissions come from `contracts/registry.py`, so a new channel
is authorised where it is declared:

* a channel's `publishers` may publish its subjects (KV: put/delete keys of its bucket; object
  store: write and purge its bucket); a `service` token is pinned to the service's own name, so
  one service cannot forge another's heartbeats, lifecycle events or dead letters;
* a channel's `consumers` may subscribe to its subjects and read its storage (stream info,
  message get, direct get);
* JetStream consumers (durable or ordered) only on storage the service reads but cannot write:
  a consumer may be told to deliver to any subject, and a service that could put its own bytes
  into a stream could then replay them onto a subject it may not publish (e.g. a manifest);
* every service may look up every registry stream (the provisioning check at start), answer its
  own `$SRV` pings and receive on its own inbox prefix (`_INBOX_<service>`, set by the bus), so
  it cannot read other services' replies; it answers requests through `allow_responses`, never
  by publishing to other inboxes. Creating, updating or deleting storage is left to the
  operator (`rose provision`, `rose up`);
* a few rights the channel table cannot express are listed in `EXTRA_RIGHTS` with the code that
  needs them; `cli` (operators: `rose status`, provisioning, benches) may do anything and
  `integrations` (`rose events forward`) may only read what the registry names it a consumer of.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from rose.contracts.registry import (
    ALL_SERVICES,
    CHANNELS,
    KV_BUCKETS,
    MANIFESTS_STREAM,
    OBJECT_STORES,
    STREAMS,
    WEIGHTS_OBJECTS,
    WEIGHTS_STAGING_OBJECTS,
    Channel,
    Kind,
)

OPERATOR = "cli"  # rose status / provision / health / benches: every right
INTEGRATIONS = "integrations"  # rose events forward and other read-only subscribers of public events
USERS = (*ALL_SERVICES, OPERATOR, INTEGRATIONS)
JS_API = "$JS.API"
SERVER_INCLUDE = "nats-auth.conf"  # `include nats-auth.conf` in the server config (the path is relative to that file)
TLS_INCLUDE = "nats-tls.conf"
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.pem", "ca-key.pem", "server-cert.pem", "server-key.pem"
SEED_SUFFIX = ".nk"
CERT_DAYS = 825


def inbox_prefix(service: str) -> str:
    """Each service's private reply subjects; the bus connects with it, and only that user may subscribe there."""
    return f"_INBOX_{service}"


def stream_name(kind: Kind, channel: Channel) -> str:
    """The JetStream stream behind a stream, KV or object-store channel (KV_<bucket>, OBJ_<bucket>)."""
    if kind is Kind.KV:
        assert channel.kv is not None
        return f"KV_{channel.kv.bucket}"
    if kind is Kind.OBJECTS:
        assert channel.objects is not None
        return f"OBJ_{channel.objects.bucket}"
    assert channel.stream is not None
    return channel.stream.name


def all_storage_streams() -> list[str]:
    return [s.name for s in STREAMS] + [f"KV_{k.bucket}" for k in KV_BUCKETS] + [f"OBJ_{o.bucket}" for o in OBJECT_STORES]


@dataclass(frozen=True)
class Extra:
    """A right the channel table cannot express, with the reason (and the code) that needs it."""

    service: str
    publish: tuple[str, ...]
    why: str


def _consumer_rights(stream: str) -> list[str]:
    """Create (durable, ephemeral, ordered) consumers on a stream, pull from them and ack."""
    return [
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS_API}.CONSUMER.DELETE.{stream}.*",  # an ordered consumer (KV watch) replaces itself after a gap
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


EXTRA_RIGHTS: tuple[Extra, ...] = (
    Extra(
        "weight_publisher",
        (f"{JS_API}.STREAM.PURGE.{MANIFESTS_STREAM.name}",),
        "prunes manifests older than the retained keyframe (services/weight_publisher/versions.py)",
    ),
    Extra(
        "weight_publisher",
        (f"$O.{WEIGHTS_STAGING_OBJECTS.bucket}.>", f"{JS_API}.STREAM.PURGE.OBJ_{WEIGHTS_STAGING_OBJECTS.bucket}"),
        "deletes a staged upload once its version is published (services/weight_publisher/service.py)",
    ),
    Extra(
        "weight_publisher",
        tuple(_consumer_rights(f"OBJ_{WEIGHTS_OBJECTS.bucket}")),
        "lists its store to prune old versions (a consumer on what it writes: it may publish weights anyway)",
    ),
)


@dataclass
class Permissions:
    """One user's allow lists, and the channels behind them (for the README table)."""

    user: str
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    publishes: list[str] = field(default_factory=list)  # channel names
    reads: list[str] = field(default_factory=list)
    writes_storage: list[str] = field(default_factory=list)
    js_consumers: list[str] = field(default_factory=list)

    def allow_pub(self, *subjects: str) -> None:
        self.publish.extend(s for s in subjects if s not in self.publish)

    def allow_sub(self, *subjects: str) -> None:
        self.subscribe.extend(s for s in subjects if s not in self.subscribe)


def _subject_pattern(channel: Channel, service: str) -> str:
    """The channel's subjects for this service: `{service}` pinned to its own name, other tokens `*`."""
    return channel.pattern(service=service) if "service" in channel.tokens else channel.pattern()


def _storage_subjects(channel: Channel, service: str) -> str:
    if channel.kind is Kind.KV:
        assert channel.kv is not None
        return f"$KV.{channel.kv.bucket}.{_subject_pattern(channel, service)}"
    if channel.kind is Kind.OBJECTS:
        assert channel.objects is not None
        return f"$O.{channel.objects.bucket}.>"
    return _subject_pattern(channel, service)


def _read_rights(stream: str) -> list[str]:
    """Look at stored messages without a consumer: info, message get, direct get."""
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>"]


def permissions(user: str) -> Permissions:
    """The permissions of one user, derived from the registry."""
    perms = Permissions(user)
    if user == OPERATOR:
        perms.allow_pub(">")
        perms.allow_sub(">")
        perms.publishes, perms.reads = ["everything"], ["everything"]
        return perms
    if user not in ALL_SERVICES and user != INTEGRATIONS:
        raise ValueError(f"no user {user!r}; users: {', '.join(USERS)}")
    perms.allow_sub(f"{inbox_prefix(user)}.>")
    if user == INTEGRATIONS:
        perms.allow_sub(f"{inbox_prefix('events_forward')}.>")  # `rose events forward` connects as service events_forward
    else:
        micro = f"rose_{user}"  # the bus's NATS services API name
        perms.allow_sub("$SRV.PING", "$SRV.INFO", "$SRV.STATS", f"$SRV.*.{micro}", f"$SRV.*.{micro}.>")
        perms.allow_pub(*(f"{JS_API}.STREAM.INFO.{s}" for s in all_storage_streams()))  # the provisioning check at start
        perms.allow_pub(f"{JS_API}.STREAM.NAMES")  # nats-py looks a stream up by subject (object store listings)
    written: set[str] = set()
    for channel in CHANNELS:
        if user in channel.publishers:
            perms.publishes.append(channel.name)
            perms.allow_pub(_storage_subjects(channel, user))
            if channel.kind in (Kind.STREAM, Kind.KV, Kind.OBJECTS):
                written.add(stream_name(channel.kind, channel))
                if channel.kind is not Kind.STREAM or channel.publishers == (user,):  # reads back what only it writes
                    perms.allow_pub(*_read_rights(stream_name(channel.kind, channel)))
            if channel.kind in (Kind.KV, Kind.OBJECTS):
                own = " (own keys)" if "service" in channel.tokens else ""
                perms.writes_storage.append(f"{stream_name(channel.kind, channel)}{own}")
            if channel.kind is Kind.OBJECTS:  # replacing or deleting an object purges its old chunks
                perms.allow_pub(f"{JS_API}.STREAM.PURGE.{stream_name(channel.kind, channel)}")
    for extra in EXTRA_RIGHTS:
        if extra.service == user:
            perms.allow_pub(*extra.publish)
            written.update(s.rsplit(".", 1)[-1] for s in extra.publish if ".STREAM.PURGE." in s)
            perms.js_consumers.extend(s.rsplit(".", 1)[-1] for s in extra.publish if s.startswith(f"{JS_API}.CONSUMER.CREATE.") and s.count(".") == 4)
    for channel in CHANNELS:
        if user not in channel.consumers:
            continue
        perms.reads.append(channel.name)
        if channel.kind in (Kind.EVENT, Kind.REQUEST, Kind.STREAM):
            perms.allow_sub(channel.pattern())
        if channel.kind in (Kind.STREAM, Kind.KV, Kind.OBJECTS):
            stream = stream_name(channel.kind, channel)
            perms.allow_pub(f"{JS_API}.STREAM.INFO.{stream}", *_read_rights(stream))
            if stream not in written:
                perms.allow_pub(*_consumer_rights(stream))
                if stream not in perms.js_consumers:
                    perms.js_consumers.append(stream)
    return perms


# ---- the server side ------------------------------------------------------------------


def _nats_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def render_authorization(public_keys: dict[str, str]) -> str:
    """The `authorization { users = [...] }` block: one NKey user per service, with its permissions.

    Only public keys appear here; the file may be read by anyone who may read the server config.
    """
    lines = [
        "# Written by `rose security init` from contracts/registry.py; regenerate, do not edit.",
        "authorization {",
        "  users = [",
    ]
    for user in USERS:
        perms = permissions(user)
        lines += [
            f"    # {user}",
            f'    {{ nkey: "{public_keys[user]}", permissions: {{',
            f"        publish: {{ allow: {_nats_list(perms.publish)} }}",
            f"        subscribe: {{ allow: {_nats_list(perms.subscribe)} }}",
            "        allow_responses: true",
            "    } }",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def render_tls(cert_file: str | Path, key_file: str | Path, *, ca_file: str | Path | None = None, verify_clients: bool = False) -> str:
    """A `tls {}` block for nats-server: clients must then connect over TLS (and, with verify_clients, present a cert from ca_file)."""
    lines = ["tls {", f'  cert_file: "{cert_file}"', f'  key_file: "{key_file}"', "  timeout: 5"]
    if ca_file:
        lines.append(f'  ca_file: "{ca_file}"')
    if verify_clients:
        lines.append("  verify: true")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- files ----------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Create (or replace) a file readable by its owner only, never briefly world-readable."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)


@dataclass(frozen=True)
class Credentials:
    """A directory made by `init_credentials`: one seed file per user, the server include, maybe TLS files."""

    directory: Path

    def seed_file(self, user: str) -> Path:
        return self.directory / f"{user}{SEED_SUFFIX}"

    @property
    def server_include(self) -> Path:
        return self.directory / SERVER_INCLUDE

    @property
    def tls_include(self) -> Path:
        return self.directory / TLS_INCLUDE

    @property
    def ca_file(self) -> Path:
        return self.directory / CA_CERT

    @property
    def has_tls(self) -> bool:
        return self.tls_include.exists() and self.ca_file.exists()

    def server_config(self, *, tls: bool = False) -> str:
        """What to give nats-server (inline: `include` paths are relative to the including file)."""
        text = self.server_include.read_text()
        if tls:
            text += self.tls_include.read_text()
        return text

    def env(self, user: str, *, tls: bool = False) -> dict[str, str]:
        """The variables that give a service process its own credentials (and the CA when TLS is on)."""
        out = {"ROSE_BUS__NKEY_SEED_FILE": str(self.seed_file(user))}
        if tls:
            out["ROSE_BUS__TLS_CA_FILE"] = str(self.ca_file)
        return out


def _new_seed() -> bytes:
    import nkeys

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def public_key(seed_file: Path) -> str:
    import nkeys

    return nkeys.from_seed(bytearray(seed_file.read_bytes().strip())).public_key.decode()


def init_credentials(directory: str | Path, *, force: bool = False, tls_hosts: list[str] | None = None) -> Credentials:
    """Generate (or reuse) a seed per user and (re)write the server include from the current registry.

    Seeds that exist are kept unless `force`, so services keep working across a restart; the
    include is always rewritten, so a new channel's rights apply at the next server start.
    `tls_hosts` also makes a CA and a server certificate for those names and IPs (kept if present).
    """
    creds = Credentials(Path(directory).resolve())
    _private_dir(creds.directory)
    keys: dict[str, str] = {}
    for user in USERS:
        path = creds.seed_file(user)
        if force or not path.exists():
            _write_private(path, _new_seed())
        os.chmod(path, 0o600)
        keys[user] = public_key(path)
    _write_private(creds.server_include, render_authorization(keys).encode())
    if tls_hosts:
        make_tls_files(creds.directory, tls_hosts, force=force)
    return creds


def make_tls_files(directory: Path, hosts: list[str], *, force: bool = False) -> None:
    """A self-signed CA and a server certificate for `hosts` (DNS names or IPs), plus the server's tls include."""
    d = Path(directory)
    if force or not (d / SERVER_CERT).exists():
        ca_pem, ca_key_pem, cert_pem, key_pem = generate_tls(hosts)
        _write_private(d / CA_KEY, ca_key_pem)
        _write_private(d / SERVER_KEY, key_pem)
        (d / CA_CERT).write_bytes(ca_pem)
        (d / SERVER_CERT).write_bytes(cert_pem)
    _write_private(d / TLS_INCLUDE, render_tls(d / SERVER_CERT, d / SERVER_KEY).encode())


def generate_tls(hosts: list[str], *, common_name: str = "rose-nats") -> tuple[bytes, bytes, bytes, bytes]:
    """(CA cert, CA key, server cert, server key) as PEM: an EC P-256 CA that signs one server certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8, encryption_algorithm=serialization.NoEncryption())
    return ca.public_bytes(pem), ca_key.private_bytes(**private), cert.public_bytes(pem), key.private_bytes(**private)


# ---- the README table -----------------------------------------------------------------


def permissions_markdown() -> str:
    """One row per user: what it may publish, read and write; `rose security permissions` prints it.

    Channels every service publishes (heartbeats, lifecycle events, dead letters, its own
    registry keys, each under its own name) are listed once, in the first row.
    """
    common = [c for c in CHANNELS if c.publishers == ALL_SERVICES]
    rows = [
        "| user | publishes | reads | writes storage | JetStream consumers on |",
        "| --- | --- | --- | --- | --- |",
        f"| every service | {', '.join(c.name for c in common)} (under its own name) | — | its own keys of {', '.join(sorted({stream_name(c.kind, c) for c in common if c.kind is Kind.KV}))} | — |",
    ]
    shared = {c.name for c in common}
    for user in USERS:
        p = permissions(user)
        extra = [e.why.split(" (")[0] for e in EXTRA_RIGHTS if e.service == user and not any(".CONSUMER." in x for x in e.publish)]
        writes = [w for w in p.writes_storage if not w.endswith("(own keys)")] + [f"+ {e}" for e in extra]
        publishes = [c for c in p.publishes if c not in shared]
        rows.append(
            f"| `{user}` | {', '.join(publishes) or '—'} | {', '.join(p.reads) or '—'} | {'; '.join(writes) or '—'} | {', '.join(p.js_consumers) or '—'} |"
        )
    return "\n".join(rows) + "\n"
