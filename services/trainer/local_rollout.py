"""Episodes run with a local torch model, producing the same `Trajectory` records as the worker.

Why: the warm start needs expert traces tokenized exactly as rollouts are (reset text, the
model's tokens ending with `<|im_end|>`, then the tokenized observation), evaluation needs
a policy's reward without a fleet, and the tests need real groups without executors. The
token bookkeeping mirrors `rollout_worker/episode.py`: tokenize the reset text once, then
only append.

`sample_episodes` samples a batch of episodes in lockstep with a KV cache (left-padded
prompts, explicit position ids); `scripted_episode` teacher-forces given completions and
records the model's logprobs for them, as an executor would have had it sampled them.
"""

from __future__ import annotations

import inspect
import time

import torch

from rose.contracts.rollout import RolloutTask, Trajectory, TurnRecord
from rose.shared.agentic.envs import IM_END, Environment


class Tokens:
    """Encoding the way the worker does, plus the stop tokens the worker asks executors for."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        self.stop_ids = {t for t in (self.im_end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _trajectory(task: RolloutTask, turns: list[TurnRecord], reward: float, status: str = "completed", reason: str = "") -> Trajectory:
    return Trajectory(
        task_id=task.task_id,
        trajectory_id=f"{task.task_id}-traj"[:128],
        env=task.env,
        status=status,  # type: ignore[arg-type]
        group_id=task.group_id,
        reason=reason,
        reward=reward,
        turns=turns,
        created_at=task.created_at,
        finished_at=time.time(),
    )


@torch.no_grad()
def teacher_logprobs(model, context: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([context + completion])
    logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def scripted_episode(model, tokens: Tokens, env: Environment, task: RolloutTask, completions: list[str], version: int = 0) -> Trajectory:
    """An episode whose completions are given (each ends its message with <|im_end|>)."""
    context = tokens.encode(env.reset(task))
    turns: list[TurnRecord] = []
    reward = 0.0
    for index, text in enumerate(completions):
        ids = tokens.encode(text) + [tokens.im_end]
        lps = teacher_logprobs(model, context, ids) if model is not None else [0.0] * len(ids)
        step = env.step(task, index, text, "stop", [t.finish_reason for t in turns])
        turns.append(
            TurnRecord(
                turn_index=index,
                prompt_token_ids=list(context),
                token_ids=ids,
                logprobs=lps,
                policy_version=version,
                executor_id="local",
                finish_reason="stop",
                text=text,
                observation=step.observation,
                tool_calls=step.tool_calls,
            )
        )
        reward = step.reward
        if step.done:
            break
        context = context + ids + tokens.encode(step.observation)
    return _trajectory(task, turns, reward)


def _cache_name(model) -> str:
    """The KV-cache argument of `forward`: `cache` in recent transformers, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it on to its base's
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def _sample(model, prompts: list[list[int]], max_tokens: int, tokens: Tokens, generator: torch.Generator) -> list[tuple[list[int], list[float], str]]:
    """Sample continuations of left-padded prompts at temperature 1; logprobs untempered."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokens.pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = _cache_name(model)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True)
    past, logits = getattr(out, cache), out.logits[:, -1]
    results: list[tuple[list[int], list[float], str]] = [([], [], "length") for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_tokens):
        logp = torch.log_softmax(logits.float(), -1)
        picked = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        for i, tok in enumerate(picked.tolist()):
            if done[i]:
                continue
            results[i][0].append(tok)
            results[i][1].append(float(logp[i, tok]))
            if tok in tokens.stop_ids:
                done[i] = True
                results[i] = (results[i][0], results[i][1], "stop")
        if all(done):
            break
        attention = torch.cat([attention, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=picked[:, None], attention_mask=attention, position_ids=positions, use_cache=True, **{cache: past})
        past, logits = getattr(out, cache), out.logits[:, -1]
    return results


def sample_episodes(
    model, tokens: Tokens, env: Environment, tasks: list[RolloutTask], *, max_tokens: int, generator: torch.Generator, version: int = 0
) -> list[Trajectory]:
    """Run the tasks' episodes in lockstep, one batched generation per turn."""
    contexts = [tokens.encode(env.reset(t)) for t in tasks]
    turns: list[list[TurnRecord]] = [[] for _ in tasks]
    rewards = [0.0] * len(tasks)
    active = list(range(len(tasks)))
    for index in range(max(t.max_turns for t in tasks)):
        active = [i for i in active if index < max(1, tasks[i].max_turns)]
        if not active:
            break
        samples = _sample(model, [contexts[i] for i in active], max_tokens, tokens, generator)
        still = []
        for i, (ids, lps, finish) in zip(active, samples):
            text = tokens.decode(ids)
            step = env.step(tasks[i], index, text, finish, [t.finish_reason for t in turns[i]])
            turns[i].append(
                TurnRecord(
                    turn_index=index,
                    prompt_token_ids=list(contexts[i]),
                    token_ids=ids,
                    logprobs=lps,
                    policy_version=version,
                    executor_id="local",
                    finish_reason=finish,
                    text=text,
                    observation=step.observation,
                    tool_calls=step.tool_calls,
                )
            )
            rewards[i] = step.reward
            if not step.done:
                contexts[i] = contexts[i] + ids + tokens.encode(step.observation)
                still.append(i)
        active = still
    return [_trajectory(t, tr, r) for t, tr, r in zip(tasks, turns, rewards)]
