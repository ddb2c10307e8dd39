"""Applying published policy versions: the follower fetches and verifies, the engine swaps between quanta.

A version published in bf16/fp16 applies bit-exactly to an fp32 policy (the upcast keeps every
value); any other dtype or shape mismatch is refused by the engine and the previous weights
keep serving.
"""

from __future__ import annotations

import asyncio

import torch

from rose.shared.weight_layout import dtype_name, fits_live, state_digest

from .engine import Engine


class PolicyUpdates:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def apply(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Swap `state` in at the next iteration boundary; returns the pause in ms (raises to refuse).

        Validation and the staging copy run in a worker thread, off the event loop that
        answers serving HTTP requests.
        """
        staged = await asyncio.to_thread(self._stage, state, version)
        return await asyncio.wrap_future(staged)

    def _stage(self, state: dict[str, torch.Tensor], version: int):
        live = self.engine.policy_state_dict()
        fitted = {}
        for name, tensor in state.items():
            target = live.get(name)
            upcast = target is not None and tensor.dtype != target.dtype and fits_live(dtype_name(tensor.dtype), dtype_name(target.dtype))
            fitted[name] = tensor.to(target.dtype) if upcast else tensor
        return self.engine.apply_policy_weights(fitted, version)

    async def digest(self) -> str:
        """SHA-256 of the live policy parameters (to prove a version arrived bit-exact)."""
        return await asyncio.to_thread(state_digest, self.engine.policy_state_dict())
