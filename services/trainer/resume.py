"""The trainer's side of checkpoints: when one is written, what was last written or resumed from.

Why: a killed trainer resumes its job where it was (checkpoint.py holds what a checkpoint is and
how it is written and verified). This module keeps the bookkeeping around the store: the
checkpoint a process resumed from, the last one written, whether its weights still have to be
published, and the log lines that say why a run resumes or starts fresh.

In: the model and optimizer, the run id and a `TrainerState` (the trainer builds it from its
progress and the ack ledger); the weight client, for the last version on the manifest stream.
Out: a `Loaded` checkpoint (the trainer applies its state), the run id to go on under, whether a
save succeeded (then the trainer acks the trajectories it covers), `published.json` records.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from rose.client.weights import WeightsClient

from .checkpoint import CheckpointStore, Loaded, TrainerState, identity_diff, identity_key

log = logging.getLogger("rose.services.trainer.trainer")  # the trainer's log lines keep their logger


class Checkpoints:
    """The checkpoints of one trainer process: its store (None: checkpoints off), what it resumed from and last wrote."""

    def __init__(self, store: CheckpointStore | None) -> None:
        self.store = store
        self.resumed_from: int | None = None  # the checkpoint step this process resumed from
        self.last_step = -1  # the last checkpoint written or resumed from
        self.last_path: Path | None = None  # the last checkpoint written or resumed from
        self.publish_due = False  # on resume: the checkpoint's version may not have been published

    async def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_id: str) -> tuple[Loaded | None, str]:
        """Restore the newest valid checkpoint of this job into `model` and `optimizer`, and the run id to go on under;
        None: a fresh run (and why, logged), under a run id of its own when another job's checkpoints used this one."""
        if self.store is None:
            log.info("checkpoints off (checkpoint.every_steps = 0): a restart starts the job over")
            return None, run_id
        loaded = await asyncio.to_thread(self.store.load, model, optimizer)
        if loaded is None:
            others = await asyncio.to_thread(self.store.others)
            if others:
                path, manifest = others[-1]
                diff = identity_diff(manifest["identity"], self.store.identity)
                old_run = manifest.get("run_id", "")
                if old_run == run_id:  # its task and group ids would collide with the other job's
                    run_id = f"{run_id}-{identity_key(self.store.identity)[:8]}"
                log.warning(
                    "not resuming: the checkpoints in %s are of another job configuration (run %s, step %s; %s); starting a fresh run %s "
                    "(restore that configuration to resume it; its checkpoints are left as they are)",
                    path.parent,
                    old_run,
                    manifest.get("step"),
                    "; ".join(diff[:8]) or "?",
                    run_id,
                )
            else:
                log.info("no checkpoint in %s: starting a fresh run %s", self.store.dir, run_id)
            return None, run_id
        self.publish_due = loaded.state.publish_due and loaded.published is None
        self.resumed_from = self.last_step = loaded.state.step
        self.last_path = loaded.path
        return loaded, loaded.state.run_id

    async def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState) -> bool:
        """Write a checkpoint of `state` (a failure is logged, never fatal); True once it is on disk."""
        if self.store is None:
            return False
        try:
            path = await asyncio.to_thread(self.store.save, model, optimizer, state)
        except Exception:
            log.exception("checkpoint of step %d failed; its trajectories stay unacked until the next one", state.step)
            return False
        self.last_step, self.last_path = state.step, path
        log.info("checkpoint: step %d, version %d -> %s", state.step, state.version, path)
        return True

    def behind(self, steps: int) -> bool:
        """Checkpoints are on and the last one is not of step `steps`."""
        return self.store is not None and self.last_step != steps

    def mark_published(self, version: int) -> None:
        """The last checkpoint's weights are out as `version`: a resume from it publishes nothing."""
        if self.store is not None and self.last_path is not None:
            try:
                self.store.mark_published(self.last_path, version)
            except OSError as exc:
                log.warning("could not record the publish of v%d in %s: %r", version, self.last_path, exc)


async def last_published(weights: WeightsClient) -> int | None:
    """The last version on the manifest stream (None: none, or not readable after a few tries)."""
    for attempt in range(5):
        try:
            return await weights.last_version()
        except Exception as exc:  # reconnecting; the publisher refuses a stale number anyway
            log.warning("could not read the last published version (%r)%s", exc, "; retrying" if attempt < 4 else "; going on without it")
            await asyncio.sleep(1.0)
    return None
