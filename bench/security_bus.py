"""`rose bench security`'s bus attacks: confused-deputy requests on a real nats-server (bench/security.py's **bus**
rows; tests/security/test_confused_deputy.py tries them one at a time).

For each request channel x each of its requesters' credentials, a request whose reply subject points at storage or
subjects an answer must never reach; blocked is judged from what the operator sees afterwards (``observe``), once on a
server with the per-service permissions of `rose security init` and once without, where only the bus's own reply
check stands.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .security import Rows

ATTACK_SETTLE_S = 0.3  # after a responder refused (or the server dropped) a request: time for a wrongly sent answer to land
REFUSAL_WAIT_S = 3.0  # how long to wait for the responder to see the request


@dataclass
class BusWorld:
    """A nats-server (with or without the per-service permissions), its operator, one responder per request channel, the attackers."""

    operator: Any
    responders: dict[str, Any]  # channel name -> Bus serving it
    attackers: dict[str, Any]  # credential -> Bus
    secured: bool
    seen: dict[str, int] = field(default_factory=dict)  # tag -> messages that reached a watched subject or inbox
    attacks: int = 0

    async def close(self) -> None:
        for bus in [*self.attackers.values(), *self.responders.values(), self.operator]:
            await bus.close()


def valid_request(channel_name: str) -> Any | None:
    """A well-formed request of a channel (its handler's answer is attacked too), or None for a channel this bench does not know."""
    from rose.contracts.executor import GenerateRequest
    from rose.contracts.rollout import TurnRouteRequest
    from rose.contracts.weights import WeightPublishRequest

    return {
        "executor.generate": GenerateRequest(request_id="atk", trajectory_id="t", turn_index=0, prompt_token_ids=[1]),
        "scheduler.route": TurnRouteRequest(trajectory_id="t", turn_index=0, prompt_tokens=1),
        "weights.publish": WeightPublishRequest(request_id="atk", model="policy", version=1, source="path", path="/nonexistent"),
    }.get(channel_name)


def request_tokens(channel: Any) -> dict[str, str]:
    """The tokens of the one subject the bench's responder serves on `channel`."""
    return {t: "ex-bench" if t == "executor_id" else "policy" if t == "model" else "bench" for t in channel.tokens}


def request_channels() -> list[Any]:
    from rose.contracts.registry import CHANNELS, Kind

    return [c for c in CHANNELS if c.kind is Kind.REQUEST]


REPLY_TARGETS = ("js-delete", "js-purge", "kv-forged-key", "service-subject", "service-stream-subject", "outsider-inbox")


def reply_target(channel: Any, target: str, tag: str) -> tuple[str, str]:
    """(description, reply subject) of one target an attacker may put on a request of `channel`."""
    from rose.contracts.registry import ALL_SERVICES, HEADROOM, LEASE_EVENT

    outsider = next(s for s in ALL_SERVICES if s not in channel.publishers and s not in channel.consumers)
    return {
        "js-delete": ("$JS.API stream delete of the leases bucket", "$JS.API.STREAM.DELETE.KV_rose_leases"),
        "js-purge": ("$JS.API purge of ROSE_EVENTS", "$JS.API.STREAM.PURGE.ROSE_EVENTS"),
        "kv-forged-key": ("$KV forged lease key", f"$KV.rose_leases.forged-{tag}"),
        "service-subject": ("another service's event subject (headroom)", HEADROOM.subject(executor_id=f"victim-{tag}")),
        "service-stream-subject": (
            "another service's stream subject (lease event)",
            LEASE_EVENT.subject(kind="granted", executor_id=f"victim-{tag}"),
        ),
        "outsider-inbox": (f"the inbox of {outsider} (not a requester)", f"_INBOX_{outsider}.victim.{tag}"),
    }[target]


async def observe(world: BusWorld, tag: str, events_before: int) -> tuple[bool, str]:
    """What the operator sees after an attack: the leases bucket and its keys, ROSE_EVENTS, the watched subjects and inboxes."""
    from rose.contracts.registry import LEASE_EVENT

    op, notes, ok = world.operator, [], True
    try:
        info = await op.js.stream_info("KV_rose_leases", subjects_filter=f"$KV.rose_leases.forged-{tag}")
        forged = sum((info.state.subjects or {}).values())
        ok &= forged == 0 and info.state.messages >= 1
        notes.append(f"KV_rose_leases exists with {info.state.messages} entries, forged keys: {forged}")
    except Exception as exc:
        ok = False
        notes.append(f"KV_rose_leases GONE ({type(exc).__name__})")
    events = await op.js.stream_info("ROSE_EVENTS", subjects_filter=LEASE_EVENT.subject(kind="granted", executor_id=f"victim-{tag}"))
    forged_events = sum((events.state.subjects or {}).values())
    ok &= events.state.messages >= events_before and forged_events == 0
    notes.append(f"ROSE_EVENTS {events.state.messages} msgs (before {events_before}), forged lease events: {forged_events}")
    ok &= world.seen.get(tag, 0) == 0
    notes.append(f"messages on the watched subject/inbox: {world.seen.get(tag, 0)}")
    return ok, "; ".join(notes)


async def bus_world(url: str, creds: Any, *, secured: bool, executor_user: str = "executor@ex-bench") -> BusWorld:
    """Provision, seed the storage an attack would damage, start the responders (each with its service's
    credentials when `secured`) and the attackers, and watch the subjects and inboxes answers must not reach."""
    from rose.contracts.executor import GenerateReply
    from rose.contracts.lease import Lease
    from rose.contracts.registry import ALL_SERVICES, GENERATE, HEADROOM, LEASE, SLO_ALERT
    from rose.contracts.slo import SloAlert
    from rose.shared.bus import Bus, RequestRefused
    from rose.shared.config import BusConfig
    from rose.shared.provisioning import provision
    from rose.shared.security import OPERATOR

    def cfg(user: str) -> BusConfig:
        seed = str(creds.directory / f"{user}.nk") if secured else ""
        return BusConfig(url=url, nkey_seed_file=seed, initial_connect_deadline_s=10.0, request_timeout_s=5.0)

    op = Bus(cfg(OPERATOR), service=OPERATOR, instance="bench-ops")
    await op.connect()
    await provision(op.js)
    await op.publish(
        SLO_ALERT, SloAlert(executor_id="bench-marker", at=time.time(), severity="burst", reason="bench marker"), executor_id="bench-marker"
    )
    await op.kv_put(
        LEASE,
        Lease(
            lease_id="l-bench",
            executor_id="ex-bench",
            epoch=1,
            state="active",
            granted_at=1.0,
            expires_at=2.0,
            kv_bytes=1,
            compute_share=0.5,
            max_rollout_batch=1,
        ),
        executor_id="ex-bench",
    )  # a purge or delete would show

    async def generate(req: Any, _d: Any) -> Any:
        return GenerateReply(request_id=req.request_id, executor_id="ex-bench", status="failed", error="bench")

    async def refuse(_req: Any, _d: Any) -> Any:
        raise RequestRefused("bench: not served here", "409")

    responders = {}
    for channel in request_channels():  # each served by its first consumer, with that service's credentials
        service = channel.consumers[0]
        user = executor_user if service == "executor" else service
        bus = Bus(cfg(user), service=service, instance=user.partition("@")[2] or f"{service}-bench")
        await bus.connect()
        await bus.serve(channel, generate if channel is GENERATE else refuse, **request_tokens(channel))
        responders[channel.name] = bus
    attackers = {}
    for user in sorted({p for c in request_channels() for p in c.publishers}):
        bus = Bus(cfg(user), service=user, instance="attacker")
        await bus.connect()
        attackers[user] = bus
    world = BusWorld(op, responders, attackers, secured)

    async def watch(msg: Any) -> None:
        tag = msg.subject.rsplit(".", 1)[-1].removeprefix("victim-")
        world.seen[tag] = world.seen.get(tag, 0) + 1

    await op.nc.subscribe(HEADROOM.pattern(), cb=watch)
    for service in ALL_SERVICES:
        await op.nc.subscribe(f"_INBOX_{service}.victim.*", cb=watch)
    await op.nc.flush()
    return world


async def attack_once(world: BusWorld, channel: Any, cred: str, target: str, body: str = "garbage") -> tuple[bool, bool, str]:
    """`cred` sends a request on `channel` whose reply subject is `target`; returns (blocked, the responder refused it, evidence)."""
    from rose.shared.codec import encode

    world.attacks += 1
    tag = f"{'s' if world.secured else 'u'}{world.attacks}"
    _, reply = reply_target(channel, target, tag)
    responder, attacker, op = world.responders[channel.name], world.attackers[cred], world.operator
    data = b"\x00garbage{" if body == "garbage" else encode(valid_request(channel.name), channel.encoding)
    events_before = (await op.js.stream_info("ROSE_EVENTS")).state.messages
    refused_before = responder.replies_refused
    await attacker.nc.publish(channel.subject(**request_tokens(channel)), data, reply=reply)
    await attacker.nc.flush()
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while responder.replies_refused == refused_before and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(ATTACK_SETTLE_S)
    blocked, evidence = await observe(world, tag, events_before)
    refused = responder.replies_refused > refused_before
    who = "the responder refused the reply subject (dead-lettered, counted)" if refused else "the request never reached the responder"
    return blocked, refused, f"{who}; {evidence}"


async def srv_attack(world: BusWorld, cred: str, verb: str) -> tuple[bool, str]:
    """`$SRV.<verb>` (answered by every service) with its reply into `$JS.API.STREAM.DELETE.KV_rose_leases`."""
    world.attacks += 1
    tag = f"{'s' if world.secured else 'u'}{world.attacks}"
    events_before = (await world.operator.js.stream_info("ROSE_EVENTS")).state.messages
    before = sum(b.replies_refused for b in world.responders.values())
    await world.attackers[cred].nc.publish(f"$SRV.{verb}", b"", reply="$JS.API.STREAM.DELETE.KV_rose_leases")
    await world.attackers[cred].nc.flush()
    await asyncio.sleep(ATTACK_SETTLE_S + 0.5)
    refused = sum(b.replies_refused for b in world.responders.values()) - before
    blocked, evidence = await observe(world, tag, events_before)
    return blocked, f"responders that refused it: {refused} (0: the server refused the publish itself); {evidence}"


async def bus_attacks(rows: Rows, world: BusWorld, quick: bool) -> None:
    """Each request channel x each requester credential x each reply target x (garbage, valid) payload;
    quick: the first requester, three targets, garbage only. Without permissions, inboxes are fair replies: not tried."""
    layer = "" if world.secured else " [server without permissions: the bus's check alone]"
    targets = list(REPLY_TARGETS) if world.secured else [t for t in REPLY_TARGETS if t != "outsider-inbox"]
    if quick:
        targets = ["js-delete", "kv-forged-key", "outsider-inbox"] if world.secured else ["kv-forged-key"]
    for channel in request_channels():
        for cred in channel.publishers[:1] if quick else channel.publishers:
            for target in targets:
                bodies = ("garbage",) if quick or valid_request(channel.name) is None else ("garbage", "valid")
                for body in bodies:
                    blocked, _refused, evidence = await attack_once(world, channel, cred, target, body)
                    what, _ = reply_target(channel, target, "x")
                    rows.add(
                        f"{channel.name} {body} request, reply into {what}{layer}",
                        "bus",
                        cred if world.secured else f"{cred} (anonymous)",
                        blocked,
                        evidence,
                    )
    for verb in ("PING",) if quick else ("PING", "INFO", "STATS"):
        blocked, evidence = await srv_attack(world, "rollout_worker", verb)
        rows.add(
            f"$SRV.{verb} with reply into $JS.API stream delete{layer}",
            "bus",
            "rollout_worker" if world.secured else "rollout_worker (anonymous)",
            blocked,
            evidence,
        )


async def bus_part(rows: Rows, tmp: Path, quick: bool) -> None:
    """Every bus attack on a server with the per-service permissions, then the quick set on one without."""
    from rose.shared.nats_server import NatsServer
    from rose.shared.security import init_credentials

    creds = init_credentials(tmp / "creds", instances={"executor": ["ex-bench"]})
    with NatsServer(tmp / "nats", extra_config=creds.server_config()) as server:
        world = await bus_world(server.url, creds, secured=True)
        try:
            await bus_attacks(rows, world, quick)
        finally:
            await world.close()
    with NatsServer(tmp / "nats-open") as server:
        world = await bus_world(server.url, creds, secured=False)
        try:
            await bus_attacks(rows, world, quick=True)
        finally:
            await world.close()
