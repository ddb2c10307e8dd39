"""`rose bench bus`: what the shared bus helpers cost over raw nats-py, on the same server, same run.

Contenders answer the same GenerateRequest with the same GenerateReply (msgspec JSON both ways):
raw nats-py (baseline), our `Bus.serve`/`Bus.request` (with tracing, dead-lettering and the
NATS services API), and FastStream's NATS broker (for the record: it is why the runtime sits
on nats-py). Rounds alternate between contenders so that machine noise hits all of them alike.

Auth is on, as in the embedded default: the server has the per-service permissions of
`rose security init`, and every contender connects with the same credentials on the same kind of
subject, so each pays the same permission checks: the answering side as the `executor` (on its own
`executor.generate` subject), the asking side as the `rollout_worker` (which calls executors),
JetStream publishes as the `slo_monitor` (the SLO alerts it publishes); only provisioning uses the
operator's (`cli`) credentials.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rose.contracts import GenerateReply, GenerateRequest, Heartbeat
from rose.contracts.registry import GENERATE, HEARTBEAT, SLO_ALERT
from rose.contracts.slo import SloAlert
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, Credentials, inbox_prefix, init_credentials
from rose.shared.tracing import setup_tracing

TARGET_P50_RATIO = 1.5
WARMUP = 200
PUBLISH_COUNT = 20_000
JS_PUBLISH_COUNT = 1_000
SERVER, CLIENT, JS_PUBLISHER = "executor", "rollout_worker", "slo_monitor"  # whose credentials each side connects with

REQUEST = GenerateRequest(request_id="bench", trajectory_id="traj", turn_index=1, prompt_token_ids=list(range(64)))


def _reply_for(msg: GenerateRequest) -> GenerateReply:
    return GenerateReply(request_id=msg.request_id, executor_id="bench", status="ok", token_ids=msg.prompt_token_ids[:16])


async def _latencies(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _summary(samples: list[list[float]]) -> dict[str, float]:
    p50 = [statistics.median(s) for s in samples]
    p99 = [sorted(s)[int(len(s) * 0.99)] for s in samples]
    return {"p50_ms": round(statistics.median(p50), 4), "p99_ms": round(statistics.median(p99), 4)}


async def refuses_anonymous(url: str) -> bool:
    """True when the server at `url` turns away a client that brings no credentials (auth is on)."""
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2.0, error_cb=_quiet)
    except nats.errors.Error as exc:
        if "authorization violation" in str(exc).lower():
            return True
        raise
    await nc.close()
    return False


async def _quiet(_exc: Exception) -> None:  # the refusal is the expected answer; nats-py would log it as an error
    return None


def _raw_options(creds: Credentials, service: str) -> dict[str, Any]:
    """What a raw nats-py client (or FastStream's broker, which takes the same kwargs) needs to connect as `service`."""
    return {"nkeys_seed": str(creds.seed_file(service)), "inbox_prefix": inbox_prefix(service)}


async def _publish_rate(publish, flush, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await publish()
    await flush()
    return n / (time.perf_counter() - t0)


@dataclass(frozen=True, kw_only=True)
class BusOptions:
    """What a `rose bench bus` run measures: ``requests`` request/replies per contender per round, ``rounds`` rounds
    alternating between the contenders (the median is reported)."""

    requests: int = 2000
    rounds: int = 3


async def run_bus_bench(options: BusOptions, out_json: str, console: Console | None = None) -> dict[str, Any]:
    """Every contender on one server with auth on; the result (also written to ``out_json``)."""
    console = console or Console()
    requests, rounds = options.requests, options.rounds
    setup_tracing("bench", "bench-1")  # the helpers pay for tracing exactly as services do
    with tempfile.TemporaryDirectory() as tmp:
        creds = init_credentials(Path(tmp) / "security")
        with NatsServer(Path(tmp) / "nats", extra_config=creds.server_config()) as server:
            auth = await refuses_anonymous(server.url)
            samples, rates = await _measure(server.url, creds, requests, rounds, console)

    raw_pub, helper_pub, raw_js, helper_js = rates
    summary = {name: _summary(s) for name, s in samples.items()}
    ratio = summary["rose_helpers"]["p50_ms"] / summary["raw_nats_py"]["p50_ms"]
    result: dict[str, Any] = {
        "request_reply": summary,
        "helper_overhead_p50": round(ratio, 3),
        "faststream_overhead_p50": round(summary["faststream"]["p50_ms"] / summary["raw_nats_py"]["p50_ms"], 3),
        "publish": {
            "raw_msgs_per_s": round(raw_pub),
            "helpers_msgs_per_s": round(helper_pub),
            "ratio": round(helper_pub / raw_pub, 3),
        },
        "jetstream_publish": {
            "raw_msgs_per_s": round(raw_js),
            "helpers_msgs_per_s": round(helper_js),
            "ratio": round(helper_js / raw_js, 3),
        },
        "requests_per_round": requests,
        "rounds": rounds,
        "target_p50_ratio": TARGET_P50_RATIO,
        "meets_target": ratio <= TARGET_P50_RATIO,
        "auth": auth,  # NATS auth on (an unauthenticated client was refused); every contender connected with credentials
    }
    _print(console, result)
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out_json}")
    return result


async def _measure(
    url: str, creds: Credentials, requests: int, rounds: int, console: Console
) -> tuple[dict[str, list[list[float]]], tuple[float, float, float, float]]:
    """Request/reply samples per contender, then (raw publish, helpers publish, raw JetStream publish, helpers JetStream publish) rates."""

    def config(service: str) -> BusConfig:
        return BusConfig(url=url, nkey_seed_file=str(creds.seed_file(service)))

    async with Bus(config(OPERATOR), service=OPERATOR, instance="bench-provision") as operator:
        await provision(operator.js)  # creating storage is the operator's right
    raw_server = await nats.connect(url, **_raw_options(creds, SERVER))
    raw_client = await nats.connect(url, **_raw_options(creds, CLIENT))
    raw_js = await nats.connect(url, **_raw_options(creds, JS_PUBLISHER))
    req_dec = msgspec.json.Decoder(GenerateRequest)
    rep_dec = msgspec.json.Decoder(GenerateReply)
    enc = msgspec.json.Encoder()
    raw_subject, fs_subject = GENERATE.subject(executor_id="raw"), GENERATE.subject(executor_id="faststream")

    async def raw_handler(msg):
        await msg.respond(enc.encode(_reply_for(req_dec.decode(msg.data))))

    await raw_server.subscribe(raw_subject, cb=raw_handler)
    await raw_server.flush()

    from fast_depends.msgspec import MsgSpecSerializer
    from faststream.nats import NatsBroker

    broker = NatsBroker(url, serializer=MsgSpecSerializer(), logger=None, **_raw_options(creds, SERVER))

    @broker.subscriber(fs_subject)
    async def fs_handler(msg: GenerateRequest) -> GenerateReply:
        return _reply_for(msg)

    await broker.start()
    try:
        async with (
            Bus(config(SERVER), service=SERVER, instance="bench-s") as bus_server,
            Bus(config(CLIENT), service=CLIENT, instance="bench-c") as bus_client,
            Bus(config(JS_PUBLISHER), service=JS_PUBLISHER, instance="bench-js") as bus_js,
        ):

            async def helper_handler(msg: GenerateRequest, _d) -> GenerateReply:
                return _reply_for(msg)

            await bus_server.serve(GENERATE, helper_handler, executor_id="bench")

            async def raw_call():
                rep_dec.decode((await raw_client.request(raw_subject, enc.encode(REQUEST), timeout=5)).data)

            async def helper_call():
                await bus_client.request(GENERATE, REQUEST, executor_id="bench")

            async def fs_call():
                rep_dec.decode((await raw_client.request(fs_subject, enc.encode(REQUEST), timeout=5)).data)

            contenders = {"raw_nats_py": raw_call, "rose_helpers": helper_call, "faststream": fs_call}
            samples: dict[str, list[list[float]]] = {k: [] for k in contenders}
            for call in contenders.values():
                await _latencies(call, WARMUP)
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("request/reply rounds", total=rounds * len(contenders))
                for _ in range(rounds):
                    for name, call in contenders.items():
                        samples[name].append(await _latencies(call, requests))
                        progress.advance(task)

            # A heartbeat under the client's own name (the only one its credentials may publish).
            beat = Heartbeat(service=CLIENT, instance="b", version="0", host="h", pid=1, started_at=0.0, sent_at=0.0, interval_s=1.0)
            beat_bytes = enc.encode(beat)
            subject = HEARTBEAT.subject(service=CLIENT, instance="b")
            raw_pub = await _publish_rate(lambda: raw_client.publish(subject, beat_bytes), raw_client.flush, PUBLISH_COUNT)
            helper_pub = await _publish_rate(
                lambda: bus_client.publish(HEARTBEAT, beat, service=CLIENT, instance="b"), bus_client.nc.flush, PUBLISH_COUNT
            )
            alert = SloAlert(executor_id="bench", at=0.0, severity="burst", reason="bench")
            alert_bytes, alert_subject = enc.encode(alert), SLO_ALERT.subject(executor_id="bench")
            js = raw_js.jetstream()
            raw_js_rate = await _publish_rate(lambda: js.publish(alert_subject, alert_bytes), raw_js.flush, JS_PUBLISH_COUNT)
            helper_js = await _publish_rate(lambda: bus_js.publish(SLO_ALERT, alert, executor_id="bench"), bus_js.nc.flush, JS_PUBLISH_COUNT)
    finally:
        await broker.stop()
        for nc in (raw_server, raw_client, raw_js):
            await nc.close()
    return samples, (raw_pub, helper_pub, raw_js_rate, helper_js)


def _print(console: Console, r: dict[str, Any]) -> None:
    table = Table(title="rose bench bus — request/reply (same server, same run)")
    for col in ("contender", "p50 ms", "p99 ms", "p50 vs raw"):
        table.add_column(col, justify="right")
    raw = r["request_reply"]["raw_nats_py"]["p50_ms"]
    for name, s in r["request_reply"].items():
        table.add_row(name, f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['p50_ms'] / raw:.2f}x")
    console.print(table)
    pub = Table(title="publish throughput (msgs/s)")
    for col in ("kind", "raw nats-py", "rose helpers", "helpers / raw"):
        pub.add_column(col, justify="right")
    for kind in ("publish", "jetstream_publish"):
        p = r[kind]
        pub.add_row(kind, f"{p['raw_msgs_per_s']:,}", f"{p['helpers_msgs_per_s']:,}", f"{p['ratio']:.2f}")
    console.print(pub)
    verdict = "meets" if r["meets_target"] else "MISSES"
    console.print(f"helper overhead at p50: {r['helper_overhead_p50']:.2f}x raw ({verdict} the ≤ {r['target_p50_ratio']}x target)")
