"""The example agents (a loop over the `openai` client, an OpenAI Agents SDK agent), unchanged, run by
the gateway: each episode's trajectory is token for token the one the rollout worker's built-in
arithmetic environment produces for the same problem and completions, scored by the environment's
reward function, and the reference trainer's batching trains exactly the sampled tokens."""

from __future__ import annotations

import pytest
import torch

from rose.services.gateway.agents import ForkedAgents, SpawnedAgents
from rose.services.trainer.batch import pad, sequences_of, token_logprobs
from rose.services.trainer.local_rollout import Tokens, scripted_episode
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.bus import Delivery
from rose.shared.models import load_model, load_tokenizer
from rose.testing.gateway import EXAMPLES, arithmetic_task, checkpoints, start_gateway
from rose.testing.polling import until

SEEDS = (11, 12, 13)


def _same_as_builtin_env(trajectory, task, tokens: Tokens) -> None:
    """The worker's env, given the completions the gateway's policy sampled, yields the same token ids."""
    env = ArithmeticEnv(int(task.env_args["max_operand"]))
    texts = [tokens.decode(t.token_ids) for t in trajectory.turns]
    reference = scripted_episode(None, tokens, env, task, texts)
    assert [t.prompt_token_ids for t in trajectory.turns] == [t.prompt_token_ids for t in reference.turns]
    assert [t.token_ids for t in trajectory.turns] == [t.token_ids for t in reference.turns]
    assert trajectory.reward == reference.reward == 1.0


@pytest.mark.parametrize("agent", ["openai_loop.py", "agents_sdk.py"])
async def test_an_example_agent_unchanged_makes_the_builtin_envs_trajectory(gw_bus, fleet, models_dir, tmp_path, agent):
    launcher = ForkedAgents(str(EXAMPLES / agent), tmp_path / "agents")
    gateway = await start_gateway(gw_bus, models_dir, launcher, tmp_path / "agents")
    tokens = Tokens(load_tokenizer(models_dir / "policy"))
    try:
        for seed in SEEDS:
            task = arithmetic_task(seed, f"ex-{agent[:6]}-{seed}")
            await gateway.episodes.handle(task, Delivery("test", attempt=1))
            t = await until(lambda task=task: gateway.trajectory(task.task_id), what=f"the trajectory of {task.task_id}")
            log = (tmp_path / "agents" / f"{task.task_id}.log").read_text()
            assert t.status == "completed", (t.reason, log)
            assert len(t.turns) == 2 and t.segment_breaks == [] and t.worker_id == "gw-test"
            assert t.turns[0].tool_calls[0].tool == "calc" and f">{t.turns[0].tool_calls[0].result}<" in t.turns[1].text
            _same_as_builtin_env(t, task, tokens)
            assert log.strip().splitlines()[-1] == t.turns[1].text, log  # the agent printed the policy's answer
            assert len(await checkpoints(gw_bus, task.task_id)) == 2
        assert not gateway.episodes.active and gateway.episodes.stats["completed"] == len(SEEDS)
    finally:
        await gateway.close()


async def test_the_reference_trainer_trains_exactly_the_sampled_tokens(gw_bus, fleet, models_dir, tmp_path):
    """Trajectories from an agent (a spawned command this time) go through the trainer's batching: each
    sequence's trained positions hold the sampled tokens, and the policy computes a loss on them."""
    import sys

    launcher = SpawnedAgents([sys.executable, str(EXAMPLES / "openai_loop.py")], tmp_path / "spawned")
    gateway = await start_gateway(gw_bus, models_dir, launcher, tmp_path / "spawned")
    try:
        task = arithmetic_task(21, "ex-spawned-21")
        await gateway.episodes.handle(task, Delivery("test", attempt=1))
        t = await until(lambda: gateway.trajectory(task.task_id))
        assert t.status == "completed" and t.reward == 1.0, t.reason
    finally:
        await gateway.close()
    (seq,) = sequences_of(t)
    sampled = [tok for turn in t.turns for tok in turn.token_ids]
    assert [tok for tok, m in zip(seq.tokens, seq.mask) if m] == sampled
    assert [lp for lp, m in zip(seq.old_logprobs, seq.mask) if m] == [lp for turn in t.turns for lp in turn.logprobs]
    model = load_model(models_dir / "policy")
    batch = pad([seq], pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    assert lp.shape[1] == len(seq.tokens) - 1 and float((lp * batch.mask).sum()) < 0
