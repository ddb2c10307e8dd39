"""The roofline against known figures (public spec sheets and well-known decode speeds)."""

import pytest

from rose.shared.devices import DEVICES, MODELS, MeasuredSteps, Roofline, model_spec, parse_fleet, rollout_tp, serving_tp


def test_spec_sheet_figures():
    h100 = DEVICES["H100"]
    assert h100.hbm_bw == pytest.approx(3.35e12) and h100.bf16_flops == pytest.approx(989e12)
    assert 250 < h100.ridge_flops_per_byte < 350  # ~295 FLOP/byte
    assert DEVICES["H200"].hbm_bytes > h100.hbm_bytes and DEVICES["A100"].bf16_flops < h100.bf16_flops


def test_model_shapes():
    assert MODELS["70B"].weight_bytes == pytest.approx(141.2e9)
    assert MODELS["70B"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB per token in bf16
    assert MODELS["7B"].kv_bytes_per_token < MODELS["14B"].kv_bytes_per_token


@pytest.mark.parametrize("batch", [1, 8, 32, 64])
def test_70b_decode_on_h100_is_memory_bound(batch):
    r = Roofline(DEVICES["H100"], MODELS["70B"], tp=8)
    compute, memory = r.decode_bounds(batch, 2000)
    assert memory > 3 * compute


def test_known_decode_speeds():
    # Llama-70B at TP8 on H100 decodes at ~8-12 ms/token at batch 1; a 7B on one H100 at ~6-8 ms
    assert 0.006 < float(Roofline(DEVICES["H100"], MODELS["70B"], 8).decode_s(1, 1000)) < 0.014
    assert 0.005 < float(Roofline(DEVICES["H100"], MODELS["7B"], 1).decode_s(1, 1000)) < 0.010
    # more bandwidth decodes faster; decode is nearly flat in batch size when memory-bound
    assert Roofline(DEVICES["H200"], MODELS["7B"], 1).decode_s(1, 1000) < Roofline(DEVICES["H100"], MODELS["7B"], 1).decode_s(1, 1000)
    r = Roofline(DEVICES["H100"], MODELS["7B"], 1)
    assert float(r.decode_s(32, 1000)) < 1.5 * float(r.decode_s(1, 1000))


def test_prefill_is_compute_bound_and_grows_with_length():
    r = Roofline(DEVICES["H100"], MODELS["70B"], 8)
    m, d = r.model, r.device
    flops_s = 2 * m.params * 2048 / (8 * d.bf16_flops * r.eff_flops)
    weights_s = m.weight_bytes / (8 * d.hbm_bw * r.eff_bw)
    assert flops_s > 5 * weights_s  # a 2k-token prefill is compute-bound
    assert flops_s < float(r.prefill_s(2048)) < 1.5 * flops_s  # plus attention, all-reduce and launch costs
    assert float(r.prefill_s(4096)) > 1.9 * float(r.prefill_s(2048)) - r.overhead_s * 2
    assert float(r.prefill_s(0)) == 0.0


def test_instance_sizing_and_fleet_parsing():
    h100 = DEVICES["H100"]
    assert serving_tp(MODELS["7B"], MODELS["7B"], h100) == 1
    assert serving_tp(MODELS["70B"], MODELS["70B"], h100) == 8  # two 70B copies need 8 x 80 GB
    assert rollout_tp(MODELS["70B"], h100) == 4
    assert parse_fleet("64xH100") == (64, h100)
    with pytest.raises(ValueError, match="COUNTxKIND"):
        parse_fleet("lots of GPUs")
    with pytest.raises(ValueError, match="KIND one of"):
        parse_fleet("8xB200")
    with pytest.raises(ValueError, match="choose one of"):
        model_spec("405B")


@pytest.mark.parametrize("size", ["7B", "70B"])
def test_packed_forward_reduces_to_decode_and_prefill(size):
    """The executor's emulated forward prices a packed batch with ``forward_s``: decodes alone are the
    simulator's ``decode_s`` at their mean context, one chunk alone its ``prefill_s``, and a mixed batch
    reads the weights once (less than the two steps apart, more than either)."""
    roof = Roofline(DEVICES["H100"], MODELS[size], tp=1 if size == "7B" else 4)
    contexts = [100.0, 900.0, 2000.0, 3000.0]
    assert roof.forward_s(contexts, []) == pytest.approx(float(roof.decode_s(len(contexts), sum(contexts) / len(contexts))))
    assert roof.forward_s([], [(512.0, 1024.0)]) == pytest.approx(float(roof.prefill_s(512.0, 1024.0)))
    mixed = roof.forward_s(contexts, [(512.0, 1024.0)])
    apart = float(roof.decode_s(4, 1500.0)) + float(roof.prefill_s(512.0, 1024.0))
    assert max(float(roof.decode_s(4, 1500.0)), float(roof.prefill_s(512.0, 1024.0))) < mixed < apart
    assert roof.forward_s([], []) == 0.0


@pytest.mark.parametrize("size", ["7B", "70B"])
def test_the_simulators_iteration_is_the_executors_packed_forward(size):
    """The simulator's rollout iterations (``mixed_s``: a decode step with one prefill chunk riding on it) are the
    emulated executor's ``forward_s`` over the same batch, for the roofline and for measured steps alike; a chunk
    at the ridge rides on a memory-bound decode step nearly free."""
    roof = Roofline(DEVICES["H100"], MODELS[size], tp=1 if size == "7B" else 4)
    measured = MeasuredSteps(decode_base_s=0.02, decode_per_seq_s=0.001, prefill_base_s=0.03, prefill_per_token_s=1e-4)
    for steps in (roof, measured):
        for batch, chunk in ((32, 258.0), (0, 258.0), (8, 0.0), (0, 0.0)):
            contexts, chunks = [1500.0] * batch, ([(chunk, 400.0)] if chunk else [])
            assert float(steps.mixed_s(batch, 1500.0, chunk, 400.0)) == pytest.approx(steps.forward_s(contexts, chunks))
    ridge = roof.ridge_tokens()
    assert roof.rollout_prefill_tokens == ridge and measured.rollout_prefill_tokens == 64
    riding = float(roof.mixed_s(32, 1500.0, ridge, 0.0)) - float(roof.decode_s(32, 1500.0))
    assert riding < 0.2 * float(roof.prefill_s(float(ridge)))
