"""Event integrations: docs/events.md is generated from the AsyncAPI document, the example
subscriber decodes real events, and `rose events forward` delivers to real HTTP servers
(retries, dead letters, durable across restarts) from a real nats-server."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiohttp import web

from rose.cli.events_forward import Forwarder, ForwardSettings, plan_consumers, public_event_subjects
from rose.cli.main import main as rose_main
from rose.contracts.export import events_markdown, public_event_channels
from rose.contracts.lease import Lease, LeaseEvent
from rose.contracts.registry import LEASE_EVENT, TRAJECTORY
from rose.contracts.rollout import Trajectory
from rose.shared.nats_server import free_port
from rose.testing.polling import until

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 30.0


def lease_event(executor_id: str, kind: str = "granted", epoch: int = 1) -> LeaseEvent:
    now = time.time()
    lease = Lease(
        lease_id=f"{executor_id}-e{epoch}",
        executor_id=executor_id,
        epoch=epoch,
        state="active",
        granted_at=now,
        expires_at=now + 10,
        kv_bytes=1 << 20,
        compute_share=0.5,
        max_rollout_batch=4,
    )
    return LeaseEvent(kind=kind, lease=lease, at=now, reason="test")  # type: ignore[arg-type]


async def publish_lease(bus, executor_id: str, kind: str = "granted", epoch: int = 1) -> None:
    await bus.publish(LEASE_EVENT, lease_event(executor_id, kind, epoch), kind=kind, executor_id=executor_id)


# ---- docs --------------------------------------------------------------------------------


def test_events_doc_is_generated_and_up_to_date():
    path = REPO / "docs" / "events.md"
    assert path.read_text() == events_markdown(), "docs/events.md is out of date: run `rose contracts docs docs/events.md`"
    names = {ch["title"] for _, ch in public_event_channels()}
    # lease granted/revoked, SLO alert, weight version published/applied/failed, trajectory completed/failed, service up/down
    assert {
        "lease.event",
        "slo.alert",
        "weights.manifest",
        "weights.applied",
        "weights.failed",
        "weights.publish_failed",
        "rollout.trajectory",
        "service.lifecycle",
    } <= names
    text = path.read_text()
    for needle in (
        "`granted`",
        "`revoked`",
        "`completed`",
        "`failed`",
        "`up`",
        "`down`",
        "ROSE_EVENTS",
        "ROSE_TRAJECTORIES",
        "ROSE_WEIGHT_MANIFESTS",
    ):
        assert needle in text, needle


# ---- the example subscriber ---------------------------------------------------------------


async def _line(stream: asyncio.StreamReader, needle: str, timeout: float = TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(stream.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise EOFError(f"stream ended before {needle!r}")
        if needle in line.decode():
            return line.decode()


async def test_example_subscriber_decodes_public_events(bus, nats_server):
    ex = f"sub-{uuid.uuid4().hex[:6]}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "examples" / "subscribe_events.py"),
        "--nats-url",
        nats_server.url,
        "--json",
        "--count",
        "2",
        "--subjects",
        LEASE_EVENT.pattern(executor_id=ex),
        TRAJECTORY.pattern(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _line(proc.stderr, "listening on")
        await publish_lease(bus, ex)
        trajectory = Trajectory(task_id=f"{ex}-t", trajectory_id=f"{ex}-traj", env="conversation", status="completed", reward=1.0)
        await bus.publish(TRAJECTORY, trajectory, status="completed")
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    events = [json.loads(line) for line in out.decode().splitlines()]
    by_type = {e["type"]: e for e in events}
    assert by_type["LeaseEvent"]["subject"] == f"rose.events.lease.granted.{ex}"
    assert by_type["LeaseEvent"]["event"]["lease"]["executor_id"] == ex
    assert by_type["Trajectory"]["event"]["trajectory_id"] == f"{ex}-traj"


# ---- the webhook bridge: the CLI against the example receiver, across a restart -------------


async def _start_forwarder(args: list[str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rose.cli.main",
        "events",
        "forward",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await _line(proc.stderr, "forwarding")
    return proc


async def _stop(proc: asyncio.subprocess.Process) -> int:
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), TIMEOUT_S)
    return proc.returncode


async def test_forward_cli_posts_events_and_resumes_after_restart(bus, nats_server, tmp_path):
    ex = f"fw-{uuid.uuid4().hex[:6]}"
    port = free_port()
    receiver = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "examples" / "webhook_receiver.py"),
        "--port",
        str(port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    args = [
        "--to",
        f"http://127.0.0.1:{port}/rose",
        "--subjects",
        LEASE_EVENT.pattern(executor_id=ex),
        TRAJECTORY.pattern(status="failed"),
        "--durable",
        f"test_{ex}",
        "--dead-letter",
        str(tmp_path / "dead.jsonl"),
        "--nats-url",
        nats_server.url,
    ]
    forwarder = None
    try:
        await _line(receiver.stderr, "receiving on")
        forwarder = await _start_forwarder(args)
        await publish_lease(bus, ex, "granted", 1)
        await bus.publish(
            TRAJECTORY, Trajectory(task_id=f"{ex}-t", trajectory_id=f"{ex}-traj", env="code", status="failed", reason="boom"), status="failed"
        )
        got = {}
        while len(got) < 2:  # two streams, two consumers: either may arrive first
            event = json.loads(await _line(receiver.stdout, ex))
            got[event["type"]] = event
        first, second = got["rose.LeaseEvent"], got["rose.Trajectory"]
        assert (
            first["subject"] == f"rose.events.lease.granted.{ex}" and first["data"]["lease"]["epoch"] == 1 and first["id"].startswith("ROSE_EVENTS-")
        )
        assert second["subject"] == "rose.rollout.trajectories.failed" and second["data"]["reason"] == "boom"
        assert await _stop(forwarder) == 0
        # published while the bridge is down: the durable consumer hands it over after the restart
        await publish_lease(bus, ex, "revoked", 1)
        forwarder = await _start_forwarder(args)
        third = json.loads(await _line(receiver.stdout, f"rose.events.lease.revoked.{ex}"))
        assert third["data"]["kind"] == "revoked"
        assert not (tmp_path / "dead.jsonl").exists()
    finally:
        for proc in (forwarder, receiver):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
    await bus.js.delete_consumer("ROSE_EVENTS", f"test_{ex}")
    await bus.js.delete_consumer("ROSE_TRAJECTORIES", f"test_{ex}")


# ---- retries and dead letters, against programmable real HTTP servers ---------------------


class Hook:
    """A real aiohttp server whose answer to each POST comes from `plan` (status codes), 200 when empty."""

    def __init__(self) -> None:
        self.plan: list[int] = []
        self.received: list[tuple[int, dict, dict[str, str]]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Hook:
        async def receive(request: web.Request) -> web.Response:
            status = self.plan.pop(0) if self.plan else 200
            self.received.append((status, await request.json(), dict(request.headers)))
            return web.Response(status=status, text="no" if status >= 300 else "ok")

        app = web.Application()
        app.router.add_post("/hook", receive)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/hook"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def hook():
    h = await Hook().start()
    yield h
    await h.stop()


async def _run_forwarder(settings: ForwardSettings, bus_config) -> tuple[Forwarder, asyncio.Task]:
    forwarder = Forwarder(settings, bus_config)
    task = asyncio.create_task(forwarder.run())
    await asyncio.wait_for(forwarder.ready.wait(), TIMEOUT_S)
    return forwarder, task


async def test_server_error_then_success_is_retried(bus, bus_config, hook, tmp_path):
    ex = f"rt-{uuid.uuid4().hex[:6]}"
    hook.plan = [500]
    settings = ForwardSettings(
        url=hook.url, subjects=[LEASE_EVENT.pattern(executor_id=ex)], durable=f"test_{ex}", dead_letter=tmp_path / "dead.jsonl", backoff_s=0.05
    )
    forwarder, task = await _run_forwarder(settings, bus_config)
    try:
        await publish_lease(bus, ex)
        await until(lambda: forwarder.forwarded == 1)
    finally:
        forwarder.stop()
        await task
    assert [status for status, _, _ in hook.received] == [500, 200]
    body, headers = hook.received[1][1], hook.received[1][2]
    assert body == hook.received[0][1]  # the same event, same id, on the retry
    assert body["subject"] == f"rose.events.lease.granted.{ex}" and headers["X-Rose-Subject"] == body["subject"]
    assert body["specversion"] == "1.0" and body["data"]["lease"]["executor_id"] == ex and headers["Content-Type"] == "application/cloudevents+json"
    assert not settings.dead_letter.exists()
    await bus.js.delete_consumer("ROSE_EVENTS", settings.durable)


async def test_refused_events_go_to_the_dead_letter_file_and_the_rest_flows(bus, bus_config, hook, tmp_path):
    ex = f"dl-{uuid.uuid4().hex[:6]}"
    hook.plan = [503, 503, 503, 422]  # epoch 1: fails 3 times; epoch 2: refused at once; epoch 3: accepted
    settings = ForwardSettings(
        url=hook.url,
        subjects=[LEASE_EVENT.pattern(executor_id=ex)],
        durable=f"test_{ex}",
        dead_letter=tmp_path / "dl" / "dead.jsonl",
        max_attempts=3,
        backoff_s=0.02,
    )
    forwarder, task = await _run_forwarder(settings, bus_config)
    try:
        for epoch in (1, 2, 3):
            await publish_lease(bus, ex, epoch=epoch)
        await until(lambda: forwarder.forwarded == 1 and forwarder.dead_lettered == 2)
    finally:
        forwarder.stop()
        await task
    assert [status for status, _, _ in hook.received] == [503, 503, 503, 422, 200]
    assert hook.received[-1][1]["data"]["lease"]["epoch"] == 3  # in order, nothing blocked behind the failures
    letters = [json.loads(line) for line in settings.dead_letter.read_text().splitlines()]
    assert [(d["attempts"], d["status"]) for d in letters] == [(3, 503), (1, 422)]
    assert [d["event"]["data"]["lease"]["epoch"] for d in letters] == [1, 2]
    assert all(d["subject"] == f"rose.events.lease.granted.{ex}" and d["url"] == hook.url and d["reason"] for d in letters)
    await bus.js.delete_consumer("ROSE_EVENTS", settings.durable)


async def test_unreachable_url_is_dead_lettered_after_retries(bus, bus_config, tmp_path):
    ex = f"nx-{uuid.uuid4().hex[:6]}"
    settings = ForwardSettings(
        url=f"http://127.0.0.1:{free_port()}/gone",
        subjects=[LEASE_EVENT.pattern(executor_id=ex)],
        durable=f"test_{ex}",
        dead_letter=tmp_path / "dead.jsonl",
        max_attempts=2,
        backoff_s=0.02,
        timeout_s=2.0,
    )
    forwarder, task = await _run_forwarder(settings, bus_config)
    try:
        await publish_lease(bus, ex)
        await until(lambda: forwarder.dead_lettered == 1)
    finally:
        forwarder.stop()
        await task
    letter = json.loads(settings.dead_letter.read_text())
    assert letter["attempts"] == 2 and letter["status"] is None and "gave up after 2 attempts" in letter["reason"]
    await bus.js.delete_consumer("ROSE_EVENTS", settings.durable)


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--to", "ftp://example.org/x"], "not an http(s) URL"),
        (["--to", "http://x/h", "--subjects", "rose.>"], "not inside one ROSE stream"),
        (["--to", "http://x/h", "--subjects", "rose.rollout.tasks"], "work queue"),
        (["--to", "http://x/h", "--subjects", "rose.events.>.x"], "'>' only the last"),
        (["--to", "http://x/h", "--max-attempts", "0"], "--max-attempts"),
        (["--to", "http://x/h", "--header", "no-colon"], "Name: value"),
        (["--to", "http://x/h", "--durable", "a.b"], "--durable"),
    ],
)
def test_bad_forward_settings_are_refused_with_a_reason(args, needle, capsys):
    assert rose_main(["events", "forward", *args]) == 2
    assert needle in capsys.readouterr().err


def test_default_subjects_are_the_public_events_and_each_lies_in_one_stream():
    plan = plan_consumers(public_event_subjects())
    assert set(plan) == {"ROSE_EVENTS", "ROSE_TRAJECTORIES", "ROSE_WEIGHT_MANIFESTS"}
    # overlapping filters collapse into the widest (a consumer's filters may not overlap)
    assert plan_consumers(["rose.events.lease.*.*", "rose.events.>", "rose.events.slo.*"]) == {"ROSE_EVENTS": ["rose.events.>"]}
