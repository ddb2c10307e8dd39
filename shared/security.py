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
  own `$SRV` pings and receive on its own inbox prefix (`_INBOX_<service>.<instance>`, set by the bus), so
  it cannot read other services' replies. There is no `allow_responses` (it lets a user answer on
  whatever reply subject a request carries, `$JS.API.STREAM.DELETE...` included: a confused
  deputy): a service answers a request channel it consumes by publishing under the inboxes of that
  channel's requesters only (`requesters`: its publishers and the operator), and `$SRV` pings
  under the operator's. The bus refuses any other reply subject before answering
  (`Bus.serve`); these rights are the server's guarantee behind it. Creating, updating or deleting
  storage is left to the operator (`rose provision`, `rose up`);
* executors, whose instances the bus addresses one by one (`INSTANCE_TOKENS`), may also get a user
  per declared instance (`executor@NAME`, seed `executor@NAME.nk`): the executor's rights with
  every `{executor_id}` (and, beside `{service}`, `{instance}`) token pinned to NAME, so one
  executor's key cannot take another's generate requests nor report, heartbeat or announce weight
  versions as it, nor read its replies (the bus's inbox prefix names the instance too). The
  generic `executor` user stays for instances nobody declared;
* a few rights the channel table cannot express are listed in `EXTRA_RIGHTS` with the code that
  needs them; `cli` (operators: `rose status`, provisioning, benches) may do anything and
  `integrations` (`rose events forward`) may only read what the registry names it a consumer of.

A cluster's nodes can also be made to authenticate each other (`cluster_routes`): a random route
password, kept in the credentials directory, and an include for the server's `cluster {}` block
that requires it from every route and dials every node with it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rose.contracts.registry import (
    ALL_SERVICES,
    CHANNELS,
    HEARTBEAT,
    KV_BUCKETS,
    MANIFESTS_STREAM,
    OBJECT_STORES,
    STREAMS,
    TOKEN_RE,
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
CLUSTER_INCLUDE = "nats-cluster-auth.conf"  # `include` it inside the server's `cluster {}` block: route auth and routes
ROUTE_SECRET = "nats-route.secret"  # the cluster's route password (kept across runs, like the seeds)
ROUTE_USER = "rose-route"
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.pem", "ca-key.pem", "server-cert.pem", "server-key.pem"
SEED_SUFFIX = ".nk"
CERT_DAYS = 825

# Services whose instances the bus addresses one by one, and the registry token that names the instance
# in their subjects: an executor serves `executor.generate` and publishes its metrics and weight events
# with executor_id = its runtime instance (services/executor/main.py). Such a service may get one user
# per declared instance (`init_credentials(instances=...)`, `rose security init --instance executor=NAME`)
# whose subjects are pinned to that instance, beside the service's generic user.
INSTANCE_TOKENS: dict[str, str] = {"executor": "executor_id"}
INSTANCE_SEP = "@"  # the user (and seed file) of instance NAME of the executor: `executor@NAME`, `executor@NAME.nk`


def instance_user(service: str, instance: str) -> str:
    """The NATS user of one declared instance (`executor@executor-1`), also its seed file's stem.

    The name must be a subject token (letters, digits, '_', '-'), which also keeps the file name plain.
    """
    if service not in INSTANCE_TOKENS:
        raise ValueError(
            f"only {', '.join(INSTANCE_TOKENS)} instances get credentials of their own, not {service!r} ones: its subjects do not name its instances"
        )
    if not TOKEN_RE.match(instance):
        raise ValueError(f"instance name {instance!r} is not a subject token: use 1-128 letters, digits, '_' or '-'")
    return f"{service}{INSTANCE_SEP}{instance}"


def split_user(user: str) -> tuple[str, str | None]:
    """`executor@executor-1` -> ("executor", "executor-1"); a service's own user -> (user, None)."""
    service, sep, instance = user.partition(INSTANCE_SEP)
    return (service, instance) if sep else (user, None)


def parse_instances(specs: Iterable[str]) -> dict[str, list[str]]:
    """`["executor=a", "executor=b,c"]` (the CLI's --instance) -> {"executor": ["a", "b", "c"]}, each name checked."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        service, sep, names = spec.partition("=")
        if not sep or not names.strip():
            raise ValueError(f"--instance takes SERVICE=NAME[,NAME...] (e.g. executor=executor-1), not {spec!r}")
        for name in (n.strip() for n in names.split(",")):
            instance_user(service.strip(), name)  # refuses unknown services and unsafe names
            if name not in out.setdefault(service.strip(), []):
                out[service.strip()].append(name)
    return out


def requesters(channel: Channel) -> tuple[str, ...]:
    """Who may ask on a request channel, hence whose inboxes may receive its answers: its publishers and the operator."""
    return (*channel.publishers, OPERATOR)


SRV_REQUESTERS = (OPERATOR,)  # who may ask a service's `$SRV` PING / INFO / STATS (`rose status`, operators)


def reply_prefixes(services: Iterable[str]) -> tuple[str, ...]:
    """The reply subjects a responder may answer to for these requesters: `_INBOX_<service>.` (every instance of it)."""
    return tuple(f"{inbox_prefix(s)}." for s in services)


def inbox_prefix(service: str, instance: str | None = None) -> str:
    """Private reply subjects: the bus connects with `_INBOX_<service>.<instance>`; a service's user may
    subscribe under `_INBOX_<service>` only, an instance's user (`executor@NAME`) under its own instance only."""
    if instance is None:
        return f"_INBOX_{service}"
    return f"_INBOX_{service}.{instance_token(instance)}"


def instance_token(instance: str) -> str:
    """An instance name as a subject token (its inbox, its dead letters and lifecycle events): unsafe characters become '_'."""
    return instance if TOKEN_RE.match(instance) else re.sub(r"[^A-Za-z0-9_-]", "_", instance)[:128] or "_"


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
    reads: tuple[Channel, ...] = ()  # core subscriptions to these channels, under its own name (and instance)


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
    *(
        Extra(
            service,
            (),
            "reads its own heartbeats: `rose health SERVICE` in the service's container runs on the service's own "
            "credentials and, while JetStream cannot answer (a cluster electing a leader), listens for them on core NATS (cli/health.py)",
            reads=(HEARTBEAT,),
        )
        for service in ALL_SERVICES
    ),
)


@dataclass(kw_only=True)
class Permissions:
    """One user's allow lists, and the channels behind them (for the table in docs/security.md)."""

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


def _own_tokens(channel: Channel, service: str, instance: str | None) -> dict[str, str]:
    """The tokens of `channel` that name the user itself: `{service}` its service; for an instance
    user also its instance token (`{executor_id}`) and, beside `{service}`, `{instance}`."""
    own: dict[str, str] = {}
    if "service" in channel.tokens:
        own["service"] = service
        if instance is not None and "instance" in channel.tokens:
            own["instance"] = instance
    token = INSTANCE_TOKENS.get(service)
    if instance is not None and token in channel.tokens:
        own[token] = instance
    return own


def _subject_pattern(channel: Channel, service: str, instance: str | None = None) -> str:
    """The channel's subjects this user may publish: its own name (and instance) pinned, other tokens `*`."""
    return channel.pattern(**_own_tokens(channel, service, instance))


def _read_pattern(channel: Channel, service: str, instance: str | None = None) -> str:
    """What a consumer may subscribe to: every subject, or for an instance user those naming its instance."""
    token = INSTANCE_TOKENS.get(service)
    if instance is not None and token in channel.tokens:
        return channel.pattern(**{token: instance})
    return channel.pattern()


def _storage_subjects(channel: Channel, service: str, instance: str | None = None) -> str:
    if channel.kind is Kind.KV:
        assert channel.kv is not None
        return f"$KV.{channel.kv.bucket}.{_subject_pattern(channel, service, instance)}"
    if channel.kind is Kind.OBJECTS:
        assert channel.objects is not None
        return f"$O.{channel.objects.bucket}.>"
    return _subject_pattern(channel, service, instance)


def _read_rights(stream: str) -> list[str]:
    """Look at stored messages without a consumer: info, message get, direct get."""
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>"]


def permissions(user: str, *, instance: str | None = None) -> Permissions:
    """The permissions of one user, derived from the registry.

    `user` is a service (or `cli`, `integrations`), or one declared instance of a service in
    INSTANCE_TOKENS (`permissions("executor", instance="executor-1")`, or `"executor@executor-1"`):
    the service's rights with every subject that names an instance pinned to its own.
    """
    if instance is None:
        user, instance = split_user(user)
    perms = Permissions(user=instance_user(user, instance) if instance is not None else user)
    if user == OPERATOR:
        perms.allow_pub(">")
        perms.allow_sub(">")
        perms.publishes, perms.reads = ["everything"], ["everything"]
        return perms
    if user not in ALL_SERVICES and user != INTEGRATIONS:
        raise ValueError(f"no user {user!r}; users: {', '.join(USERS)}")
    perms.allow_sub(f"{inbox_prefix(user, instance)}.>")
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
            perms.allow_pub(_storage_subjects(channel, user, instance))
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
            perms.allow_sub(*(_subject_pattern(c, user, instance) for c in extra.reads))
            written.update(s.rsplit(".", 1)[-1] for s in extra.publish if ".STREAM.PURGE." in s)
            perms.js_consumers.extend(s.rsplit(".", 1)[-1] for s in extra.publish if s.startswith(f"{JS_API}.CONSUMER.CREATE.") and s.count(".") == 4)
    for channel in CHANNELS:
        if user not in channel.consumers:
            continue
        perms.reads.append(channel.name)
        if channel.kind in (Kind.EVENT, Kind.REQUEST, Kind.STREAM):
            perms.allow_sub(_read_pattern(channel, user, instance))
        if channel.kind in (Kind.STREAM, Kind.KV, Kind.OBJECTS):
            stream = stream_name(channel.kind, channel)
            perms.allow_pub(f"{JS_API}.STREAM.INFO.{stream}", *_read_rights(stream))
            if stream not in written:
                perms.allow_pub(*_consumer_rights(stream))
                if stream not in perms.js_consumers:
                    perms.js_consumers.append(stream)
    if user != INTEGRATIONS:  # answers: under the inboxes of those who may ask, nowhere else (no allow_responses)
        answered = [c for c in CHANNELS if c.kind is Kind.REQUEST and user in c.consumers]
        perms.allow_pub(*(f"{p}>" for p in reply_prefixes(SRV_REQUESTERS)))
        perms.allow_pub(*(f"{p}>" for c in answered for p in reply_prefixes(requesters(c))))
    return perms


# ---- the server side ------------------------------------------------------------------


def _nats_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def render_authorization(public_keys: dict[str, str]) -> str:
    """The `authorization { users = [...] }` block: one NKey user per service (and per declared
    instance, `executor@NAME`, in `public_keys`), with its permissions.

    Only public keys appear here; the file may be read by anyone who may read the server config.
    """
    lines = [
        "# Written by `rose security init` from contracts/registry.py; regenerate, do not edit.",
        "authorization {",
        "  users = [",
    ]
    for user in [*USERS, *sorted(u for u in public_keys if u not in USERS)]:
        perms = permissions(user)
        lines += [
            f"    # {user}",
            f'    {{ nkey: "{public_keys[user]}", permissions: {{',
            f"        publish: {{ allow: {_nats_list(perms.publish)} }}",
            f"        subscribe: {{ allow: {_nats_list(perms.subscribe)} }}",
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


_ROUTE_RE = re.compile(r"^[A-Za-z0-9_.-]+:[0-9]{1,5}$")


def render_cluster_authorization(password: str, routes: list[str]) -> str:
    """What goes inside a node's `cluster {}` block: the route user every node requires, and the routes it dials with it.

    Every node gets the same text, its own address among the routes: nats-server detects a route
    to itself and drops it. The password is in the route URLs, so this file is as secret as a seed.
    """
    lines = [
        "# Written by `rose security init --cluster-route`; include it inside the cluster {} block of every node.",
        "# Routes must present this user and password; a node dials every route below (its own is ignored).",
        "authorization {",
        f'  user: "{ROUTE_USER}"',
        f'  password: "{password}"',
        "}",
        "routes: [",
        *[f'  "nats-route://{ROUTE_USER}:{password}@{route}"' for route in routes],
        "]",
    ]
    return "\n".join(lines) + "\n"


def check_routes(routes: list[str]) -> list[str]:
    """HOST:PORT of each node's route listener (no scheme, no credentials: the include adds them)."""
    bad = [r for r in routes if not _ROUTE_RE.match(r) or not 0 < int(r.rsplit(":", 1)[1]) < 65536]
    if bad:
        raise ValueError(f"cluster routes are HOST:PORT (e.g. nats-1:6222), not {', '.join(map(repr, bad))}")
    return list(dict.fromkeys(routes))


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
    """A directory made by `init_credentials`: one seed file per user (and per declared instance), the server include, maybe TLS files."""

    directory: Path

    def seed_file(self, user: str, instance: str | None = None) -> Path:
        """`<user>.nk`, or with `instance` that instance's own seed `<service>@<instance>.nk` (which may not exist)."""
        name = instance_user(user, instance) if instance is not None else user
        return self.directory / f"{name}{SEED_SUFFIX}"

    def instance_users(self) -> list[str]:
        """The declared instances whose seeds are here (`executor@executor-1`, ...), sorted."""
        users = []
        for path in sorted(self.directory.glob(f"*{INSTANCE_SEP}*{SEED_SUFFIX}")):
            service, instance = split_user(path.name[: -len(SEED_SUFFIX)])
            try:
                users.append(instance_user(service, instance or ""))
            except ValueError as exc:
                raise ValueError(f"{path} is not an instance seed `rose security init` wrote ({exc}); remove it") from None
        return users

    def instances(self, service: str) -> list[str]:
        """The names of `service`'s instances that have their own seed here."""
        return [i for s, i in map(split_user, self.instance_users()) if s == service and i is not None]

    @property
    def server_include(self) -> Path:
        return self.directory / SERVER_INCLUDE

    @property
    def tls_include(self) -> Path:
        return self.directory / TLS_INCLUDE

    @property
    def cluster_include(self) -> Path:
        return self.directory / CLUSTER_INCLUDE

    @property
    def route_secret(self) -> Path:
        return self.directory / ROUTE_SECRET

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

    def env(self, user: str, instance: str | None = None, *, tls: bool = False) -> dict[str, str]:
        """The variables that give a service process its own credentials (and the CA when TLS is on).

        With `instance`: that instance's own seed when it was declared (`executor@NAME.nk` exists),
        else the service's generic one; services whose instances have no users of their own ignore it.
        """
        seed = self.seed_file(user)
        if instance is not None and user in INSTANCE_TOKENS and self.seed_file(user, instance).exists():
            seed = self.seed_file(user, instance)
        out = {"ROSE_BUS__NKEY_SEED_FILE": str(seed)}
        if tls:
            out["ROSE_BUS__TLS_CA_FILE"] = str(self.ca_file)
        return out


def _new_seed() -> bytes:
    import nkeys

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def public_key(seed_file: Path) -> str:
    import nkeys

    return nkeys.from_seed(bytearray(seed_file.read_bytes().strip())).public_key.decode()


def init_credentials(
    directory: str | Path,
    *,
    force: bool = False,
    tls_hosts: list[str] | None = None,
    cluster_routes: list[str] | None = None,
    instances: Mapping[str, Iterable[str]] | None = None,
) -> Credentials:
    """Generate (or reuse) a seed per user and (re)write the server include from the current registry.

    Seeds that exist are kept unless `force`, so services keep working across a restart; the
    include is always rewritten, so a new channel's rights apply at the next server start.
    `instances` ({"executor": ["executor-1", ...]}) also makes a user per named instance
    (`executor@executor-1.nk`), its subjects pinned to that instance. Instance seeds already in the
    directory stay users too (as the others, they are kept across runs): delete one to revoke it.
    `tls_hosts` also makes a CA and a server certificate for those names and IPs (kept if present).
    `cluster_routes` (HOST:PORT of every node's route listener) also writes the cluster include
    (route authorization and authenticated routes) around a route password kept like the seeds.
    """
    routes = check_routes(cluster_routes) if cluster_routes else []
    declared = [instance_user(service, name) for service, names in (instances or {}).items() for name in names]
    creds = Credentials(Path(directory).resolve())
    _private_dir(creds.directory)
    keys: dict[str, str] = {}
    for user in [*USERS, *sorted(set(declared) | set(creds.instance_users()))]:
        path = creds.directory / f"{user}{SEED_SUFFIX}"
        if force or not path.exists():
            _write_private(path, _new_seed())
        os.chmod(path, 0o600)
        keys[user] = public_key(path)
    _write_private(creds.server_include, render_authorization(keys).encode())
    if routes:
        if force or not creds.route_secret.exists():
            _write_private(creds.route_secret, secrets.token_hex(24).encode())  # hex: safe in a URL and in the config
        os.chmod(creds.route_secret, 0o600)
        password = creds.route_secret.read_text().strip()
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", password):
            raise ValueError(f"{creds.route_secret} is not a route password `rose security init` wrote; remove it (or --force) to make a new one")
        _write_private(creds.cluster_include, render_cluster_authorization(password, routes).encode())
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

    now = datetime.datetime.now(datetime.UTC)
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
    pkcs8, unencrypted = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return ca.public_bytes(pem), ca_key.private_bytes(pem, pkcs8, unencrypted), cert.public_bytes(pem), key.private_bytes(pem, pkcs8, unencrypted)


# ---- the table in docs/security.md -----------------------------------------------------


def instance_pinning(service: str) -> tuple[list[str], list[str], list[str]]:
    """For an instance user of `service`: the channels it publishes under its own instance only, those
    it may subscribe to under its own instance only, and those it reads whole (JetStream storage:
    read rights there are per stream, not per subject)."""
    token = INSTANCE_TOKENS[service]
    core = (Kind.EVENT, Kind.REQUEST, Kind.STREAM)
    publishes = [c.name for c in CHANNELS if service in c.publishers and (token in c.tokens or {"service", "instance"} <= set(c.tokens))]
    reads = [c.name for c in CHANNELS if service in c.consumers and token in c.tokens and c.kind in core]
    reads += [c.name for e in EXTRA_RIGHTS if e.service == service for c in e.reads if token in c.tokens or "instance" in c.tokens]
    whole = [c.name for c in CHANNELS if service in c.consumers and token in c.tokens and c.kind not in core]
    return publishes, reads, whole


def permissions_markdown() -> str:
    """One row per user: what it may publish, read and write; `rose security permissions` prints it.

    Channels every service publishes (heartbeats, lifecycle events, dead letters, its own
    registry keys, each under its own name) are listed once, in the first row. A service whose
    instances may have users of their own gets a row saying what those pin to the instance.
    """
    common = [c for c in CHANNELS if c.publishers == ALL_SERVICES]
    own = [  # channels every service may read under its own name only (EXTRA_RIGHTS)
        c.name for c in common if "service" in c.tokens and all(any(c in e.reads for e in EXTRA_RIGHTS if e.service == s) for s in ALL_SERVICES)
    ]
    rows = [
        "| user | publishes | reads | writes storage | JetStream consumers on |",
        "| --- | --- | --- | --- | --- |",
        f"| every service | {', '.join(c.name for c in common)} (under its own name) | {', '.join(own) + ' (its own)' if own else '—'} | its own "
        f"keys of {', '.join(sorted({stream_name(c.kind, c) for c in common if c.kind is Kind.KV}))} | — |",
    ]
    shared = {c.name for c in common}
    for user in USERS:
        p = permissions(user)
        extra = [e.why.split(" (")[0] for e in EXTRA_RIGHTS if e.service == user and e.publish and not any(".CONSUMER." in x for x in e.publish)]
        writes = [w for w in p.writes_storage if not w.endswith("(own keys)")] + [f"+ {e}" for e in extra]
        publishes = [c for c in p.publishes if c not in shared]
        rows.append(
            f"| `{user}` | {', '.join(publishes) or '—'} | {', '.join(p.reads) or '—'} | {'; '.join(writes) or '—'} | "
            f"{', '.join(p.js_consumers) or '—'} |"
        )
        if user in INSTANCE_TOKENS:
            pinned_pub, pinned_sub, whole = instance_pinning(user)
            same = f"as `{user}`"
            but_whole = f" ({', '.join(whole)}: every key, JetStream reads are per stream)" if whole else ""
            rows.append(
                f"| `{instance_user(user, 'NAME')}` (`--instance {user}=NAME`) | {same}; {', '.join(pinned_pub)} only under its own instance NAME | "
                f"{same}; {', '.join(pinned_sub)} only NAME's{but_whole} | {same} | {same} |"
            )
    return "\n".join(rows) + "\n"
