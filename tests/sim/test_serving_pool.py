"""A co-hosting serving instance's KV pool is what its requests in flight hold at p99.9 of instants (sizing.py
``serving_pool_tokens``), which the simulator and the planner both use: checked here against a replay of
Poisson arrivals second by second, and for the reason a margin over the mean batch was wrong."""

from __future__ import annotations

import numpy as np
import pytest

from rose.shared.devices import DEVICES, Roofline, model_spec, serving_tp, usable_bytes
from rose.sim.coserve import serving_tick, slo_capacity_rps
from rose.sim.sizing import SERVING_POOL_QUANTILE, serving_pool_tokens
from rose.sim.traces import SAMPLE_CSV, load_azure_csv, requests_to_trace

TRACE = requests_to_trace(load_azure_csv(SAMPLE_CSV))
PROMPT, OUTPUT = float(np.mean(TRACE.request_sizes[0])), float(np.mean(TRACE.request_sizes[1]))


def _instance(serving: str, policy: str, load: float):
    h100 = DEVICES["H100"]
    big = model_spec(serving)
    tp = serving_tp(big, model_spec(policy), h100)
    perf = Roofline(h100, big, tp)
    alone = (usable_bytes(h100, tp) - big.weight_bytes) / big.kv_bytes_per_token
    rate = load * slo_capacity_rps(perf, PROMPT, OUTPUT, TRACE.prompt_p99, 1.0, 0.1, alone)
    return perf, rate, alone


def _replayed_p999(perf, rate: float, alone: float, horizon_s: float = 3000.0, dt: float = 0.02) -> tuple[float, float]:
    """Arrivals over time, each holding its prompt from arrival and one more token per decode step until it ends;
    the p99.9 and the mean of the tokens held, read every ``dt`` after a warm-up."""
    batch = float(serving_tick(perf, np.array([rate]), PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, 0.0, 0.0, 1.0, alone).batch[0])
    prefill_s = float(perf.prefill_s(PROMPT))
    per_token_s = (batch / rate - prefill_s) / OUTPUT
    rng = np.random.default_rng(1)
    arrive = np.sort(rng.uniform(0.0, horizon_s, rng.poisson(rate * horizon_s)))
    pick = rng.integers(0, len(TRACE.request_sizes[0]), len(arrive))
    prompt, output = TRACE.request_sizes[0][pick].astype(float), TRACE.request_sizes[1][pick].astype(float)
    decode_from = arrive + prefill_s
    end = decode_from + output * per_token_s
    t = np.arange(0.0, horizon_s, dt)
    held = np.zeros_like(t)
    for a, d, e, p in zip(arrive, decode_from, end, prompt):
        span = slice(int(a / dt), min(len(t), int(e / dt)))
        held[span] += p + np.clip((t[span] - d) / per_token_s, 0.0, None)
    steady = held[int(200.0 / dt) :]
    return float(np.quantile(steady, SERVING_POOL_QUANTILE)), float(steady.mean())


@pytest.mark.parametrize(("serving", "policy", "load"), [("70B", "7B", 0.3), ("7B", "7B", 0.6)])
def test_the_pool_holds_what_a_replay_of_poisson_arrivals_holds_at_p99_9(serving, policy, load):
    perf, rate, alone = _instance(serving, policy, load)
    replayed, _ = _replayed_p999(perf, rate, alone)
    pool = serving_pool_tokens(perf, rate, PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, alone, TRACE.request_sizes)
    assert pool == pytest.approx(replayed, rel=0.1), (pool, replayed)


def test_few_requests_in_flight_need_a_pool_many_times_their_mean():
    """In units of the mean batch x (prompt + output): ~3.2 at a 70B TP4 instance's ~6 requests in flight, ~1.4 at
    ~140: no one margin fits both, and the 1.25 there was fell short of both."""
    ratios = []
    for serving, policy, load in (("70B", "7B", 0.3), ("7B", "7B", 0.9)):
        perf, rate, alone = _instance(serving, policy, load)
        batch = float(serving_tick(perf, np.array([rate]), PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, 0.0, 0.0, 1.0, alone).batch[0])
        pool = serving_pool_tokens(perf, rate, PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, alone, TRACE.request_sizes)
        ratios.append(pool / (batch * (PROMPT + OUTPUT)))
    few, many = ratios
    assert few > 2.0 and 1.25 < many < 1.6, ratios
    # and never more than the instance's whole KV, nor anything without traffic
    perf, rate, alone = _instance("7B", "7B", 0.5)
    assert serving_pool_tokens(perf, rate, PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, alone / 100, TRACE.request_sizes) == alone / 100
    assert serving_pool_tokens(perf, 0.0, PROMPT, OUTPUT, TRACE.prompt_p99, 0.0, alone, TRACE.request_sizes) == 0.0
