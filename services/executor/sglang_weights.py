"""The sglang backend's two-server mode weights: a host mirror of the rollout server's policy, and each new version
sent as what changed against it.

The mirror (loaded from the policy directory) is the delta base the bus weight follower needs and the reference an
update is diffed against: only the tensors whose bits changed are sent, over `/update_weights_from_tensor` (same
host: shared-memory tensors, sglang_tensors.py) or as a safetensors directory for `/update_weights_from_disk` (a
volume both can see). The mirror takes a version only once the server has it: a refusal keeps both on the old one.
The LoRA mode's counterpart, adapter versions on one server, is sglang_lora.py.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rose.shared.weight_layout import save_safetensors

from .sglang_lora import Call
from .sglang_tensors import serialize_named_tensors
from .sglang_wire import ServerError
from .weights import StagedWeights, checked_version, stage

log = logging.getLogger("rose.executor.sglang")


class MirroredWeights:
    """The rollout server's policy, mirrored on the host (the module doc)."""

    def __init__(self, mirror: torch.nn.Module, policy_dir: Path, staging_dir: Path, url: str, call: Call, weight_sync: str) -> None:
        self.mirror, self.policy_dir, self.staging_dir, self.url, self._call, self.weight_sync = (
            mirror,
            policy_dir,
            staging_dir,
            url,
            call,
            weight_sync,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.mirror.state_dict()

    def stage(self, state: dict[str, torch.Tensor], version: int) -> StagedWeights:
        """Checked against the mirror (WeightUpdateError, nothing changed). An empty state is a version that changed no
        weight: `update` then sends no tensor, only the server's version label moves."""
        return stage(self.mirror, state, version) if state else StagedWeights({}, checked_version(version))

    async def update(self, staged: StagedWeights) -> float:
        """Send what changed; the milliseconds the server took to load it. ServerError, aiohttp's errors, OSError:
        the server refused or could not be reached, the mirror stays."""
        version, label = staged.version, str(staged.version)
        changed = await asyncio.to_thread(self._changed, staged.tensors)
        staging: Path | None = None
        try:
            if not changed:
                started = time.perf_counter()
                await self._call(self.url, "/update_weight_version", {"new_version": label, "abort_all_requests": False})
            elif self.weight_sync == "tensor":
                named = list(changed.items())  # kept alive until the server has answered (it maps their memory)
                payload = await asyncio.to_thread(serialize_named_tensors, named)
                started = time.perf_counter()
                body = {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": True, "weight_version": label}
                _check_success(await self._call(self.url, "/update_weights_from_tensor", body))
                del named
            else:
                staging = await asyncio.to_thread(self._write_staging, changed, version)
                started = time.perf_counter()
                _check_success(await self._call(self.url, "/update_weights_from_disk", {"model_path": str(staging), "weight_version": label}))
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        pause_ms = (time.perf_counter() - started) * 1000.0
        if changed:
            StagedWeights(changed, version).apply(self.mirror)
        if staging is not None:
            self._drop_old_staging(keep=staging)
        log.info("policy version %d on the rollout server: %d tensors sent (%s), %.1f ms", version, len(changed), self.weight_sync, pause_ms)
        return pause_ms

    def _changed(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        live = self.mirror.state_dict()
        return {name: t for name, t in tensors.items() if not _same_bits(t, live[name])}

    def _write_staging(self, changed: dict[str, torch.Tensor], version: int) -> Path:
        """A complete model directory of the new version (the mirror with the changes), for /update_weights_from_disk."""
        target = self.staging_dir / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for item in self.policy_dir.iterdir():  # config, tokenizer, generation config: everything but the weights
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt")):
                shutil.copy2(item, target / item.name)
        state = {**self.mirror.state_dict(), **changed}
        save_safetensors(state, target / "model.safetensors")
        return target

    def _drop_old_staging(self, keep: Path) -> None:
        for old in self.staging_dir.glob("v*"):
            if old != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included): a weight that did not change is not sent."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


def _check_success(reply: Any) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise ServerError("", 200, str(reply.get("message", "success: false")))
