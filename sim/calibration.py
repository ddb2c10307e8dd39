"""Calibration: the simulator fed this machine's measured step times, against real runs.

Step times are measured, not assumed: ``measure_step_times`` runs the executor's own paged
forward (``services/executor/model_runner.PagedModelRunner`` over a ``KVPool``) on the tiny
serving and policy models (``shared/models.build_model``), decode at several batch sizes and
prefill at several lengths, and fits ``devices.MeasuredSteps`` (least squares) to them.

Those step models replace the roofline, and the simulator predicts a real run:

- ``calibrate_e2e(report)`` — the real RL job of ``rose bench e2e`` (bench/e2e.py). Read
  from its JSON: per policy ``rl_steps_per_hour``, ``rollout_s_per_step``,
  ``serving_slo_attainment`` and the measured ``calibration`` block (trajectories per step,
  turns per trajectory, tokens per turn, train and publish seconds, serving arrivals per
  executor); top level ``serving_executors``, ``dedicated_executors``, ``fleet`` (SLO, base
  rate, bursts) and ``calibration.step_times.<serving|policy>.measured_steps`` (the models'
  measured steps, in ``MeasuredSteps`` form). A ``setup`` block, if present, overrides any of
  those (``e2e_setup`` lists the fields). Each policy's ``rl_steps_per_hour`` and
  ``serving_slo_attainment`` are predicted by the fleet simulator (engine.py) with that setup;
  error = ``|predicted - measured| / measured``. The trainer runs as the real one does: its
  ``prefetch_steps`` / ``max_staleness`` / group size from the JSON's ``trainer`` block (else
  the demo's TRAINER in shared/workload.py), whose task bounds (``ROSE_TASKS__MAX_TURNS`` / ``ROSE_TASKS__MAX_TOKENS``)
  also cap the simulated turns and tokens per turn, the worker's ``worker_concurrency`` episodes, groups taken as
  ``Trainer.next_groups`` takes them (trainer.py ``Trainer.pipelined``), as many steps as the real
  run trained. One thing is fitted, and said so in the output: the rollout engine's in-situ
  slowdown (``fit_contention``: the two-core box is shared by every executor, the worker and the
  trainer), from the static run's median turn time, the same factor for every policy.
- ``calibrate_coserve(path)`` (bench/sim_calibration.py: runs and reads the real bench) — a real
  ``rose bench coserve`` run (one executor, serving trace
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

import math
import time
from typing import Any

import numpy as np

from rose.contracts.slo import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from rose.shared.devices import MeasuredSteps

DECODE_BATCHES = (1, 4, 16, 32)
E2E_DT = 0.02  # the e2e run's turns take ~0.2-0.4 s: a 20 ms clock (admission and prefill move on tick boundaries)
CONTENTION_MAX = 32.0  # the in-situ slowdown is searched in [1, 32]
FIT_STEPS = 6  # training steps per fitting run (the median turn time settles within a few)
FIT_ITERATIONS = 6
FIT_TOLERANCE = 0.03
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


def time_steps(model, name: str, *, context: int, repeats: int, batches, prefills, seed: int = 0) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of one decode step per batch size (each sequence at ``context`` tokens) and of one
    prefill per prompt length: the executor's own paged forward (``PagedModelRunner`` over a ``KVPool``)
    on ``model``, under the caller's torch thread count. The one timing loop behind both calibrations
    (``measure_step_times`` here, bench/e2e.py's ``calibration.step_times``)."""
    import torch

    from rose.services.executor.forward_item import ForwardItem
    from rose.services.executor.kv_pool import KVPool
    from rose.services.executor.model_runner import PagedModelRunner, kv_shape_of

    vocab = int(model.config.vocab_size)
    pool = KVPool(name, kv_shape_of(model), 64 << 20, 16, torch.device("cpu"))
    runner = PagedModelRunner(model, pool)
    gen = torch.Generator().manual_seed(seed)
    decode: dict[int, float] = {}
    prefill: dict[int, float] = {}
    with torch.inference_mode():
        for p in prefills:
            tokens = torch.randint(10, vocab, (p,), generator=gen).tolist()
            times = []
            for _ in range(repeats):
                blocks = pool.allocate(pool.blocks_for(p))
                t0 = time.perf_counter()
                runner.forward([ForwardItem(blocks, 0, tokens)])
                times.append(time.perf_counter() - t0)
                pool.free(blocks)
            prefill[p] = float(np.median(times))
        for b in batches:
            tables = [pool.allocate(pool.blocks_for(context + repeats + 2)) for _ in range(b)]
            runner.forward([ForwardItem(t, 0, torch.randint(10, vocab, (context,), generator=gen).tolist()) for t in tables])
            times = []
            for r in range(repeats):
                items = [ForwardItem(t, context + r, [int(torch.randint(10, vocab, (1,), generator=gen))]) for t in tables]
                t0 = time.perf_counter()
                runner.forward(items)
                times.append(time.perf_counter() - t0)
            for t in tables:
                pool.free(t)
            decode[b] = float(np.median(times))
    return decode, prefill


def measure_step_times(seed: int = 0, threads: int = 1, repeats: int = REPEATS, batches=DECODE_BATCHES, prefills=PREFILL_TOKENS) -> dict:
    """Time decode and prefill steps of the tiny serving and policy models with the executor's forward."""
    import torch

    from rose.shared.models import POLICY_SHAPE, SERVING_SHAPE, VOCAB_SIZE, build_model

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "context": CONTEXT, "repeats": repeats}
    try:
        for offset, (name, shape) in enumerate((("serving", SERVING_SHAPE), ("policy", POLICY_SHAPE))):
            model = build_model(shape, VOCAB_SIZE, 0, seed + offset)
            decode, prefill = time_steps(model, name, context=CONTEXT, repeats=repeats, batches=batches, prefills=prefills, seed=seed)
            out[name] = {
                "decode_ms": {str(b): 1e3 * s for b, s in decode.items()},
                "prefill_ms": {str(p): 1e3 * s for p, s in prefill.items()},
            }
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


def relative_error(pred: float, meas: float) -> float | None:
    if meas is None or not math.isfinite(meas) or meas <= 0:
        return None
    return abs(pred - meas) / meas


# ---- against a real `rose bench e2e` run ------------------------------------------------------
def _measured_steps(fit: dict, name: str) -> MeasuredSteps:
    """A step model from the e2e file's ``measured_steps`` (bench/e2e.py's linear fits of the engine's steps)."""
    return MeasuredSteps(
        decode_base_s=float(fit["decode_base_s"]),
        decode_per_seq_s=float(fit["decode_per_seq_s"]),
        prefill_base_s=float(fit["prefill_base_s"]),
        prefill_per_token_s=float(fit["prefill_per_token_s"]),
        name=name,
    )


def _e2e_step_models(report: dict, step_times: dict | None, seed: int) -> tuple[MeasuredSteps, MeasuredSteps, dict]:
    """The e2e file's own measured step models (``calibration.step_times.<model>.measured_steps``),
    else a ``step_times`` table, else measured now."""
    st = (report.get("calibration") or {}).get("step_times") or report.get("step_times")
    if st and all("measured_steps" in st.get(k, {}) for k in ("serving", "policy")):
        models = [_measured_steps(st[k]["measured_steps"], f"measured {k}") for k in ("serving", "policy")]
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
        "serving_executors": report.get("serving_executors", 2),
        "dedicated_executors": report.get("dedicated_executors", 1),
        "serving_rps": cal.get("serving_arrival_rps_per_executor") or fleet.get("base_rps", 2.0),
        "burst_factor": fleet.get("burst_factor", 1.0),
        "burst_every_s": fleet.get("burst_every_s", 30.0),
        "burst_len_s": fleet.get("burst_len_s", 5.0),
        "serving_prompt_tokens": fleet.get("serving_prompt_tokens", 48),
        "serving_output_tokens": fleet.get("serving_max_tokens", 32),
        "slo_ttft_ms": fleet.get("slo_ttft_ms", DEFAULT_SLO_TTFT_MS),
        "slo_tpot_ms": fleet.get("slo_tpot_ms", DEFAULT_SLO_TPOT_MS),
        "trajectories_per_step": cal.get("trajectories_per_step", 16),
        "turns_median": cal.get("turns_per_trajectory") or 3,
        "gen_median": cal.get("tokens_per_turn") or fleet.get("rollout_max_tokens", 16),
        "gen_max": fleet.get("rollout_max_tokens", 256),
        "prompt_median": cal.get("prompt_tokens_per_turn") or 64,
        "tool_tokens_median": 16,
        "tool_latency_median_s": 0.05,
        "train_s_per_step": (cal.get("train_s_per_step") or 0.0) + (cal.get("publish_s_per_step") or 0.0)
        if cal.get("train_s_per_step") is not None
        else None,
        "serving_kv_bytes": 64 << 20,
        "rollout_kv_bytes": 128 << 20,
        "serving_kv_bytes_per_token": 2048,
        "policy_kv_bytes_per_token": 4096,
        "max_batch": fleet.get("worker_concurrency", 32),
        "worker_concurrency": fleet.get("worker_concurrency", 32),
        "steps": 16,
    }
    out.update(trainer_settings(report))
    out.update({k: v for k, v in (report.get("setup") or {}).items() if v is not None})
    return out


def trainer_settings(report: dict) -> dict:
    """The real trainer's asynchrony (``grpo.prefetch_steps``, ``grpo.max_staleness``) and group size:
    the e2e JSON's ``trainer`` block (the ROSE_* settings the bench gave the trainer), else the
    demo's own (shared/workload.py TRAINER), which is what ``rose bench e2e`` runs."""
    env = report.get("trainer")
    source = "the e2e JSON's trainer block"
    if not env:
        from rose.shared.workload import TRAINER

        env, source = TRAINER, "the demo's TRAINER, shared/workload.py (the e2e JSON has no trainer block)"
    defaults = {"ROSE_GRPO__PREFETCH_STEPS": 1, "ROSE_GRPO__MAX_STALENESS": 2, "ROSE_GRPO__GROUP_SIZE": 8}  # services/trainer/config.py
    get = lambda k: int(env.get(k, defaults[k]))  # noqa: E731
    out = {
        "prefetch_steps": get("ROSE_GRPO__PREFETCH_STEPS"),
        "max_staleness": get("ROSE_GRPO__MAX_STALENESS"),
        "early_hand_out": str(env.get("ROSE_GRPO__EARLY_HAND_OUT", "true")).lower() in ("1", "true", "yes"),
        "group_size": get("ROSE_GRPO__GROUP_SIZE"),
        "trainer_settings_from": source,
    }
    # the tasks' own bounds: an episode never runs past max_turns turns of at most max_tokens tokens each
    # (without them the simulated turn counts and lengths get a log-normal tail the real job cannot have)
    if env.get("ROSE_TASKS__MAX_TURNS"):
        out["max_turns"] = int(env["ROSE_TASKS__MAX_TURNS"])
    if env.get("ROSE_TASKS__MAX_TOKENS"):
        out["task_max_tokens"] = int(env["ROSE_TASKS__MAX_TOKENS"])
    return out


def _e2e_config(report: dict, name: str, sperf, pperf, seed: int, steps: int | None = None):
    """The fleet simulator's configuration of one policy's real e2e run (its setup from ``e2e_setup``)."""
    from dataclasses import replace

    from rose.shared.workload import RolloutSpec

    from .engine import SimConfig
    from .traces import Trace

    s = e2e_setup(report, name)
    horizon = 4 * 3600
    t = np.arange(horizon)
    shape = np.where((t % max(1.0, float(s["burst_every_s"]))) >= float(s["burst_every_s"]) - float(s["burst_len_s"]), float(s["burst_factor"]), 1.0)
    n_serv = int(s["serving_executors"])
    p, o = float(s["serving_prompt_tokens"]), float(s["serving_output_tokens"])
    trace = Trace(float(s["serving_rps"]) * n_serv * shape, np.full(horizon, p), np.full(horizon, o), p, 0.0, "e2e setup")
    gen_max = min(int(s["gen_max"]), int(s.get("task_max_tokens") or s["gen_max"]))
    spec = replace(
        RolloutSpec(),
        group_size=int(s["group_size"]),
        turns_median=float(s["turns_median"]),
        turns_sigma=0.3,
        gen_median=min(float(s["gen_median"]), gen_max),
        gen_sigma=0.3,
        gen_min=1,
        gen_max=gen_max,
        tool_tokens_median=float(s["tool_tokens_median"]),
        tool_latency_median_s=float(s["tool_latency_median_s"]),
        prompt_median=float(s["prompt_median"]),
        max_context=4096,
        max_turns=int(s.get("max_turns") or max(2, int(2 * float(s["turns_median"])))),
    )
    kvs, kvp = float(s["serving_kv_bytes_per_token"]), float(s["policy_kv_bytes_per_token"])
    memory = {
        "usable_serving": float(s["serving_kv_bytes"]) + float(s["rollout_kv_bytes"]),
        "usable_dedicated": float(s["rollout_kv_bytes"]),
        "total_serving": float(s["serving_kv_bytes"]) + float(s["rollout_kv_bytes"]),
        "serving_pool_tokens": float(s["serving_kv_bytes"]) / kvs,
        "kvb_serving": kvs,
        "kvb_policy": kvp,
        "serving_weight_bytes": 0.0,
        "policy_weight_bytes": 0.0,
    }
    return SimConfig(
        policy=name,
        perf=(sperf, pperf, pperf),
        n_serving=n_serv,
        n_dedicated=int(s["dedicated_executors"]),
        trace=trace,
        rollout=spec,
        trajectories=int(s["trajectories_per_step"]),
        steps=int(steps or s["steps"]),
        seed=seed,
        slo_ttft_ms=float(s["slo_ttft_ms"]),
        slo_tpot_ms=float(s["slo_tpot_ms"]),
        memory=memory,
        train_s=s["train_s_per_step"],
        warmup_s=5.0,
        max_sim_s=2 * 3600.0,
        max_rollout_batch=int(s["max_batch"]),
        dt=E2E_DT,
        prefetch_steps=int(s["prefetch_steps"]),
        max_staleness=int(s["max_staleness"]),
        early_hand_out=bool(s.get("early_hand_out", True)),
        worker_concurrency=int(s["worker_concurrency"]) if s.get("worker_concurrency") else None,
    )


def slowed(steps: MeasuredSteps, factor: float) -> MeasuredSteps:
    """A step model ``factor`` x slower (every term)."""
    from dataclasses import replace

    return replace(
        steps,
        decode_base_s=steps.decode_base_s * factor,
        decode_per_seq_s=steps.decode_per_seq_s * factor,
        decode_per_ctx_token_s=steps.decode_per_ctx_token_s * factor,
        prefill_base_s=steps.prefill_base_s * factor,
        prefill_per_token_s=steps.prefill_per_token_s * factor,
        name=f"{steps.name} x{factor:.2f} in situ",
    )


def fit_contention(report: dict, sperf: MeasuredSteps, pperf: MeasuredSteps, seed: int = 0, policy: str = "static") -> dict:
    """The in-situ slowdown of the rollout engine, fitted once from ``policy``'s (static's) own run.

    On the e2e box every executor, the worker, the trainer and the serving clients share two
    cores, and the rollout engine does work per iteration beyond the forward pass (sampling,
    logprobs, per-sequence bookkeeping, streaming each turn back): the policy's step times measured
    with the box to itself are too fast in situ. One factor ``k`` multiplies them (every term); it
    is fitted so that the simulated static run's median turn time (route to result, all turns)
    equals the measured ``calibration.turn_s_p50`` of the real static run (bracketed from k = 1, 4, 8, ..., then
    regula falsi on log k, to 3 %).
    Serving step times are left as measured alone: static's serving SLO attainment is already
    predicted within a few percent by them. Returns ``{"factor", "target_turn_s_p50",
    "predicted_turn_s_p50", "fitted_on", "evaluations"}`` (factor 1 and a reason when static's
    run has no turn time).
    """
    from .engine import simulate

    cal = ((report.get("policies") or {}).get(policy) or {}).get("calibration") or {}
    target = cal.get("turn_s_p50")
    if not target or target <= 0:
        return {
            "factor": 1.0,
            "fitted_on": None,
            "reason": f"no {policy} run with calibration.turn_s_p50 in the e2e JSON: step times used as measured",
        }
    runs: list[tuple[float, float]] = []

    def turn_p50(k: float) -> float:
        out = simulate(_e2e_config(report, policy, sperf, slowed(pperf, k), seed, steps=FIT_STEPS))
        runs.append((k, float(out["turn_s_p50"])))
        return float(out["turn_s_p50"]) - float(target)

    lo, f_lo = 0.0, turn_p50(1.0)
    hi, f_hi = lo, f_lo
    while f_lo < 0 and f_hi < 0 and math.exp(hi) < CONTENTION_MAX:  # bracket: x2 per try from 4 (slow runs are the costly ones)
        lo, f_lo = hi, f_hi
        hi = min(math.log(CONTENTION_MAX), hi + math.log(4.0 if hi == 0.0 else 2.0))
        f_hi = turn_p50(math.exp(hi))
    if f_lo >= 0:
        x = lo
    elif f_hi <= 0:
        x = hi
    else:
        side = 0
        x = lo
        for _ in range(FIT_ITERATIONS):  # Illinois regula falsi on log k
            x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            f = turn_p50(math.exp(x))
            if abs(f) <= FIT_TOLERANCE * target:
                break
            if (f < 0) == (f_lo < 0):
                lo, f_lo = x, f
                if side == -1:
                    f_hi /= 2
                side = -1
            else:
                hi, f_hi = x, f
                if side == 1:
                    f_lo /= 2
                side = 1
    k = math.exp(x)
    at_k = [t for kk, t in runs if abs(kk - k) <= 1e-9 * kk]  # x is always evaluated (the last run, or a bracket end)
    return {
        "factor": k,
        "fitted_on": f"{policy}: calibration.turn_s_p50",
        "target_turn_s_p50": target,
        "predicted_turn_s_p50": at_k[-1] if at_k else None,
        "evaluations": [{"factor": round(kk, 4), "turn_s_p50": round(t, 4)} for kk, t in runs],
    }


def calibrate_e2e(report: dict, step_times: dict | None, source: str, seed: int = 0, contention: float | None = None) -> dict:
    """Predict each policy's rl_steps_per_hour and serving SLO attainment of a real e2e run with the
    fleet simulator. ``contention``: the rollout engine's in-situ slowdown (default: fitted from the
    static run, ``fit_contention``; the same factor for every policy)."""
    from .engine import simulate

    sperf, pperf, used_steps = _e2e_step_models(report, step_times, seed)
    fit: dict[str, Any] = (
        fit_contention(report, sperf, pperf, seed) if contention is None else {"factor": float(contention), "fitted_on": None, "reason": "given"}
    )
    pperf_in_situ = slowed(pperf, fit["factor"]) if fit["factor"] != 1.0 else pperf
    errors: dict[str, float | None] = {}
    slo_errors: dict[str, float | None] = {}
    detail: dict = {}
    s0: dict = {}
    for name, measured in report.get("policies", {}).items():
        s0 = e2e_setup(report, name)
        try:
            sim = simulate(_e2e_config(report, name, sperf, pperf_in_situ, seed, steps=measured.get("steps") or None))
        except ValueError as exc:
            errors[name], slo_errors[name], detail[name] = None, None, f"not simulated: {exc}"
            continue
        mc = measured.get("calibration") or {}
        errors[name] = relative_error(sim["rl_steps_per_hour"], measured.get("rl_steps_per_hour"))
        slo_errors[name] = relative_error(sim["serving_slo_attainment"], measured.get("serving_slo_attainment"))
        detail[name] = {
            "metric": "rl_steps_per_hour",
            "measured": measured.get("rl_steps_per_hour"),
            "predicted": sim["rl_steps_per_hour"],
            "measured_slo_attainment": measured.get("serving_slo_attainment"),
            "predicted_slo_attainment": sim["serving_slo_attainment"],
            "slo_attainment_error": slo_errors[name],
            "measured_rollout_s_per_step": measured.get("rollout_s_per_step"),
            "predicted_rollout_s_per_step": sim["rollout_s_per_step"],
            "measured_trainer_wait_s_per_step": mc.get("trainer_wait_s_per_step"),
            "predicted_trainer_wait_s_per_step": sim["trainer_wait_s_per_step"],
            "predicted_groups_per_trained_step": sim["groups_per_trained_step"],
            "measured_turn_s_p50": mc.get("turn_s_p50"),
            "predicted_turn_s_p50": sim["turn_s_p50"],
            "measured_dedicated_rollout_tokens_per_s": mc.get("dedicated_rollout_tokens_per_s"),
            "predicted_dedicated_rollout_tokens_per_s": sim["dedicated_rollout_tokens_per_s"],
            "measured_rollout_tokens_on_serving_fraction": measured.get("harvested_fraction"),
            "predicted_rollout_tokens_on_serving_fraction": sim["rollout_tokens_on_serving_fraction"],
            "steps_simulated": sim["steps"],
        }
    if fit.get("fitted_on") and isinstance(detail.get("static"), dict):
        detail["static"]["fitted"] = (
            "the rollout engine's in-situ slowdown is fitted to this run's median turn time: static's error is "
            "partly fitted by construction (its steps/h and SLO attainment are not fitted)"
        )
    trainer = (
        {k: s0[k] for k in ("prefetch_steps", "max_staleness", "early_hand_out", "group_size", "worker_concurrency", "trainer_settings_from")}
        if s0
        else None
    )
    return {
        "calibration": errors,
        "calibration_slo_attainment": slo_errors,
        "calibration_detail": {
            "source": source,
            "against": "rose bench e2e (the real RL job)",
            "per_policy": detail,
            "trainer": trainer,
            "contention": {**fit, "applies_to": "the policy's step times on every executor, every policy (serving step times as measured)"},
            "step_times": used_steps,
        },
    }
