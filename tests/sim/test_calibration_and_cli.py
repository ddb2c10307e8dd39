"""Calibration paths and the two commands, end to end on small inputs."""

import json

import pytest

from rose.cli.main import main
from rose.sim.calibration import calibrate_e2e, fit_error, measure_step_times, step_models
from rose.sim.traces import SAMPLE_CSV
from rose.testing.sim import SYNTHETIC_E2E


def test_measured_step_times_of_the_real_executor_forward():
    st = measure_step_times(repeats=1, batches=(1, 8), prefills=(16, 64))
    serving, policy = step_models(st)
    assert all(ms > 0 for m in ("serving", "policy") for table in st[m].values() for ms in table.values())
    assert float(policy.prefill_s(64)) > 0 and float(serving.decode_s(8, 64)) > 0
    assert fit_error(st) >= 0


def test_calibration_against_an_e2e_file():
    out = calibrate_e2e(SYNTHETIC_E2E, None, source="synthetic")
    assert set(out["calibration"]) == {"static", "naive_share", "elastic_baseline", "rose"}
    for name, err in out["calibration"].items():
        d = out["calibration_detail"]["per_policy"][name]
        assert err == pytest.approx(abs(d["predicted"] - d["measured"]) / d["measured"])
        assert d["predicted"] > 0
        slo = out["calibration_slo_attainment"][name]
        assert slo == pytest.approx(abs(d["predicted_slo_attainment"] - d["measured_slo_attainment"]) / d["measured_slo_attainment"])


def test_bench_sim_end_to_end(tmp_path):
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps(SYNTHETIC_E2E))
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "bench",
                "sim",
                "--json",
                str(out),
                "--models",
                "7B",
                "--gpus",
                "8",
                "--steps",
                "1",
                "--jobs",
                "1",
                "--e2e",
                str(e2e),
                "--demand",
                "2",
                "--dedicated-ratio",
                "0.5",
                "--modes",
                "sync",
                "--seeds",
                "0",
                "1",
                "--host-kv-ratio",
                "1.5",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["settings"]["host_kv_ratio"] == 1.5  # the executors' host tier, as the runs had it
    assert report["settings"]["seeds"] == [0, 1] and len(report["rows"]) == 4  # one row per policy over both seeds
    for r in report["rows"]:
        assert r["seeds"] == [0, 1] and len(r["speedup_vs_static_by_seed"]) == 2
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert {r["policy"] for r in report["rows"]} == {"static", "naive_share", "elastic_baseline", "rose"}
    for r in report["rows"]:
        assert {"model", "gpus", "policy", "rl_steps_per_hour", "speedup_vs_static", "rollout_time_ratio_vs_elastic", "slo_violations"} <= set(r)
        assert (r["rollout_demand"], r["dedicated_ratio"], r["mode"]) == (2.0, 0.5, "sync")
    static = next(r for r in report["rows"] if r["policy"] == "static")
    assert static["speedup_vs_static"] == 1.0
    assert set(report["calibration"]) == set(report["calibration_slo_attainment"]) == {"static", "naive_share", "elastic_baseline", "rose"}
    errors = [*report["calibration"].values(), *report["calibration_slo_attainment"].values()]
    assert report["calibration_within_15pct"] == all(e <= 0.15 for e in errors)
    assert report["summary"].startswith("rose vs static")
    rose = next(r for r in report["rows"] if r["policy"] == "rose")
    t = report["targets"]["sync"]
    assert t["configurations"] == 1 and t["min_speedup"] == rose["speedup_vs_static"] == t["median_speedup_demand_ge_2"]
    assert t["meets"]["never_below_static"] == (rose["speedup_vs_static"] >= 1.0)
    # synchronous: static on its dedicated pool grown by the lanes' capacity ran beside the grid (the fleet ceiling)
    assert rose["speedup_ceiling_fleet"] is not None and rose["speedup_ceiling_fleet"] > 1.0
    (entry,) = report["targets"]["all"]["per_model"].values()
    assert entry["median_fleet_share"] == pytest.approx((rose["speedup_vs_static"] - 1.0) / (rose["speedup_ceiling_fleet"] - 1.0))
    # what prefix-cache misses cost: the prefill they redid, as a share of rollout's device time (the median seed's row)
    assert entry["max_reprefill_share"] == rose["detail"]["reprefill_share"] and 0.0 < entry["max_reprefill_share"] < 1.0


def _fits(text: str, columns: int = 80) -> None:
    """Every line within ``columns``, and no cell cut short ("lenda…")."""
    wide = [line for line in text.splitlines() if len(line) > columns]
    assert not wide and "…" not in text, wide or text


def test_plan_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(SAMPLE_CSV), "--fleet", "16xH100", "--model", "7B", "--json", str(out), "--demand", "4"]) == 0
    result = json.loads(out.read_text())
    (level,) = result["speedup_by_demand"]
    assert level["rollout_demand"] == 4.0 and level["speedup"] == level["rose_rl_steps_per_hour"] / level["static_rl_steps_per_hour"]
    assert level["speedup_ceiling"] > 1.0 and level["speedup"] <= level["speedup_ceiling"]  # 7B co-hosts: lanes add capacity
    assert level["pays"] == (level["speedup"] >= 1.05) and level["why"]
    assert level["share_of_priced_gain"] == pytest.approx((level["speedup"] - 1.0) / (level["speedup_ceiling_kv"] - 1.0))
    assert len(result["hours"]) == 24 and out.with_suffix(".png").exists()
    assert any(h["rollout_tokens_per_s"] > 0 for h in result["hours"])
    # both rollout modes, a 7B policy being a LoRA adapter of the 7B serving model: which pays, by how much
    assert result["rollout_modes"] == ["two_model", "co_batched"] and level["rollout_mode"] == "two_model"
    co = level["co_batched"]
    assert co["speedup"] == co["rose_rl_steps_per_hour"] / co["static_rl_steps_per_hour"]
    assert result["co_batched"]["rollout_pool_gb_per_instance"] > result["rollout_pool_gb_per_instance"]  # no policy copy
    assert sum(b["rollout_tokens_per_s_co_batched"] for b in result["bins"]) > 0
    paying = {m: lv for m, lv in (("two_model", level), ("co_batched", co)) if lv["pays"]}
    if paying:
        best = max(paying, key=lambda m: paying[m]["rose_rl_steps_per_hour"])
        other = co if best == "two_model" else level
        assert level["mode_that_pays"] == best
        assert level["over_other_mode"] == pytest.approx(paying[best]["rose_rl_steps_per_hour"] / other["rose_rl_steps_per_hour"])
    assert result["lending_does_not_pay"]["demand_levels"] == ([] if paying else [4.0])
    assert all(0.0 <= h["slo_risk_with_rollout"] <= 1.0 for h in result["hours"])
    assert result["bin_minutes"] == 60 and [b["start"] for b in result["bins"]] == [f"{h:02d}:00" for h in range(24)]
    printed = capsys.readouterr().out
    _fits(printed)
    assert "[1] " + level["why"].split()[0] in printed  # the reason as a note under the table
    assert "which mode pays" in printed and "co-batched (the policy a rank-32 LoRA adapter" in printed


def test_plan_bins_an_hour_long_trace_in_minutes_and_fits_80_columns(tmp_path, capsys, monkeypatch):
    """A 48-minute trace gets 2-minute bins (at most 24 rows), not one hourly row; a terminal
    narrower than the tables is told how wide they are."""
    lines = SAMPLE_CSV.read_text().splitlines()
    short = tmp_path / "48min.csv"
    short.write_text("\n".join([lines[0], *(x for x in lines[1:] if x.startswith("2023-11-16 00:") and int(x[14:16]) < 48)]) + "\n")
    out = tmp_path / "plan.json"
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--trace", str(short), "--fleet", "16xH100", "--model", "32B", "--json", str(out), "--demand"]) == 0
    result = json.loads(out.read_text())
    assert result["bin_minutes"] == 2 and 12 < len(result["bins"]) <= 24 and result["bins"][1]["start"] == "00:02"
    assert len(result["hours"]) == 1  # the JSON's hourly figures as before
    printed = capsys.readouterr().out
    _fits(printed)
    assert all(b["start"] in printed for b in result["bins"]) and "COLUMNS" not in printed
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["plan", "--trace", str(short), "--fleet", "16xH100", "--model", "32B", "--json", str(out), "--demand"]) == 0
    assert "COLUMNS=80" in capsys.readouterr().out


def test_plan_sizes_the_serving_fleet_by_its_own_model_and_the_policy_by_its_own(tmp_path, capsys, monkeypatch):
    """A company's 70B product model serving, a 7B policy trained beside it: the serving instances hold a 70B and a 7B
    (TP4 on H100, not the TP8 two 70Bs need), the dedicated instances a 7B (TP1), and the simulator runs that pair."""
    from rose.shared.devices import DEVICES, model_spec, rollout_tp, serving_tp

    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "plan.json"
    args = ["plan", "--trace", str(SAMPLE_CSV), "--fleet", "16xH100", "--model", "70B", "--json", str(out)]
    assert main([*args, "--policy-model", "7B", "--demand", "4"]) == 0
    mixed = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "70B serving, 7B policy" in printed
    _fits(printed)
    h100, big, small = DEVICES["H100"], model_spec("70B"), model_spec("7B")
    assert (mixed["model"], mixed["policy_model"]) == ("70B", "7B")
    # a 7B policy is no adapter of a 70B serving model: two-model only, and asking for co-batched says why
    assert mixed["rollout_modes"] == ["two_model"] and "co_batched" not in mixed
    assert main([*args, "--policy-model", "7B", "--rollout-modes", "co_batched", "--demand"]) == 2
    assert "LoRA adapter of the serving model" in capsys.readouterr().err
    assert mixed["serving_tp"] == serving_tp(big, small, h100) == 4 and mixed["serving_instances"] == 16 // 4
    assert mixed["dedicated_tp"] == rollout_tp(small, h100) == 1
    # the hourly table and the simulation lend from one serving pool (sizing.py), and agree that lending happens:
    # they disagreed here before (the table: a 0 GB rollout pool and no lendable minute; the simulation: a fifth of
    # the rollout tokens on leases)
    (level,) = mixed["speedup_by_demand"]
    assert mixed["serving_pool_tokens_per_instance"] > 0 and mixed["rollout_pool_gb_per_instance"] > 0
    assert level["rollout_tokens_on_serving_fraction"] > 0 and max(h["lendable_fraction"] for h in mixed["hours"]) > 0.5
    # the same fleet training a 70B policy: two 70Bs per serving instance (its co-batched plan: test_plan_end_to_end)
    assert main([*args, "--demand", "4", "--rollout-modes", "two_model"]) == 0
    same = json.loads(out.read_text())
    assert "70B serving" not in capsys.readouterr().out
    assert (same["model"], same["policy_model"]) == ("70B", "70B") and same["serving_tp"] == serving_tp(big, big, h100) == 8
    assert same["dedicated_tp"] == rollout_tp(big, h100) == 4
    # the simulator ran each pair: four 7B dedicated instances (TP1) hand out a larger batch than one 70B one (TP4)
    (level_same,) = same["speedup_by_demand"]
    assert level["speedup"] is not None and level_same["speedup"] is not None
    assert level["trajectories_per_step"] > level_same["trajectories_per_step"]


def test_the_command_lines_offer_the_model_sizes_the_devices_define():
    from rose.shared.devices import DEVICES, MODELS
    from rose.sim import DEVICE_KINDS, MODEL_SIZES

    assert tuple(MODELS) == MODEL_SIZES
    assert tuple(DEVICES) == DEVICE_KINDS


def test_plan_bad_trace_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,100,10\n2,lots,10\n")
    assert main(["plan", "--trace", str(bad), "--fleet", "8xH100", "--model", "7B", "--json", str(tmp_path / "p.json"), "--demand"]) == 2
    assert "line 3" in capsys.readouterr().err
    assert main(["plan", "--trace", str(SAMPLE_CSV), "--fleet", "8xTPU", "--model", "7B", "--json", str(tmp_path / "p.json"), "--demand"]) == 2
