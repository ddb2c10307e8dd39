"""The TRL integration's pieces without a fleet: the CPU tree attention against plain attention on TRL's own packing,
episodes as TRL's fields, the task table, the groups' re-hand-outs, and what is published as the policy (the model, or a
LoRA adapter over its base, its configuration held to what the executors run)."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from rose.contracts.rollout import RolloutTask, Trajectory, TurnRecord
from rose.integrations.trl.groups import GroupBook, RolloutFailed
from rose.integrations.trl.policy import LoraPolicy, UnsupportedPolicy, check_lora_config, policy_state_dict
from rose.integrations.trl.rollout_func import prompt_runs, trl_fields
from rose.integrations.trl.sequences import EpisodeShapeError, episode_runs, single_run
from rose.integrations.trl.tasks import TaskTable, UnknownPrompt, env_reward
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.lora import (
    ALL_LINEAR,
    Adapter,
    AdapterError,
    LoraShape,
    adapter_targets,
    adapter_tensor_name,
    lora_config,
    model_fingerprint,
    new_adapter,
    write_adapter,
)
from rose.shared.models import DEMO_POLICY_SHAPE, build_model


def turn(index: int, prompt: list[int], tokens: list[int], version: int = 3) -> TurnRecord:
    return TurnRecord(
        turn_index=index, prompt_token_ids=prompt, token_ids=tokens, logprobs=[-0.5] * len(tokens), policy_version=version, executor_id="ex"
    )


def trajectory(task_id: str, turns: list[TurnRecord], status: str = "completed", reward: float = 1.0) -> Trajectory:
    return Trajectory(task_id=task_id, trajectory_id=f"{task_id}-traj", env="arithmetic", status=status, reward=reward, turns=turns)  # type: ignore[arg-type]


def test_an_episode_is_one_prompt_and_one_completion_with_the_environment_masked():
    first = turn(0, [1, 2, 3], [10, 11])
    second = turn(1, [1, 2, 3, 10, 11, 50, 51], [12, 13, 14], version=4)  # 50, 51: the tool's result
    fields = trl_fields([trajectory("t-0", [first, second], reward=1.0)])
    assert fields["prompt_ids"] == [[1, 2, 3]]
    assert fields["completion_ids"] == [[10, 11, 50, 51, 12, 13, 14]]
    assert fields["env_mask"] == [[1, 1, 0, 0, 1, 1, 1]]
    assert fields["logprobs"] == [[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]]
    assert fields["env_reward"] == [1.0]
    assert episode_runs(trajectory("t-0", [first, second]))[0].oldest_version == 3
    # a turn whose prompt does not extend the one before (an agent's segment break) starts a second row
    broken = trajectory("t-1", [first, turn(1, [9, 9, 9], [12])])
    assert len(episode_runs(broken)) == 2
    with pytest.raises(EpisodeShapeError, match="AsyncGRPOTrainer"):
        single_run(broken)


def test_the_task_table_maps_trl_prompts_to_rose_tasks():
    env = ArithmeticEnv(4)
    table = TaskTable([env], range(40), max_turns=2, max_tokens=8)
    assert 1 < len(table) <= 40  # seeds that pose the same question are one task
    spec = table.specs_in_order()[0]
    assert table.spec(spec.prompt) is spec and table.spec([{"role": "user", "content": spec.prompt}]) is spec
    task = spec.task("g-0", group_id="g", group_size=4, max_turns=2, max_tokens=8, batch_id="b", batch_size=8)
    assert (task.env, task.env_args["seed"], task.env_args["max_operand"], task.env_args["max_tokens"]) == ("arithmetic", str(spec.seed), "4", "8")
    assert task.prompt == spec.prompt == env.problem(spec.seed).question
    assert table.dataset()["prompt"] == [s.prompt for s in table.specs_in_order()]
    with pytest.raises(UnknownPrompt, match="TaskTable.dataset"):
        table.spec("What is 1000+1000?")
    assert env_reward(["p", "p"], ["c", "c"], env_reward=[0.0, 1.0]) == [0.0, 1.0]


def test_runs_of_equal_prompts_are_groups_of_num_generations():
    assert prompt_runs(["a"] * 4 + ["b"] * 4, 4) == [("a", 4), ("b", 4)]
    assert prompt_runs(["a"] * 8, 4) == [("a", 4), ("a", 4)]  # a prompt drawn twice in a row: two groups


async def test_a_member_is_handed_out_again_until_its_trajectory_is_usable():
    sent: list[RolloutTask] = []

    async def publish(task: RolloutTask) -> None:
        sent.append(task)

    book = GroupBook(publish, max_turns=3, max_tokens=16, member_timeout_s=60.0, max_attempts=3)
    spec = TaskTable([ArithmeticEnv(4)], [7]).specs_in_order()[0]
    group = await book.open(spec, 3, group_id="run-r0-g0", batch_id="run-r0", batch_size=3, min_version=3)
    assert [t.task_id for t in sent] == ["run-r0-g0-0", "run-r0-g0-1", "run-r0-g0-2"] and all(t.group_size == 3 for t in sent)
    ok = [turn(0, [1, 2], [5, 6])]
    await book.on_trajectory(trajectory("run-r0-g0-0", ok))
    await book.on_trajectory(trajectory("run-r0-g0-0", ok))  # at least once: a copy
    await book.on_trajectory(trajectory("run-r0-g0-1", [], status="failed"))  # an environment failure: again at once
    await book.on_trajectory(trajectory("run-r0-g0-2", [turn(0, [1, 2], [5], version=2)]))  # sampled before v3: stale
    assert [t.task_id for t in sent[3:]] == ["run-r0-g0-1-r1", "run-r0-g0-2-r1"]
    await book.expire(float("inf"))  # nothing came back for the new tasks: lost, out again
    assert [t.task_id for t in sent[5:]] == ["run-r0-g0-1-r2", "run-r0-g0-2-r2"]
    await book.on_trajectory(trajectory("run-r0-g0-1-r1", ok))  # an earlier attempt comes back after all: it fills the member
    await book.on_trajectory(trajectory("run-r0-g0-2-r2", ok))
    assert [t.task_id for t in await group.wait()] == ["run-r0-g0-0", "run-r0-g0-1-r1", "run-r0-g0-2-r2"]
    assert book.stats["rerolled_failed"] == book.stats["rerolled_stale"] == 1 and book.stats["rerolled_lost"] == 2
    assert book.stats["duplicates"] == 1
    book.close(group)
    await book.on_trajectory(trajectory("run-r0-g0-1-r2", ok))
    assert book.stats["late"] == 1

    broken = await book.open(spec, 1, group_id="run-r1-g0", batch_id="run-r1", batch_size=1)
    for attempt in ("run-r1-g0-0", "run-r1-g0-0-r1", "run-r1-g0-0-r2"):
        await book.on_trajectory(trajectory(attempt, [], status="failed"))
    with pytest.raises(RolloutFailed, match="from 3 tasks"):
        await broken.wait()


def test_the_policy_is_the_whole_state_dict():
    model = build_model(DEMO_POLICY_SHAPE, 64, 0, seed=0)
    state = policy_state_dict(model)
    assert set(state) == set(model.state_dict()) and "lm_head.weight" in state  # tied: both names, as executors list them
    assert state["lm_head.weight"].data_ptr() != model.lm_head.weight.data_ptr()  # a copy the next step cannot change


def lora_layout(root: Path, shape: LoraShape) -> tuple[Path, torch.nn.Module]:
    """`rose models init --lora`'s layout, small: serving/ (the base) and policy/ (an adapter of it)."""
    base = build_model(DEMO_POLICY_SHAPE, 64, 0, seed=0)
    base.save_pretrained(root / "serving")
    adapter = Adapter(
        shape=shape, tensors=new_adapter(base, shape, seed=1), base=str(root / "serving"), base_fingerprint=model_fingerprint(base.state_dict())
    )
    return write_adapter(root / "policy", adapter), base


def peft_over(base_dir: Path, config) -> torch.nn.Module:
    """What TRL's peft path builds from `model=base_dir, peft_config=config` (trl/trainer/utils.py, then get_peft_model)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True), copy.deepcopy(config))  # (peft renames its base)


def test_a_lora_policy_starts_from_the_executors_adapter_and_publishes_its_tensor_names(tmp_path):
    shape = LoraShape(rank=2, alpha=4.0)
    policy_dir, _ = lora_layout(tmp_path, shape)
    lora = LoraPolicy.read(policy_dir)
    assert lora.base_dir == tmp_path / "serving" and check_lora_config(lora.config, shape) == shape
    model = peft_over(lora.base_dir, lora.config)
    lora.load_into(model)  # TRL's model starts from the adapter the executors serve, not from peft's fresh draw
    state = policy_state_dict(model)
    names = {adapter_tensor_name(layer, module, ab) for layer in range(DEMO_POLICY_SHAPE.num_layers) for module in shape.targets for ab in "AB"}
    assert set(state) == names == set(lora.adapter.tensors)  # the names the executors' live adapter has, nothing of the base
    assert all(torch.equal(state[n], lora.adapter.tensors[n]) for n in names)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())  # the base frozen, the adapter trained
    assert policy_state_dict(model, torch.bfloat16)[next(iter(names))].dtype == torch.bfloat16
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.add_(0.01)  # a trained adapter: B away from version 0's zeros
    state = policy_state_dict(model)
    model.merge_adapter()  # what TRL's async seam does before each sync: the adapter's own tensors are still what is read
    merged = policy_state_dict(model)
    model.unmerge_adapter()
    assert adapter_targets(merged) and all(torch.equal(merged[n], state[n]) for n in names)
    # the adapter over another model is refused by name, as the executors refuse it
    other = build_model(DEMO_POLICY_SHAPE, 64, 0, seed=5)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterError, match="fingerprint"):
        lora.load_into(peft_over(tmp_path / "other", lora.config))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"lora_dropout": 0.05}, "lora_dropout"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "lora_only"}, "bias"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"r": 4}, "r is 4"),
        ({"lora_alpha": 8}, "scale"),
        ({"target_modules": ["q_proj", "v_proj"]}, "target_modules"),
    ],
)
def test_a_lora_config_the_executors_cannot_run_is_refused_naming_the_field(change, field):
    peft = pytest.importorskip("peft")
    executors = LoraShape(rank=2, alpha=4.0)  # the adapter the executors serve
    assert check_lora_config(lora_config(executors), executors) == executors
    config = peft.LoraConfig(**{"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": list(ALL_LINEAR), **change})
    with pytest.raises(UnsupportedPolicy, match=field):
        check_lora_config(config, executors)


def test_the_cpu_tree_attention_matches_plain_attention_on_trls_packing(tmp_path):
    """TRL packs samples sharing a prefix into one trie row; through the CPU kernel each sample's log-probabilities
    are those of a plain forward of that sample alone."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention

    from rose.integrations.trl import install_cpu_fallbacks

    install_cpu_fallbacks()
    register_tree_attention()
    build_model(DEMO_POLICY_SHAPE, 64, 0, seed=0).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    tree = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=TREE_ATTENTION)
    samples = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11]]
    row = TreeRow()
    for ids in samples:
        ones = np.ones(len(ids), dtype=np.int64)
        row.add({"input_ids": np.array(ids), "completion_mask": ones, "old_log_probs": np.zeros(len(ids)), "advantage": 1.0, "group_id": 0})
    p = row.pack()
    assert len(p["input_ids"]) < sum(map(len, samples))  # the shared prefix is forwarded once
    tree_kwargs = {key: p[key] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = p["tree_max_seqlens"].tolist()
    with torch.no_grad():
        logits = tree(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None], **tree_kwargs).logits[0]
        packed = torch.log_softmax(logits, -1)[p["token_index"], p["input_ids"].new_tensor([ids[i] for ids in samples for i in range(1, len(ids))])]
        alone = [torch.log_softmax(plain(input_ids=torch.tensor([ids])).logits[0, :-1], -1) for ids in samples]
        expected = torch.cat([lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0] for lp, ids in zip(alone, samples)])
    assert torch.allclose(packed, expected, atol=1e-5)


def test_the_bench_reports_both_baselines_and_where_a_steps_time_goes():
    """`rose bench trl`'s figures: steps per hour from the steps' ends (TrainingStep events; TRL alone's batches), each
    step's training share, and the two ratios: TRL through ROSE over ROSE's trainer, and over TRL alone."""
    from rich.console import Console

    from rose.bench.demo import Observed
    from rose.bench.trl import alone_figures, arm_ratios, print_table, run_figures, summarize
    from rose.contracts.training import TrainingStep

    def run(step_s: float, train_s: float, rewards: list[float]) -> dict:
        obs = Observed()
        batch = {"groups": 8, "trajectories": 64, "trained_sequences": 64, "train_s": train_s}
        obs.steps = [TrainingStep(run_id="r", step=k + 1, version=k + 1, reward_mean=r, at=k * step_s, **batch) for k, r in enumerate(rewards)]
        rollout = {"tokens_per_s": 1.0, "harvested_fraction": 0.5}
        summary = {"serving": {"slo_attainment": 1.0}, "rollout": rollout, "trajectories": {"lost": 0, "published": 64}}
        return run_figures(summary, obs)

    rose, trl = run(9.0, 2.0, [0.1] * 5 + [0.3] * 5), run(25.0, 15.0, [0.1] * 5 + [0.2] * 5)
    batches = [{"at": 100.0 + 18.0 * k, "train_s": 15.0, "rollout_s": 2.0, "reward_mean": 0.1 + 0.01 * k} for k in range(10)]
    alone = alone_figures(batches)  # TRL training as long as through ROSE, generating in 2 s instead of 10 s around it
    assert rose["rl_steps_per_hour"] == pytest.approx(400.0) and trl["rl_steps_per_hour"] == pytest.approx(144.0)
    assert alone["rl_steps_per_hour"] == pytest.approx(200.0) and alone["generate_s_per_step"] == 2.0
    assert (rose["around_training_s_per_step"], trl["around_training_s_per_step"], alone["around_training_s_per_step"]) == pytest.approx(
        (7.0, 10.0, 3.0)
    )
    assert (rose["training_share"], trl["training_share"], alone["training_share"]) == pytest.approx((2 / 9, 15 / 25, 15 / 18))
    assert rose["reward_gain"] == pytest.approx(0.2) and trl["reward_gain"] == pytest.approx(0.1) and alone["reward_gain"] == pytest.approx(0.08)
    runs = {"rose": rose, "trl": trl, "alone": alone}
    arm_ratios(runs)
    assert runs["steps_per_hour_ratio"] == pytest.approx(0.36) and runs["trl_over_alone_ratio"] == pytest.approx(0.72)
    result = {"runs": {"0": runs}}
    summarize(result)
    assert result["steps_per_hour_ratio"]["median"] == pytest.approx(0.36) and result["trl_over_alone_ratio"]["median"] == pytest.approx(0.72)
    assert not result["meets_target"] and not result["alone_meets_target"]
    assert result["trl_reward_gain"]["each"] == [pytest.approx(0.1)] and result["alone_training_share"]["median"] == pytest.approx(15 / 18)
    assert result["trajectories_lost"] == 0
    out = io.StringIO()
    print_table(result, Console(file=out, width=80))
    assert "steps/h trl / alone (the integration's worth): median 0.72" in out.getvalue() and "training 15.0 s (83%)" in out.getvalue()
