"""`rose status`'s fleet view: one line per service within 80 columns, whatever the fleet (a new user's
`rose up --emulate 8xH100:7B` had printed 91 lines for 13 services, every URL cut)."""

from __future__ import annotations

import time

from rose.cli.status import VIEW_WIDTH, fleet_view, service_details
from rose.contracts.service import Heartbeat


def _beat(service: str, instance: str, **kw) -> Heartbeat:
    now = time.time()
    return Heartbeat(service=service, instance=instance, version="0.1.0", host="h", pid=1, started_at=now - 60, sent_at=now, interval_s=1.0, **kw)


def _fleet() -> list[Heartbeat]:
    long_url = "http://127.0.0.1:43567/a/very/long/path/that/would/not/fit/in/eighty/columns/at/all"
    executor_load = {
        "serving_queue": 3.0,
        "rollout_queue": 12.0,
        "serving_tokens_per_s": 1234.5,
        "rollout_tokens_per_s": 98765.4,
        "policy_version": 17.0,
        "lease_held": 1.0,
        "lease_parked": 0.0,
    }
    beats = [
        _beat("executor", f"emu-serving-{i}-an-instance-name-this-long", load=executor_load, labels={"role": "serving", "mode": "co_batched"})
        for i in range(8)
    ]
    beats.append(_beat("executor", "emu-dedicated-0", load={**executor_load, "lease_held": 0.0, "lease_parked": 1.0}, labels={"role": "dedicated"}))
    beats += [
        _beat("slo_monitor", "slo-1", load={"ttft_p99_ms": 123.456, "tpot_p99_ms": 7.5, "executors": 9.0}),
        _beat("scheduler", "sched-1", load={"granted": 40.0, "routed": 12000.0, "revoked": 3.0}),
        _beat("weight_publisher", "pub-1", load={"published": 17.0, "queued": 0.0}),
        _beat("rollout_worker", "worker-1", load={"episodes": 640.0, "failed": 0.0, "resumed_turns": 4.0}),
    ]
    return [
        b if i % 3 else Heartbeat(**{**{f: getattr(b, f) for f in b.__struct_fields__}, "endpoints": {"http": long_url, "openai": long_url + "/v1"}})
        for i, b in enumerate(beats)
    ]


def test_one_line_per_service_within_eighty_columns():
    beats = _fleet()
    lines = fleet_view(beats, time.time())
    assert len(lines) == 1 + len(beats)  # a header and one line each, however many endpoints
    assert all(len(line) <= VIEW_WIDTH for line in lines), max(lines, key=len)
    executor = lines[1]
    assert executor.startswith("executor") and " serving " in executor and " lent " in executor and executor.endswith(" 17")
    assert "1234" in executor and "98765" in executor and " 15 " in executor  # serving and rollout tokens/s; queue 3 + 12
    dedicated = next(line for line in lines if "emu-dedicated-0" in line)
    assert "parked" in dedicated and "dedicated" in dedicated
    assert "ttft p99 ms 123" in next(line for line in lines if line.startswith("slo "))
    assert next(line for line in lines if line.startswith("weights ")).endswith("published 17, queued 0")
    assert "step" not in lines[0] and all("http://" not in line for line in lines)


def test_endpoints_and_one_service_in_full_are_behind_a_flag_and_a_name():
    beats = _fleet()
    with_endpoints = fleet_view(beats, time.time(), endpoints=True)
    assert sum("http://127.0.0.1:43567/a/very/long/path" in line for line in with_endpoints) == 2 * sum(bool(b.endpoints) for b in beats)
    details = service_details([beats[0]], time.time())
    assert details[0].startswith("executor emu-serving-0-an-instance-name-this-long: ready")
    assert any(line == "  load rollout_tokens_per_s: 98765.4" for line in details) and any(line.startswith("  endpoint http: ") for line in details)
