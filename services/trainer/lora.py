"""The policy the trainer trains: a whole model, or a LoRA adapter (peft) over the serving model's frozen base.

Why one place: a LoRA job differs from a full-parameter one in what is loaded (the base, checked against the
adapter's fingerprint, wrapped by peft), what the optimizer steps (the adapter's parameters only) and what a
version and a checkpoint hold (the adapter's tensors under peft's names, ``get_peft_model_state_dict``: the names
of ``adapter_model.safetensors``, which the executors follow). GRPO, the warm start and local sampling see one
``torch.nn.Module`` either way: the peft model's forward is the policy.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch

from rose.shared.lora import ALL_LINEAR, AdapterError, base_dir_of, check_base, is_adapter_dir, read_adapter
from rose.shared.models import load_model


def load_policy(policy_dir: str | Path) -> torch.nn.Module:
    """The policy at ``policy_dir`` as the trainer trains it (fp32, eval mode): the model, or for an adapter directory
    peft's model over the adapter's base (``shared.lora.base_dir_of``), only the adapter trainable."""
    from peft import PeftModel

    if not is_adapter_dir(policy_dir):
        return load_model(policy_dir)
    adapter = read_adapter(policy_dir)
    base_dir = base_dir_of(policy_dir, adapter)
    base = load_model(base_dir)
    check_base(adapter, base.state_dict(), str(base_dir))
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question on every wrap: not ours to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(base, str(policy_dir), is_trainable=True)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)  # the base it runs over, as found and checked
    return model.eval()


def describe_policy(model: torch.nn.Module) -> str:
    """One line for the trainer's log: what is trained, and of what."""
    trained, total = sum(p.numel() for p in trainable_parameters(model)), sum(p.numel() for p in model.parameters())
    if not is_lora(model):
        return f"a whole model, {trained:,} parameters trained"
    c = cast(Any, model).peft_config["default"]
    targets = ",".join(t for t in ALL_LINEAR if t in c.target_modules)
    shape = f"rank {c.r}, alpha {c.lora_alpha:g}, {targets}"
    return f"a LoRA adapter ({shape}) of {c.base_model_name_or_path}: {trained:,} of {total:,} parameters trained"


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every weight of a whole model, the adapter's of a LoRA policy (peft froze the base)."""
    return [p for p in model.parameters() if p.requires_grad]


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a version and a checkpoint hold: a LoRA policy's adapter tensors under peft's names, else the state dict."""
    if is_lora(model):
        from peft import get_peft_model_state_dict

        # never the embeddings (ROSE adapts the linear layers only); "auto" would look the base's config up, on the Hub if not local
        return dict(get_peft_model_state_dict(model, save_embedding_layers=False))
    return dict(model.state_dict())


def load_trained_state(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put ``weights`` (as ``trained_state`` gave them) back into ``model``; every name and shape must be the model's."""
    if not is_lora(model):
        model.load_state_dict(weights, strict=True)
        return
    from peft import set_peft_model_state_dict

    expected = {name: tuple(t.shape) for name, t in trained_state(model).items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found != expected:
        differ = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise AdapterError(f"the weights are not this adapter's: {differ[:4]} differ in name or shape")
    with torch.no_grad():
        set_peft_model_state_dict(model, weights)
