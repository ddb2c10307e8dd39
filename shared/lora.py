"""LoRA policies: what an adapter of the serving model is, in the one format every part of ROSE reads.

Why a module of its own: the trainer trains an adapter (peft), the weight publisher ships its versions,
the executor runs it inside serving's own batches, and the device model, the simulator and the planner
price it; all of them must agree on its shape. An adapter is stored as peft stores one
(``adapter_config.json`` + ``adapter_model.safetensors``, tensor names as
``get_peft_model_state_dict`` gives them), so a peft- or TRL-trained adapter loads unchanged. ROSE's own
facts (the base model's fingerprint) go in a sidecar, ``rose_adapter.json``: peft warns on keys it does not
know in its config. An adapter directory also holds the tokenizer, since every ROSE service loads one from the
policy's directory.

How an adapter finds its base (``base_dir_of``): ``base_model_name_or_path`` when it names a local directory
(absolute, or relative to the adapter's), else the sibling ``serving/`` of the adapter's directory (the layout
``rose models init --lora`` writes); either way ``check_base`` then holds the base against the adapter's
recorded fingerprint and shapes, so an adapter never runs over a model it was not trained on.

This module imports no torch at module level: the simulator and the planner read ``LoraShape`` only; the
functions that handle tensors import torch (and peft, safetensors) when called.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .errors import RoseError

if TYPE_CHECKING:
    import torch

# Every linear layer of a Qwen2/Llama decoder block: the LoRA-for-RL results train all of them ("LoRA Without
# Regret", 2025: attention-only LoRA falls behind; peft's target_modules="all-linear" picks these, never lm_head).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_MODULES + MLP_MODULES

ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's names for an adapter's two files
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ROSE_ADAPTER_FILE = "rose_adapter.json"  # ROSE's sidecar: the base model's fingerprint
ROSE_ADAPTER_FORMAT = 1
SERVING_SIBLING = "serving"  # the base beside an adapter, as `rose models init --lora` lays them out (shared/models.py SERVING_DIRNAME)

# The decoder submodule each adapted linear layer sits in (Qwen2 / Llama), so a peft tensor name can be built and parsed.
_PARENT = {**dict.fromkeys(ATTENTION_MODULES, "self_attn"), **dict.fromkeys(MLP_MODULES, "mlp")}
_LAYERS_PREFIX = "base_model.model.model.layers"  # a PeftModelForCausalLM's path to the decoder layers
_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")
# peft config fields that would make an adapter more than plain LoRA on the linear layers: ROSE's executor applies
# `scale * B @ A` per linear layer and nothing else, so an adapter that needs any of these is refused, by name.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
}
# Elements sampled per tensor by `model_fingerprint`, evenly strided: a fine-tune moves almost every weight (an RL
# step in bf16 changes 2-4 % of elements, docs/anchors: ~20-40 of these 1,024 per tensor after a single step), so a
# sample tells two bases apart, at a cost that does not grow with the model (a full hash of 140 GB takes minutes).
FINGERPRINT_SAMPLES = 1024


@dataclass(frozen=True, kw_only=True)
class LoraShape:
    """An adapter's rank, scaling and the decoder modules it adapts.

    ``scale`` multiplies ``B @ A`` as peft does: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_LINEAR
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"a LoRA rank is at least 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in ALL_LINEAR]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be among {', '.join(ALL_LINEAR)}; got {list(self.targets) or 'none'}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# The adapter `rose models init --lora` builds unless told otherwise: rank 1, as "LoRA Without Regret" (2025) finds
# enough for RL and `rose bench lora` found no better at rank 8 on the demo's job (docs/lora.md, docs/benchmarks.md
# 2026-12-07); alpha 2 keeps peft's scale (alpha / rank) at 2, the scale measured. Its versions are the smallest: at
# 7B-70B about 1 % of a full policy's delta.
DEFAULT_LORA = LoraShape(rank=1, alpha=2.0)


class AdapterError(RoseError, ValueError):
    """An adapter directory, tensor name or shape ROSE cannot run, or an adapter over a base it was not built on."""


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """One adapter version: its shape, its tensors by peft name, and the base it adapts."""

    shape: LoraShape
    tensors: dict[str, torch.Tensor]
    base: str  # peft's base_model_name_or_path
    base_fingerprint: str | None  # `model_fingerprint` of the base; None for an adapter written without ROSE's sidecar


# ---- naming ---------------------------------------------------------------------------------------


def adapter_tensor_name(layer: int, module: str, which: Literal["A", "B"]) -> str:
    """peft's name of one adapter matrix: ``base_model.model.model.layers.{layer}.{self_attn|mlp}.{module}.lora_{A|B}.weight``."""
    if module not in _PARENT:
        raise AdapterError(f"{module!r} is not an adaptable module; use one of {', '.join(ALL_LINEAR)}")
    if which not in ("A", "B") or layer < 0:
        raise AdapterError(f"no adapter tensor for layer {layer}, matrix {which!r} (a layer index >= 0 and matrix 'A' or 'B')")
    return f"{_LAYERS_PREFIX}.{layer}.{_PARENT[module]}.{module}.lora_{which}.weight"


def adapter_targets(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [rank, in], B [out, rank]), parsed from peft names; AdapterError for any name or
    shape that does not fit (a stray tensor, a half pair, a rank that differs from the other pairs')."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR_NAME.match(name)
        if m is None:
            raise AdapterError(f"{name!r} is not a LoRA tensor name ROSE reads (expected {adapter_tensor_name(0, 'q_proj', 'A')} and the like)")
        layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if _PARENT.get(module) != parent:
            raise AdapterError(f"{name!r}: {module!r} is not a linear layer of {parent} (adaptable: {', '.join(ALL_LINEAR)})")
        if tensor.dim() != 2:
            raise AdapterError(f"{name!r} has shape {tuple(tensor.shape)}; a LoRA matrix has two dimensions")
        halves.setdefault((layer, module), {})[which] = tensor
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    ranks: set[int] = set()
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = adapter_tensor_name(layer, module, "B" if "A" in pair else "A")
            raise AdapterError(f"layer {layer} {module}: {missing!r} is missing (every adapted module has an A and a B)")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"layer {layer} {module}: A is {tuple(a.shape)} and B {tuple(b.shape)}; A is [rank, in] and B [out, rank]")
        ranks.add(int(a.shape[0]))
        out[(layer, module)] = (a, b)
    if len(ranks) > 1:
        raise AdapterError(f"the adapter's modules have ranks {sorted(ranks)}; ROSE runs one rank per adapter (no rank_pattern)")
    return out


def base_weight_name(layer: int, module: str) -> str:
    """The base model's name of the linear weight an adapter pair adapts (``model.layers.{layer}.{self_attn|mlp}.{module}.weight``)."""
    return f"{_LAYERS_PREFIX.removeprefix('base_model.model.')}.{layer}.{_PARENT[module]}.{module}.weight"


# ---- merging ------------------------------------------------------------------------------------


def merged_weights(
    base: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], scale: float, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The adapted linear weights with the adapter folded in, ``W + scale * B @ A`` (peft's merge), by the base's
    names: a model holding them computes what the base plus the adapter computes, at the base's cost. ``base``
    holds the pristine weights (never a merged one: folding twice adds the product twice); the sum is taken in
    float32 on ``device`` (default: where each pristine weight is) and given back in the base's dtype."""
    import torch

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for (layer, module), (a, b) in adapter_targets(tensors).items():
            name = base_weight_name(layer, module)
            w = base.get(name)
            if w is None:
                raise AdapterError(f"the adapter adapts {name!r}, which the base model does not have")
            if tuple(w.shape) != (b.shape[0], a.shape[1]):
                raise AdapterError(f"{name!r} is {tuple(w.shape)}; the adapter's B @ A is {(b.shape[0], a.shape[1])}")
            on = device or w.device
            delta = b.to(on, torch.float32) @ a.to(on, torch.float32)
            out[name] = (w.to(on, torch.float32) + scale * delta).to(w.dtype)
    return out


# ---- the base's identity --------------------------------------------------------------------------


def model_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """A cheap identity of a base model's weights: every tensor's name and shape and a strided sample of its values.

    The values are compared at bfloat16, the precision every dtype ROSE loads in casts to exactly, so a checkpoint
    stored in fp32 and the same weights loaded in bf16 by an executor have one fingerprint (the dtype is the load's
    choice, not the model's identity). A tied head (``lm_head.weight`` sharing the embedding) is left out, as the
    checkpoint leaves it out: a state dict read from the files and one taken from the loaded model agree."""
    import torch

    h = hashlib.sha256(b"rose-model-fingerprint-v1")
    for name in sorted(state):
        if name == "lm_head.weight" and _tied_head(state):
            continue
        flat = state[name].detach().reshape(-1)
        stride = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        sample = flat[::stride][:FINGERPRINT_SAMPLES]
        if sample.is_floating_point():
            sample = sample.to(torch.bfloat16)
        h.update(f"{name}|{tuple(state[name].shape)}|".encode())
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"sha256:{h.hexdigest()[:32]}"


def _tied_head(state: Mapping[str, torch.Tensor]) -> bool:
    import torch

    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is None or embed is None or head.shape != embed.shape:
        return False
    return head.data_ptr() == embed.data_ptr() or bool(torch.equal(head, embed))


def check_base(adapter: Adapter, base_state: Mapping[str, torch.Tensor], where: str) -> None:
    """AdapterError unless the model at ``where`` is the adapter's base: every adapted module exists with the
    adapter's in and out sizes, and (when the adapter records one) the fingerprint is the base's."""
    for (layer, module), (a, b) in adapter_targets(adapter.tensors).items():
        name = f"model.layers.{layer}.{_PARENT[module]}.{module}.weight"
        weight = base_state.get(name)
        if weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
            found = "missing" if weight is None else f"{tuple(weight.shape)}"
            raise AdapterError(
                f"the model at {where} is not this adapter's base: {name} is {found}, the adapter adapts [{b.shape[0]}, {a.shape[1]}] "
                f"(base_model_name_or_path says {adapter.base!r})"
            )
    if adapter.base_fingerprint is not None:
        found = model_fingerprint(base_state)
        if found != adapter.base_fingerprint:
            raise AdapterError(
                f"the model at {where} (fingerprint {found}) is not the base this adapter was built on ({adapter.base_fingerprint}): "
                f"point the adapter at its base (base_model_name_or_path, or a serving/ beside it), or build a new adapter of this "
                f"model (`rose models init DIR --lora`)"
            )


def base_dir_of(adapter_dir: str | Path, adapter: Adapter) -> Path:
    """Where an adapter's base model is: ``base_model_name_or_path`` when that is a local directory (absolute, or
    relative to the adapter's directory), else ``serving/`` beside the adapter's directory. The caller checks it
    (``check_base``) once loaded."""
    adapter_dir = Path(adapter_dir)
    tried = []
    if adapter.base:
        named = Path(adapter.base) if Path(adapter.base).is_absolute() else adapter_dir / adapter.base
        if (named / "config.json").is_file():
            return named
        tried.append(str(named))
    sibling = adapter_dir.parent / SERVING_SIBLING
    if (sibling / "config.json").is_file():
        return sibling
    tried.append(str(sibling))
    raise AdapterError(
        f"{adapter_dir}: no base model found for this adapter (looked in {', '.join(tried)}); set base_model_name_or_path in "
        f"{ADAPTER_CONFIG_FILE} to the base's local directory, or put the base in {sibling}"
    )


# ---- files ----------------------------------------------------------------------------------------


def is_adapter_dir(path: str | Path) -> bool:
    """The directory holds a peft adapter (its ``adapter_config.json``), not a whole model."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def read_adapter(path: str | Path) -> Adapter:
    """The adapter stored at ``path`` (peft's files and, when there, ROSE's sidecar); AdapterError says what does not fit."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_adapter_dir(path):
        raise AdapterError(f"{path}: no {ADAPTER_CONFIG_FILE}; an adapter directory is what peft's save_pretrained writes")
    config = _read_json(path / ADAPTER_CONFIG_FILE)
    shape = _shape_of(config, path)
    weights = path / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{path}: no {ADAPTER_WEIGHTS_FILE} (ROSE reads adapters saved as safetensors)")
    tensors = load_file(str(weights))
    targets = adapter_targets(tensors)
    ranks = {int(a.shape[0]) for a, _ in targets.values()}
    if ranks - {shape.rank} or not targets:
        raise AdapterError(f"{path}: {ADAPTER_CONFIG_FILE} says rank {shape.rank}, the tensors have {sorted(ranks) or 'none'}")
    stray = sorted({module for _, module in targets} - set(shape.targets))
    if stray:
        raise AdapterError(f"{path}: tensors adapt {stray}, which target_modules {list(shape.targets)} does not name")
    sidecar = _read_json(path / ROSE_ADAPTER_FILE) if (path / ROSE_ADAPTER_FILE).is_file() else {}
    fingerprint = sidecar.get("base_fingerprint")
    return Adapter(shape=shape, tensors=tensors, base=str(config.get("base_model_name_or_path") or ""), base_fingerprint=fingerprint)


def write_adapter(path: str | Path, adapter: Adapter) -> Path:
    """Write ``adapter`` as peft writes one (``PeftModel.from_pretrained`` and TRL load it unchanged), plus ROSE's
    sidecar. Deterministic: the same adapter gives the same bytes."""
    from safetensors.torch import save_file

    targets = adapter_targets(adapter.tensors)
    ranks = {int(a.shape[0]) for a, _ in targets.values()}
    if ranks != {adapter.shape.rank}:
        raise AdapterError(f"the adapter's shape says rank {adapter.shape.rank}, its tensors have {sorted(ranks) or 'none'}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = lora_config(adapter.shape, adapter.base).to_dict()
    config["target_modules"] = list(adapter.shape.targets)  # a list in ALL_LINEAR's order (peft holds a set: no stable order)
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=_jsonable) + "\n")
    tensors = {name: adapter.tensors[name].detach().cpu().contiguous() for name in sorted(adapter.tensors)}
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})  # peft's metadata
    sidecar = {"format": ROSE_ADAPTER_FORMAT, "base_fingerprint": adapter.base_fingerprint}
    (path / ROSE_ADAPTER_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: a JSON object was expected, found {type(data).__name__}")
    return data


def _shape_of(config: dict[str, Any], path: Path) -> LoraShape:
    """The LoraShape an adapter_config.json describes, refusing what plain per-layer LoRA cannot run."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; ROSE runs LoRA adapters (peft_type 'LORA')")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias is {config.get('bias')!r}; ROSE runs adapters trained with bias='none'")
    for key, plain in _UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None, {}, [], False):
            raise AdapterError(f"{path}: {key} is {config[key]!r}; ROSE runs plain LoRA on the linear layers (leave {key} unset)")
    targets = config.get("target_modules")
    if targets == "all-linear":  # peft resolves it to every linear layer but lm_head: for Qwen2 / Llama, these
        targets = list(ALL_LINEAR)
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: target_modules is {targets!r}; ROSE reads a list of module names (among {', '.join(ALL_LINEAR)})")
    try:
        return LoraShape(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            targets=tuple(t for t in ALL_LINEAR if t in targets) if set(targets) <= set(ALL_LINEAR) else tuple(targets),
            use_rslora=bool(config.get("use_rslora", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{path}: {ADAPTER_CONFIG_FILE} does not describe a LoRA shape ROSE runs: {exc}") from None


# ---- peft -----------------------------------------------------------------------------------------


def lora_config(shape: LoraShape, base: str = ""):
    """peft's ``LoraConfig`` for ``shape``: plain LoRA on the named linear layers, no dropout (RL samples and trains
    the same policy: dropout would make the trainer's logprobs differ from the executor's)."""
    from peft import LoraConfig

    return LoraConfig(
        r=shape.rank,
        lora_alpha=int(shape.alpha) if float(shape.alpha).is_integer() else shape.alpha,  # type: ignore[arg-type]  # peft: int or float
        target_modules=list(shape.targets),
        use_rslora=shape.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


def new_adapter(model: torch.nn.Module, shape: LoraShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Version 0 of an adapter of ``model``, initialised by peft itself (A as peft draws it, from ``seed``; B zeros),
    so the policy at version 0 equals the base exactly. The model is left as it was (peft's layers are unloaded,
    its ``requires_grad`` flags restored) and the caller's RNG streams are not touched."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict

    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a deprecated question on every wrap: not ours to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora_config(shape))
    try:
        tensors = get_peft_model_state_dict(peft_model, save_embedding_layers=False)  # ("auto" looks the base up, on the Hub)
        return {name: t.detach().clone() for name, t in tensors.items()}
    finally:
        peft_model.unload()
        for name, p in model.named_parameters():
            p.requires_grad_(trainable.get(name, p.requires_grad))
