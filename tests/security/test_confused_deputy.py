"""The confused deputy on the bus (issue 22): a requester picks a request's reply subject, and a
responder that answers wherever it is told publishes, with its own rights, into `$JS.API.>`
(deleting the leases bucket, purging ROSE_EVENTS), `$KV.>` (a forged lease), another service's
subjects or inboxes. Each case sends the request with the requester's real credentials to a real
responder (the bus's `serve`) on a real nats-server with the generated permissions, and is judged
by what the operator sees afterwards (rose.bench.security_bus.observe): the bucket is still there
with no forged key, the stream was not purged and holds nothing on the forged subject, nothing
reached the watched subject or inbox. The controls show the same requests do damage where
nothing checks the reply subject.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from rose.bench.security_bus import REPLY_TARGETS, BusWorld, attack_once, bus_world, observe, reply_target, srv_attack, valid_request
from rose.contracts.registry import CHANNELS, GENERATE, ROUTE_TURN, Kind
from rose.shared.nats_server import NatsServer
from rose.shared.security import INTEGRATIONS, USERS, inbox_prefix, permissions, render_authorization
from rose.testing.polling import until

REQUEST_CHANNELS = [c for c in CHANNELS if c.kind is Kind.REQUEST]
CASES = [(c.name, cred, target) for c in REQUEST_CHANNELS for cred in c.publishers for target in REPLY_TARGETS]


@pytest.fixture(scope="module")
def deputy_server(tmp_path_factory, credentials):
    """A server of its own (the session's permissions): the attacks seed and watch storage other tests read."""
    with NatsServer(tmp_path_factory.mktemp("nats-deputy"), extra_config=credentials.server_config()) as server:
        yield server


@pytest.fixture(scope="module")
async def world(deputy_server, credentials):
    w = await bus_world(deputy_server.url, credentials, secured=True, executor_user="executor")
    yield w
    await w.close()


@pytest.mark.parametrize(("channel_name", "cred", "target"), CASES, ids=["-".join(c) for c in CASES])
async def test_reply_outside_the_requesters_inboxes_is_never_answered(world: BusWorld, channel_name: str, cred: str, target: str):
    channel = next(c for c in REQUEST_CHANNELS if c.name == channel_name)
    body = ("garbage", "valid")[REPLY_TARGETS.index(target) % 2] if valid_request(channel_name) is not None else "garbage"
    blocked, refused, evidence = await attack_once(world, channel, cred, target, body=body)
    assert blocked, evidence
    assert refused, evidence  # the responder saw the request and refused it (counted, dead-lettered): the server was not the only wall


async def test_refusal_is_dead_lettered_with_the_reason(world: BusWorld):
    blocked, refused, evidence = await attack_once(world, ROUTE_TURN, "rollout_worker", "js-delete")
    assert blocked and refused, evidence
    last = await world.operator.js.get_last_msg("ROSE_DLQ", "rose.dlq.scheduler.*")
    assert b"unauthorised" in last.data and b"$JS.API.STREAM.DELETE.KV_rose_leases" in last.data and b"not answered" in last.data


async def test_srv_ping_with_a_forged_reply(world: BusWorld):
    blocked, evidence = await srv_attack(world, "rollout_worker", "PING")
    assert blocked, evidence


async def test_legitimate_requests_still_get_their_answers(world: BusWorld):
    """The check does not get in the way: a requester's own inbox (the bus's default) is answered."""
    from rose.bench.security_bus import request_tokens, valid_request

    reply = await world.attackers["rollout_worker"].request(GENERATE, valid_request(GENERATE.name), **request_tokens(GENERATE))
    assert reply.request_id == "atk"


async def test_the_server_refuses_a_responder_that_answers_anywhere(deputy_server, credentials, world: BusWorld):
    """A responder with a bug (raw nats-py, no check, answering every request) still cannot reach `$JS.API`:
    its user has no `allow_responses`, only its requesters' inboxes."""
    raw = await nats.connect(deputy_server.url, nkeys_seed=str(credentials.seed_file("executor")), inbox_prefix=inbox_prefix("executor"))
    try:

        async def blind(msg):
            await msg.respond(b"answer")

        subject = GENERATE.subject(executor_id="ex-raw")
        await raw.subscribe(subject, cb=blind)
        await raw.flush()
        world.attacks += 1
        tag = f"raw{world.attacks}"
        events_before = (await world.operator.js.stream_info("ROSE_EVENTS")).state.messages
        for target in REPLY_TARGETS:
            _, reply = reply_target(GENERATE, target, tag)
            await world.attackers["rollout_worker"].nc.publish(subject, b"x", reply=reply)
        await world.attackers["rollout_worker"].nc.flush()
        await asyncio.sleep(0.5)
        blocked, evidence = await observe(world, tag, events_before)
        assert blocked, evidence
        answer = await world.attackers["rollout_worker"].nc.request(subject, b"x", timeout=5)  # its requesters' inboxes still work
        assert answer.data == b"answer"
    finally:
        await raw.close()


async def test_without_permissions_the_bus_check_alone_blocks_and_the_attack_is_real(tmp_path, credentials):
    """On a server with no permissions at all: a raw responder does write the forged lease (the attack is real);
    the bus's responder does not (its reply check alone)."""
    with NatsServer(tmp_path / "open") as server:
        w = await bus_world(server.url, credentials, secured=False)
        try:
            for target in ("js-delete", "kv-forged-key", "service-subject", "service-stream-subject"):
                blocked, refused, evidence = await attack_once(w, ROUTE_TURN, "rollout_worker", target)
                assert blocked and refused, evidence
            raw = await nats.connect(server.url)
            try:

                async def blind(msg):
                    await msg.respond(b"garbage")

                await raw.subscribe("rose.control.raw", cb=blind)
                await raw.flush()
                attacker = w.attackers["rollout_worker"].nc

                async def forged() -> str | None:
                    """Send the request again, then look: once one attempt lands, the attack is shown real. (Once in a
                    full suite run a single attempt never landed within 10 s; the cause was not found.)"""
                    await attacker.publish("rose.control.raw", b"x", reply="$KV.rose_leases.forged-control")
                    await attacker.flush()
                    blocked, evidence = await observe(w, "control", 0)
                    return None if blocked else evidence

                # until the forged key lands (a loaded machine takes longer than a fixed sleep)
                evidence = await until(forged, timeout=10.0, step=0.25, what="the forged key (the attack without the check)")
                assert "forged keys: 0" not in evidence, evidence  # what the check prevents
            finally:
                await raw.close()
        finally:
            await w.close()


def test_server_permissions_answer_only_requesters_inboxes():
    """No user has allow_responses; a responder may publish under its requesters' (and the operator's) inboxes only."""
    assert "allow_responses" not in render_authorization({u: "UKEY" for u in USERS})
    for user in USERS:
        if user in ("cli",):
            continue
        inboxes = {s for s in permissions(user).publish if s.startswith("_INBOX")}
        expected = set() if user == INTEGRATIONS else {"_INBOX_cli.>"}
        for c in REQUEST_CHANNELS:
            if user in c.consumers:
                expected |= {f"_INBOX_{p}.>" for p in c.publishers}
        assert inboxes == expected, user
    assert "_INBOX_trainer.>" not in permissions("executor").publish and "_INBOX_executor.>" not in permissions("scheduler").publish
