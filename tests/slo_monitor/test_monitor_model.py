"""The monitor's pure parts: window merging, the step-time headroom model, burst detection."""

from __future__ import annotations

import msgspec
from ddsketch import DDSketch

from rose.contracts.executor import PoolUsage
from rose.services.executor.slo_guard import SETPOINT
from rose.services.slo_monitor.bursts import BurstDetector
from rose.services.slo_monitor.config import HeadroomSettings, SloMonitorConfig
from rose.services.slo_monitor.headroom import assess, fit_step_model, lendable_kv_bytes, observations, rollout_slots
from rose.services.slo_monitor.monitor import Monitor
from rose.services.slo_monitor.windows import ExecutorWindow, fleet_stats
from rose.shared.bursts import BurstSettings
from rose.testing.messages import SNAPSHOT_INTERVAL_S as INTERVAL
from rose.testing.messages import snap


def test_windows_merge_sketches_exactly_per_executor_and_fleet():
    w1, w2 = ExecutorWindow(30.0), ExecutorWindow(30.0)
    ref = DDSketch(0.01)
    for i in range(20):
        values = [10.0 + i, 200.0 if i == 19 else 11.0]
        w1.add(snap(i * INTERVAL, ttft=values), i * INTERVAL)
        for v in values:
            ref.add(v)
    w2.add(snap(1.0, ex="ex-2", ttft=[500.0], arrivals=5), 1.0)
    s = w1.stats()
    assert abs(s.ttft_p99_ms - ref.get_quantile_value(0.99)) < 1e-6
    assert s.arrivals == 20 and abs(s.arrival_rate_rps - 10.0) < 1e-6
    fleet = fleet_stats([w1, w2], 30.0)
    ref.add(500.0)
    assert abs(fleet.ttft_p99_ms - ref.get_quantile_value(0.99)) < 1e-6  # one sketch over both executors
    assert fleet.ttft_count == 41
    assert abs(fleet.arrival_rate_rps - (10.0 + 50.0)) < 1e-6


def test_long_window_drops_old_snapshots():
    w = ExecutorWindow(2.0)
    for i in range(50):
        w.add(snap(i * INTERVAL), i * INTERVAL)
    assert w.snapshots[-1].at - w.snapshots[0].at <= 2.0
    assert len(w.recent(0.5)) == 5


def test_step_model_recovers_batch_coefficients_and_bounds_slots():
    obs = [(s, r, 5.0 + 0.8 * s + 0.3 * r) for s in range(1, 8) for r in (0, 4, 8, 16)]
    model = fit_step_model(obs, fallback_tpot_ms=10.0)
    assert abs(model.per_serving_ms - 0.8) < 0.05 and abs(model.per_rollout_ms - 0.3) < 0.05 and abs(model.base_ms - 5.0) < 0.3
    # margin 0.7 x 40 ms = 28 ms; serving at peak 7 (+1) costs 5 + 6.4 = 11.4 ms; (28 - 11.4) / 0.3 = 55 slots, capped
    assert rollout_slots(model, 7, 40.0, 0.7, 32) == 32
    assert rollout_slots(model, 7, 20.0, 0.7, 32) == int((14.0 - 11.4) / model.per_rollout_ms)
    assert rollout_slots(model, 30, 20.0, 0.7, 32) == 0  # serving alone eats the budget


def test_a_reserved_rollout_pool_is_lent_whole_and_free_memory_only_in_part():
    """An engine preallocates its rollout pool inside a budget that already keeps the workspace out: lending half of
    it priced a lane at half what it holds (docs/benchmarks.md). Free device memory still needs an allocation's margin."""
    cfg = HeadroomSettings(max_lend_kv_bytes=64 << 30, lend_memory_fraction=0.5)
    reserved = msgspec.structs.replace(snap(0.0), rollout_pool=PoolUsage(block_bytes=1 << 20, total_blocks=3000, used_blocks=7))
    assert lendable_kv_bytes(reserved, 0.1, cfg) == 3000 << 20
    assert lendable_kv_bytes(reserved, 0.9, cfg) == (3000 << 20) // 2  # serving above its high-water mark
    assert lendable_kv_bytes(reserved, 0.1, msgspec.structs.replace(cfg, max_lend_kv_bytes=1 << 30)) == 1 << 30
    none_reserved = snap(0.0)  # its rollout pool holds no block: 8 GiB total, 2 GiB used
    assert lendable_kv_bytes(none_reserved, 0.1, cfg) == 3 << 30
    assert lendable_kv_bytes(None, 0.1, cfg) == cfg.max_lend_kv_bytes


def test_thin_data_falls_back_to_the_prior():
    model = fit_step_model([(1, 0, 7.0)], fallback_tpot_ms=10.0)
    assert model.base_ms == 7.0 and model.observations == 1


def test_assess_lends_only_well_below_slo():
    cfg = HeadroomSettings(slo_ttft_ms=500.0, slo_tpot_ms=100.0)
    w = ExecutorWindow(30.0)
    for i in range(30):
        w.add(snap(i * INTERVAL, ttft=[40.0], tpot=[8.0 + (i % 3)], serving=1 + i % 3, rollout=4 * (i % 2)), i * INTERVAL)
    model = fit_step_model(observations(list(w.snapshots)), 10.0)
    ok = assess(w.stats(3.0), w.stats(), model, w.latest, cfg, alerting=False)
    assert ok.lendable and ok.slots > 0 and 0 < ok.kv_bytes <= cfg.max_lend_kv_bytes
    hot = ExecutorWindow(30.0)
    for i in range(30):
        hot.add(snap(i * INTERVAL, ttft=[450.0], tpot=[60.0]), i * INTERVAL)
    verdict = assess(hot.stats(3.0), hot.stats(), fit_step_model(observations(list(hot.snapshots)), 60.0), hot.latest, cfg, alerting=False)
    assert not verdict.lendable and "ttft" in verdict.reason and "tpot" in verdict.reason
    # TTFT's gate is the executor's own setpoint (0.8 x SLO: a lease adds at most a quantum to a first token), not half the
    # SLO: a large model's long prompts put p99 TTFT past half the SLO with TPOT calm (70B: 550-660 ms of 1000)
    slow_prefill = ExecutorWindow(30.0)
    for i in range(30):
        slow_prefill.add(snap(i * INTERVAL, ttft=[300.0], tpot=[8.0 + (i % 3)], serving=1 + i % 3, rollout=4 * (i % 2)), i * INTERVAL)
    fit = fit_step_model(observations(list(slow_prefill.snapshots)), 10.0)
    assert assess(slow_prefill.stats(3.0), slow_prefill.stats(), fit, slow_prefill.latest, cfg, alerting=False).lendable
    assert cfg.ttft_grant_fraction == SETPOINT
    assert not assess(w.stats(3.0), w.stats(), model, w.latest, cfg, alerting=True).lendable


def test_a_co_batched_executor_is_judged_against_its_guards_setpoint():
    """Co-batched rows raise serving's TPOT to the executor's guard setpoint by design: 70 ms of a 100 ms SLO is
    lendable there (under 0.8), where a two-model executor at 70 ms is not (over 0.5: its lease would be revoked as
    unhealthy, and the rows it sheds would bring it back, a lease on and off every window)."""
    cfg = HeadroomSettings(slo_ttft_ms=500.0, slo_tpot_ms=100.0)
    verdicts = {}
    for mode in ("two_model", "co_batched"):
        w = ExecutorWindow(30.0)
        for i in range(30):
            s = snap(i * INTERVAL, ttft=[40.0], tpot=[65.0 + (i % 3) * 2], serving=2 + i % 3, rollout=8 * (i % 2))
            w.add(msgspec.structs.replace(s, rollout_mode=mode), i * INTERVAL)
        model = fit_step_model(observations(list(w.snapshots)), 60.0)
        verdicts[mode] = assess(w.stats(3.0), w.stats(), model, w.latest, cfg, alerting=False)
    assert "tpot p99" in verdicts["two_model"].reason and not verdicts["two_model"].lendable
    assert "tpot p99" not in verdicts["co_batched"].reason
    hot = ExecutorWindow(30.0)  # past the setpoint: refused in either mode
    for i in range(30):
        hot.add(msgspec.structs.replace(snap(i * INTERVAL, ttft=[40.0], tpot=[90.0]), rollout_mode="co_batched"), i * INTERVAL)
    model = fit_step_model(observations(list(hot.snapshots)), 90.0)
    assert "tpot p99" in assess(hot.stats(3.0), hot.stats(), model, hot.latest, cfg, alerting=False).reason


def test_a_serving_queue_refuses_a_lease_only_when_its_first_tokens_are_projected_past_the_ttft_gate():
    cfg = HeadroomSettings(slo_ttft_ms=1000.0, slo_tpot_ms=100.0)
    gate = cfg.ttft_grant_fraction * cfg.slo_ttft_ms

    def verdict(queue: int, wait_ms: float | None):
        w = ExecutorWindow(30.0)
        for i in range(30):
            w.add(snap(i * INTERVAL, ttft=[40.0], tpot=[8.0 + (i % 3)], serving=1 + i % 3, queue=queue, queue_wait_ms=wait_ms), i * INTERVAL)
        return assess(w.stats(3.0), w.stats(), fit_step_model(observations(list(w.snapshots)), 10.0), w.latest, cfg, alerting=False)

    assert verdict(6, 0.2 * gate).lendable  # six waiting, drained well within the SLO: Poisson noise at this load
    refused = verdict(6, gate)
    assert not refused.lendable and "serving queue 6" in refused.reason
    # an executor that cannot project the wait (an SGLang backend): its queue's length decides, as before
    assert verdict(cfg.max_serving_queue, None).lendable
    assert not verdict(cfg.max_serving_queue + 1, None).lendable


def _detector() -> tuple[ExecutorWindow, BurstDetector]:
    cfg = BurstSettings(window_s=0.5, rate_ratio=2.0, min_arrivals=4, recover_s=1.0, realert_s=0.5)
    return ExecutorWindow(30.0), BurstDetector("ex-1", cfg, HeadroomSettings(), short_s=3.0)


def test_arrival_burst_is_detected_before_latency_moves_then_recovers():
    w, d = _detector()
    t = 0.0
    for _ in range(50):  # 10 rps baseline, latency fine
        w.add(snap(t, ttft=[30.0], tpot=[8.0], arrivals=1), t)
        assert d.observe(w, t) is None
        t += INTERVAL
    alert = None
    for _ in range(20):  # 30 rps: a 3x burst, latency still fine; at one false alarm an hour, within 2 s
        w.add(snap(t, ttft=[30.0], tpot=[8.0], arrivals=3), t)
        alert = alert or d.observe(w, t)
        t += INTERVAL
    assert alert is not None and alert.severity == "burst" and "arrival rate" in alert.reason
    after = []
    for _ in range(40):  # the longest window still holds the burst's arrivals for a while, then calm
        w.add(snap(t, ttft=[30.0], tpot=[8.0], arrivals=1), t)
        after.append(d.observe(w, t))
        t += INTERVAL
    alerts = [a.severity for a in after if a is not None]
    assert alerts and alerts[-1] == "recovered" and alerts.count("recovered") == 1


def test_poisson_noise_at_low_rate_is_no_burst():
    w, d = _detector()
    pattern = [0, 2, 0, 1, 3, 0, 1, 0, 2, 1]  # 10 rps on average, lumpy
    alerts = []
    for i in range(100):
        w.add(snap(i * INTERVAL, ttft=[30.0], tpot=[8.0], arrivals=pattern[i % 10]), i * INTERVAL)
        alerts.append(d.observe(w, i * INTERVAL))
    assert [a for a in alerts if a is not None] == []


def test_queue_growth_and_violation_raise_alerts():
    w, d = _detector()
    for i, q in enumerate([0, 0, 1, 5]):
        w.add(snap(i * INTERVAL, ttft=[30.0], tpot=[8.0], arrivals=0, queue=q), i * INTERVAL)
        alert = d.observe(w, i * INTERVAL)
    assert alert is not None and "queue" in alert.reason
    # the same growing queue, projected to be served well within the TTFT SLO: noise, no alert; near the SLO: a burst
    slo_ttft = HeadroomSettings().slo_ttft_ms
    for wait, alerts in ((0.1 * slo_ttft, False), (0.9 * slo_ttft, True)):
        wq, dq = _detector()
        for i, q in enumerate([0, 0, 1, 5]):
            wq.add(snap(i * INTERVAL, ttft=[30.0], tpot=[8.0], arrivals=0, queue=q, queue_wait_ms=wait), i * INTERVAL)
            alert = dq.observe(wq, i * INTERVAL)
        assert (alert is not None and "queue" in alert.reason) is alerts
    w2, d2 = _detector()
    w2.add(snap(0.0, ttft=[900.0], tpot=[8.0], arrivals=0), 0.0)
    alert = d2.observe(w2, 0.0)
    assert alert is not None and alert.severity == "violation"


def test_monitor_headroom_for_serving_and_dedicated():
    m = Monitor(SloMonitorConfig())
    for i in range(20):
        m.observe(snap(i * INTERVAL, ttft=[20.0], tpot=[5.0], rollout_tps=100.0 + i), now=i * INTERVAL)
        m.observe(snap(i * INTERVAL, ex="ded-1", role="dedicated", rollout_tps=400.0, arrivals=0), now=i * INTERVAL)
    h = m.headroom("ex-1", 2.0)
    assert h.role == "serving" and h.lendable and h.rollout_batch_slots > 0 and h.rollout_tokens_per_s == 119.0
    assert h.device_kind == "cpu" and h.device_memory_bytes == 8 << 30
    d = m.headroom("ded-1", 2.0)
    assert d.role == "dedicated" and d.rollout_tokens_per_s == 400.0
    assert h.rollout_prefill_tokens_per_s == d.rollout_prefill_tokens_per_s == 0.0  # none reported: unknown
    m.observe(msgspec.structs.replace(snap(20 * INTERVAL, ex="ded-1", role="dedicated", arrivals=0), rollout_prefill_tokens_per_s=9000.0), now=2.0)
    assert m.headroom("ded-1", 2.0).rollout_prefill_tokens_per_s == 9000.0  # the latest snapshot's
    assert set(m.live(2.5)) == {"ex-1", "ded-1"} and m.live(100.0) == []
    assert m.fleet_load()["executors"] == 2.0


def test_running_window_sums_read_the_quantiles_ddsketch_reads():
    """The window keeps bin sums (added on arrival, subtracted on eviction) instead of merging
    DDSketch objects on every snapshot; its p99 must be exactly what a DDSketch of the window's
    values reads, after evictions too, zeros included."""
    import numpy as np

    rng = np.random.default_rng(3)
    w = ExecutorWindow(2.0)
    values: list[tuple[float, list[float]]] = []
    for i in range(60):
        batch = [0.0] * int(rng.integers(0, 2)) + [float(v) for v in rng.lognormal(3.5, 0.6, size=int(rng.integers(0, 12)))]
        w.add(snap(i * INTERVAL, ttft=batch, tpot=batch[:3]), i * INTERVAL)
        values.append((i * INTERVAL, batch))
        ref, ref_short = DDSketch(0.01), DDSketch(0.01)
        for at, vs in values:
            for v in vs:
                if i * INTERVAL - at <= 2.0:
                    ref.add(v)
                if i * INTERVAL - at < 0.5:
                    ref_short.add(v)
        got, got_short = w.stats(), w.stats(0.5)
        assert got.ttft_p99_ms == (ref.get_quantile_value(0.99) or 0.0 if ref.count else 0.0)
        assert got_short.ttft_p99_ms == (ref_short.get_quantile_value(0.99) or 0.0 if ref_short.count else 0.0)
        assert got.ttft_count == ref.count
