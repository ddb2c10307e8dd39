"""`rose bench pool`: the serving pool as the planner sizes it, a pool too small and the unbounded baseline, on the
real engine with emulated device time.

Asserted is what the bench must be able to tell, never a speed: every pool of a load takes the same arrivals, the
derived pool is the one definition's (sim/sizing.py), and a pool too small for the traffic fills and misses the
SLO where the instance's whole KV does not miss more (one run on a loaded CI box may miss a request or two
anywhere; the small pool's misses are a queue that grows for the whole run).
"""

from __future__ import annotations

import json

import pytest

from rose.bench.pool import UNBOUNDED, PoolCheck, derived_pool, run_pool_bench

TINY = 0.1  # x the derived pool: at load 0.5 about three of the trace's requests at once, where ~16 are in flight


def test_a_pool_too_small_fills_and_misses_the_slo(models_dir, tmp_path, capsys):
    check = PoolCheck(serving_model="70B", policy_model="7B", loads=(0.5,), pool_scales=(TINY, 1.0), duration_s=8.0, drain_s=6.0)
    out = tmp_path / "pool.json"
    result = run_pool_bench(check, str(out), models_dir=str(models_dir))
    row = result["loads"][0]
    runs = row["runs"]
    assert set(runs) == {f"{TINY:g}x", "1x", UNBOUNDED}
    # one definition: the pool run as "1x" is serving_pool_tokens at the load's rate (to a block)
    assert row["derived_pool_tokens"] == pytest.approx(derived_pool(check, check.sized(), row["rate_rps"]))
    assert abs(runs["1x"]["pool_tokens"] - row["derived_pool_tokens"]) <= 256
    assert runs[UNBOUNDED]["pool_tokens"] == pytest.approx(result["settings"]["whole_pool_tokens"], abs=256)
    # the same arrivals for every pool
    assert len({r["requests"] for r in runs.values()}) == 1 and runs[UNBOUNDED]["requests"] > 10
    small, whole = runs[f"{TINY:g}x"], runs[UNBOUNDED]
    assert 0.9 * small["pool_tokens"] <= small["held_max_tokens"] <= small["pool_tokens"] and small["nearly_full_share"] > 0
    assert small["slo_misses"] > whole["slo_misses"] + 2, (small, whole)
    # rollout ran beside serving in every run (the pool is sized with a lane taking its quanta)
    assert all(r["rollout_tokens_per_s"] > 0 for r in runs.values())
    assert json.loads(out.read_text())["loads"][0]["derived_pool_tokens"] == row["derived_pool_tokens"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "derived pool" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(loads=(0.0,)), "loads must be in"),
        (dict(pool_scales=(0.5, 0.0)), "pool scales must be positive"),
        (dict(serving_model="9B"), "9B"),
        (dict(drain_s=-1.0), "drain_s not negative"),
    ],
)
def test_bad_settings_are_refused_with_a_reason(change, message):
    with pytest.raises(ValueError, match=message):
        PoolCheck(**change)
