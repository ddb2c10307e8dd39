"""The co-batched mode: a LoRA policy of the serving model, its rollout rows inside serving's own iterations."""

import asyncio
import copy
import time
import warnings

import pytest
import torch

from rose.services.executor.engine import Engine, EngineConfig, EngineModeError
from rose.services.executor.protocol import InvalidRequest, WorkClass
from rose.services.executor.weights import WeightUpdateError
from rose.shared.lora import Adapter, AdapterError, LoraShape, lora_config, model_fingerprint, new_adapter
from rose.testing.engine import CoServingEngineTestcase, generate, req
from rose.testing.polling import until

MIB = 1 << 20
SHAPE = LoraShape(rank=4, alpha=8.0)
CONFIG = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0, rollout_mode="co_batched")
FAR_S = 3600.0


def trained_adapter(model, seed: int = 1) -> Adapter:
    """An adapter of ``model`` whose B is not zero (version 0's is): what a few training steps leave."""
    tensors = new_adapter(model, SHAPE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (t + 0.05 * torch.randn(t.shape, generator=gen)) if ".lora_B." in n else t for n, t in tensors.items()}
    return Adapter(shape=SHAPE, tensors=tensors, base="", base_fingerprint=model_fingerprint(model.state_dict()))


@pytest.fixture
def make_co_batched(loaded):
    """Started co-batched engines over the session's serving model; stopped at teardown."""
    engines = []

    def build(config: EngineConfig = CONFIG, lease: bool = True, adapter: Adapter | None = None, policy: str = "rose") -> Engine:
        model, tok = loaded["serving"]
        engine = Engine(model, tok, None, tok, config, policy, adapter=adapter or trained_adapter(model))
        engine.start()
        if lease:
            engine.set_rollout_lease(config.rollout_kv_bytes, time.monotonic() + FAR_S)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        asyncio.run(engine.stop())


class TestCoBatchedEngine(CoServingEngineTestcase):
    """The shared engine test case on the co-batched mode."""

    @pytest.fixture
    def engine(self, make_co_batched):
        return make_co_batched(lease=False)


def _peft_greedy(base, adapter: Adapter, prompt: list[int], n: int) -> list[int]:
    """peft's own greedy continuation of ``prompt`` under ``adapter``: the tokens the trainer's model would choose."""
    from peft import get_peft_model, set_peft_model_state_dict

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(copy.deepcopy(base), lora_config(adapter.shape))
    set_peft_model_state_dict(model, adapter.tensors)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_rollout_rows_are_the_adapters_tokens_and_serving_rows_the_bases(make_co_batched, loaded):
    """In one engine at once: a rollout turn gets peft's greedy tokens under the adapter, a serving request the base
    model's, though they ran in the same forwards."""
    base, _ = loaded["serving"]
    adapter = trained_adapter(base, seed=3)
    engine = make_co_batched(adapter=adapter)
    rollout = engine.submit(req(engine, "r", temperature=0, max_tokens=12, ignore_eos=True))
    serving = engine.submit(req(engine, "s", WorkClass.SERVING, temperature=0, max_tokens=12, ignore_eos=True))
    turn, served = await rollout.result(), await serving.result()
    prompt = list(req(engine, "x").prompt_token_ids)
    assert list(turn.token_ids) == _peft_greedy(base, adapter, prompt, 12)
    assert list(turn.token_ids) != list(served.token_ids)  # the adapter changed the choice: the test can tell the two apart
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(base(torch.tensor([ids])).logits[0, -1].argmax()))
    assert list(served.token_ids) == ids[len(prompt) :]
    assert engine.metrics.co_batched_iterations > 0  # some forward carried both classes' rows


async def test_the_two_model_mode_runs_the_same_lora_policy_to_the_same_tokens(make_co_batched, loaded):
    base, tok = loaded["serving"]
    adapter = trained_adapter(base, seed=4)
    co = make_co_batched(adapter=adapter)
    two = Engine(
        base, tok, copy.deepcopy(base), tok, EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu"), adapter=adapter
    )
    two.start()
    try:
        two.set_rollout_lease(16 * MIB, time.monotonic() + FAR_S)
        params = dict(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
        a, b = await generate(co, req(co, "a", **params)), await generate(two, req(two, "b", **params))
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert two.policy_state_dict().keys() == co.policy_state_dict().keys() == adapter.tensors.keys()
    finally:
        await two.stop()


async def test_rollout_rides_only_within_the_guards_threshold(make_co_batched):
    """A TPOT SLO no iteration can meet: while serving runs, no rollout row rides (the threshold leaves none);
    once serving is done, the turn runs to its end."""
    engine = make_co_batched()
    engine.set_slo(None, 1e-6)
    serving = engine.submit(req(engine, "s", WorkClass.SERVING, temperature=0, max_tokens=60, ignore_eos=True))
    await until(lambda: engine.stats().serving_running, 30, "serving to run")
    turn = engine.submit(req(engine, "r", temperature=0, max_tokens=8, ignore_eos=True))
    served, result = await serving.result(), await turn.result()
    assert served.finish_reason == result.finish_reason == "length" and len(result.token_ids) == 8
    assert engine.metrics.co_batched_iterations == 0  # no forward carried both: the turn ran once serving was done


async def test_a_revoked_lease_leaves_rollout_rows_out_at_the_next_iteration(make_co_batched):
    engine = make_co_batched()
    handle = engine.submit(req(engine, "r", temperature=0, max_tokens=400, ignore_eos=True, stream=True))
    async for _ in handle:
        engine.revoke_rollout()
        break
    await until(lambda: engine.stats().rollout_pool.used_blocks == 0, 30, "the revoked rollout's KV freed")
    tokens = engine.metrics.rollout_tokens_total
    await asyncio.sleep(0.2)
    assert engine.metrics.rollout_tokens_total == tokens  # no rollout row since
    assert not handle.done() and engine.metrics.reclaim_ms  # waiting for a lease, not lost; the reclaim was sampled


async def test_an_adapter_version_flips_slots_between_iterations(make_co_batched, loaded):
    base, _ = loaded["serving"]
    engine = make_co_batched()
    v1 = trained_adapter(base, seed=9).tensors
    pause = await asyncio.wrap_future(engine.apply_policy_weights(v1, 1))
    assert pause < 50 and engine.policy_version == 1
    assert all(torch.equal(engine.policy_state_dict()[n], v1[n]) for n in v1)
    turn = await generate(engine, req(engine, "r", temperature=0, max_tokens=6, ignore_eos=True))
    assert set(turn.token_versions) == {1}
    name = next(iter(v1))
    with pytest.raises(WeightUpdateError, match="adapter"):
        engine.apply_policy_weights({name: torch.zeros(3, 3)}, 2)
    with pytest.raises(WeightUpdateError, match="adapter"):
        engine.apply_policy_weights({"model.layers.0.mlp.up_proj.weight": torch.zeros(3)}, 2)
    assert engine.policy_version == 1


def test_the_mode_refuses_a_policy_it_cannot_co_batch(loaded):
    model, tok = loaded["serving"]
    policy, ptok = loaded["policy"]
    with pytest.raises(EngineModeError, match="LoRA adapter of the serving model"):
        Engine(model, tok, policy, ptok, CONFIG)
    with pytest.raises(EngineModeError, match="two_model mode only"):
        Engine(model, tok, None, tok, CONFIG, "static_partition", adapter=trained_adapter(model))
    other = trained_adapter(model)
    foreign = Adapter(shape=other.shape, tensors=other.tensors, base="elsewhere", base_fingerprint="sha256:" + "0" * 32)
    with pytest.raises(AdapterError, match="serving model .* is not the base this adapter was built on"):
        Engine(model, tok, None, tok, CONFIG, adapter=foreign)


async def test_the_policys_weights_cannot_be_released_in_the_co_batched_mode(make_co_batched):
    engine = make_co_batched()
    with pytest.raises(InvalidRequest, match="release kv_cache alone"):
        engine.control.release_memory(("weights",))
    freed = await asyncio.wrap_future(engine.control.release_memory(("kv_cache",)))
    assert freed["kv_cache"] > 0
    await asyncio.wrap_future(engine.control.resume_memory(("kv_cache",)))
