"""Waiting for things that happen asynchronously (events, heartbeats, leases), with a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time

import nats.errors

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.lease import Lease
from rose.contracts.registry import EXECUTOR_METRICS, LEASE
from rose.shared.codec import decode


async def within(predicate, timeout: float = 15.0, step: float = 0.05):
    """Poll `predicate()` (plain or async) until it returns something truthy, and return that; None at `timeout`
    (for a test that goes on either way and asserts on what it has)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(step)


async def until(predicate, timeout: float = 15.0, what: str = "the condition", step: float = 0.05):
    """Poll `predicate()` (plain or async) until it returns something truthy, and return that; fail the test at `timeout`."""
    value = await within(predicate, timeout, step)
    if not value:
        raise AssertionError(f"{what} did not happen in {timeout:.0f} s")
    return value


async def retrying(
    call, errors: type[BaseException] | tuple[type[BaseException], ...] = Exception, timeout: float = 15.0, what: str = "the call", step: float = 0.25
):
    """Await `call()` again while it raises one of `errors` (a service still starting, a leader being elected), and
    return its result; at `timeout` fail the test with the last error as the cause."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except errors as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} still failing after {timeout:.0f} s: {exc!r}") from exc
        await asyncio.sleep(step)


async def put_lease(bus, executor_id: str, lease: Lease | None, timeout: float = 20.0) -> None:
    """Write (or, with None, delete) an executor's lease in the bucket, then wait until the executor's metrics show it
    applied: its watcher runs in its own process, and a fixed wait can be too short on a loaded host."""
    want = lease.lease_id if lease is not None and lease.state == "active" else ""
    sub = await bus.nc.subscribe(EXECUTOR_METRICS.subject(executor_id=executor_id))
    try:
        if lease is None:
            await bus.kv_delete(LEASE, executor_id=executor_id)
        else:
            await bus.kv_put(LEASE, lease, executor_id=executor_id)
        sent = time.time()

        async def applied() -> bool:
            try:
                snap = decode((await sub.next_msg(timeout=1)).data, MetricsSnapshot)
            except nats.errors.TimeoutError:  # no snapshot this second: ask again, until's deadline says when to stop
                return False
            return snap.at >= sent and snap.lease_id == want

        await until(applied, timeout, f"executor {executor_id} applying lease {want or '(none)'}")
    finally:
        await sub.unsubscribe()


def within_sync(predicate, timeout: float = 15.0, step: float = 0.3):
    """`within` for tests that drive subprocesses without an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(step)


def until_sync(predicate, timeout: float = 15.0, what: str = "the condition", step: float = 0.3):
    """`until` for tests that drive subprocesses without an event loop."""
    value = within_sync(predicate, timeout, step)
    if not value:
        raise AssertionError(f"{what} did not happen in {timeout:.0f} s")
    return value
