"""A gateway in the test's own process, on the real bus, in front of a stand-in scheduler and executor.

The stand-in executor "samples" like an expert arithmetic policy in ROSE's tool format: asked to go on
from a prompt whose last message is a question "What is E?", it writes `<tool>calc: E</tool>`; after a
`<result>R</result>`, it writes `<answer>R</answer>`; each ended with `<|im_end|>`, with logprob -0.5 a
token. Everything between the agent and the bus is the real gateway (runner, chat format, HTTP API,
agent launcher): what these tests check is the gateway, not the policy.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

import rose
from rose.contracts.executor import GenerateReply, GenerateRequest
from rose.contracts.registry import EPISODE_TURN, GENERATE, ROUTE_TURN, TRAJECTORY
from rose.contracts.rollout import RolloutTask, Trajectory, TurnRoute, TurnRouteRequest
from rose.services.gateway.agents import AgentLauncher
from rose.services.gateway.chat import ChatFormat
from rose.services.gateway.config import GatewayConfig
from rose.services.gateway.http_api import GatewayApi
from rose.services.gateway.runner import Episodes
from rose.shared.bus import Bus
from rose.shared.http_server import HardenedAppRunner
from rose.shared.models import load_tokenizer
from rose.shared.turns.runner import TurnRunner
from rose.shared.turns.settings import TurnSettings

EXAMPLES = Path(rose.__file__).resolve().parent / "examples" / "agents"
STANDIN_EXECUTOR = "ex-gateway-standin"
QUESTION_RE = re.compile(r"What is ([0-9+\-*/ ()]+)\?")
RESULT_RE = re.compile(r"<result>(.*?)</result>")


def expert_completion(prompt_text: str) -> str:
    """What an expert policy in ROSE's tool format writes next."""
    tail = prompt_text.rsplit("<|im_start|>", 2)[-2] if prompt_text.count("<|im_start|>") >= 2 else prompt_text
    if tail.startswith("tool\n") and (result := RESULT_RE.search(tail)):
        return f"<answer>{result.group(1)}</answer>"
    question = QUESTION_RE.search(tail)
    return f"<tool>calc: {question.group(1)}</tool>" if question else "I do not know."


@dataclass
class StandInFleet:
    """A scheduler that routes every turn to one executor, and that executor (an expert, see above)."""

    fmt: ChatFormat
    requests: list[GenerateRequest] = field(default_factory=list)
    script: dict[str, list[str]] = field(default_factory=dict)  # task id -> completions to play instead of the expert's
    delay_s: dict[str, float] = field(default_factory=dict)  # task id -> how long each of its turns takes

    async def start(self, bus: Bus) -> None:
        async def route(req: TurnRouteRequest, _d) -> TurnRoute:
            return TurnRoute(
                trajectory_id=req.trajectory_id,
                turn_index=req.turn_index,
                executor_id=STANDIN_EXECUTOR,
                lease_id="l-1",
                lease_epoch=1,
                role="dedicated",
            )

        async def generate(req: GenerateRequest, _d) -> GenerateReply:
            self.requests.append(req)
            if req.task_id in self.delay_s:
                await asyncio.sleep(self.delay_s[req.task_id])
            played = self.script.get(req.task_id, [])
            text = played[req.turn_index] if req.turn_index < len(played) else expert_completion(self.fmt.decode(req.prompt_token_ids, special=True))
            ids = self.fmt.encode(text)[: req.sampling.max_tokens - 1] + [self.fmt.stop_token_ids[-1]]
            return GenerateReply(
                request_id=req.request_id,
                executor_id=STANDIN_EXECUTOR,
                status="ok",
                token_ids=ids,
                logprobs=[-0.5] * len(ids),
                finish_reason="stop",
                policy_version=2,
                token_versions=[2] * len(ids),
            )

        await bus.serve(ROUTE_TURN, route)
        await bus.serve(GENERATE, generate, executor_id=STANDIN_EXECUTOR)


@dataclass
class InProcessGateway:
    episodes: Episodes
    api: GatewayApi
    runner: web.AppRunner
    url: str
    published: list[Trajectory] = field(default_factory=list)

    def trajectory(self, task_id: str) -> Trajectory | None:
        return next((t for t in self.published if t.task_id == task_id), None)

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.episodes.launcher is not None:
            await self.episodes.launcher.close()


async def start_gateway(
    bus: Bus,
    models_dir: Path,
    launcher: AgentLauncher | None,
    logs: Path,
    *,
    config: GatewayConfig | None = None,
    head_timeout_s: float | None = None,
) -> InProcessGateway:
    """The gateway's parts, wired as services/gateway/main.py wires them, on a free port."""
    config = config or GatewayConfig(turns=TurnSettings(hedge=False, retry_backoff_s=0.05), ack_wait_s=10.0)
    fmt = ChatFormat(load_tokenizer(models_dir / "policy"))
    if launcher is not None:
        await launcher.start()
    episodes = Episodes(bus, TurnRunner(bus, config.turns), fmt, launcher, config, "gw-test")
    episodes.logs_dir = logs
    logs.mkdir(parents=True, exist_ok=True)
    api = GatewayApi(episodes, fmt, config.model_name, config.http.max_body_bytes, config.turns.temperature)
    runner = HardenedAppRunner(api.app, access_log=None, **({"head_timeout_s": head_timeout_s} if head_timeout_s else {}))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    episodes.base_url = url
    gateway = InProcessGateway(episodes, api, runner, url)

    async def collect(t: Trajectory, _d) -> None:
        gateway.published.append(t)

    await bus.subscribe(TRAJECTORY, collect)
    return gateway


def arithmetic_task(seed: int, task_id: str, *, max_operand: int = 9, max_turns: int = 3) -> RolloutTask:
    from rose.shared.agentic.env_arithmetic import ArithmeticEnv

    task = ArithmeticEnv(max_operand).task(seed, task_id=task_id, group_id=f"g-{task_id}", group_size=1, max_turns=max_turns)
    task.env_args["max_tokens"] = "16"
    return task


async def checkpoints(bus: Bus, episode_id: str) -> list:
    """An episode's checkpointed turns, in order."""
    out: list = []
    while (cp := await bus.kv_get(EPISODE_TURN, episode_id=episode_id, turn_index=str(len(out)))) is not None:
        out.append(cp)
    return out
