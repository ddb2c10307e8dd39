"""`rose bench gateway`: what an agent's turn through the rollout gateway costs, and that the trajectory
holds exactly what the policy sampled.

The fleet, as real processes on an embedded nats-server: one dedicated executor running a tiny policy
warm-started on expert traces (so that agents call their tool and episodes have several turns), the
SLO monitor and the scheduler. In the bench's own process, on one bus connection: the gateway's parts
as services/gateway/main.py wires them (runner, chat format, hardened HTTP server, agent launcher) and
a rollout worker's turn runner.

1. **overhead** (same run, same executor): `pairs` conversations of three turns, each run twice, once
   through the gateway by an HTTP client sending what an agent sends (messages with a tool; the client
   is in this process and its JSON work is counted), once on the worker's own path (shared/turns
   `TurnRunner.run` plus the turn's checkpoint, as the worker does; its prompts planned outside the
   timed region). Both sample with the same seeds, so both generate the same tokens; which goes first
   alternates. Reported: each path's p50/p99 and the paired difference (the gateway's overhead) and
   the ratio of the p50s.
2. **fidelity**: the example agents (examples/agents/openai_loop.py, agents_sdk.py), unchanged, run
   arithmetic tasks through the gateway until `turns` turns. Every turn the executor sampled (as the
   gateway's turn runner received it) is compared token by token with the published trajectory; the
   policy (the executor's weights, loaded here) recomputes the logprob of every trained token from the
   trajectory (a token or a position off shows as a logprob off); every segment break is listed with
   its reason; and the prompts a re-tokenizing proxy would have sent (each later turn re-encoded from
   the agent's messages) are compared with the ones the gateway sent.
3. **agent launch**: the time to start an agent that imports `openai`, forked from the warm interpreter
   (zygote.py) and spawned as a fresh process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

from rose.contracts.registry import TRAJECTORY, TURN_CHECKPOINT
from rose.contracts.rollout import RolloutTask, Trajectory, TurnCheckpoint, TurnRecord
from rose.services.gateway.agents import ForkedAgents, SpawnedAgents
from rose.services.gateway.chat import ChatFormat, conversation_digest, normalize_messages, normalize_tools
from rose.services.gateway.config import GatewayConfig
from rose.services.gateway.episode import Episode, Turn
from rose.services.gateway.http_api import GatewayApi
from rose.services.gateway.runner import Episodes, seed_of
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig
from rose.shared.http_server import HardenedAppRunner
from rose.shared.launch import start_all, stop_all
from rose.shared.models import init_models, load_model, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.turns.runner import TurnRunner, TurnSpec
from rose.shared.turns.settings import TurnSettings

from .demo import DEMO_POLICY
from .fleet import FleetSpec, fleet_processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "agents"
AGENTS = ("openai_loop.py", "agents_sdk.py")
CALC = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    }
]
MAX_OPERAND = 4  # the demo's difficulty
TURN_TOKENS = 16
WARM_START_STEPS = 200
LOGPROB_TOLERANCE = 0.05  # a wrong token or position is off by far more (a random policy's logprobs are ~ -8)
START_TIMEOUT_S = 240.0
EPISODES_AT_ONCE = 16  # agents at once in the fidelity phase
LAUNCHES = 5


@dataclass
class Sampled:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


class RecordingTurns(TurnRunner):
    """The turn runner, keeping what the executors returned for each turn (task id, turn index)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: dict[tuple[str, int], Sampled] = {}
        self.run_ms: dict[tuple[str, int], float] = {}  # how long each turn spent in the turn runner (route + generate)

    async def run(self, spec: TurnSpec) -> TurnRecord:
        t0 = time.perf_counter()
        record = await super().run(spec)
        self.run_ms[(spec.task.task_id, spec.turn_index)] = (time.perf_counter() - t0) * 1e3
        self.sampled[(spec.task.task_id, spec.turn_index)] = Sampled(list(spec.prompt_token_ids), list(record.token_ids), list(record.logprobs))
        return record


@dataclass
class Percentiles:
    values: list[float] = field(default_factory=list)

    def q(self, p: float) -> float | None:
        if not self.values:
            return None
        s = sorted(self.values)
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    def summary(self) -> dict[str, Any]:
        return {
            "n": len(self.values),
            "p50_ms": self.q(0.5),
            "p99_ms": self.q(0.99),
            "mean_ms": statistics.fmean(self.values) if self.values else None,
        }


def warm_started_models(directory: Path, console: Console) -> Path:
    """The demo's tiny policy, warm-started on the arithmetic expert traces as the trainer does (the executor loads it)."""
    from rose.services.trainer.local_rollout import Tokens
    from rose.services.trainer.sft import expert_sequences, warm_start

    if (directory / "policy" / ".warm-started").exists():
        return directory
    started = time.monotonic()
    init_models(directory, 0, DEMO_POLICY)
    tokens = Tokens(load_tokenizer(directory / "policy"))
    model = load_model(directory / "policy")
    seqs = expert_sequences([ArithmeticEnv(MAX_OPERAND)], tokens, range(300))
    report = warm_start(model, seqs, tokens.pad_id, steps=WARM_START_STEPS, lr=3e-3, batch_size=16)
    model.save_pretrained(directory / "policy", safe_serialization=True)
    (directory / "policy" / ".warm-started").write_text(json.dumps(report.__dict__))
    console.print(
        f"warm start: {report.steps} steps, expert NLL {report.nll_before:.2f} -> {report.nll_after:.2f} ({time.monotonic() - started:.0f} s)"
    )
    return directory


def task_of(seed: int, task_id: str) -> RolloutTask:
    task = ArithmeticEnv(MAX_OPERAND).task(seed, task_id=task_id, group_id=task_id, group_size=1, max_turns=3)
    task.env_args["max_tokens"] = str(TURN_TOKENS)
    return task


def _next_messages(messages: list[dict], reply: dict, k: int) -> list[dict]:
    """The conversation after an answer: its tool calls answered, or a user's nudge."""
    out = [*messages, reply]
    calls = reply.get("tool_calls") or []
    for call in calls:
        out.append({"role": "tool", "tool_call_id": call["id"], "content": "1"})
    if not calls:
        out.append({"role": "user", "content": ("Go on.", "And then?", "Sure?")[k % 3]})
    return out


async def overhead(bus: Bus, episodes: Episodes, turns: RecordingTurns, fmt: ChatFormat, pairs: int, console: Console) -> dict[str, Any]:
    worker = RecordingTurns(bus, episodes.config.turns)
    gateway_ms, direct_ms, diff_ms, added_ms = Percentiles(), Percentiles(), Percentiles(), Percentiles()
    tokens: dict[str, list[list[int]]] = {}  # task id -> each turn's tokens: the two paths of a pair must have sampled the same
    tools = normalize_tools(CALC)
    model = episodes.config.model_name
    async with aiohttp.ClientSession() as http:
        for i in range(pairs):
            task = task_of(10_000 + i, f"bench-gw-pair-{i}")
            direct_task = task_of(10_000 + i, f"bench-gw-pair-{i}-direct")
            q = ArithmeticEnv(MAX_OPERAND).problem_of(task).question

            async def through_gateway(task=task, q=q) -> list[float]:
                episode = await episodes.open(task)
                _, base = episodes.urls(episode)
                headers = {"Authorization": f"Bearer {episode.key}"}
                messages: list[dict] = [{"role": "user", "content": q}]
                out = []
                for k in range(3):
                    body = {"model": model, "messages": messages, "tools": CALC}
                    t0 = time.perf_counter()
                    async with http.post(f"{base}/chat/completions", json=body, headers=headers) as r:
                        answer = await r.json()
                    out.append((time.perf_counter() - t0) * 1e3)
                    tokens.setdefault(task.task_id, []).append(episode.turns[-1].record.token_ids)
                    assert r.status == 200, answer
                    messages = _next_messages(messages, answer["choices"][0]["message"], k)
                await episodes.post_reward(episode, 0.0)
                await episodes.publish(episode)
                return out

            async def on_worker_path(task=task, direct_task=direct_task, q=q) -> list[float]:
                plan_episode = Episode(direct_task.task_id, direct_task, "-", max_turns=3, deadline_s=3600)
                messages = normalize_messages([{"role": "user", "content": q}])
                out = []
                for k in range(3):
                    plan = plan_episode.plan_chat(fmt, messages, tools)
                    spec = TurnSpec(
                        direct_task, f"{direct_task.task_id}-traj", k, plan.prompt_ids, "", TURN_TOKENS, fmt.stop_token_ids, seed_of(task, k)
                    )
                    t0 = time.perf_counter()
                    record = await worker.run(spec)
                    await bus.kv_put(
                        TURN_CHECKPOINT,
                        TurnCheckpoint(task_id=direct_task.task_id, trajectory_id=spec.trajectory_id, turn=record),
                        task_id=direct_task.task_id,
                        turn_index=str(k),
                    )
                    out.append((time.perf_counter() - t0) * 1e3)
                    tokens.setdefault(direct_task.task_id, []).append(record.token_ids)
                    parsed = fmt.reply(record.token_ids, tools, "auto")
                    reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                    if parsed.calls:
                        reply["tool_calls"] = [{"id": f"c{k}{j}", "type": "function", "function": c} for j, c in enumerate(parsed.calls)]
                    plan_episode.turns.append(
                        Turn(record, "chat", messages, tools, reply, conversation_digest(messages, tools), plan.extends, delta=plan.delta)
                    )
                    messages = normalize_messages(_next_messages(messages, reply, k))
                return out

            if i % 2 == 0:
                g, d = await through_gateway(), await on_worker_path()
            else:
                d, g = await on_worker_path(), await through_gateway()
            gateway_ms.values += g
            direct_ms.values += d
            diff_ms.values += [a - b for a, b in zip(g, d)]
            # outside the turn runner (route + generate): the gateway's HTTP, planning, parsing, checkpoint vs the worker's checkpoint
            gateway_own = [g[k] - turns.run_ms[(task.task_id, k)] for k in range(3)]
            worker_own = [d[k] - worker.run_ms[(direct_task.task_id, k)] for k in range(3)]
            added_ms.values += [a - b for a, b in zip(gateway_own, worker_own)]
            if (i + 1) % 10 == 0:
                console.print(f"overhead: {i + 1}/{pairs} conversations, added p50 {added_ms.q(0.5):.2f} ms, p99 {added_ms.q(0.99):.2f} ms")
    gw, dr = gateway_ms.summary(), direct_ms.summary()
    same = sum(tokens[f"bench-gw-pair-{i}"] == tokens[f"bench-gw-pair-{i}-direct"] for i in range(pairs))
    return {
        "turns": len(diff_ms.values),
        "pairs_that_sampled_the_same_tokens": same,
        "gateway": gw,
        "worker_path": dr,
        "paired_difference": diff_ms.summary(),  # end to end: the executor's own jitter between the two runs is in it
        "overhead": added_ms.summary(),  # the same difference with each path's time in the turn runner taken out
        "ratio_p50": gw["p50_ms"] / dr["p50_ms"] if dr["p50_ms"] else None,
        "targets": {"overhead_p50_ms": 2.0, "overhead_p99_ms": 10.0},
    }


async def fidelity(
    bus: Bus, episodes: RecordingEpisodes, turns: RecordingTurns, fmt: ChatFormat, models: Path, want_turns: int, console: Console
) -> dict[str, Any]:
    published: dict[str, Trajectory] = {}

    async def collect(t: Trajectory, _d) -> None:
        published[t.task_id] = t

    await bus.subscribe(TRAJECTORY, collect)
    by_agent: dict[str, dict[str, float]] = {}
    seed = 0
    for agent in AGENTS:
        launcher = ForkedAgents(str(EXAMPLES / agent), episodes.logs_dir / agent)
        await launcher.start()
        episodes.launcher = launcher
        done = 0
        try:
            while done < want_turns // len(AGENTS):
                batch = [task_of(seed + j, f"bench-gw-{agent[:6]}-{seed + j}") for j in range(EPISODES_AT_ONCE)]
                seed += EPISODES_AT_ONCE
                await asyncio.gather(*(episodes.handle(task, Delivery("bench", attempt=1)) for task in batch))
                for task in batch:
                    while task.task_id not in published:
                        await asyncio.sleep(0.01)
                    done += len(published[task.task_id].turns)
                console.print(f"fidelity: {agent}: {done} turns")
        finally:
            await launcher.close()
            episodes.launcher = None
        mine = [t for t in published.values() if t.task_id.startswith(f"bench-gw-{agent[:6]}")]
        by_agent[agent] = {
            "episodes": len(mine),
            "turns": sum(len(t.turns) for t in mine),
            "completed": sum(t.status == "completed" for t in mine),
            "reward_mean": statistics.fmean(t.reward for t in mine) if mine else 0.0,
        }
    trajectories = [t for t in published.values() if t.task_id.startswith("bench-gw-") and "-pair-" not in t.task_id]
    compared = differing = prompt_diff = 0
    breaks: list[dict[str, Any]] = []
    for t in trajectories:
        for turn in t.turns:
            got = turns.sampled[(t.task_id, turn.turn_index)]
            compared += len(got.tokens)
            differing += sum(a != b for a, b in zip(got.tokens, turn.token_ids)) + abs(len(got.tokens) - len(turn.token_ids))
            differing += sum(a != b for a, b in zip(got.logprobs, turn.logprobs))
            prompt_diff += got.prompt != turn.prompt_token_ids
        breaks += [{"task_id": t.task_id, "turn": b.turn_index, "reason": b.reason} for b in t.segment_breaks]
    recomputed = _recompute(models, trajectories)
    agents_episodes = [e for e in episodes.finished if e.episode_id in {t.task_id for t in trajectories}]
    retokenized = _retokenizing_proxy(fmt, agents_episodes)
    return {
        "agents": by_agent,
        "trajectories": len(trajectories),
        "turns": sum(len(t.turns) for t in trajectories),
        "tokens_compared": compared,
        "tokens_differing": differing,
        "prompts_differing": prompt_diff,
        "segment_breaks": breaks,
        "segment_breaks_without_reason": sum(1 for b in breaks if not b["reason"]),
        "logprobs_recomputed": recomputed,
        "retokenizing_proxy": retokenized,
    }


def _recompute(models: Path, trajectories: list[Trajectory]) -> dict[str, Any]:
    """Teacher-force every trajectory's sequences on the executor's weights: trained tokens' logprobs vs the executor's."""
    import torch

    from rose.services.trainer.batch import pad, sequences_of, token_logprobs

    model = load_model(models / "policy")
    deltas: list[float] = []
    with torch.no_grad():
        for t in trajectories:
            for seq in sequences_of(t):
                b = pad([seq], 0)
                lp = token_logprobs(model, b)[0]
                for i in range(len(seq.tokens) - 1):
                    if seq.mask[i + 1]:
                        deltas.append(abs(float(lp[i]) - seq.old_logprobs[i + 1]))
    return {
        "tokens": len(deltas),
        "max_abs_delta": max(deltas, default=0.0),
        "mean_abs_delta": statistics.fmean(deltas) if deltas else 0.0,
        "over_tolerance": sum(d > LOGPROB_TOLERANCE for d in deltas),
        "tolerance": LOGPROB_TOLERANCE,
    }


def _retokenizing_proxy(fmt: ChatFormat, finished: list[Episode]) -> dict[str, Any]:
    """Later turns whose prompt, re-encoded from the agent's messages (as a proxy without a token history would
    send it), differs from the one the gateway sent: each such turn would train on tokens the policy never saw."""
    later = differ = 0
    for episode in finished:
        for turn in episode.turns:
            if turn.api == "chat" and turn.extends >= 0:
                later += 1
                differ += fmt.prompt_ids(turn.request, turn.tools) != turn.record.prompt_token_ids
    return {"later_turns": later, "re_encoded_prompt_differs": differ}


class RecordingEpisodes(Episodes):
    """The gateway's episodes, keeping each one published (its turns hold the agent's messages)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[Episode] = []

    async def publish(self, episode: Episode) -> Trajectory:
        self.finished.append(episode)
        return await super().publish(episode)


async def launch_times(logs: Path) -> dict[str, Any]:
    script = logs / "import_openai.py"
    script.write_text("import openai\n")
    out: dict[str, Any] = {}
    for name, launcher in (
        ("forked", ForkedAgents(str(script), logs / "forked")),
        ("spawned", SpawnedAgents([sys.executable, str(script)], logs / "spawned")),
    ):
        await launcher.start()
        times = []
        try:
            for i in range(LAUNCHES):
                t0 = time.perf_counter()
                run = await launcher.launch(f"launch-{name}-{i}", {}, [], logs / f"launch-{name}-{i}.log")
                code = await run.exited
                times.append((time.perf_counter() - t0) * 1e3)
                assert code == 0, (logs / f"launch-{name}-{i}.log").read_text()
        finally:
            await launcher.close()
        out[name] = Percentiles(times).summary()
    return out


async def run(out_json: str, pairs: int, turns: int, models_dir: str | None, console: Console) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rose-bench-gateway-"))
    models = warm_started_models(Path(models_dir) if models_dir else root / "models", console)
    server = NatsServer(root / "nats", log_file=root / "nats-server.log").start()
    spec = FleetSpec(prefix="gwbench")
    procs = fleet_processes(root / "logs", server.url, models, spec, 0, 1)
    procs.pop("worker")
    bus = Bus(BusConfig(url=server.url, initial_connect_deadline_s=20.0), service="cli", instance="bench-gateway")
    await bus.connect()
    await provision(bus.js)
    gw_runner = None
    try:
        console.print(f"starting {len(procs)} services (logs in {root / 'logs'}) ...")
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        config = GatewayConfig(turns=TurnSettings(hedge=False), ack_wait_s=30.0)
        fmt = ChatFormat(load_tokenizer(models / "policy"))
        recording = RecordingTurns(bus, config.turns)
        episodes = RecordingEpisodes(bus, recording, fmt, None, config, "gw-bench")
        episodes.logs_dir = root / "agents"
        episodes.logs_dir.mkdir(parents=True)
        api = GatewayApi(episodes, fmt, config.model_name, config.http.max_body_bytes, config.turns.temperature)
        gw_runner = HardenedAppRunner(api.app, access_log=None)
        await gw_runner.setup()
        site = web.TCPSite(gw_runner, "127.0.0.1", 0)
        await site.start()
        episodes.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        result = {
            "overhead": await overhead(bus, episodes, recording, fmt, pairs, console),
            "fidelity": await fidelity(bus, episodes, recording, fmt, models, turns, console),
            "agent_launch_ms": await launch_times(root / "agents"),
            "policy": {"shape": DEMO_POLICY.__dict__, "warm_start_steps": WARM_START_STEPS, "turn_tokens": TURN_TOKENS},
        }
    finally:
        if gw_runner is not None:
            await gw_runner.cleanup()
        await asyncio.to_thread(stop_all, list(procs.values()))
        await bus.close()
        server.stop()
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result, out_json, console)
    if not models_dir:
        shutil.rmtree(root, ignore_errors=True)
    return result


def print_summary(result: dict[str, Any], out_json: str, console: Console) -> None:
    o, f = result["overhead"], result["fidelity"]
    table = Table(title="rose bench gateway")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    rows = [
        ("turn through the gateway p50 / p99", f"{ms(o['gateway']['p50_ms'])} / {ms(o['gateway']['p99_ms'])}"),
        ("turn on the worker's path p50 / p99", f"{ms(o['worker_path']['p50_ms'])} / {ms(o['worker_path']['p99_ms'])}"),
        ("gateway overhead p50 / p99 (target 2 / 10)", f"{ms(o['overhead']['p50_ms'])} / {ms(o['overhead']['p99_ms'])}"),
        ("paired end-to-end difference p50 / p99", f"{ms(o['paired_difference']['p50_ms'])} / {ms(o['paired_difference']['p99_ms'])}"),
        ("ratio of p50s (gateway / worker)", f"{o['ratio_p50']:.3f}" if o["ratio_p50"] else "-"),
        ("turns from the example agents", str(f["turns"])),
        ("tokens compared / differing", f"{f['tokens_compared']} / {f['tokens_differing']}"),
        ("segment breaks (without a reason)", f"{len(f['segment_breaks'])} ({f['segment_breaks_without_reason']})"),
        (
            "recomputed logprobs: max |delta|, over tolerance",
            f"{f['logprobs_recomputed']['max_abs_delta']:.2e}, {f['logprobs_recomputed']['over_tolerance']}",
        ),
        (
            "re-tokenizing proxy: later prompts that differ",
            f"{f['retokenizing_proxy']['re_encoded_prompt_differs']} of {f['retokenizing_proxy']['later_turns']}",
        ),
        (
            "agent launch forked / spawned p50",
            f"{ms(result['agent_launch_ms']['forked']['p50_ms'])} / {ms(result['agent_launch_ms']['spawned']['p50_ms'])}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {out_json}")


@dataclass(frozen=True, kw_only=True)
class GatewayOptions:
    """What a `rose bench gateway` run measures: ``pairs`` 3-turn conversations on both paths (each gives 3 paired
    turns), ``turns`` turns from the example agents for the token-for-token check."""

    pairs: int = 200
    turns: int = 1000


def run_gateway_bench(options: GatewayOptions, out_json: str, model_dir: str | None = None, console: Console | None = None) -> dict[str, Any]:
    """Both paths and the fidelity check; the result (also written to ``out_json``). ``model_dir``: where to build the
    warm-started policy and keep it (default: a temporary directory)."""
    return asyncio.run(run(out_json, options.pairs, options.turns, model_dir, console or Console()))
