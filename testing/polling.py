"""Waiting for things that happen asynchronously (events, heartbeats, leases), with a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time


async def until(predicate, timeout: float = 15.0, what: str = "the condition", step: float = 0.05):
    """Poll `predicate()` (plain or async) until it returns something truthy, and return that; fail the test at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout:.0f} s")
        await asyncio.sleep(step)


def until_sync(predicate, timeout: float = 15.0, what: str = "the condition", step: float = 0.3):
    """`until` for tests that drive subprocesses without an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout:.0f} s")
        time.sleep(step)
