"""`rose events forward`'s arguments and runner, apart from the forwarder: `rose`'s parser adds them for every
command (a container healthcheck among them), and the forwarder's imports (aiohttp, the bus) cost
about a second of CPU that those commands do not need."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose events` and its one action, `forward`, to `rose`'s commands."""
    p = commands.add_parser("events", help="integrations with ROSE's public events")
    actions = p.add_subparsers(dest="events_command", required=True, metavar="ACTION")
    e = actions.add_parser(
        "forward",
        help="a webhook bridge: POST every event on --subjects to --to (durable, retries with backoff, dead-letter file)",
        description="POST every event on the given subjects to an HTTP URL as CloudEvents JSON. A JetStream durable consumer keeps the "
        "place across restarts; failures are retried with exponential backoff, and events the URL refuses are appended to a dead-letter file.",
    )
    add_arguments(e)
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .events_forward import forward

    return forward(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, help="the http(s) URL each event is POSTed to")
    p.add_argument(
        "--subjects",
        nargs="+",
        default=None,
        metavar="SUBJECT",
        help="subject filters, each inside one stream (default: every public event; see docs/events.md)",
    )
    p.add_argument(
        "--durable", default=None, help="the JetStream durable consumer name (default: derived from --to); the same name resumes where it stopped"
    )
    p.add_argument(
        "--dead-letter",
        default=None,
        help="JSON-lines file of events the URL refused (default: $ROSE_STATE_DIR/forward/<durable>.dead-letters.jsonl)",
    )
    p.add_argument("--max-attempts", type=int, default=5, help="HTTP attempts per event before it is dead-lettered (default 5)")
    p.add_argument("--backoff", type=float, default=0.5, help="seconds before the first retry, doubled each time (default 0.5)")
    p.add_argument("--max-backoff", type=float, default=30.0, help="longest wait between retries (default 30)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP attempt (default 10)")
    p.add_argument(
        "--deliver", choices=("new", "all"), default="new", help="where a new consumer starts: events from now on (new) or all the stream keeps (all)"
    )
    p.add_argument(
        "--header", action="append", default=[], metavar="'NAME: VALUE'", help="an extra HTTP header (repeatable), e.g. 'Authorization: Bearer ...'"
    )
    p.add_argument("--nats-url", default=None, help="NATS to read from (default: NATS_URL, else the one `rose up` started)")
    p.add_argument("--state-dir", default=None, help="state dir of the `rose up` whose NATS to use")
