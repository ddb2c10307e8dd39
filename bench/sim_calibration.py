"""``rose bench sim``'s calibration: the simulator's predictions against a real run (`rose bench e2e`, or a short
`rose bench coserve` of one executor under its policies), per policy and figure. Apart from bench/sim.py, which
builds and reports the grid, so that neither passes the size a module may have."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rose.sim import POLICIES
from rose.sim.calibration import calibrate_e2e, fit_error, measure_step_times, relative_error, step_models

CALIBRATION_TOLERANCE = 0.15  # the bar: predicted within ±15 % of the real run, per policy and figure


def within_tolerance(cal: dict) -> bool | None:
    """Every policy's predicted figures within ``CALIBRATION_TOLERANCE`` of the real run (None: nothing to compare)."""
    errors = [*cal["calibration"].values(), *cal.get("calibration_slo_attainment", {}).values()]
    known = [e for e in errors if e is not None]
    return all(e <= CALIBRATION_TOLERANCE for e in known) if known else None


def fresh_coserve(out_json: str, seed: int, console) -> str:
    """Run a short real `rose bench coserve` (the executor under its policies) for calibration."""
    from rose.bench.coserve import CoserveOptions, run_coserve_bench

    path = str(Path(out_json).with_name(Path(out_json).stem + "-coserve.json"))
    run_coserve_bench(CoserveOptions(seed=seed, serving_load=0.3, duration_s=5.0), path, console=console)
    return path


# ---- against a real `rose bench coserve` run --------------------------------------------------
def predict_coserve(report: dict, step_times: dict, parallel_lanes: bool = True) -> dict:
    """Per executor policy: predicted rollout tokens/s and SLO attainment over the bench's trace."""
    from rose.bench import coserve_runs as bc
    from rose.services.executor.policies import Signals, make_policy
    from rose.sim.coserve import ServingTick, rollout_interference, rollout_share, serving_tick
    from rose.sim.policies import executor_signals

    sperf, pperf = step_models(step_times)
    from dataclasses import replace as _replace

    # One parameter is fitted, not predicted: the rollout lane's per-iteration cost beyond the forward
    # pass (sampling, scheduling, per-sequence bookkeeping of a 32-sequence batch), from the dedicated
    # run (the policy model alone): static's figure is then matched by construction.
    b_r0 = float(bc.BENCH_CONFIG.rollout_max_batch)
    dedicated = float(report.get("dedicated_rollout_tokens_per_s") or 0.0)
    overhead = 0.0
    if dedicated > 0:
        per_iter = (b_r0 * bc.ROLLOUT_MAX_TOKENS / dedicated - b_r0 * float(pperf.prefill_s(bc.ROLLOUT_PROMPT_TOKENS))) / bc.ROLLOUT_MAX_TOKENS
        overhead = max(0.0, per_iter - float(pperf.decode_s(b_r0, bc.ROLLOUT_PROMPT_TOKENS + bc.ROLLOUT_MAX_TOKENS / 2)))
    pperf = _replace(pperf, decode_base_s=pperf.decode_base_s + overhead)
    rate = float(report["serving_load"]) * float(report["serving_capacity_rps"])
    duration = float(report.get("duration_s", 20.0))
    slo_ttft, slo_tpot = float(report["slo"]["ttft_ms"]) / 1e3, float(report["slo"]["tpot_ms"]) / 1e3
    quantum = float(report.get("quantum_ms", 10.0))
    t = np.arange(0.0, duration, 0.1)  # the bench's bursts are 0.5 s long: 100 ms ticks
    in_burst = (t % bc.BURST_EVERY_S) > bc.BURST_EVERY_S - bc.BURST_LEN_S
    rates = rate * np.where(in_burst, bc.BURST_FACTOR, 1.0)
    p, o = float(bc.SERVING_PROMPT_TOKENS), float(bc.SERVING_MAX_TOKENS)
    b_r = float(bc.BENCH_CONFIG.rollout_max_batch)
    ctx_r = bc.ROLLOUT_PROMPT_TOKENS + bc.ROLLOUT_MAX_TOKENS / 2
    per_req = bc.ROLLOUT_MAX_TOKENS
    tau_r = float(pperf.decode_s(b_r, ctx_r))
    prefill_r = float(pperf.prefill_s(bc.ROLLOUT_PROMPT_TOKENS))
    alone_tps = b_r * per_req / (per_req * tau_r + b_r * prefill_r)  # a batch's decode plus its prefills
    kv_tokens = bc.BENCH_CONFIG.serving_kv_bytes / 1.0  # tokens are tiny here: never the limit
    out = {"static": {"rollout_tokens_per_s": alone_tps}, "engine_overhead_ms": overhead * 1e3}
    for name in ("naive_share", "rose"):
        ep = make_policy(name, quantum_ms=quantum)
        active = np.ones(len(t), dtype=bool)
        st0 = serving_tick(sperf, rates, p, o, p, 0.0, 0.0, 0.0, 0.1, kv_tokens)
        if parallel_lanes and not ep.shares_serving_lane:
            # a CPU executor runs a policy's own rollout lane on its own thread and core, beside serving
            st, share = st0, np.ones(len(t))
        else:

            def signals(d: int, st0: ServingTick = st0) -> Signals:  # st0 of this tick (bound now, not when called)
                return executor_signals(
                    float(t[d]),
                    st0.batch[d],
                    float(st0.iteration_s[d]) * 1e3,
                    slo_tpot * 1e3,
                    serving_max_batch=bc.BENCH_CONFIG.serving_max_batch,
                    gpu_engine=False,
                )

            extra, wait, may = rollout_interference(ep, active, np.full(len(t), tau_r), per_req, signals)
            st = serving_tick(sperf, rates, p, o, p, extra, wait, 0.0, 0.1, kv_tokens)
            share = rollout_share(ep, st, extra, may)
        tps = float(np.mean(share)) * alone_tps
        ok = (st.ttft_p99_s <= slo_ttft) & (st.tpot_p99_s <= slo_tpot)
        attain = float(np.sum(rates * ok) / max(1e-9, np.sum(rates)))
        out[name] = {"rollout_tokens_per_s": tps, "slo_attainment": attain}
    return out


def calibrate_coserve(report: dict, step_times: dict, source: str) -> dict:
    pred = predict_coserve(report, step_times)
    meas = {
        "static": {"rollout_tokens_per_s": report.get("dedicated_rollout_tokens_per_s")},
        "naive_share": report["policies"]["naive_share"],
        "rose": report["policies"]["rose"],
    }
    errors: dict[str, float | None] = {}
    detail: dict = {}
    for name in POLICIES:
        if name == "elastic_baseline":
            errors[name] = None
            detail[name] = "lends whole devices: a one-executor run has nothing to compare (needs rose bench e2e)"
            continue
        m, p = meas[name], pred[name]
        errors[name] = relative_error(p["rollout_tokens_per_s"], m.get("rollout_tokens_per_s"))
        detail[name] = {"metric": "rollout_tokens_per_s", "measured": m.get("rollout_tokens_per_s"), "predicted": p["rollout_tokens_per_s"]}
        if "slo_attainment" in p:
            detail[name].update(measured_slo_attainment=m.get("slo_attainment"), predicted_slo_attainment=p["slo_attainment"])
    detail["static"]["fitted"] = "the engine's per-iteration overhead is fitted to this figure: its error is 0 by construction"
    return {
        "calibration": errors,
        "calibration_detail": {
            "source": source,
            "against": "rose bench coserve (one executor, real engine)",
            "per_policy": detail,
            "engine_overhead_ms_per_iteration": pred["engine_overhead_ms"],
            "device_model": "CPU: a rollout lane of its own runs on its own core beside serving (rose); "
            "naive_share shares the serving lane (time-sliced as on one accelerator)",
            "step_times": step_times,
            "step_fit_max_error": fit_error(step_times),
        },
    }


def run_calibration(*, e2e: str | None, coserve: str | None, measure: bool, seed: int, console=None) -> dict:
    """The bench's calibration block: from an e2e file, else a coserve file, else step times only."""
    if e2e:  # its own measured step times, else measured now
        return calibrate_e2e(json.loads(Path(e2e).read_text()), None, source=str(e2e), seed=seed)
    if coserve:
        return calibrate_coserve(json.loads(Path(coserve).read_text()), measure_step_times(seed), source=str(coserve))
    step_times = measure_step_times(seed) if measure else None
    detail: dict[str, Any] = {
        "source": ("step times measured now; " if step_times is not None else "")
        + "no real per-policy run to compare against (no bench-out/e2e.json)",
        "next": "pass --e2e FILE (rose bench e2e) or --coserve FILE / --calibrate (runs rose bench coserve briefly)",
    }
    if step_times is not None:
        detail.update(step_times=step_times, step_fit_max_error=fit_error(step_times))
    return {"calibration": {}, "calibration_detail": detail}
