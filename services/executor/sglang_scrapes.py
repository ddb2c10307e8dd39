"""The SGLang servers' own /metrics, scraped: the backend's view of their queues, KV and (two-model mode) tokens.

Who owns what: ``ServerScrapes`` holds the latest scrape of each server ("serving", and "rollout" in the two-model
mode; the LoRA mode's one server answers for both) and the loop that refreshes them, every ``interval_s`` or at once
when ``stats()`` asks (``refresh``). What a new scrape adds to the backend's interval counters is the backend's
business: it passes ``on_scrape`` (sglang_backend.py folds the two-model mode's counters; the LoRA mode counts per
request instead). A server that stops answering is logged once, and again once it answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from .sglang_wire import Scrape, ServerError, parse_metrics

log = logging.getLogger("rose.executor.sglang")


class ServerScrapes:
    def __init__(
        self,
        urls: dict[str, str],
        headers: Callable[[], dict[str, str]],
        *,
        interval_s: float,
        timeout_s: float,
        on_scrape: Callable[[str, Scrape | None, Scrape], None] | None = None,
    ) -> None:
        self.urls, self._headers = urls, headers
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._on_scrape = on_scrape
        self.rounds = 0  # completed scrape rounds (the first one is only the baseline of the counters)
        self._last: dict[str, Scrape] = {}
        self._ok: dict[str, bool] = {}
        self._now = asyncio.Event()

    def last(self, name: str) -> Scrape:
        """The latest scrape of server ``name`` (empty before the first)."""
        return self._last.get(name, Scrape())

    def refresh(self) -> None:
        """Scrape again now rather than at the next interval (a stats() call: the figures for the next one)."""
        self._now.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.once(session)
            self.rounds += 1
            waiter = asyncio.ensure_future(self._now.wait())
            try:  # asyncio.wait, not wait_for: wait_for on 3.11 can swallow the cancel that stop() sends
                await asyncio.wait({waiter}, timeout=self.interval_s)
            finally:
                waiter.cancel()
            self._now.clear()

    async def once(self, session: aiohttp.ClientSession) -> None:
        names = list(self.urls)
        texts = await asyncio.gather(*(self._fetch(session, self.urls[n]) for n in names), return_exceptions=True)
        for name, text in zip(names, texts):
            url = self.urls[name]
            if isinstance(text, BaseException):
                if self._ok.get(name, True):
                    log.warning("cannot scrape %s/metrics: %s", url, text)
                self._ok[name] = False
                continue
            if not self._ok.get(name, True):
                log.info("scraping %s/metrics again", url)
            self._ok[name] = True
            try:
                scrape = parse_metrics(text)
            except ValueError as exc:
                log.warning("%s/metrics is not Prometheus text: %s", url, exc)
                continue
            if self._on_scrape is not None:
                self._on_scrape(name, self._last.get(name), scrape)
            self._last[name] = scrape

    async def _fetch(self, session: aiohttp.ClientSession, base: str) -> str:
        t = aiohttp.ClientTimeout(total=self.timeout_s)
        async with session.get(base + "/metrics", headers=self._headers(), timeout=t) as resp:
            if resp.status != 200:
                raise ServerError(base + "/metrics", resp.status, (await resp.text())[:200])
            return await resp.text()
