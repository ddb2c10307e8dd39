"""Trainer checkpoints with a real tiny Qwen2 policy and a real AdamW: a bit-exact round trip
(weights, optimizer state, RNG streams, and the training that follows), atomicity (a checkpoint
without its manifest, with a bad digest or a leftover temp dir is skipped for the previous one),
pruning, and a changed job configuration that must not resume."""

from __future__ import annotations

import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch

from rose.services.trainer.checkpoint import MANIFEST, POLICY, CheckpointStore, TrainerState, identity_diff, job_identity
from rose.services.trainer.config import CheckpointSettings, GrpoSettings, TrainerConfig
from rose.services.trainer.trainer import Trainer
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.models import ModelShape, PolicyModelRef, build_model

TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
VOCAB = 256


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and light on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def train_step(model, optimizer, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def fresh(seed: int):
    model = build_model(TINY, VOCAB, 1, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def state(step: int, **kw) -> TrainerState:
    return TrainerState(run_id="job-a", step=step, version=step + 1, emitted_steps=step + 2, emit_from=step + 1, **kw)


def draws() -> tuple:
    return (torch.rand(4).tolist(), random.random(), float(np.random.rand()))


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for k in sa["state"]:
        for name, value in sa["state"][k].items():
            other = sb["state"][k][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (k, name)


def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
    model, optimizer = fresh(seed=0)
    for s in range(2):
        train_step(model, optimizer, s)
    store = CheckpointStore(tmp_path, {"job": "a"}, keep=2)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    saved = state(2, outstanding=[("job-a-s3-g0", 8)], used_groups=["job-a-s2-g0"], rewards=[0.25, 0.5], collector_stats={"received": 16})
    path = store.save(model, optimizer, saved)
    expected_draws = draws()  # what the RNGs give next in the original process
    train_step(model, optimizer, 2)

    other, other_opt = fresh(seed=7)  # another init: everything must come from the checkpoint
    loaded = store.load(other, other_opt)
    assert loaded is not None and loaded.path == path and loaded.manifest["step"] == 2
    assert loaded.state.outstanding == [("job-a-s3-g0", 8)] and loaded.state.used_groups == ["job-a-s2-g0"]
    assert loaded.state.rewards == [0.25, 0.5] and loaded.state.collector_stats == {"received": 16} and loaded.state.run_id == "job-a"
    assert draws() == expected_draws  # RNG continuity: torch, Python and NumPy streams go on where they were
    train_step(other, other_opt, 2)  # the same next step as the original took
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_same_optimizer(optimizer, other_opt)


def test_incomplete_or_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    model, optimizer = fresh(seed=0)
    store = CheckpointStore(tmp_path, {"job": "a"}, keep=3)
    train_step(model, optimizer, 0)
    store.save(model, optimizer, state(1))
    good = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, 1)
    newest = store.save(model, optimizer, state(2))
    # a writer killed mid-way leaves a temp dir (never a step dir): ignored
    (store.dir / ".tmp-step-00000003-99999").mkdir()
    (store.dir / ".tmp-step-00000003-99999" / POLICY).write_bytes(b"partial")

    manifest = (newest / MANIFEST).read_bytes()
    (newest / MANIFEST).unlink()  # as if killed before the manifest went in (no rename happens then, but be strict)
    caplog.set_level(logging.WARNING)
    target, target_opt = fresh(seed=5)
    loaded = store.load(target, target_opt)
    assert loaded is not None and loaded.manifest["step"] == 1
    assert all(torch.equal(good[k], v) for k, v in target.state_dict().items())
    assert "no manifest" in caplog.text and str(newest) in caplog.text

    (newest / MANIFEST).write_bytes(manifest)
    raw = bytearray((newest / POLICY).read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the weights
    (newest / POLICY).write_bytes(bytes(raw))
    caplog.clear()
    loaded = store.load(*fresh(seed=5))
    assert loaded is not None and loaded.manifest["step"] == 1 and "SHA-256" in caplog.text

    broken = json.loads(manifest)
    broken["files"].pop(POLICY)
    (newest / MANIFEST).write_text(json.dumps(broken))
    assert store.load(*fresh(seed=5)).manifest["step"] == 1

    shutil.rmtree(store.dir / "step-00000001")  # nothing valid left: a fresh start, no exception
    assert store.load(*fresh(seed=5)) is None


def test_keeps_the_newest_n_and_removes_stale_temp_dirs(tmp_path):
    model, optimizer = fresh(seed=0)
    store = CheckpointStore(tmp_path, {"job": "a"}, keep=2)
    (store.dir / ".tmp-step-00000001-99999").mkdir(parents=True)
    for s in range(1, 5):
        store.save(model, optimizer, state(s))
    assert sorted(p.name for p in store.dir.iterdir()) == ["step-00000003", "step-00000004"]


def config_of(tmp_path, **grpo) -> TrainerConfig:
    return TrainerConfig(
        models=PolicyModelRef(policy_dir=str(tmp_path / "policy")),
        grpo=GrpoSettings(**grpo),
        checkpoint=CheckpointSettings(dir=str(tmp_path / "ckpt")),
    )


def trainer_of(config: TrainerConfig, run_id: str) -> Trainer:
    model = build_model(TINY, VOCAB, 1, seed=0)
    bus = Bus(BusConfig(), service="trainer", instance="t-unconnected")  # restore() reads files only
    return Trainer(bus, model, None, [], config, run_id)


async def test_a_changed_job_configuration_starts_a_fresh_run_instead_of_resuming(tmp_path, caplog):
    a = trainer_of(config_of(tmp_path, lr=1e-3), "trainer-host-1")
    a.steps, a.version, a.emitted_steps = 3, 4, 5
    await a.checkpoint(emit_owed=1)
    assert a.checkpoints.last_step == 3

    same = trainer_of(config_of(tmp_path, lr=1e-3, group_timeout_s=30.0), "trainer-host-2")  # an operational change only
    assert await same.restore()
    assert (same.run_id, same.steps, same.version, same.checkpoints.resumed_from, same.emitted_steps, same.emit_target) == (
        "trainer-host-1",
        3,
        4,
        3,
        5,
        6,
    )
    assert same.load()["resumed_from_step"] == 3.0 and same.load()["warm_started"] == 0.0

    caplog.set_level(logging.INFO)
    changed = trainer_of(config_of(tmp_path, lr=2e-3), "trainer-host-1")
    assert not await changed.restore()
    assert changed.steps == 0 and changed.checkpoints.resumed_from is None
    assert "not resuming" in caplog.text and "grpo.lr: 0.001 -> 0.002" in caplog.text
    assert changed.run_id.startswith("trainer-host-1-") and changed.run_id != "trainer-host-1"  # its task ids must not collide
    assert identity_diff(job_identity(config_of(tmp_path, lr=1e-3)), job_identity(config_of(tmp_path, lr=2e-3))) == ["grpo.lr: 0.001 -> 0.002"]
    # the other job's checkpoints are left alone: going back to its configuration resumes it
    assert await trainer_of(config_of(tmp_path, lr=1e-3), "x").restore()


async def test_checkpoints_off_never_resume(tmp_path):
    config = config_of(tmp_path)
    config.checkpoint.every_steps = 0
    t = trainer_of(config, "r")
    assert t.checkpoints.store is None and not await t.restore()
