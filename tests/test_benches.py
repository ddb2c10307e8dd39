"""The benchmark commands run end to end at a tiny size and write every JSON field their issue names.

No figure is asserted here (speed belongs to the benchmarks themselves, on a quiet machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _bench(*args: str, out: Path, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, "-m", "rose.cli.main", "bench", *args, "--json", str(out)], capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_bus_fields(tmp_path):
    r = _bench("bus", "--requests", "200", "--rounds", "1", out=tmp_path / "bus.json")
    for name in ("raw_nats_py", "rose_helpers", "faststream"):
        assert r["request_reply"][name]["p50_ms"] > 0 and r["request_reply"][name]["p99_ms"] > 0
    assert r["publish"]["raw_msgs_per_s"] > 0 and r["publish"]["helpers_msgs_per_s"] > 0
    assert r["helper_overhead_p50"] > 0 and isinstance(r["meets_target"], bool)


def test_bench_weights_fields(tmp_path):
    r = _bench("weights", "--params", "3000000", "--steps", "2", out=tmp_path / "weights.json")
    for field in ("params", "full_bytes", "wire_bytes", "wire_ratio", "changed_fraction", "publish_s", "fetch_apply_s", "full_snapshot_speedup", "apply_pause_ms", "encode_mb_s", "decode_mb_s"):
        assert field in r, field
    assert r["bit_exact"] is True  # exactness is a correctness property, not a speed
    assert set(r["objstore_baseline"]) >= {"put_s", "get_s"}
    assert (tmp_path / "weights.png").exists()


def test_bench_coserve_fields(tmp_path, models_dir):
    r = _bench("coserve", "--duration", "3", "--models", str(models_dir), out=tmp_path / "coserve.json", timeout=600)
    assert set(r["policies"]) == {"serving_only", "naive_share", "static_partition", "rose"}
    for p in r["policies"].values():
        assert set(p) >= {"slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "serving_tokens_per_s", "rollout_tokens_per_s"}
    for field in ("dedicated_rollout_tokens_per_s", "harvest_ratio", "reclaim_latency_ms_p99", "executor_rss_mb"):
        assert field in r, field
    assert r["policies"]["serving_only"]["rollout_tokens_per_s"] == 0
    assert (tmp_path / "coserve.png").exists()
