"""Applying published policy versions: the follower fetches and verifies, the engine swaps between quanta.

A version published in bf16/fp16 applies bit-exactly to an fp32 policy (the upcast keeps every
value); any other dtype or shape mismatch is refused by the engine and the previous weights
keep serving. Names, shapes and dtypes are all checked before a single tensor is converted, so a
wrong or oversized state costs no conversion (no memory) before it is refused.
"""

from __future__ import annotations

import asyncio

import torch

from rose.shared.weight_layout import LayoutError, dtype_name, fits_live, state_digest

from .backend import CoServingEngine
from .weights import WeightUpdateError


class PolicyUpdates:
    def __init__(self, engine: CoServingEngine) -> None:
        self.engine = engine

    async def apply(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Swap `state` in at the next iteration boundary; returns the pause in ms (raises to refuse).

        Validation and the staging copy run in a worker thread, off the event loop that
        answers serving HTTP requests. An emulated device first waits the time the real model's
        delta would take to arrive (``weight_transfer_s``; 0 on a real device, whose bytes came
        over the bus for real). An empty `state` is a version that changed no weight here: nothing to
        transfer or stage, the engine only moves the version label.
        """
        if not state:
            return await asyncio.wrap_future(self.engine.apply_policy_weights({}, version))
        transfer_s = self.engine.device.weight_transfer_s()
        if transfer_s > 0:
            await asyncio.sleep(transfer_s)
        staged = await asyncio.to_thread(self._stage, state, version)
        return await asyncio.wrap_future(staged)

    def _stage(self, state: dict[str, torch.Tensor], version: int):
        live = self.engine.policy_state_dict()
        check_fits(state, live)
        fitted = {name: tensor.to(live[name].dtype) if tensor.dtype != live[name].dtype else tensor for name, tensor in state.items()}
        return self.engine.apply_policy_weights(fitted, version)

    async def digest(self) -> str:
        """SHA-256 of the live policy parameters (to prove a version arrived bit-exact)."""
        return await asyncio.to_thread(state_digest, self.engine.policy_state_dict())


def check_fits(state: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
    """Raise WeightUpdateError unless every tensor names a live parameter, has its shape and a dtype that applies losslessly."""
    if not state:
        raise WeightUpdateError("empty state dict: nothing to update")
    problems = []
    for name, tensor in state.items():
        target = live.get(name)
        if target is None:
            problems.append(f"{name}: unknown parameter names (not in the policy model)")
        elif not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a tensor")
        elif tuple(tensor.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        elif not _fits(tensor.dtype, target.dtype):
            problems.append(f"{name}: dtype {tensor.dtype} != {target.dtype}")
    if problems:
        raise WeightUpdateError("state dict does not match the policy model: " + "; ".join(problems[:5]))


def _fits(published: torch.dtype, live: torch.dtype) -> bool:
    try:
        return fits_live(dtype_name(published), dtype_name(live))
    except LayoutError:
        return False
