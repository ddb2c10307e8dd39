"""The rollout worker: runs multi-turn episodes from the task work queue, publishes trajectories.

connect -> load the policy tokenizer -> consume tasks (N episodes at once) -> wait -> drain.
"""

from __future__ import annotations

import asyncio
import logging

from rose.contracts.registry import ROLLOUT_TASK
from rose.shared.agentic import agentic_envs  # noqa: F401  (registers the arithmetic, code and search-QA environments)
from rose.shared.agentic.env_code import configure_registered_code_env
from rose.shared.models import load_tokenizer, wait_for_files
from rose.shared.service import ServiceRuntime, service_main
from rose.shared.turns.runner import TurnRunner

from .config import RolloutWorkerConfig
from .telemetry import InstrumentedEpisodes

log = logging.getLogger(__name__)


async def run(config: RolloutWorkerConfig) -> None:
    policy = config.models.policy_path()
    await wait_for_files(policy, ("tokenizer.json",), config.models.wait_s)
    tokenizer = await asyncio.to_thread(load_tokenizer, policy)
    if refused := await asyncio.to_thread(configure_registered_code_env, config.sandbox.backend):  # fail closed: no unconfined code
        log.error("the code environment will refuse its episodes: %s", refused)
    stats: dict[str, float] = {}
    async with ServiceRuntime("rollout_worker", bus=config.bus, runtime=config.runtime, load=lambda: dict(stats)) as rt:
        turns = TurnRunner(rt.bus, config.turns)
        episodes = InstrumentedEpisodes(rt.bus, turns, tokenizer, rt.instance, max_tokens=config.turns.max_tokens, max_deliver=config.max_deliver)
        for _ in range(config.concurrency):  # one pull loop per episode slot: nothing waits out its ack deadline
            await rt.bus.consume(
                ROLLOUT_TASK,
                episodes.handle,
                durable=config.durable,
                max_deliver=config.max_deliver,
                ack_wait_s=config.ack_wait_s,
                batch=1,
                keep_alive=True,  # an episode runs as long as its turns take; only a stopped worker's is redelivered
            )
        rt.ready()
        while not rt.stopping:
            stats.update({k: float(v) for k, v in {**turns.stats, **episodes.stats}.items()})
            await rt.idle(config.runtime.heartbeat_interval_s)


def main(argv: list[str]) -> int:
    return service_main(argv, service="rollout_worker", description="Run a rollout worker.", config_cls=RolloutWorkerConfig, run=run)
