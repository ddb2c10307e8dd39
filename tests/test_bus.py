"""The typed bus helpers against a real nats-server: request/reply, events, JetStream, KV, $SRV."""

from __future__ import annotations

import asyncio
import json
import uuid

import msgspec
import pytest

from rose.contracts import GenerateReply, GenerateRequest, Heartbeat, RolloutTask, SloAlert, Trajectory
from rose.contracts.lease import Lease
from rose.contracts.registry import GENERATE, HEARTBEAT, LEASE, ROLLOUT_TASK, SERVICE_REGISTRY, SLO_ALERT, TRAJECTORY
from rose.shared.bus import Bus, Delivery, RemoteError, RequestRefused
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.polling import retrying, within


def _request(i: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", trajectory_id="t1", turn_index=0, prompt_token_ids=[1, 2, 3])


async def _echo(msg: GenerateRequest, d: Delivery) -> GenerateReply:
    return GenerateReply(request_id=msg.request_id, executor_id=d.tokens["executor_id"], status="ok", token_ids=msg.prompt_token_ids)


async def test_request_reply_roundtrip(bus_config):
    async with Bus(bus_config, service="executor", instance="ex-a") as server, Bus(bus_config, service="client", instance="c") as client:
        await server.serve(GENERATE, _echo, executor_id="ex-a")
        reply = await client.request(GENERATE, _request(), executor_id="ex-a")
        assert isinstance(reply, GenerateReply)
        assert reply.executor_id == "ex-a" and reply.token_ids == [1, 2, 3]


async def test_handler_exception_is_a_500_and_a_dead_letter(bus_config, bus):
    async def broken(msg, d):
        raise RuntimeError("engine on fire")

    async with Bus(bus_config, service="executor", instance="ex-broken") as server:
        await server.serve(GENERATE, broken, executor_id="ex-broken")
        with pytest.raises(RemoteError) as err:
            await bus.request(GENERATE, _request(), executor_id="ex-broken")
        assert err.value.code == "500" and "engine on fire" in err.value.description
        assert server.dead_letters == 1


async def test_handler_refusal_is_a_4xx_without_dead_letter(bus_config, bus):
    async def refuse(msg, d):
        raise RequestRefused("version 3 is not newer than 5", code="409", reason="version_not_newer", data={"latest": 5})

    async def refuse_plainly(msg, d):
        raise RequestRefused("no")

    async with Bus(bus_config, service="executor", instance="ex-refuse") as server:
        await server.serve(GENERATE, refuse, executor_id="ex-refuse")
        await server.serve(GENERATE, refuse_plainly, executor_id="ex-refuse-plainly")
        with pytest.raises(RemoteError) as err:
            await bus.request(GENERATE, _request(), executor_id="ex-refuse")
        # the requester branches on the typed reason and its data, never on the English description
        assert err.value.code == "409" and err.value.reason == "version_not_newer" and err.value.data == {"latest": 5}
        with pytest.raises(RemoteError) as err:
            await bus.request(GENERATE, _request(), executor_id="ex-refuse-plainly")
        assert err.value.code == "400" and err.value.reason == "" and err.value.data == {} and err.value.description == "no"
        assert server.dead_letters == 0


async def test_services_api_ping_info_stats(bus_config, bus):
    async with Bus(bus_config, service="srv_probe", instance="ex-srv") as server:
        await server.serve(GENERATE, _echo, executor_id="ex-srv")
        await bus.request(GENERATE, _request(), executor_id="ex-srv")
        ping = json.loads((await bus.nc.request("$SRV.PING.rose_srv_probe", b"", timeout=2)).data)
        assert ping["name"] == "rose_srv_probe" and ping["metadata"]["instance"] == "ex-srv"
        info = json.loads((await bus.nc.request("$SRV.INFO.rose_srv_probe", b"", timeout=2)).data)
        assert info["endpoints"][0]["subject"] == GENERATE.subject(executor_id="ex-srv")
        stats = json.loads((await bus.nc.request("$SRV.STATS.rose_srv_probe", b"", timeout=2)).data)
        assert stats["endpoints"][0]["num_requests"] >= 1


async def test_event_subscribe_with_wildcard_tokens(bus):
    got: asyncio.Queue = asyncio.Queue()

    async def on_beat(msg: Heartbeat, d: Delivery) -> None:
        await got.put((msg, d.tokens))

    await bus.subscribe(HEARTBEAT, on_beat, service="executor")
    beat = Heartbeat(service="executor", instance="ex-9", version="0", host="h", pid=1, started_at=1.0, sent_at=2.0, interval_s=1.0)
    await bus.publish(HEARTBEAT, beat, service="executor", instance="ex-9")
    msg, tokens = await asyncio.wait_for(got.get(), 5)
    assert msg == beat and tokens == {"service": "executor", "instance": "ex-9"}


async def test_jetstream_consume_acks_and_retries(bus_config, bus, task_queue):
    attempts: dict[str, int] = {}
    done = asyncio.Event()

    async def flaky(task: RolloutTask, d: Delivery) -> None:
        attempts[task.task_id] = d.attempt
        if d.attempt < 2:
            raise RuntimeError("transient")
        done.set()

    async with Bus(bus_config, service="rollout_worker", instance="w1") as worker:
        await worker.consume(ROLLOUT_TASK, flaky, durable="test_flaky", ack_wait_s=5)
        await bus.publish(ROLLOUT_TASK, RolloutTask(task_id="task-1", env="arith", prompt="2+2"))
        await asyncio.wait_for(done.wait(), 15)
    await bus.js.delete_consumer("ROSE_TASKS", "test_flaky")  # a work queue allows one consumer per subject
    assert attempts["task-1"] == 2


async def test_a_long_handler_keeps_its_message_and_a_stopped_one_loses_it(bus_config, bus, task_queue):
    """A rollout episode runs as long as its turns take: with ``keep_alive`` its task is delivered once however much
    longer than ``ack_wait_s`` it runs (without, it was redelivered meanwhile and both copies ran to the end); a worker
    that stops mid-episode renews nothing, and the task goes to another worker."""
    deliveries: dict[str, list[str]] = {}
    finished = asyncio.Event()

    def worker_handler(name: str, hold_s: float):
        async def handle(task: RolloutTask, d: Delivery) -> None:
            deliveries.setdefault(task.task_id, []).append(name)
            await asyncio.sleep(hold_s)
            if task.task_id == "long-kept":
                finished.set()

        return handle

    for keep_alive, task_id in ((False, "long-unkept"), (True, "long-kept")):
        durable = f"keep-{keep_alive}".lower()
        async with Bus(bus_config, service="rollout_worker", instance="w1") as w1, Bus(bus_config, service="rollout_worker", instance="w2") as w2:
            for w, name in ((w1, "w1"), (w2, "w2")):
                await w.consume(ROLLOUT_TASK, worker_handler(name, 2.5), durable=durable, ack_wait_s=1.0, batch=1, keep_alive=keep_alive)
            await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=task_id, env="arith", prompt="2+2"))
            await asyncio.sleep(3.2)  # 2.5 s of work against a 1 s ack deadline
        await bus.js.delete_consumer("ROSE_TASKS", durable)  # a work queue allows one consumer per subject
    assert len(deliveries["long-unkept"]) >= 2  # redelivered while the first delivery still ran
    assert len(deliveries["long-kept"]) == 1 and finished.is_set()

    durable = "keep-stopped"
    async with Bus(bus_config, service="rollout_worker", instance="w3") as w3:
        stopping = Bus(bus_config, service="rollout_worker", instance="w4")
        await stopping.connect()
        await stopping.consume(ROLLOUT_TASK, worker_handler("w4", 3600.0), durable=durable, ack_wait_s=1.0, batch=1, keep_alive=True)
        await bus.publish(ROLLOUT_TASK, RolloutTask(task_id="stopped", env="arith", prompt="2+2"))
        while not deliveries.get("stopped"):
            await asyncio.sleep(0.05)
        await w3.consume(ROLLOUT_TASK, worker_handler("w3", 0.0), durable=durable, ack_wait_s=1.0, batch=1, keep_alive=True)
        await stopping.close()  # mid-episode: its renewals stop with it
        for _ in range(100):
            if len(deliveries["stopped"]) > 1:
                break
            await asyncio.sleep(0.1)
    await bus.js.delete_consumer("ROSE_TASKS", durable)
    assert deliveries["stopped"] == ["w4", "w3"]


async def test_consumers_that_have_fetched_close_without_waiting_out_the_drain(bus_config, bus):
    """nats.py's drain waits for a pull subscription's pending queue to join(), and a fetch that reads a
    reply left over from the previous fetch (the server's 408 arriving just after the client's own
    timeout) takes it with get_nowait and never marks it done: such a subscription never drains, and
    each service's stop waited out drain_timeout_s (10 s a trainer, on every run). The bus unsubscribes
    its pull subscriptions first. Which fetch leaves a reply behind is a race, so several consumers
    close at staggered times (before this fix about half of these 8 timed out, in each of five runs).
    The durable consumers outlive the connections: what is published next still reaches them."""
    config = msgspec.structs.replace(bus_config, drain_timeout_s=3.0)
    durables = [f"drain-{uuid.uuid4().hex[:8]}" for _ in range(8)]
    marker = f"after-close-{uuid.uuid4().hex[:8]}"
    seen: dict[str, list[str]] = {d: [] for d in durables}

    def recorder(durable: str):
        async def handle(t: Trajectory, d: Delivery) -> None:
            if t.task_id == marker:
                seen[durable].append(t.task_id)

        return handle

    async def consume_then_close(i: int, durable: str) -> int:
        worker = Bus(config, service="trainer", instance=f"t-{durable}")
        await worker.connect()
        await worker.consume(TRAJECTORY, recorder(durable), durable=durable, deliver_new=True, batch=64)
        await asyncio.sleep(2.0 + 0.25 * i)  # past two idle fetches (one per CONSUME_FETCH_TIMEOUT_S), then across the third
        await worker.close()
        return worker.drain_timeouts

    assert await asyncio.gather(*(consume_then_close(i, d) for i, d in enumerate(durables))) == [0] * len(durables)
    t = Trajectory(task_id=marker, trajectory_id=marker, env="arith", status="completed")
    await bus.publish(TRAJECTORY, t, msg_id=t.trajectory_id, status=t.status)
    async with Bus(bus_config, service="trainer", instance="t-drain-again") as again:
        for d in durables:
            await again.consume(TRAJECTORY, recorder(d), durable=d, deliver_new=True, batch=64)
        await within(lambda: all(seen[d] for d in durables), 10, step=0.1)
    for d in durables:
        await bus.js.delete_consumer("ROSE_TRAJECTORIES", d)
    assert all(seen[d] == [marker] for d in durables), seen


async def test_stream_event_is_persisted(bus):
    alert = SloAlert(executor_id="ex-1", at=1.0, severity="burst", reason="arrivals x3")
    await bus.publish(SLO_ALERT, alert, executor_id="ex-1")
    msg = await bus.js.get_last_msg("ROSE_EVENTS", SLO_ALERT.subject(executor_id="ex-1"))
    assert msg.data and b'"burst"' in msg.data


def _lease(epoch: int) -> Lease:
    """An active lease on ex-1 (its id names its epoch)."""
    return Lease(
        lease_id=f"l{epoch}",
        executor_id="ex-1",
        epoch=epoch,
        state="active",
        granted_at=1.0,
        expires_at=2.0,
        kv_bytes=10,
        compute_share=0.5,
        max_rollout_batch=4,
    )


async def test_kv_put_get_delete(bus):
    lease = _lease(3)
    await bus.kv_put(LEASE, lease, executor_id="ex-1")
    assert await bus.kv_get(LEASE, executor_id="ex-1") == lease
    await bus.kv_delete(LEASE, executor_id="ex-1")
    assert await bus.kv_get(LEASE, executor_id="ex-1") is None
    assert SERVICE_REGISTRY.kv is not None


async def test_every_service_runtime_answers_srv_ping(bus_config, bus):
    from rose.shared.config import RuntimeConfig
    from rose.shared.service import ServiceRuntime

    async with ServiceRuntime("slo_monitor", bus=bus_config, runtime=RuntimeConfig(instance="mon-ping")) as rt:
        rt.ready()
        ping = json.loads((await bus.nc.request("$SRV.PING.rose_slo_monitor", b"", timeout=2)).data)
        assert ping["metadata"]["instance"] == "mon-ping"


async def test_connect_to_an_unreachable_server_gives_up_at_its_deadline():
    """nats-py alone retries a first connect forever when reconnects are unlimited; ours says why and stops."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bus = Bus(
        BusConfig(url=f"nats://127.0.0.1:{port}", initial_connect_deadline_s=1.0, connect_timeout_s=0.5), service="tests", instance="unreachable"
    )
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await asyncio.wait_for(bus.connect(), timeout=20.0)


# ---- the nats-py private method shared/bus_connection.py `_survive_cancelled_flushes` replaces ----
# nats-py is bounded `>=2.16,<3` in pyproject.toml (constraints.txt pins only torch); these tests fail
# when a nats-py release changes what the patch relies on, or fixes the bug it works around.


async def _cancel_flushes(nc, times: int = 3) -> None:
    """Cancel `flush()` waiters whose PINGs are out, and let their PONGs come back to the cancelled futures."""
    for _ in range(times):
        waiting = asyncio.ensure_future(nc.flush(timeout=5))
        await asyncio.sleep(0)  # the PING is out
        waiting.cancel()
        await asyncio.sleep(0.1)  # its PONG comes back to a cancelled waiter


async def test_a_cancelled_flush_does_not_stop_the_connection(bus):
    """nats-py alone stops reading when the PONG of a cancelled flush arrives; every later reply would time out."""
    await _cancel_flushes(bus.nc)
    await bus.nc.flush(timeout=2)
    assert await bus.kv_get(SERVICE_REGISTRY, service="nobody", instance="x") is None


def test_the_nats_py_method_the_bus_replaces_is_still_the_one_it_assumes():
    """`_survive_cancelled_flushes` sets `nc._process_pong` on the instance: that only works while the
    parser calls `self.nc._process_pong()` for each PONG, the original takes no argument, and the
    client keeps the PING futures in `_pongs` and counts `_pongs_received` / `_pings_outstanding`."""
    import inspect
    import textwrap

    from nats.aio.client import Client as NatsClient
    from nats.protocol import parser

    original = NatsClient._process_pong
    assert inspect.iscoroutinefunction(original)
    assert list(inspect.signature(original).parameters) == ["self"]
    body = textwrap.dedent(inspect.getsource(original))
    assert "self._pongs.pop(0)" in body and "future.set_result(True)" in body  # the unguarded resolve the patch guards
    assert "self._pongs_received += 1" in body and "self._pings_outstanding = 0" in body  # what the patch keeps doing
    assert "await self.nc._process_pong()" in inspect.getsource(parser.Parser.parse)  # looked up on the instance: the patch applies
    fresh = NatsClient()
    assert fresh._pongs == [] and fresh._pongs_received == 0 and fresh._pings_outstanding == 0
    flush = inspect.getsource(NatsClient.flush)
    assert "await self._send_ping(future)" in flush and "asyncio.wait_for(future, timeout)" in flush  # the future a cancel leaves done


async def test_nats_py_alone_stops_reading_after_a_cancelled_flush(nats_server):
    """The bug the patch works around, on a client without it: the PONG of a cancelled flush raises
    InvalidStateError in the read loop, which ends, so a later request never gets its reply. When a
    nats-py release fixes this, this test fails: the patch in shared/bus_connection.py can then go."""
    import nats

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    responder = await nats.connect(nats_server.url)
    plain = await nats.connect(nats_server.url)
    try:
        await responder.subscribe("rose.test.pong-echo", cb=echo)
        await responder.flush()
        # the first reply proves the path works before the flushes; on a loaded box (load 15, two suites) the server
        # answered it "no responders" once in about twenty runs although the SUB's flush had returned: ask again then
        first = await retrying(lambda: plain.request("rose.test.pong-echo", b"before", timeout=2), nats.errors.NoRespondersError, 10)
        assert first.data == b"before"
        assert "_process_pong" not in vars(plain)  # not patched
        await _cancel_flushes(plain)
        assert plain._reading_task.done()  # the read loop is gone for good
        with pytest.raises(nats.errors.TimeoutError):
            await plain.request("rose.test.pong-echo", b"after", timeout=1)
    finally:
        await plain.close()
        await responder.close()


async def test_a_bus_request_gets_its_reply_after_cancelled_flushes(bus_config, bus):
    """The same cancelled flushes on a Bus's connection (patched): a later request over the real
    server still gets its reply. Fails if the patch stops applying (a renamed or moved method)."""
    async with Bus(bus_config, service="executor", instance="ex-after-flush") as server:
        await server.serve(GENERATE, _echo, executor_id="ex-after-flush")
        await _cancel_flushes(bus.nc)
        reply = await bus.request(GENERATE, _request(7), executor_id="ex-after-flush")
        assert reply.request_id == "r7" and reply.token_ids == [1, 2, 3]
    assert not bus.nc._reading_task.done()
    assert "_process_pong" in vars(bus.nc)  # set on the instance by `_survive_cancelled_flushes`


async def test_kv_watch_hears_a_change_made_after_a_server_restart(tmp_path):
    """A watch starts over from the current values when the bus reconnects. nats.py's ordered consumer alone
    notices its consumer is gone only after two missed idle heartbeats (10-20 s): an executor's lease watch was
    that stale after a NATS restart in `rose bench elastic`, and the executor refused every turn routed to it
    under a lease it had not heard of. Here the fallback comes ~20 s after the watch started (its first check finds
    the consumer active as created); the 9 s wait below ends before it, so only the re-watch passes."""
    seen: list[Lease | None] = []

    async def on_lease(_key: str, value: Lease | None) -> None:
        seen.append(value)

    with NatsServer(tmp_path / "nats") as server:
        config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, request_timeout_s=5.0)
        async with Bus(config, service="scheduler", instance="s-1") as writer, Bus(config, service="executor", instance="ex-1") as executor:
            await provision(writer.js)
            await writer.kv_put(LEASE, _lease(1), executor_id="ex-1")
            await executor.kv_watch(LEASE, on_lease, executor_id="ex-1")
            assert await within(lambda: _lease(1) in seen, timeout=5.0)
            server.restart()
            await retrying(lambda: writer.kv_put(LEASE, _lease(2), executor_id="ex-1"), timeout=10.0, what="a put after the restart")
            assert await within(lambda: _lease(2) in seen, timeout=9.0), f"the watch heard {seen} only"
            await writer.kv_delete(LEASE, executor_id="ex-1")
            assert await within(lambda: seen[-1] is None, timeout=5.0)  # and it goes on hearing changes
