"""Hugging Face TRL trains through ROSE (`pip install rose-rl[trl]`; docs/trl.md).

Two seams, both through TRL's own arguments and protocols:

    with RoseConnection(nats_url, TaskTable([ArithmeticEnv(4)], seeds)) as rose:
        # GRPOTrainer: every generation batch rolled out by ROSE's fleet, on-policy
        GRPOTrainer(model, reward_funcs=[env_reward], train_dataset=rose.tasks.dataset(),
                    rollout_func=RoseRolloutFunc(rose), args=GRPOConfig(...))
        # AsyncGRPOTrainer: ROSE's logprobs and versions feed TRL's importance ratio and staleness filter
        install_cpu_fallbacks()  # off CUDA only
        transfer = RoseWeightTransfer(rose)
        trainer = AsyncGRPOTrainer(model_path, args=args, train_dataset=rose.tasks.dataset(),
                                   rollout_worker=RoseRolloutWorker(rose, args), weight_transfer=transfer)
        transfer.bind(trainer.model)

A LoRA policy (the executors run an adapter of the serving model, `rose models init --lora`): TRL's peft path,
`lora = LoraPolicy.read(policy_dir)`, `model=str(lora.base_dir)`, `peft_config=lora.config`, then
`lora.load_into(trainer.model)`; each version published is the adapter's tensors.

A client of ROSE: it imports contracts, shared and client, never a service.
"""

from .async_grpo import RoseRolloutWorker, RoseWeightTransfer
from .bridge import RoseConnection
from .cpu import install_cpu_fallbacks
from .groups import RolloutFailed
from .policy import LoraPolicy, UnsupportedPolicy, check_lora_config, policy_state_dict
from .rollout_func import RoseRolloutFunc
from .tasks import TaskSpec, TaskTable, UnknownPrompt, env_reward

__all__ = [
    "LoraPolicy",
    "RolloutFailed",
    "RoseConnection",
    "RoseRolloutFunc",
    "RoseRolloutWorker",
    "RoseWeightTransfer",
    "TaskSpec",
    "TaskTable",
    "UnknownPrompt",
    "UnsupportedPolicy",
    "check_lora_config",
    "env_reward",
    "install_cpu_fallbacks",
    "policy_state_dict",
]
