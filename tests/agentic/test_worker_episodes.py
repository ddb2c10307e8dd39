"""The tool environments inside the real rollout worker (episode.py + shared/turns/runner.py) on the real bus,
with a stand-in scheduler and a stand-in executor that "generates" scripted completions: the
token bookkeeping, tool calls, rewards and the failure path, end to end through the worker."""

from __future__ import annotations

import pytest

from rose.contracts.executor import GenerateReply, GenerateRequest
from rose.contracts.registry import GENERATE, ROUTE_TURN, TRAJECTORY
from rose.contracts.rollout import Trajectory, TurnRoute, TurnRouteRequest
from rose.services.rollout_worker.episode import EpisodeRunner
from rose.services.trainer.local_rollout import Tokens
from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.envs import ENVIRONMENTS, register
from rose.shared.bus import Delivery
from rose.shared.models import load_tokenizer
from rose.shared.turns.runner import TurnRunner
from rose.shared.turns.settings import TurnSettings
from rose.testing.agentic import BrokenEnv
from rose.testing.polling import until

EXECUTOR = "ex-agentic-standin"
MAX_DELIVER = 3


@pytest.fixture
async def worker(bus, models_dir):
    """A worker's episode runner, plus the scripts the stand-in executor plays, and what gets published."""
    tokens = Tokens(load_tokenizer(models_dir / "policy"))
    scripts: dict[str, list[str]] = {}
    published: list[Trajectory] = []

    async def route(req: TurnRouteRequest, _d) -> TurnRoute:
        return TurnRoute(
            trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id=EXECUTOR, lease_id="lease-1", lease_epoch=1, role="dedicated"
        )

    async def generate(req: GenerateRequest, _d) -> GenerateReply:
        text = scripts[req.task_id][req.turn_index]
        ids = tokens.encode(text) + [tokens.im_end]
        return GenerateReply(
            request_id=req.request_id,
            executor_id=EXECUTOR,
            status="ok",
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason="stop",
            policy_version=3,
        )

    async def collect(t: Trajectory, _d) -> None:
        published.append(t)

    await bus.serve(ROUTE_TURN, route)
    await bus.serve(GENERATE, generate, executor_id=EXECUTOR)
    await bus.subscribe(TRAJECTORY, collect)
    runner = EpisodeRunner(
        bus, TurnRunner(bus, TurnSettings(hedge=False)), tokens.tokenizer, "worker-agentic", max_tokens=64, max_deliver=MAX_DELIVER
    )
    return runner, tokens, scripts, published


async def published_for(published: list[Trajectory], task_id: str) -> Trajectory:
    return await until(lambda: next((t for t in published if t.task_id == task_id), None), timeout=15, what=f"a trajectory for {task_id}")


@pytest.mark.parametrize("env_name", ["arithmetic", "code", "search_qa"])
async def test_an_expert_episode_through_the_worker(worker, env_name):
    runner, tokens, scripts, published = worker
    env = ENVIRONMENTS[env_name]
    task = env.task(7, task_id=f"agentic-{env_name}-7", group_id="g-agentic", group_size=1)
    scripts[task.task_id] = env.expert(env.problem_of(task))
    await runner.handle(task, Delivery("test", attempt=1))
    t = await published_for(published, task.task_id)
    assert t.status == "completed" and t.reward == 1.0 and len(t.turns) == 2
    first, second = t.turns
    assert first.tool_calls and first.tool_calls[0].error == "" and first.tool_calls[0].result
    assert second.tool_calls == [] and second.policy_version == 3 and second.executor_id == EXECUTOR
    # Token in, token out: the second prompt is the first prompt, its tokens, then the observation.
    assert second.prompt_token_ids == first.prompt_token_ids + first.token_ids + tokens.encode(first.observation)


async def test_a_broken_tool_fails_the_trajectory_with_its_reason(worker):
    runner, _, scripts, published = worker
    if "agentic_broken" not in ENVIRONMENTS:
        broken = BrokenEnv()
        broken.name = "agentic_broken"
        register(broken)
    task = ENVIRONMENTS["agentic_broken"].task(1, task_id="agentic-broken-1")
    scripts[task.task_id] = ["<tool>crash: now</tool>"]
    await runner.handle(task, Delivery("test", attempt=1))  # not retryable: published as failed on the first delivery
    t = await published_for(published, task.task_id)
    assert t.status == "failed" and "database is down" in t.reason
