"""The trainer service: warm start, then GRPO on trajectory groups from the bus, publishing each version.

load the policy (fp32 master weights; or a LoRA adapter over its frozen base, lora.py) -> connect -> resume from a checkpoint, if this job has
one -> consume trajectories -> (fresh: SFT warm start, checkpoint and publish -> emit tasks;
resumed: finish its publish, emit its tasks again) -> [wait for groups -> GRPO step ->
checkpoint -> publish -> emit] ... -> drain.
See trainer.py for the SDK calls this makes (the public API for a user's own RL framework),
checkpoint.py for what a checkpoint holds and what identifies a job, resume.py for when one is
written and what a process resumed from, and ledger.py for when a trajectory is acked.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from rose.shared.agentic import agentic_envs
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.agentic.env_emulated import EmulatedAgentEnv
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.config import ConfigError
from rose.shared.models import load_tokenizer, wait_for_files
from rose.shared.service import ServiceRuntime, service_main

from .config import TasksSettings, TrainerConfig
from .local_rollout import Tokens
from .lora import describe_policy, load_policy
from .trainer import Trainer

log = logging.getLogger(__name__)


def tool_envs(tasks: TasksSettings) -> list[ToolEnv]:
    """The environments to draw tasks from, with this job's difficulty (carried in each task's env_args)."""
    agentic_envs.register_agentic_envs()
    envs = []
    for name in tasks.envs:
        if name == ArithmeticEnv.name:
            env: object = ArithmeticEnv(tasks.max_operand)
        elif name == EmulatedAgentEnv.name:
            env = EmulatedAgentEnv(tasks.rollout_spec())
        else:
            env = ENVIRONMENTS.get(name)
        if not isinstance(env, ToolEnv):
            raise ConfigError(f"tasks.envs: {name!r} is not a tool environment; known: {agentic_envs.tool_env_names()}")
        envs.append(env)
    return envs


async def run(config: TrainerConfig) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)
    envs = tool_envs(config.tasks)
    policy = config.models.policy_path()
    # the tokenizer is written last, after the model's or the adapter's files (shared/models.py)
    await wait_for_files(policy, ("tokenizer.json",), config.models.wait_s)
    model = await asyncio.to_thread(load_policy, policy)  # a whole model, or a LoRA adapter over its base (lora.py)
    tokenizer = await asyncio.to_thread(load_tokenizer, policy)
    holder: dict[str, Trainer] = {}
    async with ServiceRuntime("trainer", bus=config.bus, runtime=config.runtime, load=lambda: holder["t"].load() if "t" in holder else {}) as rt:
        log.info("policy %s: %s", policy, describe_policy(model))
        trainer = holder["t"] = Trainer(rt.bus, model, Tokens(tokenizer), envs, config, config.run_id or rt.instance)
        resumed = await trainer.restore()  # before consuming: the resumed run's open groups must be known
        await trainer.start()
        rt.ready()
        stop = asyncio.Event()
        stopper = asyncio.create_task(_mirror(rt, stop))
        try:
            if resumed:
                await trainer.resume()
            else:
                await trainer.fresh()
                await trainer.warm_start()
                for step in range(config.grpo.prefetch_steps + 1):
                    await trainer.emit(step)
            while not stop.is_set() and (config.max_steps == 0 or trainer.steps < config.max_steps):
                if not await trainer.step(stop):
                    break
            await trainer.final_checkpoint()
            log.info("trainer done: %d steps, version %d, rewards %s", trainer.steps, trainer.version, [round(r, 3) for r in trainer.rewards])
        finally:
            stopper.cancel()
            await trainer.stop()


async def _mirror(rt: ServiceRuntime, stop: asyncio.Event) -> None:
    await rt.wait_for_shutdown()
    stop.set()


def main(argv: list[str]) -> int:
    return service_main(argv, service="trainer", description="Run the reference GRPO trainer.", config_cls=TrainerConfig, run=run)
