"""Calibration: the simulator fed this machine's measured step times, against real runs.

Step times are measured, not assumed: ``measure_step_times`` runs the executor's own paged
forward (``services/executor/model_runner.PagedModelRunner`` over a ``KVPool``) on the tiny
serving and policy models (``shared/models.build_model``), decode at several batch sizes and
prefill at several lengths, and fits ``devices.MeasuredSteps`` (least squares) to them.

Those step models replace the roofline, and the simulator predicts a real run:

- ``calibrate_e2e(report)`` — the real RL job of ``rose bench e2e`` (cli/bench_e2e.py). Read
  from its JSON: per policy ``rl_steps_per_hour``, ``rollout_s_per_step``,
  ``serving_slo_attainment`` and the measured ``calibration`` block (trajectories per step,
  turns per trajectory, tokens per turn, train and publish seconds, serving arrivals per
  executor); top level ``serving_executors``, ``dedicated_executors``, ``fleet`` (SLO, base
  rate, bursts) and ``calibration.step_times.<serving|policy>.measured_steps`` (the models'
  measured steps, in ``MeasuredSteps`` form). A ``setup`` block, if present, overrides any of
  those (``e2e_setup`` lists the fields). Each policy's ``rl_steps_per_hour`` is predicted by
  the fleet simulator (engine.py) with that setup; error = ``|predicted - measured| / measured``.
- ``calibrate_coserve(path)`` — a real ``rose bench coserve`` run (one executor, serving trace
  plus a saturating rollout backlog): each executor policy's rollout tokens/s and SLO
  attainment are predicted by the simulator's per-instance model (coserve.py) over the same
  trace. The fleet policies map onto it as static = the policy model alone on the device
  (``dedicated_rollout_tokens_per_s``), naive_share and rose = those executor policies;
  elastic_baseline lends whole devices, which a one-executor run does not exercise (no figure).
  Two things are fitted rather than predicted, and said so in the output: the engine's
  per-iteration cost beyond the forward pass (from the dedicated figure, so static's error is 0
  by construction), and the device: on this CPU a rollout lane of its own (rose) runs on its own
  core beside serving, where an accelerator would time-slice them (``parallel_lanes``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from .devices import MeasuredSteps

DECODE_BATCHES = (1, 4, 16, 32)
PREFILL_TOKENS = (16, 64, 256)
CONTEXT = 64
REPEATS = 5


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b x, least squares, slope at least 0."""
    a = np.vstack([np.ones(len(xs)), np.asarray(xs, dtype=float)]).T
    coef, *_ = np.linalg.lstsq(a, np.asarray(ys, dtype=float), rcond=None)
    return max(0.0, float(coef[0])), max(0.0, float(coef[1]))


def steps_from_table(table: dict, name: str) -> MeasuredSteps:
    """MeasuredSteps from {"decode_ms": {batch: ms}, "prefill_ms": {tokens: ms}}."""
    dec = sorted((float(b), float(ms)) for b, ms in table["decode_ms"].items())
    pre = sorted((float(p), float(ms)) for p, ms in table["prefill_ms"].items())
    da, db = _fit([b for b, _ in dec], [ms / 1e3 for _, ms in dec])
    pa, pb = _fit([p for p, _ in pre], [ms / 1e3 for _, ms in pre])
    return MeasuredSteps(da, db, pa, pb, name=name)


def measure_step_times(seed: int = 0, threads: int = 1, repeats: int = REPEATS, batches=DECODE_BATCHES, prefills=PREFILL_TOKENS) -> dict:
    """Time decode and prefill steps of the tiny serving and policy models with the executor's forward."""
    import torch

    from rose.services.executor.kv_pool import KVPool
    from rose.services.executor.model_runner import ForwardItem, PagedModelRunner, kv_shape_of
    from rose.shared.models import POLICY_SHAPE, SERVING_SHAPE, VOCAB_SIZE, build_model

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "context": CONTEXT, "repeats": repeats}
    try:
        for offset, (name, shape) in enumerate((("serving", SERVING_SHAPE), ("policy", POLICY_SHAPE))):
            model = build_model(shape, VOCAB_SIZE, 0, seed + offset)
            pool = KVPool(name, kv_shape_of(model), 64 << 20, 16, torch.device("cpu"))
            runner = PagedModelRunner(model, pool)
            gen = torch.Generator().manual_seed(seed)
            table: dict = {"decode_ms": {}, "prefill_ms": {}}
            with torch.inference_mode():
                for p in prefills:
                    tokens = torch.randint(10, VOCAB_SIZE, (p,), generator=gen).tolist()
                    times = []
                    for _ in range(repeats):
                        blocks = pool.allocate(pool.blocks_for(p))
                        t0 = time.perf_counter()
                        runner.forward([ForwardItem(blocks, 0, tokens)])
                        times.append(time.perf_counter() - t0)
                        pool.free(blocks)
                    table["prefill_ms"][str(p)] = 1e3 * float(np.median(times))
                for b in batches:
                    tables = [pool.allocate(pool.blocks_for(CONTEXT + repeats + 2)) for _ in range(b)]
                    runner.forward([ForwardItem(t, 0, torch.randint(10, VOCAB_SIZE, (CONTEXT,), generator=gen).tolist()) for t in tables])
                    times = []
                    for r in range(repeats):
                        items = [ForwardItem(t, CONTEXT + r, [int(torch.randint(10, VOCAB_SIZE, (1,), generator=gen))]) for t in tables]
                        t0 = time.perf_counter()
                        runner.forward(items)
                        times.append(time.perf_counter() - t0)
                    for t in tables:
                        pool.free(t)
                    table["decode_ms"][str(b)] = 1e3 * float(np.median(times))
            out[name] = table
    finally:
        torch.set_num_threads(previous)
    return out


def step_models(step_times: dict) -> tuple[MeasuredSteps, MeasuredSteps]:
    return steps_from_table(step_times["serving"], "measured serving"), steps_from_table(step_times["policy"], "measured policy")


def fit_error(step_times: dict) -> float:
    """Largest relative error of the fitted step models on the measured points (how linear steps are)."""
    worst = 0.0
    for name, model in zip(("serving", "policy"), step_models(step_times)):
        for b, ms in step_times[name]["decode_ms"].items():
            worst = max(worst, abs(float(model.decode_s(float(b), CONTEXT)) * 1e3 - ms) / ms)
        for p, ms in step_times[name]["prefill_ms"].items():
            worst = max(worst, abs(float(model.prefill_s(float(p))) * 1e3 - ms) / ms)
    return worst


def _rel(pred: float, meas: float) -> float | None:
    if meas is None or not math.isfinite(meas) or meas <= 0:
        return None
    return abs(pred - meas) / meas


# ---- against a real `rose bench coserve` run --------------------------------------------------
def predict_coserve(report: dict, step_times: dict, parallel_lanes: bool = True) -> dict:
    """Per executor policy: predicted rollout tokens/s and SLO attainment over the bench's trace."""
    from rose.cli import bench_coserve as bc
    from rose.services.executor.policies import Signals, make_policy

    from .coserve import rollout_interference, rollout_share, serving_tick

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
            extra, wait, may = rollout_interference(ep, active, np.full(len(t), tau_r), per_req,
                                                    lambda d: Signals(float(t[d]), 0, int(round(st0.batch[d])), float(st0.iteration_s[d]) * 1e3, slo_tpot * 1e3))
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
    for name in ("static", "naive_share", "elastic_baseline", "rose"):
        if name == "elastic_baseline":
            errors[name] = None
            detail[name] = "lends whole devices: a one-executor run has nothing to compare (needs rose bench e2e)"
            continue
        m, p = meas[name], pred[name]
        errors[name] = _rel(p["rollout_tokens_per_s"], m.get("rollout_tokens_per_s"))
        detail[name] = {"metric": "rollout_tokens_per_s", "measured": m.get("rollout_tokens_per_s"), "predicted": p["rollout_tokens_per_s"]}
        if "slo_attainment" in p:
            detail[name].update(measured_slo_attainment=m.get("slo_attainment"), predicted_slo_attainment=p["slo_attainment"])
    detail["static"]["fitted"] = "the engine's per-iteration overhead is fitted to this figure: its error is 0 by construction"
    return {"calibration": errors, "calibration_detail": {"source": source, "against": "rose bench coserve (one executor, real engine)", "per_policy": detail,
                                                          "engine_overhead_ms_per_iteration": pred["engine_overhead_ms"],
                                                          "device_model": "CPU: a rollout lane of its own runs on its own core beside serving (rose); "
                                                                          "naive_share shares the serving lane (time-sliced as on one accelerator)",
                                                          "step_times": step_times, "step_fit_max_error": fit_error(step_times)}}


# ---- against a real `rose bench e2e` run ------------------------------------------------------
def _e2e_step_models(report: dict, step_times: dict | None, seed: int) -> tuple[MeasuredSteps, MeasuredSteps, dict]:
    """The e2e file's own measured step models (``calibration.step_times.<model>.measured_steps``),
    else a ``step_times`` table, else measured now."""
    st = (report.get("calibration") or {}).get("step_times") or report.get("step_times")
    if st and all("measured_steps" in st.get(k, {}) for k in ("serving", "policy")):
        fields = ("decode_base_s", "decode_per_seq_s", "prefill_base_s", "prefill_per_token_s")
        models = [MeasuredSteps(*(float(st[k]["measured_steps"][f]) for f in fields), name=f"measured {k}") for k in ("serving", "policy")]
        return models[0], models[1], st
    if st and all("decode_ms" in st.get(k, {}) for k in ("serving", "policy")):
        sp, pp = step_models(st)
        return sp, pp, st
    st = step_times or measure_step_times(seed)
    sp, pp = step_models(st)
    return sp, pp, st


def e2e_setup(report: dict, policy: str) -> dict:
    """The real run's setup, from ``rose bench e2e``'s JSON (``fleet``, per-policy ``calibration``),
    with a generic ``setup`` block taking precedence; defaults for what neither gives."""
    fleet = report.get("fleet", {})
    cal = (report.get("policies", {}).get(policy, {}) or {}).get("calibration", {}) or {}
    out = {
        "serving_executors": report.get("serving_executors", 2), "dedicated_executors": report.get("dedicated_executors", 1),
        "serving_rps": cal.get("serving_arrival_rps_per_executor") or fleet.get("base_rps", 2.0), "burst_factor": fleet.get("burst_factor", 1.0),
        "burst_every_s": fleet.get("burst_every_s", 30.0), "burst_len_s": fleet.get("burst_len_s", 5.0),
        "serving_prompt_tokens": fleet.get("serving_prompt_tokens", 48), "serving_output_tokens": fleet.get("serving_max_tokens", 32),
        "slo_ttft_ms": fleet.get("slo_ttft_ms", 500.0), "slo_tpot_ms": fleet.get("slo_tpot_ms", 100.0),
        "trajectories_per_step": cal.get("trajectories_per_step", 16), "turns_median": cal.get("turns_per_trajectory") or 3,
        "gen_median": cal.get("tokens_per_turn") or fleet.get("rollout_max_tokens", 16), "gen_max": fleet.get("rollout_max_tokens", 256),
        "prompt_median": cal.get("prompt_tokens_per_turn") or 64, "tool_tokens_median": 16, "tool_latency_median_s": 0.05,
        "train_s_per_step": (cal.get("train_s_per_step") or 0.0) + (cal.get("publish_s_per_step") or 0.0) if cal.get("train_s_per_step") is not None else None,
        "serving_kv_bytes": 64 << 20, "rollout_kv_bytes": 128 << 20, "serving_kv_bytes_per_token": 2048, "policy_kv_bytes_per_token": 4096,
        "max_batch": fleet.get("worker_concurrency", 32), "steps": 5,
    }
    out.update({k: v for k, v in (report.get("setup") or {}).items() if v is not None})
    return out


def calibrate_e2e(report: dict, step_times: dict | None, source: str, seed: int = 0) -> dict:
    """Predict each policy's rl_steps_per_hour of a real e2e run with the fleet simulator."""
    from dataclasses import replace

    from .engine import SimConfig, simulate
    from .rollouts import RolloutSpec
    from .traces import Trace

    sperf, pperf, used_steps = _e2e_step_models(report, step_times, seed)
    errors: dict[str, float | None] = {}
    detail: dict = {}
    for name, measured in report.get("policies", {}).items():
        s = e2e_setup(report, name)
        horizon = 4 * 3600
        t = np.arange(horizon)
        shape = np.where((t % max(1.0, float(s["burst_every_s"]))) >= float(s["burst_every_s"]) - float(s["burst_len_s"]), float(s["burst_factor"]), 1.0)
        n_serv = int(s["serving_executors"])
        p, o = float(s["serving_prompt_tokens"]), float(s["serving_output_tokens"])
        trace = Trace(float(s["serving_rps"]) * n_serv * shape, np.full(horizon, p), np.full(horizon, o), p, 0.0, "e2e setup")
        spec = replace(RolloutSpec(), turns_median=float(s["turns_median"]), turns_sigma=0.3, gen_median=float(s["gen_median"]), gen_sigma=0.3,
                       gen_max=int(s["gen_max"]), tool_tokens_median=float(s["tool_tokens_median"]), tool_latency_median_s=float(s["tool_latency_median_s"]),
                       prompt_median=float(s["prompt_median"]), max_context=4096, max_turns=max(2, int(2 * float(s["turns_median"]))))
        kvs, kvp = float(s["serving_kv_bytes_per_token"]), float(s["policy_kv_bytes_per_token"])
        memory = {"usable_serving": float(s["serving_kv_bytes"]) + float(s["rollout_kv_bytes"]), "usable_dedicated": float(s["rollout_kv_bytes"]),
                  "total_serving": float(s["serving_kv_bytes"]) + float(s["rollout_kv_bytes"]), "serving_pool_tokens": float(s["serving_kv_bytes"]) / kvs,
                  "kvb_serving": kvs, "kvb_policy": kvp, "serving_weight_bytes": 0.0, "policy_weight_bytes": 0.0}
        cfg = SimConfig(policy=name, perf=(sperf, pperf, pperf), n_serving=n_serv, n_dedicated=int(s["dedicated_executors"]), trace=trace, rollout=spec,
                        trajectories=int(s["trajectories_per_step"]), steps=int(s["steps"]), seed=seed, slo_ttft_ms=float(s["slo_ttft_ms"]),
                        slo_tpot_ms=float(s["slo_tpot_ms"]), memory=memory, train_s=s["train_s_per_step"], warmup_s=5.0, max_sim_s=2 * 3600.0,
                        max_rollout_batch=int(s["max_batch"]), dt=0.1)
        try:
            sim = simulate(cfg)
        except ValueError as exc:
            errors[name], detail[name] = None, f"not simulated: {exc}"
            continue
        errors[name] = _rel(sim["rl_steps_per_hour"], measured.get("rl_steps_per_hour"))
        detail[name] = {"metric": "rl_steps_per_hour", "measured": measured.get("rl_steps_per_hour"), "predicted": sim["rl_steps_per_hour"],
                        "measured_slo_attainment": measured.get("serving_slo_attainment"), "predicted_slo_attainment": sim["serving_slo_attainment"],
                        "slo_attainment_error": _rel(sim["serving_slo_attainment"], measured.get("serving_slo_attainment")),
                        "measured_rollout_s_per_step": measured.get("rollout_s_per_step"), "predicted_rollout_s_per_step": sim["rollout_s_per_step"]}
    return {"calibration": errors, "calibration_detail": {"source": source, "against": "rose bench e2e (the real RL job)", "per_policy": detail,
                                                          "step_times": used_steps}}


def calibrate(*, e2e: str | None, coserve: str | None, measure: bool, seed: int, console=None) -> dict:
    """The bench's calibration block: from an e2e file, else a coserve file, else step times only."""
    if e2e:  # its own measured step times, else measured now
        return calibrate_e2e(json.loads(Path(e2e).read_text()), None, source=str(e2e), seed=seed)
    step_times = measure_step_times(seed) if measure or coserve else None
    if coserve:
        return calibrate_coserve(json.loads(Path(coserve).read_text()), step_times, source=str(coserve))
    detail = {"source": ("step times measured now; " if step_times is not None else "") + "no real per-policy run to compare against (no bench-out/e2e.json)",
              "next": "pass --e2e FILE (rose bench e2e) or --coserve FILE / --calibrate (runs rose bench coserve briefly)"}
    if step_times is not None:
        detail.update(step_times=step_times, step_fit_max_error=fit_error(step_times))
    return {"calibration": {}, "calibration_detail": detail}
