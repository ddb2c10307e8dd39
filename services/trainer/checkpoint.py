"""Checkpoints of the reference trainer: a killed trainer resumes its job where it was.

A checkpoint is a directory written whole, then renamed into place:

    <checkpoint.dir>/<job key>/step-00000012/
        policy.safetensors   the fp32 master weights (bit-exact); of a LoRA policy, the adapter's only (lora.py)
        optimizer.pt         torch.save of the optimizer's state_dict
        rng.json             Python, NumPy and torch (CPU, CUDA) RNG states
        state.json           run id, step, version, task cursor, open groups, counters (TrainerState)
        manifest.json        written last: format, job identity, step, and every file's SHA-256 and size
        published.json       added once these weights are out as a version (not part of the checkpoint proper)

It is first written as `.tmp-step-...-<pid>` (every file fsync'd, the manifest last), then
renamed (atomic on one file system), and the parent directory fsync'd. A directory without a
manifest, with a manifest that does not parse, or with a file whose digest or size differs is
not a checkpoint: loading skips it with a log line and takes the next older one; nothing here
raises on a bad checkpoint. The newest `keep` are kept; older ones and stale temp dirs go.

The job key is a digest of the job's identity (`job_identity`: the policy model, the task,
GRPO and warm-start settings, the weight model name, the consumer, an explicit run id), so a
changed configuration never finds, and never resumes, the checkpoints of another one: it
starts a fresh run (main.py logs what differs). Operational settings (bus, runtime, threads,
max_steps, initial_version, publish staging and timeouts, group_timeout_s, these checkpoint
settings) may change between restarts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file

from rose.shared.errors import RoseError
from rose.shared.weight_layout import save_safetensors

from .config import TrainerConfig
from .lora import load_trained_state, trained_state

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
POLICY, OPTIMIZER, RNG, STATE = "policy.safetensors", "optimizer.pt", "rng.json", "state.json"
PUBLISHED = "published.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
DIGEST_CHUNK = 1 << 20


# ---- what identifies a job ------------------------------------------------------------


def job_identity(config: TrainerConfig) -> dict[str, Any]:
    """The settings that make a job: resuming under other values would silently train another job."""
    grpo = msgspec.to_builtins(config.grpo)
    grpo.pop("group_timeout_s", None)  # how long to wait for stragglers: operational
    return {
        "policy": str(config.models.policy_path().resolve()),
        "publish_model": config.publish.model,
        "durable": config.durable,
        "run_id": config.run_id,
        "grpo": grpo,
        "sft": msgspec.to_builtins(config.sft),
        "tasks": msgspec.to_builtins(config.tasks),
    }


def identity_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(identity, order="sorted")).hexdigest()[:16]


def identity_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`field: old -> new` for every leaf that differs (dotted paths)."""

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else k))
        return out

    a, b = flat(old), flat(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def default_dir(config: TrainerConfig) -> Path:
    from rose.shared.nats_server import state_dir  # noqa: PLC0415 - as the other services pick theirs

    return Path(config.checkpoint.dir) if config.checkpoint.dir else state_dir() / "trainer" / config.durable


# ---- what a checkpoint holds besides tensors ------------------------------------------


@dataclass(kw_only=True)
class TrainerState:
    run_id: str
    step: int  # GRPO steps taken (0: after the warm start)
    version: int  # the policy version of these weights (published, or being published when it was written)
    emitted_steps: int  # the task cursor: steps whose tasks were handed out (group i of step s: problem index s * groups_per_step + i)
    emit_from: int  # steps in [emit_from, emitted_steps) may not all have gone out: emitted again (same ids) on resume
    outstanding: list[tuple[str, int]] = field(default_factory=list)  # groups handed out, not trained on: (group id, size), in order
    used_groups: list[str] = field(default_factory=list)  # recent groups trained on (their redeliveries are acked, not counted)
    rewards: list[float] = field(default_factory=list)  # mean reward of each step
    collector_stats: dict[str, int] = field(default_factory=dict)  # without the outstanding groups' trajectories (redelivered)
    stats: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    warm_started: bool = False
    publish_due: bool = False  # `version` was about to be published: publish it on resume unless the stream has it
    written_at: float = 0.0


@dataclass
class Loaded:
    path: Path
    manifest: dict[str, Any]
    state: TrainerState
    published: int | None = None  # the version these weights went out as, if that was recorded


# ---- RNG ------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(s: dict[str, Any]) -> None:
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(s["torch"])), dtype=torch.uint8))
    if "cuda" in s and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray(bytes.fromhex(h)), dtype=torch.uint8) for h in s["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# ---- files ----------------------------------------------------------------------------


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DIGEST_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    path.write_bytes(json.dumps(data, separators=(",", ":")).encode())


def step_of(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


class CheckpointError(RoseError):
    """This directory is not a complete, intact checkpoint (the reason says why)."""


class CheckpointStore:
    """The checkpoints of one job (one identity) under `root/<job key>/`."""

    def __init__(self, root: str | Path, identity: dict[str, Any], keep: int = 2) -> None:
        self.root = Path(root)
        self.identity = identity
        self.key = identity_key(identity)
        self.dir = self.root / self.key
        self.keep = keep

    # ---- writing ----------------------------------------------------------------------

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState) -> Path:
        """Write a checkpoint of `state.step` atomically; returns its directory. Raises only on I/O errors."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{state.step:08d}"
        tmp = self.dir / f"{TMP_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            state.written_at = time.time()
            save_safetensors({k: v.detach().cpu() for k, v in trained_state(model).items()}, tmp / POLICY)
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
            _write_json(tmp / RNG, rng_state())
            _write_json(tmp / STATE, asdict(state))
            files = {}
            for fname in (POLICY, OPTIMIZER, RNG, STATE):
                _fsync(tmp / fname)
                files[fname] = {"sha256": _digest(tmp / fname), "bytes": (tmp / fname).stat().st_size}
            manifest = {
                "format": FORMAT,
                "job_key": self.key,
                "identity": self.identity,
                "run_id": state.run_id,
                "step": state.step,
                "version": state.version,
                "written_at": state.written_at,
                "files": files,
            }
            _write_json(tmp / MANIFEST, manifest)  # last: a directory without it is not a checkpoint
            _fsync(tmp / MANIFEST)
            final = self.dir / name
            if final.exists():  # a step redone after a fallback past a bad checkpoint of the same step
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    @staticmethod
    def mark_published(path: Path, version: int) -> None:
        """Record that the checkpoint's weights are out as `version` (so a resume need not publish them again)."""
        tmp = path / f"{PUBLISHED}.partial"
        _write_json(tmp, {"version": version})
        tmp.replace(path / PUBLISHED)

    @staticmethod
    def published_version(path: Path) -> int | None:
        try:
            version = json.loads((path / PUBLISHED).read_bytes()).get("version")
        except (OSError, ValueError, AttributeError):
            return None
        return version if isinstance(version, int) else None

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; remove older ones and temp dirs of dead writers."""
        steps = sorted((p for p in self.dir.iterdir() if step_of(p) is not None), key=lambda p: step_of(p) or 0)
        for old in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.dir.glob(f"{TMP_PREFIX}*"):
            if not tmp.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(tmp, ignore_errors=True)

    # ---- reading ----------------------------------------------------------------------

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of a complete, intact checkpoint of this job, or CheckpointError saying what is wrong."""
        try:
            manifest = json.loads((path / MANIFEST).read_bytes())
        except FileNotFoundError:
            raise CheckpointError("no manifest (incomplete: the writer stopped before its last file)") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"manifest unreadable: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"manifest format {manifest.get('format') if isinstance(manifest, dict) else '?'} is not {FORMAT}")
        if manifest.get("job_key") != self.key or manifest.get("identity") != self.identity:
            raise CheckpointError("written for another job configuration")
        files = manifest.get("files")
        if not isinstance(files, dict) or set(files) != {POLICY, OPTIMIZER, RNG, STATE}:
            raise CheckpointError(f"manifest lists {sorted(files) if isinstance(files, dict) else files}, not the checkpoint's files")
        for fname, meta in files.items():
            f = path / fname
            if not f.is_file():
                raise CheckpointError(f"{fname} is missing")
            if f.stat().st_size != meta.get("bytes"):
                raise CheckpointError(f"{fname} has {f.stat().st_size} bytes, the manifest says {meta.get('bytes')}")
            if _digest(f) != meta.get("sha256"):
                raise CheckpointError(f"{fname} does not match its SHA-256 in the manifest")
        return manifest

    def candidates(self) -> list[Path]:
        """Checkpoint directories of this job, newest first (valid or not)."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if p.is_dir() and step_of(p) is not None), key=lambda p: step_of(p) or 0, reverse=True)

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Loaded | None:
        """Restore the newest valid checkpoint into `model` and `optimizer` (and the RNGs); None if there is none.

        An invalid one is logged and skipped; restoring is all or nothing: the model and the
        optimizer are only changed once every file of a checkpoint has been read.
        """
        for path in self.candidates():
            try:
                manifest = self.verify(path)
                weights = load_file(str(path / POLICY))
                opt = torch.load(path / OPTIMIZER, weights_only=True)
                rng = json.loads((path / RNG).read_bytes())
                raw = json.loads((path / STATE).read_bytes())
                state = TrainerState(**{**raw, "outstanding": [tuple(g) for g in raw.get("outstanding", [])]})
                before = {k: v.detach().clone() for k, v in trained_state(model).items()}
                try:
                    load_trained_state(model, weights)
                    optimizer.load_state_dict(opt)
                    set_rng_state(rng)
                except Exception:
                    load_trained_state(model, before)  # as it was: the next older one may fit
                    raise
            except CheckpointError as exc:
                log.warning("checkpoint %s is not usable (%s): skipped, trying the previous one", path, exc)
                continue
            except Exception as exc:  # a file that verified but does not load: never crash on a checkpoint
                log.warning("checkpoint %s could not be restored (%s: %s): skipped, trying the previous one", path, type(exc).__name__, exc)
                continue
            return Loaded(path, manifest, state, self.published_version(path))
        return None

    def others(self) -> list[tuple[Path, dict[str, Any]]]:
        """Complete checkpoints of *other* job configurations under the same root (newest last), to say why none resumes."""
        out: list[tuple[Path, dict[str, Any]]] = []
        if not self.root.is_dir():
            return out
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub.name == self.key:
                continue
            for p in sub.iterdir():
                if step_of(p) is None:
                    continue
                try:
                    manifest = json.loads((p / MANIFEST).read_bytes())
                except (OSError, ValueError):
                    continue
                if isinstance(manifest, dict) and isinstance(manifest.get("identity"), dict):
                    out.append((p, manifest))
        return sorted(out, key=lambda pm: pm[1].get("written_at", 0.0))
