"""`rose security`: per-service NATS credentials and the server's permission config, from the registry.

`rose security init DIR` writes one NKey seed per service (`DIR/<service>.nk`, mode 0600, DIR 0700)
and `DIR/nats-auth.conf`, the server's `authorization` block with each service's publish and
subscribe allow lists (public keys only). Put `include nats-auth.conf` in the server config and
give each service its seed (`ROSE_BUS__NKEY_SEED_FILE`). `--tls-host` adds a CA, a server
certificate and `nats-tls.conf`. `rose security permissions` prints what each user may do.
"""

from __future__ import annotations

import argparse
import json
import sys

from rose.shared.security import SERVER_INCLUDE, TLS_INCLUDE, USERS, init_credentials, permissions, permissions_markdown


def init_command(args: argparse.Namespace) -> int:
    creds = init_credentials(args.dir, force=args.force, tls_hosts=args.tls_host or None)
    print(f"credentials for {', '.join(USERS)} in {creds.directory} (seeds *.nk, mode 0600)")
    print(f"server: add `include {SERVER_INCLUDE}` to the nats-server config (copy the file beside it)")
    if args.tls_host:
        print(f"TLS: `include {TLS_INCLUDE}` too; clients set ROSE_BUS__TLS_CA_FILE={creds.ca_file}")
    print(f"each service: ROSE_BUS__NKEY_SEED_FILE={creds.directory}/<service>.nk (operators and `rose status`: cli.nk)")
    return 0


def permissions_command(args: argparse.Namespace) -> int:
    if args.json:
        out = {u: {"publish": p.publish, "subscribe": p.subscribe, "allow_responses": True} for u in USERS for p in [permissions(u)]}
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        sys.stdout.write(permissions_markdown())
    return 0


def add_parser(security_sub: argparse._SubParsersAction) -> None:
    """Register `init` and `permissions` under the `rose security` command group."""
    i = security_sub.add_parser("init", help="write an NKey seed per service and the server's permission config (nats-auth.conf) into DIR")
    i.add_argument("dir", help="directory for the credentials (created with mode 0700)")
    i.add_argument("--force", action="store_true", help="replace existing seeds (and TLS files): every service then needs its new seed")
    i.add_argument("--tls-host", action="append", metavar="HOST", help="also make a CA and a server certificate for HOST (a name or an IP; repeat for more)")
    i.set_defaults(func=init_command)
    p = security_sub.add_parser("permissions", help="what each user may publish, read and write (markdown table; --json: the exact subjects)")
    p.add_argument("--json", action="store_true", help="the publish/subscribe allow lists of every user")
    p.set_defaults(func=permissions_command)
