"""`rose security`: per-service NATS credentials and the server's permission config, from the registry.

`rose security init DIR` writes one NKey seed per service (`DIR/<service>.nk`, mode 0600, DIR 0700)
and `DIR/nats-auth.conf`, the server's `authorization` block with each service's publish and
subscribe allow lists (public keys only). Put `include nats-auth.conf` in the server config and
give each service its seed (`ROSE_BUS__NKEY_SEED_FILE`). `--tls-host` adds a CA, a server
certificate and `nats-tls.conf`. `--cluster-route HOST:PORT` (one per node) adds a route password
(`nats-route.secret`, kept across runs) and `nats-cluster-auth.conf`, to include inside every
node's `cluster {}` block: nodes then accept only routes that present it, and dial each other
with it. `--instance executor=NAME[,NAME...]` (repeatable) adds a user per named executor
(`DIR/executor@NAME.nk`) whose subjects are pinned to NAME: its generate requests, metrics, weight
events and heartbeats, no other executor's. Re-running keeps seeds (instance seeds too) and the
route password and rewrites the includes; `--force` replaces them all. `rose security permissions`
prints what each user may do (`--json --instance executor=NAME`: the exact subjects of that one).
"""

from __future__ import annotations

import argparse
import json
import sys

from rose.shared.security import (
    CLUSTER_INCLUDE,
    INSTANCE_TOKENS,
    SERVER_INCLUDE,
    TLS_INCLUDE,
    USERS,
    init_credentials,
    instance_user,
    parse_instances,
    permissions,
    permissions_markdown,
)

from .security_keys import add_parser as add_weights_key_parser


def init_command(args: argparse.Namespace) -> int:
    try:
        instances = parse_instances(args.instance or [])
        creds = init_credentials(
            args.dir, force=args.force, tls_hosts=args.tls_host or None, cluster_routes=args.cluster_route or None, instances=instances
        )
    except ValueError as exc:
        print(f"rose security init: {exc}", file=sys.stderr)
        return 2
    print(f"credentials for {', '.join(USERS)} in {creds.directory} (seeds *.nk, mode 0600)")
    if creds.instance_users():
        print(
            f"instances: {', '.join(creds.instance_users())} (seeds <service>@<instance>.nk: each may act only as that instance; "
            f"the generic {'/'.join(INSTANCE_TOKENS)} seed stays, for instances not declared)"
        )
    print(f"server: add `include {SERVER_INCLUDE}` to the nats-server config (copy the file beside it)")
    if args.cluster_route:
        print(
            f"cluster: `include {CLUSTER_INCLUDE}` inside the cluster {{}} block of every node (route password and routes to "
            f"{', '.join(args.cluster_route)})"
        )
    if args.tls_host:
        print(f"TLS: `include {TLS_INCLUDE}` too; clients set ROSE_BUS__TLS_CA_FILE={creds.ca_file}")
    print(
        f"each service: ROSE_BUS__NKEY_SEED_FILE={creds.directory}/<service>.nk, a declared instance its own <service>@<instance>.nk "
        "(operators and `rose status`: cli.nk)"
    )
    return 0


def permissions_command(args: argparse.Namespace) -> int:
    try:
        instances = parse_instances(args.instance or [])
    except ValueError as exc:
        print(f"rose security permissions: {exc}", file=sys.stderr)
        return 2
    if args.json:
        users = [*USERS, *(instance_user(s, name) for s, names in instances.items() for name in names)]
        out = {u: {"publish": p.publish, "subscribe": p.subscribe} for u in users for p in [permissions(u)]}
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        sys.stdout.write(permissions_markdown())
    return 0


def add_parser(security_sub: argparse._SubParsersAction) -> None:
    """Register `init` and `permissions` under the `rose security` command group."""
    i = security_sub.add_parser("init", help="write an NKey seed per service and the server's permission config (nats-auth.conf) into DIR")
    i.add_argument("dir", help="directory for the credentials (created with mode 0700)")
    i.add_argument(
        "--force", action="store_true", help="replace existing seeds (and TLS files, the route password): every service then needs its new seed"
    )
    i.add_argument(
        "--tls-host", action="append", metavar="HOST", help="also make a CA and a server certificate for HOST (a name or an IP; repeat for more)"
    )
    i.add_argument(
        "--cluster-route",
        action="append",
        metavar="HOST:PORT",
        help=f"a cluster node's route listener (repeat for every node): also write {CLUSTER_INCLUDE}, route auth with a generated password, for "
        "every node's cluster block",
    )
    i.add_argument(
        "--instance",
        action="append",
        metavar="SERVICE=NAME[,NAME...]",
        help=f"also a user per named instance of SERVICE ({', '.join(INSTANCE_TOKENS)}), its subjects pinned to NAME: DIR/SERVICE@NAME.nk (repeat "
        "for more)",
    )
    i.set_defaults(func=init_command)
    p = security_sub.add_parser("permissions", help="what each user may publish, read and write (markdown table; --json: the exact subjects)")
    p.add_argument("--json", action="store_true", help="the publish/subscribe allow lists of every user")
    p.add_argument("--instance", action="append", metavar="SERVICE=NAME[,NAME...]", help="with --json: also the lists of these instance users")
    p.set_defaults(func=permissions_command)


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose security` to `rose`'s commands: `init` and `permissions` (above), `weights-key` (security_keys.py)."""
    p = commands.add_parser(
        "security",
        help="keys and credentials: `init` per-service NATS credentials and permissions, `weights-key` the pair that signs weight manifests",
    )
    actions = p.add_subparsers(dest="security_command", required=True, metavar="ACTION")
    add_parser(actions)
    add_weights_key_parser(actions)
