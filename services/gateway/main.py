"""The rollout gateway: external agents' episodes on the policy, through an OpenAI-compatible HTTP API.

connect -> load the policy's tokenizer (its chat template, its tool-call format) -> start the agent
launcher -> serve HTTP -> consume agent tasks (N episodes at once) -> wait -> drain.
See runner.py for an episode's life, episode.py for how turns extend each other, http_api.py for the API.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from aiohttp import web

from rose.contracts.registry import AGENT_TASK
from rose.shared.http_server import HardenedAppRunner
from rose.shared.models import load_tokenizer, wait_for_files
from rose.shared.nats_server import state_dir
from rose.shared.service import ServiceRuntime, service_main
from rose.shared.turns.runner import TurnRunner

from .agents import launcher_for
from .chat import ChatFormat
from .config import GatewayConfig
from .http_api import GatewayApi
from .runner import Episodes

log = logging.getLogger(__name__)


def max_positions(policy) -> int:
    """The policy's context length (config.json), 0 when it does not say."""
    try:
        return int(json.loads((policy / "config.json").read_text()).get("max_position_embeddings", 0))
    except (OSError, ValueError):
        return 0


async def run(config: GatewayConfig) -> None:
    policy = config.models.policy_path()
    await wait_for_files(policy, ("tokenizer.json",), config.models.wait_s)
    fmt = ChatFormat(await asyncio.to_thread(load_tokenizer, policy))
    logs = state_dir() / "gateway" / "agents" if not config.agent.logs_dir else Path(config.agent.logs_dir)
    launcher = launcher_for(config.agent.script, config.agent.command, logs)
    stats: dict[str, float] = {}
    async with ServiceRuntime("gateway", bus=config.bus, runtime=config.runtime, load=lambda: dict(stats)) as rt:
        if launcher is not None:
            await launcher.start()
        else:
            log.error("no agent.script or agent.command: every episode will fail, saying so")
        turns = TurnRunner(rt.bus, config.turns)
        episodes = Episodes(rt.bus, turns, fmt, launcher, config, rt.instance)
        episodes.logs_dir, episodes.max_positions = logs, max_positions(policy)
        api = GatewayApi(episodes, fmt, config.model_name, config.http.max_body_bytes, config.turns.temperature)
        runner = HardenedAppRunner(api.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.http.host, config.http.port)
        await site.start()
        url = f"http://{config.http.host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        episodes.base_url = (config.http.public_url or url).rstrip("/")
        for _ in range(config.concurrency):  # one pull loop per episode slot
            await rt.bus.consume(
                AGENT_TASK,
                episodes.handle,
                durable=config.durable,
                max_deliver=config.max_deliver,
                ack_wait_s=config.ack_wait_s,
                batch=1,
                keep_alive=True,  # an episode runs as long as its agent takes; only a stopped gateway's is redelivered
            )
        rt.ready(endpoints={"http": episodes.base_url})
        log.info("gateway at %s, policy %s, tool calls: %s", episodes.base_url, config.model_name, fmt.calls.name)
        try:
            while not rt.stopping:
                stats.update({k: float(v) for k, v in {**turns.stats, **episodes.stats}.items()})
                stats["active_episodes"] = float(len(episodes.active))
                await rt.idle(config.runtime.heartbeat_interval_s)
        finally:
            await runner.cleanup()
            if launcher is not None:
                await launcher.close()


def main(argv: list[str]) -> int:
    return service_main(
        argv, service="gateway", description="Run the rollout gateway (external agents' episodes).", config_cls=GatewayConfig, run=run
    )
