"""What of TRL's model goes to ROSE's executors as the policy: the one place that decides it, for both seams.

Full weights now: the model's whole state dict (tied tensors under both names, as the executors'
own model lists them; a keyframe must hold every tensor the executor's model has), detached and
copied so that the optimizer's next step cannot change a version being published.

A `PeftModel` (TRL's peft path) is refused until ROSE serves LoRA policies: ROSE's executors
apply full weights only, and publishing the adapter's few tensors as if they were the policy
would be refused by every executor (`unknown_tensor`). Once LoRA policies land, this function
returns `peft.get_peft_model_state_dict(model)` for a `PeftModel` (docs/trl.md, "LoRA").
"""

from __future__ import annotations

import torch

from rose.shared.errors import RoseError


class UnsupportedPolicy(RoseError, TypeError):
    """A model ROSE cannot publish as the executors' policy yet."""


def is_peft_model(model: torch.nn.Module) -> bool:
    """Without importing peft: a PEFT wrapper carries its adapters' configs in `peft_config`."""
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def policy_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors to publish for `model` (TRL's trainer model, unwrapped from its accelerator), in `dtype` (None: as trained)."""
    if is_peft_model(model):
        raise UnsupportedPolicy(
            "the trainer's model is a PeftModel (a LoRA adapter), and ROSE's executors serve full-weight policies only for now: "
            "train full weights (no peft_config), or wait for ROSE's LoRA policies (docs/trl.md, 'LoRA')"
        )
    return {name: t.detach().to(dtype or t.dtype).contiguous().clone() for name, t in model.state_dict().items()}
