"""What of TRL's model goes to ROSE's executors as the policy: the one place that decides it, for both seams.

Full weights: the model's whole state dict (tied tensors under both names, as the executors' own model lists them; a
keyframe must hold every tensor the executor's model has), detached and copied so that the optimizer's next step cannot
change a version being published.

A LoRA policy (TRL's peft path: the trainer's model is a `PeftModel`): the adapter's tensors,
`peft.get_peft_model_state_dict(model)`, named as peft names them, which are the names the executors' live adapter has
(shared/lora.py `adapter_tensor_name`); the publisher ships them as any version. They are read from the adapter's own
parameters, so TRL's async seam merging the adapter into the base before each sync changes nothing of what is sent.
The base never travels: it is the serving model the executors already hold.

ROSE's executors run plain LoRA on the linear layers and nothing else (docs/lora.md), so TRL's `LoraConfig` is checked
before anything is published (`check_lora_config`, the field to change named): what `shared.lora` reads from an adapter
directory, plus no dropout (the executors sample without it, so the trainer's logprobs would not be theirs), and, given
the adapter the executors serve, the same rank, scale and targets. `LoraPolicy` is TRL's peft path on ROSE's layout:
TRL builds its `PeftModel` over the base (the serving model the adapter was built on, found and checked as the
executors find it) with the adapter's config, and starts from the adapter of `rose models init --lora`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rose.shared.errors import RoseError
from rose.shared.lora import ALL_LINEAR, Adapter, AdapterError, LoraShape, _shape_of, base_dir_of, check_base, lora_config, read_adapter


class UnsupportedPolicy(RoseError, TypeError):
    """A model, or a LoRA configuration, ROSE's executors cannot run as the policy."""


def is_peft_model(model: Any) -> bool:
    """Without importing peft: a PEFT wrapper carries its adapters' configs in `peft_config`."""
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def check_lora_config(config: Any, executors: LoraShape | None = None) -> LoraShape:
    """The `LoraShape` TRL's peft `LoraConfig` trains, if ROSE's executors can run it; UnsupportedPolicy names the field.

    `executors`: the shape of the adapter the executors serve (`read_adapter(policy_dir).shape`), which fixes rank,
    targets and scale: a version of another shape is refused by every executor, and one of another scale
    (`lora_alpha`, `use_rslora`) would run as a different policy than the one trained."""
    fields = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    where = Path("TRL's LoraConfig")
    peft_type = fields.get("peft_type")
    fields["peft_type"] = getattr(peft_type, "value", peft_type)  # peft's PeftType enum, or its string
    targets = fields.get("target_modules")
    if isinstance(targets, set | frozenset | tuple):
        targets = fields["target_modules"] = sorted(targets)
    if targets != "all-linear" and not (isinstance(targets, list) and targets and set(targets) <= set(ALL_LINEAR)):
        raise UnsupportedPolicy(
            f"{where}: target_modules is {targets!r}; ROSE's executors adapt the decoder's linear layers by name, among "
            f"{', '.join(ALL_LINEAR)} (never the head or the embeddings): list those modules, or 'all-linear'"
        )
    dropout = float(fields.get("lora_dropout") or 0.0)
    if dropout:
        raise UnsupportedPolicy(
            f"{where}: lora_dropout is {dropout}; ROSE's executors sample without dropout, so the trainer's logprobs would not be "
            "the sampling policy's: set lora_dropout=0.0"
        )
    try:
        shape = _shape_of(fields, where)
    except AdapterError as exc:
        raise UnsupportedPolicy(str(exc)) from None
    if executors is not None:
        differs = [
            f"{name} is {mine!r}, the executors' adapter has {theirs!r}"
            for name, mine, theirs in (
                ("r", shape.rank, executors.rank),
                ("target_modules", list(shape.targets), list(executors.targets)),
                ("lora_alpha / use_rslora (scale)", shape.scale, executors.scale),
            )
            if mine != theirs
        ]
        if differs:
            raise UnsupportedPolicy(
                f"{where}: {'; '.join(differs)}: train the adapter the executors serve (TRL's peft_config=LoraPolicy.read(policy_dir).config)"
            )
    return shape


@dataclass(frozen=True)
class LoraPolicy:
    """The LoRA policy ROSE's executors serve, for TRL's peft path: the base's directory and peft's `LoraConfig` of the
    adapter's shape (TRL's `model` and `peft_config`), and the adapter itself, whose tensors TRL's model starts from.

        lora = LoraPolicy.read(policy_dir)
        trainer = GRPOTrainer(model=str(lora.base_dir), peft_config=lora.config, ...)  # or AsyncGRPOTrainer
        lora.load_into(trainer.model)"""

    base_dir: Path
    config: Any  # peft.LoraConfig
    adapter: Adapter

    @classmethod
    def read(cls, policy_dir: str | Path) -> LoraPolicy:
        """The adapter at `policy_dir` (`rose models init --lora`'s policy/) and where its base is, found as the executors
        find it (`base_dir_of`: `base_model_name_or_path`, else `serving/` beside). Local files only."""
        adapter = read_adapter(policy_dir)
        base_dir = base_dir_of(policy_dir, adapter)
        return cls(base_dir, lora_config(adapter.shape, str(base_dir)), adapter)

    def load_into(self, model: Any) -> None:
        """TRL's `PeftModel` (built over `base_dir` with `config`) starts from this adapter's tensors, over the base the
        adapter was built on (`check_base`: AdapterError otherwise), as the executors' version 0 does."""
        from peft import set_peft_model_state_dict

        if not is_peft_model(model):
            raise UnsupportedPolicy(f"{type(model).__name__} is not a PeftModel: build TRL's trainer with peft_config=LoraPolicy.config")
        check_lora_config(model.peft_config[model.active_adapter], self.adapter.shape)
        base = {n.replace(".base_layer.", "."): t for n, t in model.get_base_model().state_dict().items() if ".lora_" not in n}
        check_base(self.adapter, base, str(self.base_dir))
        with torch.no_grad():
            result: Any = set_peft_model_state_dict(model, self.adapter.tensors, adapter_name=model.active_adapter)
        if result.unexpected_keys:
            raise UnsupportedPolicy(f"TRL's model has no place for the adapter's {result.unexpected_keys[:3]}: its LoraConfig is not the adapter's")


def check_policy(model: Any) -> None:
    """UnsupportedPolicy now, before anything is published, for a `PeftModel` whose LoraConfig the executors cannot run."""
    if is_peft_model(model):
        check_lora_config(model.peft_config[model.active_adapter])


def policy_state_dict(model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors to publish for `model` (TRL's trainer model, unwrapped from its accelerator), in `dtype` (None: as
    trained): the whole state dict, or a `PeftModel`'s adapter tensors by peft name (its LoraConfig checked first)."""
    check_policy(model)
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        # ("auto" would look the base up on the Hub for embedding layers; ROSE never adapts them)
        state = get_peft_model_state_dict(model, adapter_name=model.active_adapter, save_embedding_layers=False)
    else:
        state = model.state_dict()
    return {name: t.detach().to(dtype or t.dtype).contiguous().clone() for name, t in state.items()}
