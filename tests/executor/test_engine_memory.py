"""An engine started and stopped leaves nothing behind in its process: a bench grid runs hundreds
of engines in one process, and each one that stayed held its rollout child's shared weight banks
and KV (~145 MiB: the 2026-12-02 coserve grid ended at 12 GB). Run in a fresh interpreter: this
test session's own engines must not share the process-wide collector state it checks."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import asyncio, gc, json, sys, weakref
from pathlib import Path
from rose.services.executor.engine import Engine, EngineConfig
from rose.shared.models import load_model, load_tokenizer

def shm_maps():
    return sum(1 for line in open("/proc/self/maps") if "/dev/shm" in line or "torch_" in line)

async def once(models, config):
    (s, st), (p, pt) = models
    engine = Engine(s, st, p, pt, config, "static_partition")
    engine.start()
    ref = weakref.ref(engine)
    await engine.stop()
    return ref

if __name__ == "__main__":
    root = Path(sys.argv[1])  # the session's tiny models (tests/conftest.py models_dir), not built again
    models = [(load_model(root / d), load_tokenizer(root / d)) for d in ("serving", "policy")]
    config = EngineConfig(serving_kv_bytes=8 << 20, rollout_kv_bytes=16 << 20, device="cpu", seed=0, rollout_process=True)
    counts, alive = [], []
    for _ in range(2):
        ref = asyncio.run(once(models, config))
        gc.collect()
        counts.append(shm_maps())
        alive.append(ref() is not None)
    print(json.dumps({"shm_maps": counts, "alive": alive}))
"""


def test_a_stopped_engine_is_collected_with_its_shared_memory(models_dir):
    out = subprocess.run([sys.executable, "-c", PROBE, str(models_dir)], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["alive"] == [False, False]  # nothing holds a stopped engine
    # the first engine shared the models' own parameters (they stay, as the models do); the second
    # engine's weight banks and KV were mapped and are gone again: no growth (before the fix: 114 -> 166 maps)
    assert r["shm_maps"][0] > 0
    assert r["shm_maps"][1] == r["shm_maps"][0], r["shm_maps"]
