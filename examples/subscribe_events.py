"""Subscribe to ROSE's public events with plain nats-py and decode each into its contract type.

    python examples/subscribe_events.py --nats-url nats://127.0.0.1:4222
    python examples/subscribe_events.py --subjects 'rose.events.lease.>' --json --count 10

No ROSE runtime is involved: `rose.contracts` gives the msgspec Struct of every subject (the
registry maps a subject to its channel and payload type), `msgspec.json.decode` checks the
JSON against it. These are live (core NATS) subscriptions: events published while this runs.
For a durable subscription that resumes after a restart, use a JetStream durable consumer on
the event's stream (docs/events.md names it), as `rose events forward` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import msgspec
import nats

from rose.contracts.registry import CHANNELS, Channel


def public_channels() -> list[Channel]:
    """Channels whose consumers include integrations: the public events."""
    return [c for c in CHANNELS if "integrations" in c.consumers and c.payload is not None]


def channel_of(subject: str, channels: list[Channel]) -> Channel | None:
    for channel in channels:
        try:
            channel.parse(subject)
            return channel
        except ValueError:
            continue
    return None


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print ROSE's public events as they happen.")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--subjects", nargs="+", default=None, help="subjects to subscribe to (default: every public event)")
    parser.add_argument("--count", type=int, default=0, help="exit after this many events (0: run until Ctrl-C)")
    parser.add_argument("--json", action="store_true", help="one JSON object per event instead of a summary line")
    args = parser.parse_args(argv)

    channels = public_channels()
    subjects = args.subjects or [c.pattern() for c in channels]
    nc = await nats.connect(args.nats_url, name="rose-example-subscriber")
    done = asyncio.Event()
    seen = 0

    async def on_event(msg) -> None:
        nonlocal seen
        channel = channel_of(msg.subject, channels)
        if channel is None:
            print(f"{msg.subject}: not a public ROSE event", file=sys.stderr)
            return
        try:
            event = msgspec.json.decode(msg.data, type=channel.payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            print(f"{msg.subject}: does not match {channel.payload.__name__}: {exc}", file=sys.stderr)
            return
        if args.json:
            print(json.dumps({"subject": msg.subject, "type": type(event).__name__, "event": msgspec.to_builtins(event)}), flush=True)
        else:
            print(f"{msg.subject} {type(event).__name__} {msgspec.json.encode(event).decode()[:200]}", flush=True)
        seen += 1
        if args.count and seen >= args.count:
            done.set()

    for subject in subjects:
        await nc.subscribe(subject, cb=on_event)
    await nc.flush()
    print(f"listening on {', '.join(subjects)}", file=sys.stderr, flush=True)
    try:
        await done.wait()
    finally:
        await nc.drain()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        pass
