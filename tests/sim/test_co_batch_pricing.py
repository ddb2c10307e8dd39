"""The device model prices a co-batched iteration: the base weights once, every row's KV, the LoRA adapter's kernels
for the rollout rows (shared/devices.py). Without adapted tokens it is exactly today's figure."""

import numpy as np
import pytest

from rose.shared.devices import DEVICES, LORA_LINEAR_S, MODELS, MeasuredSteps, Roofline
from rose.shared.lora import ALL_LINEAR, ATTENTION_MODULES, LoraShape
from rose.sim.co_batched import AdaptedSteps

H100 = DEVICES["H100"]
TP = {"7B": 1, "14B": 2, "32B": 4, "70B": 8}  # the serving instances' widths on H100 (sizing.serving_tp)


def test_lora_params_count_every_adapted_linear_of_every_layer():
    m = MODELS["7B"]  # Qwen2.5-7B: hidden 3584, 28 heads and 4 KV heads of 128, intermediate 18944, 28 layers
    q, kv = 28 * 128, 4 * 128
    per_layer = (3584 + q) + 2 * (3584 + kv) + (q + 3584) + 2 * (3584 + 18944) + (18944 + 3584)
    assert m.lora_params(LoraShape(rank=1, alpha=1)) == 28 * per_layer
    assert m.lora_params(LoraShape(rank=8, alpha=16)) == 8 * 28 * per_layer  # linear in the rank
    attention = m.lora_params(LoraShape(rank=8, alpha=8, targets=ATTENTION_MODULES))
    assert attention == 8 * 28 * ((3584 + q) + 2 * (3584 + kv) + (q + 3584))
    assert (*ATTENTION_MODULES, "gate_proj", "up_proj", "down_proj") == ALL_LINEAR


@pytest.mark.parametrize("size", ["7B", "14B", "32B", "70B"])
def test_packed_forward_without_adapted_tokens_is_todays_figure(size):
    roof = Roofline(H100, MODELS[size], TP[size])
    lora = LoraShape(rank=32, alpha=32)
    contexts, chunks = [800.0, 2500.0, 6000.0], [(300.0, 1200.0)]
    today = roof.forward_s(contexts, chunks)
    assert roof.forward_s(contexts, chunks, adapted_tokens=0.0, lora=lora) == today
    assert roof.forward_s(contexts, chunks, adapted_tokens=50.0, lora=None) == today
    batch, ctx, chunk = np.array([0.0, 16.0, 64.0]), np.array([1.0, 3000.0, 6500.0]), np.array([0.0, 258.0, 0.0])
    assert np.array_equal(roof.mixed_s(batch, ctx, chunk, 100.0, adapted_tokens=0.0, lora=lora), roof.mixed_s(batch, ctx, chunk, 100.0))
    measured = MeasuredSteps(decode_base_s=0.02, decode_per_seq_s=1e-3, prefill_base_s=0.03, prefill_per_token_s=1e-4)
    assert measured.forward_s(contexts, chunks, adapted_tokens=10.0, lora=lora) == measured.forward_s(contexts, chunks)  # nothing measured


@pytest.mark.parametrize("size", ["7B", "14B", "32B", "70B"])
@pytest.mark.parametrize("rank", [1, 8, 64])
def test_the_adapters_term_at_7b_to_70b(size, rank):
    """A pass with rollout rows pays the adapter's kernels: their fixed time per adapted linear (Punica's measured
    launch-bound pair) dominates at decode sizes, the FLOPs and bytes grow with the rank and the tokens. The adapter is
    at most ~2 % of the model's parameters at rank 64; at 128 adapted rows it adds 5-40 % to a decode step of those
    rows at the mean agentic context (6.5k tokens)."""
    m, roof = MODELS[size], Roofline(H100, MODELS[size], TP[size])
    lora = LoraShape(rank=rank, alpha=rank)
    fixed = m.layers * len(ALL_LINEAR) * LORA_LINEAR_S
    assert float(roof.adapter_s(0.0, lora)) == 0.0
    one, rows = float(roof.adapter_s(1.0, lora)), float(roof.adapter_s(128.0, lora))
    assert fixed < one < 1.1 * fixed and one < rows
    assert m.lora_params(lora) / m.params < 0.022
    step = float(roof.decode_s(128, 6500.0))
    assert 0.05 < rows / step < 0.4, (rows, step)
    # the adapter's own bytes (read once a pass) and FLOPs grow with its rank
    assert float(roof.adapter_s(128.0, LoraShape(rank=64, alpha=64))) > float(roof.adapter_s(128.0, LoraShape(rank=1, alpha=1)))
    contexts = [6500.0] * 128
    assert roof.forward_s(contexts, [], adapted_tokens=128.0, lora=lora) == pytest.approx(roof.forward_s(contexts, []) + rows)


def test_a_co_batched_pass_grows_with_its_rows_and_reads_the_weights_once():
    """Monotone in rows, adapted tokens and prefill; a serving batch with rollout rows in it costs less than the two
    passes apart (the base weights are read once), more than either."""
    roof, lora = Roofline(H100, MODELS["70B"], 8), LoraShape(rank=32, alpha=32)
    serving = [1600.0] * 16
    last = roof.forward_s(serving, [])
    for rows in (1, 8, 32, 128):
        t = roof.forward_s([*serving, *[6500.0] * rows], [], adapted_tokens=rows, lora=lora)
        assert t > last
        last = t
    together = roof.forward_s([*serving, *[6500.0] * 32], [], adapted_tokens=32, lora=lora)
    serving_alone, rollout_alone = roof.forward_s(serving, []), roof.forward_s([6500.0] * 32, [], adapted_tokens=32, lora=lora)
    assert max(serving_alone, rollout_alone) < together < serving_alone + rollout_alone
    batch = np.arange(0.0, 300.0, 10.0)
    priced = roof.mixed_s(batch, 4000.0, 258.0, 0.0, adapted_tokens=batch + 258.0, lora=lora)
    assert np.all(np.diff(priced) > 0)


def test_a_lora_policys_steps_are_its_bases_plus_the_adapter_on_every_token():
    """A co-batched job's dedicated instances (and its rollout alone on a serving instance) run the base and the
    adapter: every token they compute is adapted (sim/co_batched.py ``AdaptedSteps``)."""
    roof, lora = Roofline(H100, MODELS["7B"], 1), LoraShape(rank=32, alpha=32)
    steps = AdaptedSteps(roof, lora)
    assert float(steps.decode_s(64, 3000.0)) == pytest.approx(float(roof.decode_s(64, 3000.0)) + float(roof.adapter_s(64, lora)))
    assert float(steps.prefill_s(512.0, 100.0)) == pytest.approx(float(roof.prefill_s(512.0, 100.0)) + float(roof.adapter_s(512.0, lora)))
    assert float(steps.prefill_s(0.0)) == 0.0
    assert float(steps.mixed_s(32, 3000.0, 258.0, 10.0)) == pytest.approx(steps.forward_s([3000.0] * 32, [(258.0, 10.0)]))
    assert steps.rollout_prefill_tokens == roof.rollout_prefill_tokens and "LoRA rank 32" in steps.label()
