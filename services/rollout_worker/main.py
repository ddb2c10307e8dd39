"""The rollout worker: runs multi-turn episodes from the task work queue, publishes trajectories.

connect -> load the policy tokenizer -> consume tasks (N episodes at once) -> wait -> drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from rose.contracts.registry import ROLLOUT_TASK
from rose.shared.models import POLICY_DIRNAME, load_tokenizer
from rose.shared.nats_server import state_dir
from rose.shared.service import ServiceRuntime, service_main

from . import agentic_envs  # noqa: F401  (registers the arithmetic, code and search-QA environments)
from .config import RolloutWorkerConfig
from .episode import EpisodeRunner
from .turns import TurnRunner

log = logging.getLogger(__name__)


def policy_dir(config: RolloutWorkerConfig) -> Path:
    m = config.models
    if m.policy_dir:
        return Path(m.policy_dir)
    return (Path(m.dir) if m.dir else state_dir() / "models") / POLICY_DIRNAME


async def wait_for_tokenizer(directory: Path, timeout_s: float):
    """The policy's tokenizer; under `rose up` an executor may still be building the models."""
    deadline = time.monotonic() + timeout_s
    while not (directory / "tokenizer.json").exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no tokenizer at {directory}: run `rose models init` or set models.dir")
        log.info("waiting for the policy tokenizer at %s", directory)
        await asyncio.sleep(1.0)
    return await asyncio.to_thread(load_tokenizer, directory)


async def run(config: RolloutWorkerConfig) -> None:
    tokenizer = await wait_for_tokenizer(policy_dir(config), config.models.wait_s)
    stats: dict[str, float] = {}
    async with ServiceRuntime("rollout_worker", bus=config.bus, runtime=config.runtime, load=lambda: dict(stats)) as rt:
        turns = TurnRunner(rt.bus, config.turns)
        episodes = EpisodeRunner(rt.bus, turns, tokenizer, rt.instance, max_tokens=config.turns.max_tokens, max_deliver=config.max_deliver)
        for _ in range(config.concurrency):  # one pull loop per episode slot: nothing waits out its ack deadline
            await rt.bus.consume(
                ROLLOUT_TASK, episodes.handle, durable=config.durable, max_deliver=config.max_deliver, ack_wait_s=config.ack_wait_s, batch=1
            )
        rt.ready()
        while not rt.stopping:
            stats.update({k: float(v) for k, v in {**turns.stats, **episodes.stats}.items()})
            await rt.idle(config.runtime.heartbeat_interval_s)


def main(argv: list[str]) -> int:
    return service_main(argv, service="rollout_worker", description="Run a rollout worker.", config_cls=RolloutWorkerConfig, run=run)
