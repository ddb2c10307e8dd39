"""Policy weight updates: validate fully, stage, then swap between iterations.

``stage`` checks every name, shape and dtype against the live model before anything is
copied, so a bad state dict raises ``WeightUpdateError`` and the old weights stay. The
swap itself is done by the rollout lane between quanta — never inside a batch — so every
token is produced by exactly one version: ``StagedWeights.apply`` re-points the parameters
(in process), ``copy_into`` copies in place (captured CUDA graphs), and the CPU's forward
process flips between two shared-memory banks (rollout_process.py). Partial state dicts (a
subset of names) are allowed: a delta sync may only change some tensors.

How a policy's versions arrive, the engine decides once: ``FullPolicyWeights`` (a model of its own),
``AdapterPolicyWeights`` (a LoRA adapter riding in serving's batches, its versions flipping between slots of an
adapter bank) or ``MergedAdapterWeights`` (a LoRA adapter run as a model of its own, each version folded in).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rose.shared.errors import RoseError
from rose.shared.lora import Adapter, AdapterError, adapter_targets, base_weight_name, merged_weights


class WeightUpdateError(RoseError, ValueError):
    """The state dict does not fit the policy model; nothing was changed."""


@dataclass
class StagedWeights:
    tensors: dict[str, torch.Tensor]
    version: int

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> float:
        """Swap the staged tensors in; returns the pause in milliseconds.

        Parameters are re-pointed at the staged copies (O(1) each, so the pause does not grow
        with the model); buffers are copied. The forward looks weights up through the
        modules on every call, so the next iteration sees the new version whole.
        """
        start = time.perf_counter()
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        for name, tensor in self.tensors.items():
            if name in params:
                params[name].data = tensor
            else:
                buffers[name].copy_(tensor)
        if self.tensors and next(iter(self.tensors.values())).is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000.0

    @torch.no_grad()
    def copy_into(self, model: torch.nn.Module) -> float:
        """Copy the staged tensors into the live ones, keeping every weight's address; returns the
        pause in milliseconds. For a model whose forward replays captured CUDA graphs (which read
        the weights by address): re-pointing would leave them reading freed memory, or force a
        recapture of every graph after each update. The cost is one device copy of the update
        (an H200 copies ~4 TB/s, read plus write: ~1.3 ms for a 1.3B bfloat16 policy)."""
        start = time.perf_counter()
        live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        for name, tensor in self.tensors.items():
            live[name].copy_(tensor)
        if self.tensors and next(iter(self.tensors.values())).is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000.0


def checked_version(version: object) -> int:
    """A policy version label: a non-negative integer (WeightUpdateError otherwise)."""
    if not isinstance(version, int) or version < 0:
        raise WeightUpdateError(f"version must be a non-negative integer, got {version!r}")
    return version


def stage(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
    checked_version(version)
    if not state_dict:
        raise WeightUpdateError("empty state dict: nothing to update")
    live = model.state_dict()
    unknown = sorted(set(state_dict) - set(live))
    if unknown:
        raise WeightUpdateError(f"unknown parameter names (not in the policy model): {unknown[:5]}")
    problems = []
    for name, tensor in state_dict.items():
        ref = live[name]
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a tensor")
        elif tuple(tensor.shape) != tuple(ref.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != {tuple(ref.shape)}")
        elif tensor.dtype != ref.dtype:
            problems.append(f"{name}: dtype {tensor.dtype} != {ref.dtype}")
    if problems:
        raise WeightUpdateError("state dict does not match the policy model: " + "; ".join(problems[:5]))
    device = next(iter(live.values())).device
    return StagedWeights({n: t.detach().to(device, copy=True).contiguous() for n, t in state_dict.items()}, version)


class FullPolicyWeights:
    """A policy that is a model of its own: a version is staged against it (``stage``), prepared by its runner on the
    caller's thread (a rollout process fills its standby bank) and swapped in by the runner between iterations."""

    def __init__(self, model: torch.nn.Module, runner: Any) -> None:
        self.model, self.runner = model, runner

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def prepare(self, state_dict: dict[str, torch.Tensor], version: int) -> Callable[[], float]:
        """Check and stage now (WeightUpdateError: nothing changed); returns the swap, which gives its pause in ms."""
        staged = stage(self.model, state_dict, version)
        self.runner.prepare_weights(staged)
        return lambda: self.runner.apply_weights(staged)


class AdapterPolicyWeights:
    """A policy that is a LoRA adapter: its versions live in an ``AdapterBank``'s slots (adapters.py). A version is
    written into the spare slot on the caller's thread, over a copy of the live one (a delta names only what
    changed); the swap, between iterations, moves ``live`` to it: every later row names the new slot, so the
    pause is a pointer move whatever the adapter's size."""

    def __init__(self, bank: Any) -> None:
        self.bank = bank
        self.live = 0
        self._pending: int | None = None  # a slot written and not yet swapped to

    def slot(self) -> int:
        """The slot the policy's rows use now."""
        return self.live

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.bank.state_dict(self.live)

    def prepare(self, state_dict: dict[str, torch.Tensor], version: int) -> Callable[[], float]:
        checked_version(version)
        if not state_dict:
            raise WeightUpdateError("empty state dict: nothing to update")
        if self._pending is not None:
            raise WeightUpdateError("an adapter version is still being swapped in: apply the next one once it is live")
        spare = (self.live + 1) % self.bank.slots
        try:
            self.bank.load(spare, state_dict, version, base_slot=self.live)
        except ValueError as exc:  # AdapterError: names or shapes that are not the live adapter's
            raise WeightUpdateError(f"state dict does not match the policy's adapter: {exc}") from None
        self._pending = spare

        def swap() -> float:
            start = time.perf_counter()
            self.live, self._pending = spare, None
            return (time.perf_counter() - start) * 1000.0

        return swap


def fold_in(model: torch.nn.Module, adapter: Adapter) -> dict[str, torch.Tensor]:
    """Fold ``adapter`` into ``model``'s weights in place, before any runner reads them (AdapterError: not an adapter
    of this model's shape); returns the pristine weights it changed, copied to the host, that every later version
    is folded over (``MergedAdapterWeights``)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = [base_weight_name(layer, module) for layer, module in adapter_targets(adapter.tensors)]
    pristine = {n: params[n].detach().to("cpu", copy=True) for n in names if n in params}  # a name it lacks: merged_weights says which
    with torch.no_grad():
        for name, weight in merged_weights(pristine, adapter.tensors, adapter.shape.scale).items():
            params[name].copy_(weight)
    return pristine


class MergedAdapterWeights:
    """A LoRA policy run as a model of its own (the two-model mode): each version is folded into the policy model's
    adapted weights, ``W + scale * B @ A`` over the pristine ``W`` (``fold_in``), and swapped in as a full policy's
    version is. Rollout's forwards then cost the base model's, with no per-row adapter product: co-batching needs
    that product (serving's rows in the same batch are not adapted), a model of its own does not. The price is
    the adapted weights twice, pristine on the host (all-linear: about the whole model; a TP shard's on an 8-GPU
    node), and a fold per version, on the device, that copies them over the host link (shared/devices.py
    ``fold_seconds``); what is published, held and read back stays the adapter (peft names)."""

    def __init__(self, adapter: Adapter, pristine: dict[str, torch.Tensor], full: FullPolicyWeights) -> None:
        self.scale = adapter.shape.scale
        self._pristine, self._full = pristine, full
        self._device = next(full.model.parameters()).device  # where a version is folded: the pristine weights cross the host link once
        self._live = {name: t.detach().to("cpu", copy=True) for name, t in adapter.tensors.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live version's adapter tensors by peft name."""
        return dict(self._live)

    def prepare(self, state_dict: dict[str, torch.Tensor], version: int) -> Callable[[], float]:
        if not state_dict:
            raise WeightUpdateError("empty state dict: nothing to update")
        for name, tensor in state_dict.items():
            held = self._live.get(name)
            if held is None:
                raise WeightUpdateError(f"state dict does not match the policy's adapter: {name!r} is not one of its tensors")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(held.shape):
                found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise WeightUpdateError(f"state dict does not match the policy's adapter: {name!r} is {found}, the adapter's {tuple(held.shape)}")
        version_tensors = self._live | {name: t.detach().to("cpu", copy=True) for name, t in state_dict.items()}
        try:
            merged = merged_weights(self._pristine, version_tensors, self.scale, self._device)
        except AdapterError as exc:
            raise WeightUpdateError(f"state dict does not fold into the policy: {exc}") from None
        swap = self._full.prepare(merged, version)

        def apply() -> float:
            pause = swap()
            self._live = version_tensors
            return pause

        return apply


PolicyWeights = FullPolicyWeights | AdapterPolicyWeights | MergedAdapterWeights  # how a policy's versions arrive: one, fixed at start
