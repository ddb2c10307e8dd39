"""A real OTLP/HTTP receiver for the export tests: what a collector would get, decoded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def otlp_receiver(path: str, message_type: type) -> AsyncIterator[tuple[str, list]]:
    """Serve POST `path` on a free port; yields (endpoint URL, decoded `message_type` requests)."""
    received: list = []

    async def handler(request: web.Request) -> web.Response:
        message = message_type()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]  # the port the OS chose (public read-out; no private state)
        yield f"http://127.0.0.1:{port}", received
    finally:
        await runner.cleanup()
