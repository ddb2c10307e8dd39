"""`turns.resume_interrupted`: an interrupted turn resumes elsewhere with its tokens (default), or,
switched off (the elastic baseline's whole-job preemption in `rose bench e2e`), starts over and
its tokens are counted as discarded."""

from __future__ import annotations

from rose.contracts.executor import GenerateReply, GenerateRequest
from rose.contracts.registry import GENERATE, ROUTE_TURN
from rose.contracts.rollout import RolloutTask, TurnRoute, TurnRouteRequest
from rose.services.rollout_worker.config import RolloutWorkerConfig
from rose.shared.config import load_config
from rose.shared.turns.runner import TurnRunner, TurnSpec
from rose.shared.turns.settings import TurnSettings


def spec(trajectory: str) -> TurnSpec:
    task = RolloutTask(task_id=trajectory, env="conversation", prompt="hi", group_id="g", group_size=1)
    return TurnSpec(task, trajectory, 1, [10, 11, 12], "", 6, [], 7)


async def test_interrupted_turn_keeps_or_discards_its_tokens(bus):
    received: dict[str, list[GenerateRequest]] = {"tp-cut": [], "tp-ok": []}

    async def route(req: TurnRouteRequest, _d):
        ex = next(e for e in ("tp-cut", "tp-ok") if e not in req.exclude)
        return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id=ex, lease_id=f"{ex}-e1", lease_epoch=1)

    async def cut(req, _d):  # loses its lease after 2 tokens
        received["tp-cut"].append(req)
        return GenerateReply(
            request_id=req.request_id,
            executor_id="tp-cut",
            status="rejected",
            reject_reason="lease_revoked",
            token_ids=[101, 102],
            logprobs=[-0.5, -0.5],
            finish_reason="abort",
            policy_version=3,
        )

    async def ok(req, _d):
        received["tp-ok"].append(req)
        n = req.sampling.max_tokens
        return GenerateReply(
            request_id=req.request_id,
            executor_id="tp-ok",
            status="ok",
            token_ids=list(range(200, 200 + n)),
            logprobs=[-0.1] * n,
            finish_reason="length",
            policy_version=3,
        )

    await bus.serve(ROUTE_TURN, route)
    await bus.serve(GENERATE, cut, executor_id="tp-cut")
    await bus.serve(GENERATE, ok, executor_id="tp-ok")

    assert TurnSettings().resume_interrupted is True
    resume = TurnRunner(bus, TurnSettings(hedge=False, retry_backoff_s=0.05))
    kept = await resume.run(spec("traj-tp-1"))
    assert kept.token_ids == [101, 102, 200, 201, 202, 203] and received["tp-ok"][-1].prompt_token_ids == [10, 11, 12, 101, 102]
    assert resume.stats["resumed"] == 1 and resume.stats["discarded_tokens"] == 0

    restart = TurnRunner(bus, TurnSettings(hedge=False, retry_backoff_s=0.05, resume_interrupted=False))
    fresh = await restart.run(spec("traj-tp-2"))
    assert fresh.token_ids == [200, 201, 202, 203, 204, 205] and len(fresh.logprobs) == 6
    assert received["tp-ok"][-1].prompt_token_ids == [10, 11, 12] and received["tp-ok"][-1].sampling.max_tokens == 6
    assert restart.stats["resumed"] == 0 and restart.stats["discarded_tokens"] == 2 and fresh.attempts == 2
    cfg = load_config(RolloutWorkerConfig, env={"ROSE_TURNS__RESUME_INTERRUPTED": "false"})
    assert cfg.turns.resume_interrupted is False
