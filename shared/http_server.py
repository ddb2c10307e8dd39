"""The HTTP server of ROSE's public endpoints (the executor's APIs, the gateway's): aiohttp with the
limits a public endpoint needs (see docs/http-api.md).

aiohttp bounds the body size (``client_max_size``) and the header size, and closes idle
keep-alive connections, but it has no deadline for *receiving* a request head: a client that
sends its headers at one byte a second holds a connection (and a file descriptor) for as long
as it likes (slowloris). ``HeadDeadlineHandler`` gives every request head a deadline, from its
first byte (or from the connection's opening) until aiohttp has parsed it; past the deadline the
server closes the connection. Body reads have their own deadline (``read_body``).

Admin credentials are compared in constant time (``same_secret``).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

HEAD_READ_TIMEOUT_S = 10.0  # a request head (request line + headers) must arrive within this
BODY_READ_TIMEOUT_S = 60.0  # a request body must arrive within this once its head is in
KEEPALIVE_TIMEOUT_S = 75.0  # an idle keep-alive connection is closed after this (aiohttp's long-time default)
MAX_LINE_BYTES = 8190  # request line or one header line longer than this: 400 (aiohttp's parser limits, pinned here)
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128


def same_secret(sent: str, expected: str) -> bool:
    """Constant-time comparison, so the time to reject a key says nothing about how much of it was right."""
    return hmac.compare_digest(sent.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


async def read_body(request: web.Request, timeout_s: float = BODY_READ_TIMEOUT_S) -> bytes:
    """The whole body, within ``timeout_s`` (408 past it); aiohttp enforces the size limit (413)."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"the request body did not arrive within {timeout_s:g} s") from None


class HeadDeadlineHandler(RequestHandler):
    """aiohttp's per-connection protocol, plus a deadline on each request head.

    Armed when the connection opens and when the first byte of a next request arrives on an
    idle keep-alive connection; disarmed when aiohttp hands the parsed request to the app
    (``_handle_request``: aiohttp's per-request entry point, pinned by tests/executor_service/
    test_openai_conformance.py). A request body, and the response however long it streams,
    are not under this deadline.
    """

    def __init__(self, manager: web.Server, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None
        self._serving_request = False

    def _arm(self) -> None:
        if self._head_deadline is None and not self._serving_request:
            self._head_deadline = asyncio.get_running_loop().call_later(self._head_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        transport = self.transport
        self.force_close()
        if transport is not None:
            transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._arm()  # a no-op while a request is being served (its body, or a pipelined next head)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    async def _handle_request(self, request, start_time, request_handler):
        self._disarm()
        self._serving_request = True
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._serving_request = False


class HeadDeadlineServer(web.Server):
    """An aiohttp ``Server`` whose connections are ``HeadDeadlineHandler``s."""

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s

    def __call__(self) -> RequestHandler:
        return HeadDeadlineHandler(self, loop=self._loop, head_timeout_s=self.head_timeout_s, **self._kwargs)


class HardenedAppRunner(web.AppRunner):
    """``web.AppRunner`` serving through ``HeadDeadlineServer`` (use it as the runner, with any site)."""

    def __init__(self, app: web.Application, *, head_timeout_s: float = HEAD_READ_TIMEOUT_S, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_FIELD_BYTES)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        super().__init__(app, **kwargs)
        self.head_timeout_s = head_timeout_s

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # the app's startup hooks run here; rebuild the same server with our handler
        return HeadDeadlineServer(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            head_timeout_s=self.head_timeout_s,
            **base._kwargs,
        )
