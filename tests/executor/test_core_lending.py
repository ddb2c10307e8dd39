"""CPU core lending: the serving lane lends its core while it waits and gets it back before it computes."""

import asyncio
import threading
import time

import pytest

from rose.services.executor.core_lending import CoreLending
from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass


def test_lent_core_is_taken_back_only_once_the_rollout_lane_has_narrowed():
    widths: list[int] = []
    cores = CoreLending(1, 2, widths.append, return_timeout_s=60.0)
    assert cores.fit() is False and widths == []  # nothing lent: stays narrow
    cores.lend()
    cores.fit()
    assert cores.is_wide and widths == [2]
    cores.fit()
    assert widths == [2]  # no change while lent
    took_back = threading.Event()

    def serving_lane():
        cores.take_back()
        took_back.set()

    t = threading.Thread(target=serving_lane)
    t.start()
    while cores.returns == 0:  # the serving lane has recalled its core and is about to wait ...
        pass
    assert not cores.lent and not took_back.is_set()  # ... for the rollout lane, which still spans it
    assert cores.fit() is True and widths == [2, 1]  # next safepoint: narrowed
    t.join()
    assert took_back.is_set() and cores.returns == 1


def test_recall_before_the_rollout_lane_widens_costs_the_serving_lane_nothing():
    widths: list[int] = []
    cores = CoreLending(1, 2, widths.append)
    cores.lend()
    cores.recall()  # an arrival
    assert cores.fit() is False and not cores.is_wide and widths == []
    cores.take_back()
    assert cores.returns == 0  # it never had to wait


def test_an_idle_rollout_lane_narrows_at_once_and_a_single_width_never_lends():
    widths: list[int] = []
    cores = CoreLending(1, 2, widths.append)
    cores.lend()
    cores.fit()
    cores.fit(may_widen=False)  # the rollout lane goes idle, the core still lent
    assert widths == [2, 1] and not cores.is_wide
    cores.take_back()
    assert cores.returns == 0  # nothing to wait for
    single = CoreLending(2, 2, widths.append)
    single.lend()
    assert not single.enabled and not single.lent and single.fit() is False


def _serving(i):
    ids = tuple(range(20, 60))
    return GenerationRequest(
        request_id=f"s{i}", work_class=WorkClass.SERVING, prompt_token_ids=ids, sampling=EngineSampling(temperature=0, max_tokens=12, ignore_eos=True)
    )


def _rollout(i):
    ids = tuple(range(30, 62))
    return GenerationRequest(
        request_id=f"r{i}",
        work_class=WorkClass.ROLLOUT,
        prompt_token_ids=ids,
        sampling=EngineSampling(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True),
        stream=False,
    )


async def _serve_beside_rollout(engine, n_serving=6, n_rollout=8):
    rollouts = [engine.submit(_rollout(i)) for i in range(n_rollout)]
    await asyncio.sleep(0.05)
    serving = []
    for i in range(n_serving):
        serving.append(await engine.submit(_serving(i)).result())
        await asyncio.sleep(0.01)
    return serving, [await h.result() for h in rollouts]


async def test_rose_lends_the_idle_serving_core_and_serves_the_same_tokens(make_engine):
    """Under rose the rollout lane spans the serving core while serving has no work and gives it
    back to each arrival; serving tokens are those of serving alone, every rollout finishes whole."""
    alone = make_engine("serving_only")
    reference = [await alone.submit(_serving(i)).result() for i in range(6)]
    engine = make_engine("rose")
    if not engine.core_lending.enabled:  # a one-core machine: there is no second core to lend (asserted, not skipped)
        assert engine.device.max_lane_width(1) == 1
        return
    serving, rollouts = await _serve_beside_rollout(engine)
    assert [r.token_ids for r in serving] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in rollouts)
    assert engine.core_lending.returns > 0  # the rollout lane spanned the serving core and gave it back


async def test_static_partition_never_lends_the_serving_core(make_engine):
    engine = make_engine("static_partition")
    assert not engine.core_lending.enabled
    await _serve_beside_rollout(engine, n_serving=2, n_rollout=2)
    assert engine.core_lending.returns == 0 and not engine.core_lending.is_wide


def test_rose_pauses_rollout_as_a_burst_fills_the_serving_batch():
    """Where rollout shares the serving interpreter, the batch is filling once its free slots would be
    taken within the TTFT margin ((1 - setpoint) x SLO = 20 ms here) at the recent arrival rate (500/s:
    10 slots), or once the serving step is past half the TPOT setpoint (32 ms / 2)."""
    from rose.services.executor.policies import Signals, make_policy

    rose = make_policy("rose")
    side_by_side = dict(
        serving_prefill_pending=0,
        serving_iteration_ms=5.0,
        slo_tpot_ms=40.0,
        lanes_overlap=False,
        serving_max_batch=32,
        slo_ttft_ms=100.0,
        serving_arrival_rate_rps=500.0,
    )
    assert rose.may_run_rollout(Signals(now=0.0, serving_running=21, **side_by_side))
    assert not rose.may_run_rollout(Signals(now=0.0, serving_running=22, **side_by_side))  # 10 slots left: filled within the margin
    assert not rose.may_run_rollout(Signals(now=0.0, serving_running=4, **{**side_by_side, "serving_iteration_ms": 17.0}))  # step past 32 / 2 ms
    unknown_limit = {**side_by_side, "serving_max_batch": 0}
    assert rose.may_run_rollout(Signals(now=0.0, serving_running=30, **unknown_limit))
    # rollout forwards in a process of their own: no interpreter lock to hand over, so only the backlog and
    # iteration-time guards (which see the hardware's interference directly) pause it
    own_process = {**side_by_side, "shares_interpreter": False}
    assert rose.may_run_rollout(Signals(now=0.0, serving_running=30, **own_process))
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_running=30, **{**own_process, "serving_prefill_pending": 2, "serving_oldest_wait_ms": 70.0})
    )
    assert not rose.may_run_rollout(Signals(now=0.0, serving_running=30, **{**own_process, "serving_iteration_ms": 33.0}))


def test_side_by_side_rose_pauses_for_a_serving_backlog_once_its_first_tokens_are_at_risk():
    """Beside serving (own cores), first tokens pause rollout once the oldest one is projected to land past
    the guard's share x the setpoint of the TTFT SLO (its wait plus a serving iteration for it and each
    first token queued behind it); without a TTFT SLO, at a backlog of two; where the lanes overlap, at one."""
    from rose.services.executor.policies import Signals, make_policy

    rose = make_policy("rose")
    beside = dict(serving_running=4, serving_iteration_ms=5.0, slo_tpot_ms=40.0, lanes_overlap=False, serving_max_batch=32, shares_interpreter=False)
    assert rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=74.0, slo_ttft_ms=100.0, **beside))
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=75.0, slo_ttft_ms=100.0, **beside)
    )  # 75 + 5 = 0.8 x 100 ms
    assert rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=3, serving_oldest_wait_ms=64.0, slo_ttft_ms=100.0, **beside))
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=3, serving_oldest_wait_ms=65.0, slo_ttft_ms=100.0, **beside)
    )  # 65 + 3 x 5 ms
    # the closed loop's share scales the thresholds: at half, 40 ms for the first token, 16 ms for the serving step
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=35.0, slo_ttft_ms=100.0, rollout_share=0.5, **beside)
    )
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=0, slo_ttft_ms=100.0, rollout_share=0.5, **{**beside, "serving_iteration_ms": 17.0})
    )
    assert rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=0, slo_ttft_ms=100.0, rollout_share=0.5, **{**beside, "serving_iteration_ms": 15.0})
    )
    assert rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=0.0, **beside))  # no TTFT SLO known: one may wait
    assert not rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=2, serving_oldest_wait_ms=0.0, **beside))  # ... two may not
    overlap = {**beside, "lanes_overlap": True}
    assert not rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=0.0, slo_ttft_ms=100.0, **overlap))


def test_on_a_gpu_rose_keeps_decoding_beside_pending_first_tokens_but_holds_its_eager_prefill():
    """CUDA: serving's stream has priority and rollout decodes by graph replay, so pending first tokens
    stop only rollout's eager prefill, until they are at risk (projected past the setpoint of the TTFT SLO);
    a filling serving batch likewise; without graphs every rollout step is eager and pauses as before."""
    from rose.services.executor.policies import Signals, make_policy

    rose = make_policy("rose")
    gpu = dict(
        serving_running=4,
        serving_iteration_ms=5.0,
        slo_tpot_ms=40.0,
        lanes_overlap=True,
        serving_max_batch=32,
        priority_streams=True,
        rollout_decode_graphs=True,
        slo_ttft_ms=100.0,
    )
    pending = Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=10.0, **gpu)
    assert rose.may_run_rollout(pending) and not rose.may_prefill_rollout(pending)
    at_risk = Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=75.0, **gpu)
    assert not rose.may_run_rollout(at_risk)
    assert not rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=1, **{**gpu, "slo_ttft_ms": None}))  # no TTFT SLO known
    quiet = Signals(now=0.0, serving_prefill_pending=0, **gpu)
    assert rose.may_run_rollout(quiet) and rose.may_prefill_rollout(quiet)
    filling = Signals(now=0.0, serving_prefill_pending=0, **{**gpu, "serving_running": 22, "serving_arrival_rate_rps": 500.0})
    assert rose.may_run_rollout(filling) and not rose.may_prefill_rollout(filling)
    assert not rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=0, **{**gpu, "serving_iteration_ms": 33.0}))  # TPOT guard
    eager = {**gpu, "rollout_decode_graphs": False}
    assert not rose.may_run_rollout(
        Signals(now=0.0, serving_prefill_pending=0, **{**eager, "serving_running": 22, "serving_arrival_rate_rps": 500.0})
    )
    assert rose.may_prefill_rollout(Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=10.0, **eager))
    cpu_widened = {**gpu, "priority_streams": False, "rollout_decode_graphs": False}  # CPU lane over serving's core: give it back now
    assert not rose.may_run_rollout(Signals(now=0.0, serving_prefill_pending=1, serving_oldest_wait_ms=0.0, **cpu_widened))
    for name in ("serving_only", "naive_share", "static_partition"):
        assert make_policy(name).may_prefill_rollout(pending)


async def test_a_rollout_iteration_told_not_to_prefill_only_decodes(loaded):
    """The engine side of may_prefill_rollout: running rollouts take their decode step, a new prompt
    waits unadmitted, and is prefilled once prefill is allowed again."""
    from rose.services.executor.engine import Engine, EngineConfig

    config = EngineConfig(serving_kv_bytes=8 << 20, rollout_kv_bytes=16 << 20, device="cpu", rollout_process=False)
    engine = Engine(*loaded["serving"], *loaded["policy"], config, "rose")  # not started: this test drives the rollout lane
    engine.set_rollout_lease(config.rollout_kv_bytes, time.monotonic() + 600)
    lane = engine._rollout_loop
    lane._between_quanta()
    rt = engine.rollout
    for i in range(2):
        engine.submit(_rollout(i))
    rt.receive()
    lane._iterate(admit=True)  # both prompts prefilled, a first token each
    assert [len(s.tokens) - s.prompt_len for s in rt.running] == [1, 1]
    engine.submit(_rollout(2))
    rt.receive()
    engine.policy.may_prefill_rollout = lambda s: False
    lane._iterate(admit=True)
    assert [len(s.tokens) - s.prompt_len for s in rt.running] == [2, 2] and len(rt.waiting) == 1
    del engine.policy.may_prefill_rollout
    lane._iterate(admit=True)
    assert [len(s.tokens) - s.prompt_len for s in rt.running] == [3, 3, 1] and not rt.waiting


async def test_the_rollout_lane_sees_how_long_the_oldest_serving_first_token_has_waited(loaded):
    """The signal behind the guard above: serving requests queued, waiting or admitted but not yet
    prefilled are counted once each, and the longest wait among them is reported."""
    from rose.services.executor.engine import Engine, EngineConfig

    config = EngineConfig(serving_kv_bytes=8 << 20, rollout_kv_bytes=16 << 20, device="cpu", rollout_process=False)
    engine = Engine(*loaded["serving"], *loaded["policy"], config, "rose")  # not started: the queues stay as set here
    engine.set_slo(100.0, 40.0)
    signals = engine._rollout_loop.signals()
    assert (signals.serving_prefill_pending, signals.serving_oldest_wait_ms, signals.slo_ttft_ms) == (0, 0.0, 100.0)
    for i in range(3):
        engine.submit(_serving(i))
    rt = engine.serving
    admitted, waiting, queued = rt.inbox
    rt.inbox.clear()
    rt.running.append(admitted)
    rt.waiting.append(waiting)
    rt.inbox.append(queued)
    admitted.arrival, waiting.arrival, queued.arrival = 10.0, 10.2, 10.1
    rt.count_unprefilled()
    assert engine._rollout_loop.signals().serving_prefill_pending == 3
    assert rt.oldest_wait_ms(10.5) == pytest.approx(500.0)
    admitted.num_cached = admitted.prompt_len  # prefilled: its first token is out of danger
    rt.count_unprefilled()
    assert engine._rollout_loop.signals().serving_prefill_pending == 2
    assert rt.oldest_wait_ms(10.5) == pytest.approx(400.0)  # the queued one, older than the waiting one
    rt.inbox.clear()
    rt.waiting.clear()
    assert rt.oldest_wait_ms(10.5) == 0.0


async def test_an_idle_rollout_lane_never_holds_the_serving_core(make_engine):
    """With a lease but no rollout work the lane stays narrow: serving never waits for its core."""
    engine = make_engine("rose")
    for i in range(3):
        await engine.submit(_serving(i)).result()
        await asyncio.sleep(0.02)  # serving idles: its core is lent, nobody takes it
    assert not engine.core_lending.is_wide and engine.core_lending.returns == 0


def test_the_executor_setting_turns_lending_off(model_paths):
    """ROSE_ENGINE__LEND_SERVING_CORE=false (several executors on one host's cores) reaches the engine."""
    from rose.services.executor.config import ExecutorConfig
    from rose.services.executor.main import build_engine
    from rose.shared.config import load_config

    models = {"ROSE_MODELS__SERVING_DIR": str(model_paths.serving), "ROSE_MODELS__POLICY_DIR": str(model_paths.policy), "ROSE_ENGINE__DEVICE": "cpu"}
    on = build_engine(load_config(ExecutorConfig, env=models))
    assert on.core_lending.enabled == (on.device.max_lane_width(1) > 1)  # on by default wherever there is a core to lend
    off = build_engine(load_config(ExecutorConfig, env={**models, "ROSE_ENGINE__LEND_SERVING_CORE": "false"}))
    assert not off.core_lending.enabled
