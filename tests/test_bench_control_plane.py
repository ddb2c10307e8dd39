"""`rose bench control-plane` on a small fleet: the real monitor and scheduler, stand-ins on real NATS.

Checks what the bench reports, not how fast: every snapshot sent was merged, routes were
answered, leases were granted and never twice, a burst on a leased stand-in was revoked.
"""

from __future__ import annotations

import json

from rose.bench.control_plane import ControlPlaneOptions, run_control_plane_bench


async def test_control_plane_bench_small_fleet(tmp_path):
    settings = ControlPlaneOptions(executors=(20,), duration_s=8.0, warmup_s=8.0, burst_share=0.25, burst_len_s=3.0, turns_per_s=2.0)
    out = await run_control_plane_bench(settings, tmp_path / "cp.json", plot=False)
    assert json.loads((tmp_path / "cp.json").read_text()) == out
    (level,) = out["levels"]
    assert level["executors"] == 20 and level["instances"] == 1
    assert level["snapshots_sent_per_s"] > 0 and level["snapshots_lost"] == 0
    assert level["leases_granted_seen"] > 0 and level["double_grants"] == 0
    assert level["route_rps"] > 0 and level["route_errors"] == 0 and level["route_ms_p99"] is not None
    assert level["bursts_with_lease"] > 0 and level["alert_to_revoke_samples"] > 0
    assert {"cp-monitor-0", "cp-scheduler-0", "bench_standins", "nats_0"} <= set(level["cpu_s_per_s"])
    assert level["nats_msgs_in_per_s"] > level["snapshots_sent_per_s"]
    assert set(level["targets"]) >= {"monitor_under_one_core", "route_p99_le_20ms", "no_snapshot_lost", "no_double_grant"}
