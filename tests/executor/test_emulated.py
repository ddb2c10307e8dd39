"""The emulated accelerator (services/executor/emulated.py): the real engine, device time from the step model.

What is checked is what the emulation promises, never a speed: forwards are priced by the simulator's own
step model (the device's planned seconds add up to exactly the roofline of the batches the engine ran),
pools are sized in the emulated device's memory, the generator honours lengths and never ends a turn
itself, a serving forward goes before a long rollout one, and a fleet's settings keep their proportions
under a time scale. A duration is only ever bounded from below (the host can be late, never early).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from rose.services.executor.config import EmulationSettings
from rose.services.executor.emulated import EmulatedAccelerator, EmulationSpec, default_memory, emulation_spec, instance_tp, parse_device
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass
from rose.services.executor.telemetry import Telemetry
from rose.shared.devices import DEVICES, MODELS, Roofline, SyncSpec, fold_seconds, model_spec, sync_seconds
from rose.shared.lora import LoraShape
from rose.testing.engine import EMULATED_7B_H100, CoServingEngineTestcase

SPEC_7B = EMULATED_7B_H100


@pytest.fixture
def emulated(loaded):
    """Started emulated engines (7B on an H100), stopped at teardown."""
    engines: list[Engine] = []

    def build(spec: EmulationSpec = SPEC_7B, **config) -> Engine:
        s_model, s_tok = loaded["serving"]
        p_model, p_tok = loaded["policy"]
        engine = Engine(s_model, s_tok, p_model, p_tok, EngineConfig(device="emulated:H100", emulation=spec, **config))
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        asyncio.run(engine.stop())


def _request(rid: str, work_class: WorkClass, prompt: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, work_class=work_class, prompt_token_ids=tuple(prompt), sampling=EngineSampling(max_tokens=max_tokens), **kw
    )


def test_pools_are_sized_in_the_emulated_devices_memory(emulated):
    engine = emulated()
    pool = engine.work_for(WorkClass.ROLLOUT).pool
    kv_per_token = MODELS["7B"].kv_bytes_per_token  # 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes
    assert pool.block_bytes == kv_per_token * pool.block_size
    assert pool.num_blocks == SPEC_7B.rollout_kv_bytes // pool.block_bytes
    assert pool.k.numel() == 0 and pool.capacity_bytes > 8e9 - pool.block_bytes  # accounted, never allocated
    telemetry = engine.device.telemetry()
    assert telemetry.kind == "emulated" and telemetry.memory_total_bytes == DEVICES["H100"].hbm_bytes
    assert telemetry.memory_used_bytes == int(2 * MODELS["7B"].weight_bytes + SPEC_7B.serving_kv_bytes + SPEC_7B.rollout_kv_bytes)


async def test_a_request_takes_the_step_models_time_and_its_own_length(emulated):
    """One serving request alone: its prefill chunks and decodes hold the device for exactly the roofline's
    time of those batches (the planned seconds add up), so it cannot finish sooner; it ends at max_tokens."""
    engine = emulated(serving_prefill_tokens=512)
    roof = Roofline(DEVICES["H100"], MODELS["7B"], 1)
    prompt = list(range(10, 1210))  # 1,200 tokens: prefill chunks of 512, 512, 176
    started = time.monotonic()
    result = await engine.submit(_request("s", WorkClass.SERVING, prompt, 50)).result()
    took = time.monotonic() - started
    assert result.finish_reason == "length" and len(result.token_ids) == 50
    chunks = roof.forward_s([], [(512.0, 0.0)]) + roof.forward_s([], [(512.0, 512.0)]) + roof.forward_s([], [(176.0, 1024.0)])
    decodes = sum(roof.forward_s([float(1200 + i)], []) for i in range(1, 50))
    assert engine.device.accelerator.planned_s == pytest.approx(chunks + decodes, rel=1e-9)
    assert took >= chunks + decodes


async def test_the_generator_never_ends_a_turn_and_is_seeded(emulated, loaded):
    engine = emulated()
    engine.set_rollout_lease(SPEC_7B.rollout_kv_bytes, time.monotonic() + 3600)
    tokenizer = loaded["policy"][1]
    eos = tokenizer.eos_token_id
    prompt = [5, 6, 7, 8]

    def rollout(rid: str, seed: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=rid,
            work_class=WorkClass.ROLLOUT,
            prompt_token_ids=tuple(prompt),
            sampling=EngineSampling(max_tokens=300, seed=seed, stop_token_ids=(eos, 11)),
            trajectory_id=rid,
            stream=False,
        )

    a, b, c = [await engine.submit(rollout(rid, seed)).result() for rid, seed in (("a", 1), ("b", 1), ("c", 2))]
    assert len(a.token_ids) == 300 and a.finish_reason == "length"
    assert not {eos, 11} & set(a.token_ids) and not set(tokenizer.all_special_ids) & set(a.token_ids)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids  # the seed, not the time, picks the tokens
    assert all(lp <= 0.0 for lp in a.logprobs) and len(a.logprobs) == 300


def test_a_serving_forward_goes_before_a_long_rollout_one():
    """The device runs one forward at a time, serving first: a rollout forward of a second yields within its
    quantum to a serving forward that asks, which finishes long before the rollout one does."""
    device = EmulatedAccelerator(layers=28, quantum_s=0.01)
    done: dict[str, float] = {}

    def run(lane: WorkClass, seconds: float) -> None:
        device.run(lane, seconds)
        done[lane.value] = time.monotonic()

    rollout = threading.Thread(target=run, args=(WorkClass.ROLLOUT, 1.0))
    rollout.start()
    time.sleep(0.05)
    serving = threading.Thread(target=run, args=(WorkClass.SERVING, 0.01))
    serving.start()
    serving.join()
    rollout.join()
    assert done["serving"] < done["rollout"]
    assert device.planned_s == pytest.approx(1.01)


def test_an_abandoned_rollout_forward_stops_at_a_layer_boundary():
    device = EmulatedAccelerator(layers=4, quantum_s=0.01)
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert device.run(WorkClass.ROLLOUT, 2.0, should_stop=stop.is_set) is False
    assert time.monotonic() - started < 1.0  # abandoned at the layer in progress (0.5 s each), not run to its end


def test_a_serving_lane_busy_forward_after_forward_leaves_rollout_its_turn():
    """Serving's decode forwards back to back, each asked by its thread the moment the last ends, and a rollout
    forward of three quanta: each serving forward is followed by at most one rollout quantum, the alternation the
    simulator prices (sim/coserve.py), so the rollout forward ends after about four serving forwards, not after the
    serving lane runs out of work (its thread would win every race for the device)."""
    device = EmulatedAccelerator(layers=28, quantum_s=0.01)
    ended: list[str] = []
    serving_forwards = 40

    def serve() -> None:
        for _ in range(serving_forwards):
            device.run(WorkClass.SERVING, 0.01)
            ended.append("serving")

    def rollout() -> None:
        device.run(WorkClass.ROLLOUT, 0.03)
        ended.append("rollout")

    serving = threading.Thread(target=serve)
    serving.start()
    time.sleep(0.015)  # serving's second forward is running: from now on serving always waits for the device
    rollout_thread = threading.Thread(target=rollout)
    rollout_thread.start()
    serving.join()
    rollout_thread.join()
    assert ended.index("rollout") < serving_forwards // 2
    assert device.planned_s == pytest.approx(serving_forwards * 0.01 + 0.03)


def _run_then_note(device: EmulatedAccelerator, work: WorkClass, order: list[str], name: str) -> None:
    device.run(work, 0.005)
    order.append(name)


def test_a_prefilling_serving_forward_owes_rollout_no_turn():
    """A serving forward that carries prefill is compute-bound: rollout waiting beside it gets no turn after it
    (the simulator's rollout gets nothing while a first token is prefilled), while after a decode one it does."""
    for prefill, rollout_first in ((True, False), (False, True)):
        device = EmulatedAccelerator(layers=28, quantum_s=0.01)
        order: list[str] = []
        first = threading.Thread(target=device.run, args=(WorkClass.SERVING, 0.05), kwargs={"prefill": prefill})
        first.start()
        time.sleep(0.01)
        rollout = threading.Thread(target=_run_then_note, args=(device, WorkClass.ROLLOUT, order, "rollout"))
        rollout.start()
        time.sleep(0.01)
        second = threading.Thread(target=_run_then_note, args=(device, WorkClass.SERVING, order, "serving"))
        second.start()
        for t in (first, rollout, second):
            t.join()
        assert (order[0] == "rollout") is rollout_first, (prefill, order)


def test_a_decode_forward_is_a_graph_replay_and_a_prefill_one_stops_at_a_layer(emulated):
    """On the GPU it emulates, rollout decodes replay CUDA graphs: a replay's one safepoint is before it, so a
    serving arrival during it does not abandon it (nothing is lost); a prefill forward is eager and stops at the
    next layer boundary, its work lost."""
    from rose.services.executor.forward_item import ForwardItem
    from rose.services.executor.sampling import SamplerState

    engine = emulated()
    runner = engine.rollout.runner
    sampler = SamplerState(EngineSampling(max_tokens=4), seed=1)
    decodes = [ForwardItem([0], 100 + i, [7]) for i in range(8)]
    calls: list[int] = []

    def stop_after_first_ask() -> bool:
        calls.append(1)
        return len(calls) > 1

    assert runner.forward_sample(decodes, [(0, sampler)], should_stop=stop_after_first_ask) is not None
    assert len(calls) == 1  # asked once, before the replay
    assert runner.forward_sample(decodes, [(0, sampler)], should_stop=lambda: True) is None
    prefill = [ForwardItem(list(range(80)), 0, list(range(10, 1290)))]
    calls.clear()
    assert runner.forward_sample(prefill, [(0, sampler)], should_stop=stop_after_first_ask) is None


def test_the_rollout_prefill_chunk_is_the_policys_roofline_ridge(emulated, make_engine):
    """An emulated executor prefills rollout in chunks of the roofline's ridge: fewer tokens cost a whole weight
    read anyway (64 did, ~4x the time per token at 7B on an H100), more only lengthen a forward an arrival
    abandons. A CPU executor keeps short chunks (its forward is the host's own eager work)."""
    roof = SPEC_7B.roofline(WorkClass.ROLLOUT)
    ridge = roof.ridge_tokens()
    assert roof.forward_s([], [(float(ridge), 0.0)]) == pytest.approx(roof.forward_s([], [(1.0, 0.0)]), rel=0.01)
    assert roof.forward_s([], [(2.0 * ridge, 0.0)]) > 1.5 * roof.forward_s([], [(float(ridge), 0.0)])
    assert emulated().rollout.limits.prefill_tokens == ridge
    assert make_engine().rollout.limits.prefill_tokens == 64


async def test_the_measured_rollout_prefill_rate_is_the_step_models_at_most(emulated):
    """What the scheduler prices a moved turn's prefill at (``rollout_prefill_tokens_per_s``): the prompt tokens of the
    rollout forwards that prefilled over their seconds. On an emulated H100 it is positive and never above the step
    model's rate for the chunks the engine ran (the host can be late, never early); decode steps leave it alone."""
    engine = emulated()
    engine.set_rollout_lease(SPEC_7B.rollout_kv_bytes, time.monotonic() + 3600)
    assert engine.stats().rollout_prefill_tokens_per_s == 0.0  # nothing prefilled yet: unknown
    roof = SPEC_7B.roofline(WorkClass.ROLLOUT)
    ridge = engine.rollout.limits.prefill_tokens
    prompt = list(range(10, 10 + 2 * ridge + 20))  # chunks of ridge, ridge and 20 tokens
    result = await engine.submit(_request("r", WorkClass.ROLLOUT, prompt, 30)).result()
    assert len(result.token_ids) == 30
    fastest = max(ridge / roof.forward_s([], [(float(ridge), 0.0)]), ridge / roof.forward_s([], [(float(ridge), float(ridge))]))
    measured = engine.stats().rollout_prefill_tokens_per_s
    assert 0.0 < measured <= fastest * (1 + 1e-9)
    snapshot = Telemetry(engine, "executor-1", "serving", 1.0).snapshot(engine.stats())  # what the monitor receives
    assert snapshot.rollout_prefill_tokens_per_s == measured


def test_emulation_settings_are_checked_and_sized_as_the_simulator_sizes():
    assert parse_device("emulated:h100") == "H100"
    with pytest.raises(ValueError, match="emulated:A100"):
        parse_device("emulated:B200")
    assert instance_tp("H100", "70B", "70B", dedicated=False) == 8 and instance_tp("H100", "70B", "70B", dedicated=True) == 4
    spec = emulation_spec("emulated:H100", EmulationSettings(model="7B"), dedicated=False, quantum_ms=10.0)
    assert (spec.serving_kv_bytes, spec.rollout_kv_bytes) == default_memory("H100", 1, spec.weight_bytes(), False)
    sized = emulation_spec("emulated:H100", EmulationSettings(model="7B", rollout_kv_gib=20.0), dedicated=True, quantum_ms=10.0)
    assert sized.rollout_kv_bytes == 20 << 30 and sized.dedicated
    with pytest.raises(ValueError, match="choose one of"):
        emulation_spec("emulated:H100", EmulationSettings(model="9B"), dedicated=False, quantum_ms=10.0)
    with pytest.raises(ValueError, match="cannot hold the weights"):
        default_memory("A100", 1, 2 * model_spec("70B").weight_bytes, False)
    # a co-batched serving instance hosts the serving model and the adapter, no copy of the base: more KV to lend
    lora = LoraShape(rank=8, alpha=16.0)
    co = emulation_spec("emulated:H100", EmulationSettings(model="7B"), dedicated=False, quantum_ms=10.0, lora=lora, co_batched=True)
    assert co.weight_bytes() == pytest.approx(model_spec("7B").weight_bytes + co.adapter_bytes)
    assert co.rollout_kv_bytes - spec.rollout_kv_bytes == pytest.approx((model_spec("7B").weight_bytes - co.adapter_bytes) / 2, rel=1e-6)
    assert co.version_bytes == co.adapter_bytes < 3e-3 * model_spec("7B").weight_bytes  # rank 8: 0.27 % of 7B's weights
    with pytest.raises(ValueError, match="adapts the serving model"):
        emulation_spec("emulated:H100", EmulationSettings(model="7B", policy_model="14B"), dedicated=False, quantum_ms=10.0, lora=lora)


def test_a_new_version_arrives_as_the_simulator_prices_it(loaded):
    """An emulated executor waits out the real model's delta over the link before a version goes live: the
    simulator's sync_seconds (cross-cluster for a serving instance, the trainer's fabric for a dedicated one)."""
    from rose.services.executor.device import EmulatedDevice

    serving = EmulatedDevice(SPEC_7B)
    dedicated = EmulatedDevice(EmulationSpec(**{**SPEC_7B.__dict__, "dedicated": True, "time_scale": 3.0}))
    weights = MODELS["7B"].weight_bytes
    assert serving.weight_transfer_s() == pytest.approx(sync_seconds(weights, "delta", SyncSpec(), cross_cluster=True))
    assert dedicated.weight_transfer_s() == pytest.approx(3.0 * sync_seconds(weights, "delta", SyncSpec(), cross_cluster=False))
    # a LoRA version is its adapter, whole; run as a model of its own (two-model), it is then folded into the base copy
    lora = LoraShape(rank=8, alpha=16.0)
    co_batched = EmulatedDevice(EmulationSpec(**{**SPEC_7B.__dict__, "lora": lora, "co_batched": True}))
    merged = EmulatedDevice(EmulationSpec(**{**SPEC_7B.__dict__, "lora": lora, "dedicated": True}))
    adapter = co_batched.spec.adapter_bytes
    assert co_batched.weight_transfer_s() == pytest.approx(sync_seconds(adapter, "full", SyncSpec(), cross_cluster=True))
    fold = fold_seconds(MODELS["7B"].adapted_weight_bytes(lora), SyncSpec())
    assert merged.weight_transfer_s() == pytest.approx(sync_seconds(adapter, "full", SyncSpec(), cross_cluster=False) + fold)
    assert 0.8 * weights < MODELS["7B"].adapted_weight_bytes(lora) < weights  # all-linear: all but the embeddings


class TestEmulatedEngine(CoServingEngineTestcase):
    """The shared engine test case (rose.testing.engine) on the emulated accelerator (7B on an H100)."""

    long_tokens = 120  # ~10 ms a step of emulated device time: over a second in flight
    lease_bytes = 1 << 30  # 7B's KV is 56 KiB a token

    @pytest.fixture
    def engine(self, emulated):
        return emulated()


class TestEmulatedCoBatchedEngine(CoServingEngineTestcase):
    """The shared engine test case on the emulated accelerator in the co-batched mode: a rank-8 LoRA policy of the 7B
    serving model, its rows priced inside serving's forwards (``Roofline.forward_s`` with the adapter's kernels)."""

    long_tokens = 120
    lease_bytes = 1 << 30

    @pytest.fixture
    def engine(self, loaded):
        from rose.shared.lora import Adapter, model_fingerprint, new_adapter

        model, tok = loaded["serving"]
        shape = LoraShape(rank=8, alpha=16.0)
        adapter = Adapter(shape=shape, tensors=new_adapter(model, shape), base="", base_fingerprint=model_fingerprint(model.state_dict()))
        spec = dataclasses.replace(SPEC_7B, lora=shape, co_batched=True)
        config = EngineConfig(device="emulated:H100", emulation=spec, rollout_mode="co_batched")
        engine = Engine(model, tok, None, tok, config, adapter=adapter)
        engine.start()
        yield engine
        asyncio.run(engine.stop())
