"""The optimizer step of an emulated training cluster (``emulation.device`` set, config.py EmulatedTraining).

An emulated fleet's trainer does all its host-side work for real (groups, staleness, the ledger, early
hand-out, checkpoints, publishing) and replaces only the step's forward and backward: it takes the time
the simulator prices for the policy's FLOPs over the batch's tokens on the trainer's GPUs
(``shared.devices.train_seconds``, times the time scale, shared/clock.py), and it changes a share of the
stand-in policy's weights by a seeded random step, so each version the executors follow is a real
sparse delta on the wire (bf16 deltas of a real AdamW step change 2-4 % of elements: anchors.md).
"""

from __future__ import annotations

import time

import torch

from rose.shared.clock import time_scale
from rose.shared.devices import device_spec, model_spec, train_seconds

from .batch import Sequence
from .config import EmulatedTraining


class EmulatedStep:
    def __init__(self, model: torch.nn.Module, settings: EmulatedTraining) -> None:
        self.model, self.s = model, settings
        self.device, self.policy = device_spec(settings.device), model_spec(settings.model)
        self.steps = 0

    def seconds(self, tokens: int) -> float:
        """The step's emulated time, in wall seconds."""
        return train_seconds(self.policy, tokens, self.s.gpus, self.device, self.s.mfu) * time_scale()

    @torch.no_grad()
    def __call__(self, seqs: list[Sequence]) -> dict[str, float]:
        tokens = sum(len(s.tokens) for s in seqs)
        started = time.monotonic()
        self.steps += 1
        gen = torch.Generator().manual_seed(self.steps)
        for p in self.model.parameters():
            if not p.requires_grad:
                continue  # a LoRA policy's frozen base: only its adapter is trained and published
            changed = torch.rand(p.shape, generator=gen) < self.s.changed_fraction
            # a step of ~2 % of each changed element's magnitude: enough to move its bf16 value
            p.add_(changed * p.abs().clamp_min(1e-3) * 0.02 * torch.randn(p.shape, generator=gen))
        time.sleep(max(0.0, self.seconds(tokens) - (time.monotonic() - started)))
        return {"loss": 0.0, "tokens": float(tokens), "clip_fraction": 0.0, "mean_ratio": 1.0, "approx_kl": 0.0}
