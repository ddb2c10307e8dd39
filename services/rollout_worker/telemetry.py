"""The rollout worker's metrics and its episode span, around the episode runner.

`InstrumentedEpisodes` is the `EpisodeRunner` with a `rollout.episode` span over each task
(the task's consume span is its parent; every turn is a child) and the counters recorded when
a trajectory is published: trajectories per status, turns, turn attempts and tool calls. Every
counter is exported at 0 from the start for each environment the worker knows (tool calls: for
each of its tools), so a dashboard shows 0, not "No data", before the first one.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rose.contracts.rollout import RolloutTask, TrajectoryStatus, TurnRecord
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.bus import Delivery
from rose.shared.metrics import LATENCY_BUCKETS_S, meter, metric_name
from rose.shared.tracing import tracer

from .episode import EpisodeRunner, trajectory_id_of


class RolloutMetrics:
    def __init__(self) -> None:
        m = meter()
        self.trajectories = m.create_counter(
            metric_name("rollout.trajectories"),
            unit="{trajectory}",
            description="Trajectories published, per status (completed, failed) and environment.",
        )
        self.turns = m.create_counter(metric_name("rollout.turns"), unit="{turn}", description="Turns in published trajectories, per environment.")
        self.attempts = m.create_counter(
            metric_name("rollout.turn_attempts"), unit="{attempt}", description="Executor attempts behind those turns (retries, resumes, hedges)."
        )
        self.tool_calls = m.create_counter(
            metric_name("rollout.tool_calls"),
            unit="{call}",
            description="Tool calls made by the policy, per environment, tool and outcome (ok, error).",
        )
        self.duration = m.create_histogram(
            metric_name("rollout.episode_duration"),
            unit="s",
            description="One delivery of a task: first turn to trajectory published.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        for name, env in ENVIRONMENTS.items():  # the label sets a dashboard queries, at 0
            for status in ("completed", "failed"):
                self.trajectories.add(0, {"env": name, "status": status})
            self.turns.add(0, {"env": name})
            self.attempts.add(0, {"env": name})
            for tool in env.tools() if isinstance(env, ToolEnv) else ():
                for outcome in ("ok", "error"):
                    self.tool_calls.add(0, {"env": name, "tool": tool, "outcome": outcome})

    def trajectory(self, env: str, status: str, turns: list[TurnRecord]) -> None:
        self.trajectories.add(1, {"env": env, "status": status})
        self.turns.add(len(turns), {"env": env})
        self.attempts.add(sum(t.attempts for t in turns), {"env": env})
        for turn in turns:
            for call in turn.tool_calls:
                self.tool_calls.add(1, {"env": env, "tool": call.tool, "outcome": "error" if call.error else "ok"})


class InstrumentedEpisodes(EpisodeRunner):
    """The episode runner, traced and counted (same constructor, plus `metrics`)."""

    def __init__(self, *args, metrics: RolloutMetrics | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics or RolloutMetrics()

    async def handle(self, task: RolloutTask, delivery: Delivery) -> None:
        attributes: dict[str, AttributeValue] = {
            "rose.task_id": task.task_id,
            "rose.env": task.env,
            "rose.worker_id": self.worker_id,
            "rose.delivery_attempt": delivery.attempt,
            "rose.group_id": task.group_id,
        }
        with tracer().start_as_current_span("rollout.episode", attributes=attributes):
            started = time.monotonic()
            await super().handle(task, delivery)
            self.metrics.duration.record(time.monotonic() - started, {"env": task.env})

    async def _publish(self, task: RolloutTask, turns: list[TurnRecord], status: TrajectoryStatus, reward: float, reason: str) -> None:
        await super()._publish(task, turns, status, reward, reason)
        self.metrics.trajectory(task.env, status, turns)
        trace.get_current_span().set_attributes(
            {
                "rose.trajectory_id": trajectory_id_of(task),
                "rose.status": status,
                "rose.reward": reward,
                "rose.turns": len(turns),
                "rose.reason": reason[:256],
            }
        )
