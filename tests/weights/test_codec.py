"""The shard codec and layout: bit-exact round trips, the encoder's choice, bad payloads, lossy top-k."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.shared.weight_codec import CodecError, ShardDecoder, decode_shard, encode_shard, topk_sparsify
from rose.shared.weight_layout import (
    ALIGN,
    ITEMSIZES,
    itemsize,
    layout_of,
    pack_shards,
    parse_safetensors,
    plan_layout,
    safetensors_blob,
    state_bytes,
    torch_dtypes,
)
from rose.testing.weights import make_state, rl_step

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40]


def _pair(dtype: torch.dtype, n: int, density: float, seed: int, specials: bool) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    new = old.clone()
    mask = torch.rand(n, generator=g) < density
    new[mask] = (new[mask].float() * (1 + torch.randn(int(mask.sum()), generator=g) * 0.05)).to(dtype)
    if specials and n >= len(SPECIALS):
        new[: len(SPECIALS)] = torch.tensor(SPECIALS).to(dtype)
    return old.view(torch.uint8).numpy(), new.view(torch.uint8).numpy()


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(1, 5000),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 10_000),
    specials=st.booleans(),
    exhaustive=st.booleans(),
)
def test_round_trip_is_bit_exact(dtype, n, density, seed, specials, exhaustive):
    old, new = _pair(DTYPES[dtype], n, density, seed, specials)
    width = DTYPES[dtype].itemsize
    encoded = encode_shard(new, old, [(0, new.size, width)], exhaustive=exhaustive)
    assert np.array_equal(decode_shard(encoded.payload, old), new)
    assert encoded.changed == int((old.view(f"u{width}") != new.view(f"u{width}")).sum())


def test_mixed_dtype_shard_round_trips_through_the_layout():
    before = make_state(1)
    after = rl_step(before, 2)
    layout = layout_of(before, shard_bytes=1 << 20)
    assert len(layout.shard_sizes) == 1 and all(s.offset % ALIGN == 0 for s in layout.slots)
    assert {w for _, _, w in layout.segments(0)} == {2, 4}
    old, new = pack_shards(layout, state_bytes(before))[0], pack_shards(layout, state_bytes(after))[0]
    encoded = encode_shard(new, old, layout.segments(0))
    assert encoded.encoding == "sparse_delta"
    assert np.array_equal(decode_shard(encoded.payload, old), new)


def test_encoder_picks_the_smallest():
    old, _ = _pair(torch.bfloat16, 200_000, 0.0, 1, False)
    segs = [(0, old.size, 2)]
    same = encode_shard(old.copy(), old, segs)
    assert same.encoding == "unchanged" and same.payload == b"" and same.changed == 0
    keyframe = encode_shard(old, None, segs)
    assert keyframe.encoding == "dense" and np.array_equal(decode_shard(keyframe.payload, None), old)
    for density, expected in ((0.001, "sparse_delta"), (0.03, "sparse_delta")):
        _, new = _pair(torch.bfloat16, 200_000, density, 1, False)
        fast, full = encode_shard(new, old, segs), encode_shard(new, old, segs, exhaustive=True)
        assert fast.encoding == full.encoding == expected
        assert fast.wire_bytes == full.wire_bytes < 4 * fast.changed + 200  # raw index + value: 6 bytes
    # Everything rewritten with random bits: nothing beats the raw bytes.
    noise = np.random.default_rng(0).integers(0, 256, old.size, dtype=np.uint8)
    assert encode_shard(noise, old, segs).encoding == "dense"
    # Most elements flipping a low bit: the XOR plane is smallest.
    flipped = (old.view(np.uint16) ^ np.uint16(1)).view(np.uint8)
    choice = encode_shard(flipped, old, segs, exhaustive=True)
    assert choice.encoding == "xor_zstd"
    assert encode_shard(flipped, old, segs).encoding == "xor_zstd"


def test_bad_payloads_raise_codec_errors():
    old, new = _pair(torch.bfloat16, 50_000, 0.05, 3, False)
    payload = bytes(encode_shard(new, old, [(0, new.size, 2)]).payload)
    with pytest.raises(CodecError, match="frames|ended"):
        decode_shard(payload[:-10], old)
    with pytest.raises(CodecError, match="header"):
        decode_shard(b"XXXX" + payload[4:], old)
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(CodecError):
        decode_shard(bytes(damaged), old)
    with pytest.raises(CodecError, match="base"):
        decode_shard(payload, None)
    with pytest.raises(CodecError, match="limit"):
        decode_shard(payload, old, max_decoded_bytes=1000)


def test_streaming_decoder_decodes_frames_as_they_arrive():
    old, new = _pair(torch.float32, 100_000, 0.02, 4, False)
    payload = encode_shard(new, old, [(0, new.size, 4)]).payload
    decoder = ShardDecoder(len(payload), old, 1 << 30)
    for end in range(0, len(payload) + 4096, 4096):
        end = min(end, len(payload))
        decoder.buffer[:end] = payload[:end]
        decoder.advance(end)
    assert decoder.frames_left == 0  # all frames done before finish()
    assert np.array_equal(decoder.finish(), new)


def test_topk_with_error_feedback_converges_and_reports_divergence():
    g = torch.Generator().manual_seed(5)
    held = (torch.randn(10_000, generator=g) * 0.02).to(torch.bfloat16)
    true = (held.float() + torch.randn(10_000, generator=g) * 1e-3).to(torch.bfloat16)
    tb, hb = true.view(torch.uint16).numpy(), held.view(torch.uint16).numpy()
    pending = int((tb != hb).sum())
    out, div = topk_sparsify(tb, hb, "bfloat16", 0.1)
    assert int((out != hb).sum()) == 1000  # exactly k moved
    assert div.max_abs > 0 and 0 < div.mean_abs <= div.max_abs
    sent = out
    for _ in range(20):  # the same target: the residual is carried until everything is sent
        sent, div = topk_sparsify(tb, sent, "bfloat16", 0.1)
    assert np.array_equal(sent, tb) and div.max_abs == 0.0 and pending > 1000
    # The largest changes go first.
    err = np.abs(true.float().numpy() - held.float().numpy())
    moved = out != hb
    assert err[moved].min() >= np.sort(err)[-1000] - 1e-12


def test_layout_is_stable_and_big_tensors_get_their_own_shard():
    specs = [("a", "bfloat16", (1000,)), ("b", "float32", (10, 10)), ("c", "bfloat16", (100_000,))]
    layout = plan_layout(specs, shard_bytes=4096)
    assert layout == plan_layout(list(reversed(specs)), shard_bytes=4096)
    by = layout.by_name()
    assert by["c"].shard_id != by["a"].shard_id and layout.shard_sizes[by["c"].shard_id] >= 200_000


def test_safetensors_blob_matches_the_library():
    state = make_state(7)
    blob = bytes(safetensors_blob(state))
    loaded = safetensors.torch.load(blob)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    parsed = parse_safetensors(safetensors.torch.save(state))
    assert {n: (d, s) for n, (d, s, _) in parsed.items()} == {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}


def test_the_layouts_dtype_widths_are_torchs():
    assert set(torch_dtypes()) == set(ITEMSIZES)
    for name, dtype in torch_dtypes().items():
        assert itemsize(name) == torch.empty((), dtype=dtype).element_size(), name


def test_the_weight_publisher_runs_without_torch():
    """It lays out and packs bytes; torch would cost each start ~1.8 s of CPU and ~300 MB (shared/weight_layout.py)."""
    code = "import sys, rose.services.weight_publisher.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
