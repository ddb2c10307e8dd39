"""`rose bench lora` end to end at a small size: both arms from one warm base, the same episodes at step 0 (version 0
of the adapter is the base), every step trained and published, the adapter's versions far smaller than the policy's."""

from __future__ import annotations

import json

from rich.console import Console

from rose.bench.lora_learning import LoraOptions, run_lora_bench


def test_the_lora_bench_runs_both_arms_from_one_base(tmp_path):
    out = tmp_path / "lora.json"
    options = LoraOptions(seeds=(0,), steps=2, lora_rank=1, lora_alpha=2.0, warm_start_steps=100)
    result = run_lora_bench(options, out, console=Console(quiet=True))
    assert json.loads(out.read_text())["steps"] == 2
    full, lora = (next(r for r in result["runs"] if r["arm"] == arm) for arm in ("full", "lora"))
    assert full["rewards"][0] == lora["rewards"][0]  # the same 64 episodes: the adapter's version 0 is the base bit for bit
    assert len(full["rewards"]) == len(lora["rewards"]) == 2
    assert all(r["skipped"] == 0 for r in result["runs"])  # every step had a reward spread, was trained and published
    assert 0 < result["wire"]["lora"]["dense_bytes"] < result["wire"]["full"]["dense_bytes"] / 100
    assert [r["model"] for r in result["wire_at_scale"]] == ["7B", "14B", "32B", "70B"]
    assert isinstance(result["meets_target"], bool)
