"""`rose bench faults --quick`: the demo's fleet as real processes under a subset of the faults.

Asserted: every JSON field the issue names, every injected fault listed with an outcome, and
the timeline PNG. How fast things recover (and whether every fault is survived on a loaded
2-core machine) is what the full run measures and reports; no timing is asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rose.bench.demo import Observed
from rose.bench.faults import QUICK, weight_versions_lost


@pytest.mark.slow
def test_quick_fault_run_reports_every_fault_and_field(tmp_path):
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, "-m", "rose.cli.main", "bench", "faults", "--quick", "--json", str(out), "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("faults_injected", "faults_survived", "trajectories_lost", "weight_versions_lost", "serving_requests_failed"):
        assert isinstance(r[key], int) and r[key] >= 0, key
    assert r["recovery_s_p99"] is None or r["recovery_s_p99"] >= 0.0
    assert r["faults_injected"] == len(QUICK) == len(r["faults"])
    assert [f["fault"] for f in r["faults"]] == list(QUICK)
    assert 0 <= r["faults_survived"] <= r["faults_injected"]
    assert r["faults_survived"] == sum(1 for f in r["faults"] if f["survived"])
    for f in r["faults"]:
        assert isinstance(f["survived"], bool) and f["outcome"] and f["target"], f
        assert f["recovery_s"] is None or f["recovery_s"] >= 0.0
    limit = next(f for f in r["faults"] if f["fault"] == "stream_byte_limit")
    assert limit["acked_before_limit"] > 0 and limit["read_back_intact"] and limit["error"], limit
    assert r["serving_requests"] > 0 and r["trajectories_published"] > 0
    assert (tmp_path / "faults.png").stat().st_size > 1000
    assert "rose bench faults" in proc.stdout
    # the exit status says whether the targets were met
    met = r["faults_survived"] == r["faults_injected"] and r["trajectories_lost"] == 0 and r["weight_versions_lost"] == 0
    assert proc.returncode == (0 if met else 1), proc.stdout[-3000:] + proc.stderr[-3000:]


class _M:
    pass


def test_a_version_counts_as_applied_when_a_catch_up_passed_through_it():
    obs = Observed()
    obs.manifests = {v: _M() for v in range(1, 8)}

    class F:
        applied = [(0.0, "a", 2, 0), (0.0, "b", 5, 2), (0.0, "a", 7, 0)]  # b caught up 3 -> 5

    assert weight_versions_lost(obs, F, corrupted={6}) == [1]
