"""Learning, measured with a tiny policy in pure torch (no bus): the expert warm start makes the
expert traces more probable, and a few GRPO steps on sampled groups raise the arithmetic reward.

The tiny policy (hidden 64, 2 layers, the project's real tokenizer) learns single-digit operands
(`max_operand=4`) in seconds on one core; the figures are printed (`pytest -s`) and recorded.
"""

from __future__ import annotations

import pytest
import torch

from rose.services.trainer.batch import pad
from rose.services.trainer.groups import GroupCollector
from rose.services.trainer.grpo import grpo_step
from rose.services.trainer.local_rollout import Tokens, sample_episodes, teacher_logprobs
from rose.services.trainer.sft import expert_sequences, mean_nll, warm_start
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.models import ModelShape, build_model, load_tokenizer

TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
SFT_STEPS, SFT_LR, SFT_TRACES = 200, 3e-3, 300
GRPO_STEPS, GRPO_LR, GRPO_EPOCHS, GROUP_SIZE = 10, 1e-3, 2, 8
PROBLEMS = list(range(500, 504))  # the groups' tasks: GRPO must raise the reward on them
EVAL_SAMPLES = 16
MAX_TOKENS = 16
MIN_REWARD_GAIN = 0.15


@pytest.fixture(scope="module")
def setup(models_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and light on a shared 2-core machine
    tokenizer = load_tokenizer(models_dir / "policy")
    tokens = Tokens(tokenizer)
    env = ArithmeticEnv(max_operand=4, system_prompt=False)
    model = build_model(TINY, len(tokenizer), tokenizer.eos_token_id, seed=0)
    train = expert_sequences([env], tokens, range(SFT_TRACES))
    held_out = expert_sequences([env], tokens, range(10_000, 10_032))
    report = warm_start(model, train, tokens.pad_id, steps=SFT_STEPS, lr=SFT_LR, batch_size=16, eval_seqs=held_out)
    yield model, tokens, env, report, held_out
    torch.set_num_threads(threads)


def reward(model, tokens, env, seed: int) -> float:
    tasks = [env.task(s, task_id=f"eval-{s}-{j}") for s in PROBLEMS for j in range(EVAL_SAMPLES)]
    trajectories = sample_episodes(model, tokens, env, tasks, max_tokens=MAX_TOKENS, generator=torch.Generator().manual_seed(seed))
    return sum(t.reward for t in trajectories) / len(trajectories)


def test_warm_start_makes_expert_traces_more_probable(setup, record_property):
    model, tokens, env, report, held_out = setup
    print(f"\nSFT: held-out expert NLL/token {report.nll_before:.3f} -> {report.nll_after:.3f} in {report.steps} steps")
    record_property("sft_nll_before", report.nll_before)
    record_property("sft_nll_after", report.nll_after)
    assert report.nll_after < 0.1 * report.nll_before
    assert mean_nll(model, held_out, tokens.pad_id) == pytest.approx(report.nll_after)


def test_grpo_steps_raise_the_arithmetic_reward(setup, record_property):
    model, tokens, env, _, _ = setup
    before = reward(model, tokens, env, seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=GRPO_LR, weight_decay=0.0)
    collector = GroupCollector(max_staleness=1)
    generator = torch.Generator().manual_seed(0)
    curve = []
    for step in range(GRPO_STEPS):
        tasks = []
        for seed in PROBLEMS:
            group = f"s{step}-p{seed}"
            collector.expect(group, GROUP_SIZE)
            tasks += [env.task(seed, task_id=f"{group}-{j}", group_id=group, group_size=GROUP_SIZE) for j in range(GROUP_SIZE)]
        for t in sample_episodes(model, tokens, env, tasks, max_tokens=MAX_TOKENS, generator=generator, version=step):
            collector.add(t)
            assert t.turns[0].policy_version == step
        seqs = collector.sequences(collector.ready(), current_version=step)
        curve.append(sum(s.advantage != 0 for s in seqs))
        if seqs:
            grpo_step(model, optimizer, [pad(seqs, tokens.pad_id)], clip_eps=0.2, max_grad_norm=1.0, epochs=GRPO_EPOCHS)
    after = reward(model, tokens, env, seed=99)
    print(f"\nGRPO: arithmetic reward {before:.3f} -> {after:.3f} after {GRPO_STEPS} steps ({len(PROBLEMS)} groups of {GROUP_SIZE} per step)")
    record_property("grpo_reward_before", before)
    record_property("grpo_reward_after", after)
    assert collector.stats["groups_used"] > 0
    assert after >= before + MIN_REWARD_GAIN


def test_batched_sampling_records_the_models_own_logprobs(setup):
    """Left-padded lockstep sampling (prompts of different lengths) records what the model computes unpadded."""
    model, tokens, _, _, _ = setup
    env = ArithmeticEnv()  # operands up to 99: prompts and turns of different lengths
    tasks = [env.task(seed, task_id=f"lp-{seed}") for seed in range(6)]
    trajectories = sample_episodes(model, tokens, env, tasks, max_tokens=MAX_TOKENS, generator=torch.Generator().manual_seed(5))
    assert len({len(t.turns[0].prompt_token_ids) for t in trajectories}) > 1
    for t in trajectories:
        for turn in t.turns:
            assert teacher_logprobs(model, turn.prompt_token_ids, turn.token_ids) == pytest.approx(turn.logprobs, abs=1e-3)
