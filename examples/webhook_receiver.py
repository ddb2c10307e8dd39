"""A minimal webhook receiver for `rose events forward`: prints each event it is POSTed.

    python examples/webhook_receiver.py --port 8080 &
    rose events forward --to http://127.0.0.1:8080/rose --subjects 'rose.events.>' 'rose.rollout.trajectories.*'

Each request body is a CloudEvents 1.0 JSON envelope: `id` (`<stream>-<sequence>`, the same on
a redelivery: use it to drop duplicates), `subject` (the NATS subject), `type`
(`rose.<Message>`), `time` and `data` (the event, as docs/events.md describes it). Answer 2xx
to acknowledge; a 5xx (or 408/429) makes the bridge retry with backoff; any other 4xx sends
the event to the bridge's dead-letter file.
"""

from __future__ import annotations

import argparse
import json
import sys

from aiohttp import web


def make_app() -> web.Application:
    seen: set[str] = set()

    async def receive(request: web.Request) -> web.Response:
        try:
            event = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        if not isinstance(event, dict) or event.get("specversion") != "1.0" or "subject" not in event:
            return web.json_response({"error": "expected a CloudEvents 1.0 envelope"}, status=400)
        if event["id"] not in seen:  # at-least-once delivery: keep each event once
            seen.add(event["id"])
            print(json.dumps({"subject": event["subject"], "type": event["type"], "id": event["id"], "data": event.get("data")}), flush=True)
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/{tail:.*}", receive)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the ROSE events a webhook bridge POSTs here.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    print(f"receiving on http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    web.run_app(make_app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
