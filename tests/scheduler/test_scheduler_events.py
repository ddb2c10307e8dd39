"""Every lease grant/revoke and every placement is an event on the bus and a span in the trace."""

from __future__ import annotations

import time

from nats.js.errors import NotFoundError

from rose.contracts.registry import EVENTS_STREAM, LEASE, LEASE_EVENT, PLACEMENT
from rose.contracts.rollout import TurnRouteRequest
from rose.contracts.slo import SloAlert
from rose.services.scheduler.config import SchedulerConfig
from rose.services.scheduler.scheduler import Scheduler
from rose.shared.bus import Delivery
from rose.shared.codec import decode
from rose.testing.messages import beat, headroom
from rose.testing.polling import until


async def test_grant_place_revoke_are_events_and_spans(bus, spans):
    spans.clear()
    await bus.kv_delete(LEASE, executor_id="ex-ev1")
    s = Scheduler(SchedulerConfig(), bus)
    d = Delivery("test")
    await s.on_heartbeat(beat("ex-ev1", "serving"), d)
    await s.on_headroom(headroom(time.time(), ex="ex-ev1"), d)
    await s.tick()
    lease = await bus.kv_get(LEASE, executor_id="ex-ev1")
    assert lease is not None and lease.state == "active" and s.counts["granted"] == 1

    route = await s.route(TurnRouteRequest(trajectory_id="tr-ev", turn_index=0, prompt_tokens=4), d)
    assert route.executor_id == "ex-ev1" and route.lease_id == lease.lease_id

    async def placed():  # the event is published off the reply path
        try:
            msg = await bus.js.get_last_msg(EVENTS_STREAM.name, PLACEMENT.subject(executor_id="ex-ev1"))
        except NotFoundError:
            return None
        event = decode(msg.data, PLACEMENT.payload)
        return event if event.trajectory_id == "tr-ev" else None

    event = await until(placed, 10, "the placement event")
    assert event.lease_id == lease.lease_id

    await s.on_alert(SloAlert(executor_id="ex-ev1", at=time.time(), severity="burst", reason="test"), d)
    revoked = await bus.kv_get(LEASE, executor_id="ex-ev1")
    assert revoked.state == "revoked" and revoked.epoch == lease.epoch
    msg = await bus.js.get_last_msg(EVENTS_STREAM.name, LEASE_EVENT.subject(kind="revoked", executor_id="ex-ev1"))
    assert decode(msg.data, LEASE_EVENT.payload).lease.lease_id == lease.lease_id

    names = [sp.name for sp in spans.get_finished_spans()]
    assert "lease.granted" in names and "lease.revoked" in names and "scheduler.place" in names
    grant = next(sp for sp in spans.get_finished_spans() if sp.name == "lease.granted")
    assert grant.attributes["rose.executor_id"] == "ex-ev1" and grant.attributes["rose.lease_epoch"] == lease.epoch
    # the lease event's publish span is a child of the decision's span: one trace
    sends = [sp for sp in spans.get_finished_spans() if sp.parent is not None and sp.parent.span_id == grant.context.span_id]
    assert sends, "the lease event was not published inside the decision's span"
