"""Building and loading the models ROSE runs: a serving model and an RL policy model.

Why this module exists: the executor must host two *different* real models on one device
(the production serving model and the policy being trained), and a user must be able to
point it at any local Hugging Face directory instead. So there is one way to load a model
for each use, local files only, never a download: ``load_model`` (transformers' model, to
train and to check logits against), ``load_for_inference`` (its parameters for the paged
forward, without transformers' modeling code) and ``load_tokenizer``; and
``init_models`` builds a small default pair in that same format so everything runs on a
laptop CPU: Qwen2 weights saved as safetensors by ``save_pretrained`` and a byte-level BPE
tokenizer trained here with the ``tokenizers`` library on a generated corpus (arithmetic,
plain English, Python snippets, tool-call markup), saved as ``tokenizer.json`` with a
``tokenizer_config.json`` so ``transformers.AutoTokenizer`` loads it.

With ``lora``, ``init_models`` writes the policy as a LoRA adapter of the serving model (shared/lora.py:
peft's files, version 0 equal to the base) instead of a second model.

The weights are random (seeded); the models are for systems work — latency, memory,
scheduling, weight sync — not for answering questions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import torch

from .agentic.tool_env import SYSTEM_PROMPT as TOOLS_SYSTEM_PROMPT
from .config import PositiveSeconds
from .lora import Adapter, LoraShape, is_adapter_dir, model_fingerprint, new_adapter, write_adapter
from .nats_server import state_dir

log = logging.getLogger("rose.models")

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
DEFAULT_SEED = 0
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
CORPUS_LINES = 6000

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# Qwen-style (ChatML) chat template, so /v1/chat/completions can render messages to a prompt. With `tools`
# (the rollout gateway's agents) it renders them as ROSE's own tool format, which the policy learns from
# the tool environments' expert traces (shared/agentic/tools.py): the system line a `ToolEnv` writes,
# assistant tool calls as `<tool>NAME: ARGS</tool>` (a call's single argument as its raw text, more as
# JSON) and tool results as `<result>...</result>`; so an agent that sends [user question] with a tool
# gets the very prompt the built-in environment's episode starts with.
_TOOLS_BEFORE, _TOOLS_AFTER = TOOLS_SYSTEM_PROMPT.split("{tools}")
CHAT_TEMPLATE = (
    "{%- set rest = messages %}"
    "{%- if tools %}"
    "{%- set line = '"
    + _TOOLS_BEFORE
    + "' + (tools | map(attribute='function.name') | sort(case_sensitive=true) | join(', ')) + '"
    + _TOOLS_AFTER
    + "' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '\n\n' + line + '<|im_end|>\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{{ '<|im_start|>system\n' + line + '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set f = call['function'] if call.get('function') else call %}{%- set args = f['arguments'] %}"
    "{{ '<tool>' + f['name'] + ': ' }}"
    "{%- if args is mapping and args | length == 1 %}{{ args.values() | first }}"
    "{%- elif args is string %}{{ args }}{%- else %}{{ args | tojson }}{%- endif %}"
    "{{ '</tool>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<result>' + message['content'] + '</result><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SERVING_DIRNAME = "serving"
POLICY_DIRNAME = "policy"


@dataclass(frozen=True)
class ModelShape:
    """The few numbers that define one of the default models."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


SERVING_SHAPE = ModelShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)
POLICY_SHAPE = ModelShape(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=1024)
# `rose demo`'s policy (~0.4M parameters, 1/20 of POLICY_SHAPE's): it learns the tool format from a short warm
# start and improves under GRPO within a few dozen steps on a CPU (also `rose bench faults` and the compose check)
DEMO_POLICY_SHAPE = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
# GPU-class sizes (``rose models init --preset qwen2.5``): the layer shapes of Qwen2.5-0.5B (serving)
# and Qwen2.5-1.5B (policy), over our own tokenizer's vocabulary (so ~0.36B and ~1.3B parameters).
QWEN25_SERVING_SHAPE = ModelShape(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
QWEN25_POLICY_SHAPE = ModelShape(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960)


@dataclass(frozen=True)
class ModelPreset:
    """A serving shape, a policy shape and the dtype the weights are saved in.

    ``lora_serving``: the serving model's shape when the policy is a LoRA adapter of it (``init_models(lora=...)``);
    None keeps ``serving``."""

    serving: ModelShape
    policy: ModelShape
    dtype: str = "float32"
    lora_serving: ModelShape | None = None


MODEL_PRESETS = {
    "tiny": ModelPreset(SERVING_SHAPE, POLICY_SHAPE),  # the CPU default: seconds to build, ms per forward
    # `rose demo`'s models: GRPO steps in seconds on a CPU; as a LoRA job the serving model takes the demo policy's shape,
    # so the adapted model trains as fast as the demo's own policy does
    "demo": ModelPreset(SERVING_SHAPE, DEMO_POLICY_SHAPE, lora_serving=DEMO_POLICY_SHAPE),
    "qwen2.5": ModelPreset(QWEN25_SERVING_SHAPE, QWEN25_POLICY_SHAPE, "bfloat16"),  # for GPU nodes
}


@dataclass(frozen=True)
class ModelPaths:
    serving: Path
    policy: Path


# ---------------------------------------------------------------------------- corpus

_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "model",
    "agent",
    "tool",
    "answer",
    "result",
    "question",
    "server",
    "latency",
    "token",
    "batch",
    "memory",
    "queue",
    "request",
    "policy",
    "reward",
    "step",
    "turn",
    "river",
    "house",
    "tree",
    "light",
    "water",
    "time",
    "day",
    "small",
    "big",
    "fast",
    "slow",
    "good",
    "new",
    "old",
    "first",
    "last",
    "long",
    "short",
    "red",
    "blue",
    "green",
    "runs",
    "sees",
    "makes",
    "takes",
    "gives",
    "finds",
    "reads",
    "writes",
    "adds",
    "checks",
    "returns",
    "computes",
    "sends",
    "keeps",
]
_PY_TEMPLATES = (
    "def {f}(x, y):\n    return x {op} y\n",
    "for i in range({n}):\n    total += i {op} {m}\n",
    "result = {f}({n}, {m})\nprint(result)\n",
    "if x > {n}:\n    x = x {op} {m}\nelse:\n    x = {m}\n",
    "class {F}:\n    def __init__(self):\n        self.value = {n}\n",
    "items = [{n}, {m}, {n} {op} {m}]\nassert len(items) == 3\n",
)
_OPS = ("+", "-", "*")


def _arith(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 999), rng.randint(0, 99)
    op = rng.choice(_OPS)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}", value


def build_corpus(seed: int, lines: int = CORPUS_LINES) -> list[str]:
    """A deterministic mixed corpus for training the tokenizer."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        if kind == 0:
            expr, value = _arith(rng)
            out.append(f"{expr} = {value}")
        elif kind == 1:
            n = rng.randint(5, 14)
            sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
            out.append(sentence.capitalize() + ".")
        elif kind == 2:
            f = rng.choice(["add", "mul", "step", "score", "run", "calc"])
            out.append(rng.choice(_PY_TEMPLATES).format(f=f, F=f.capitalize(), op=rng.choice(_OPS), n=rng.randint(0, 99), m=rng.randint(0, 99)))
        elif kind == 3:
            expr, value = _arith(rng)
            out.append(
                f"{IM_START}user\nWhat is {expr}?{IM_END}\n{IM_START}assistant\n"
                f"<tool>calc: {expr}</tool>{IM_END}\n{IM_START}tool\n<result>{value}</result>{IM_END}\n"
                f"{IM_START}assistant\n<answer>{value}</answer>{IM_END}{EOS_TOKEN}"
            )
        else:
            expr, value = _arith(rng)
            out.append(f"Question: what is {expr}? <tool>calc: {expr}</tool> <result>{value}</result> <answer>{value}</answer>")
    return out


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


# ---------------------------------------------------------------------------- models


def _qwen2_config(shape: ModelShape, vocab_size: int, eos_id: int, dtype: str = "float32"):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype=dtype,
    )


def build_model(shape: ModelShape, vocab_size: int, eos_id: int, seed: int, dtype: str = "float32"):
    """A randomly initialised Qwen2 causal LM, deterministic given seed (initialised in float32,
    then cast to ``dtype``)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_qwen2_config(shape, vocab_size, eos_id, dtype))
    return model.to(getattr(torch, dtype)).eval()


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def init_models(
    directory: str | Path,
    seed: int = DEFAULT_SEED,
    policy_shape: ModelShape | None = None,
    preset: str = "tiny",
    lora: LoraShape | None = None,
) -> ModelPaths:
    """Build a serving and a policy model (plus tokenizer) under ``directory``, of a preset's sizes.

    `policy_shape` overrides the preset's policy: `rose demo` uses a policy small enough to train
    visibly in minutes on a CPU. With `lora`, policy/ is a LoRA adapter of serving/ instead of a model of its own
    (``init_adapter``: version 0 equals the base); the serving model then takes the preset's ``lora_serving`` shape,
    or `policy_shape` when given (the model RL trains is the serving model itself).
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; use one of {', '.join(MODEL_PRESETS)}")
    sizes = MODEL_PRESETS[preset]
    _quiet_transformers()
    root = Path(directory)
    tokenizer = train_tokenizer(seed)
    vocab = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    paths = ModelPaths(serving=root / SERVING_DIRNAME, policy=root / POLICY_DIRNAME)
    if lora is not None:
        _refuse_model_in(paths.policy)  # before anything is written: a refused init changes nothing
        serving_shape = policy_shape or sizes.lora_serving or sizes.serving
        _save_model(paths.serving, build_model(serving_shape, vocab, eos_id, seed, sizes.dtype), tokenizer)
        init_adapter(paths.serving, paths.policy, lora, seed + 1)
        return paths
    for offset, (path, shape) in enumerate(((paths.serving, sizes.serving), (paths.policy, policy_shape or sizes.policy))):
        _save_model(path, build_model(shape, vocab, eos_id, seed + offset, sizes.dtype), tokenizer)
    return paths


def _save_model(path: Path, model, tokenizer) -> None:
    """The model's safetensors and config, then the tokenizer (last: the services wait for tokenizer.json)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _refuse_model_in(policy: Path) -> None:
    if (policy / "config.json").is_file() and not is_adapter_dir(policy):
        raise ValueError(f"{policy} holds a model, not an adapter: remove it (or choose another directory) to write an adapter there")


def init_adapter(serving: str | Path, policy: str | Path, shape: LoraShape, seed: int = DEFAULT_SEED + 1) -> Path:
    """Write ``policy`` as version 0 of a LoRA adapter of the model in ``serving`` (peft's initialisation: B = 0, so the
    policy equals the base), with the base's fingerprint and path and the base's tokenizer. Run again after the base
    changed (a warm start), it rewrites the adapter for the new base."""
    serving, policy = Path(serving), Path(policy)
    _refuse_model_in(policy)
    base = load_model(serving)
    tensors = new_adapter(base, shape, seed)
    write_adapter(policy, Adapter(shape=shape, tensors=tensors, base=str(serving.resolve()), base_fingerprint=model_fingerprint(base.state_dict())))
    load_tokenizer(serving).save_pretrained(policy)
    return policy


def load_model(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load any local HF-format Qwen2 or Llama causal LM, in eval mode, without downloading.

    One load at a time per process: transformers builds a model on the meta device through process-wide
    patches of torch, so two threads loading at once (the executors of an emulated group) broke each other."""
    with _LOAD_LOCK:
        return _load_model(directory, device, dtype)


_LOAD_LOCK = threading.Lock()


def _load_model(directory: str | Path, device: str | torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    _check_model_type(directory, config.model_type)
    # Typed as a Module: transformers' wrapper of `to` types its own `self` wrongly.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    return model.to(device).eval()


def _check_model_type(directory: str | Path, model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{directory}: model_type {model_type!r} is not supported; use a Qwen2 or Llama checkpoint ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def load_for_inference(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model as an inference engine reads it (``ModelWeights``): its parameters under the HF model's names,
    its config and the rotary ``inv_freq``, read from config.json and safetensors without transformers' modeling code.

    Why: importing that code (the Qwen2 / Llama module and all it pulls in) was most of what loading cost: 1.5 s of
    CPU per executor start alone, and the largest single part of a fleet's start under load (py-spy, `rose bench
    faults`: 14 % of the fleet's CPU until ready). The module has no forward; ``load_model`` gives the HF model, to
    train or to check logits against. A checkpoint this cannot read exactly as transformers would (no safetensors,
    a rope type other than the default, a field the config leaves to transformers' defaults) goes through
    ``load_model``: slower, the same parameters."""
    directory = Path(directory)
    config = _read_config(directory)
    if config is None:
        return load_model(directory, device, dtype)
    tensors = _read_safetensors(directory)
    if tensors is None:
        return load_model(directory, device, dtype)
    tied = bool(config["tie_word_embeddings"])
    if "lm_head.weight" not in tensors and not tied:
        return load_model(directory, device, dtype)  # transformers decides what an untied model without a head means
    return InferenceModel(config, tensors, tied, dtype).to(device).eval()


# config.json fields the paged forward reads, which a checkpoint for the light load must state (else: ``load_model``)
_STATED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def _read_config(directory: Path) -> dict | None:
    """config.json as the light load can take it, or None to leave it to transformers."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (a local Hugging Face model directory has one)")
    config = json.loads(path.read_text())
    _check_model_type(directory, config.get("model_type"))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(k not in config for k in _STATED) or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    return config


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of a single or sharded safetensors checkpoint by name, or None when it has none."""
    from safetensors.torch import load_file

    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(directory / shard))
        return tensors
    return None


class _Rotary(torch.nn.Module):
    """The rotary embedding's inverse frequencies, as HF's default rope computes them (not saved: HF's neither)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        rope = config.get("rope_parameters") or {}
        base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), persistent=False)
        self.attention_scaling = 1.0


class InferenceModel(torch.nn.Module):
    """A causal LM's parameters under the names HF's Qwen2 / Llama model gives them (``model.layers.0.self_attn.
    q_proj.weight``, ..., ``lm_head.weight``, tied to the embedding when the checkpoint ties them), so its
    ``state_dict`` and a weight update's names are the trainer's; ``config`` answers as an HF config for the
    fields the engine reads."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], tied: bool, dtype: torch.dtype) -> None:
        super().__init__()
        fields = {"num_key_value_heads": config["num_attention_heads"], "use_sliding_window": False, **config, "tie_word_embeddings": tied}
        self.config = SimpleNamespace(**fields)
        for name, tensor in tensors.items():
            self._put(name, torch.nn.Parameter(tensor.to(dtype), requires_grad=False))
        if tied:
            self._put("lm_head.weight", self.get_parameter("model.embed_tokens.weight"))
        self.get_submodule("model").add_module("rotary_emb", _Rotary(config))

    def _put(self, name: str, param: torch.nn.Parameter) -> None:
        *path, leaf = name.split(".")
        module: torch.nn.Module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, param)


def load_tokenizer(directory: str | Path):
    """Load the tokenizer saved next to a model, without downloading."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


# ---------------------------------------------------------------------------- where services find them


class PolicyModelRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Config of a service that reads the policy model the executors load (worker, trainer)."""

    dir: str = ""  # default <state dir>/models
    policy_dir: str = ""  # default <dir>/policy
    wait_s: PositiveSeconds = 300.0  # for an executor still building the models under `rose up`

    def policy_path(self) -> Path:
        return Path(self.policy_dir) if self.policy_dir else models_root(self.dir) / POLICY_DIRNAME


def models_root(directory: str) -> Path:
    """The models directory a service was given, or `<state dir>/models` (where `rose up` builds them)."""
    return Path(directory) if directory else state_dir() / "models"


async def wait_for_files(directory: Path, names: tuple[str, ...], timeout_s: float) -> None:
    """Until every file exists (an executor may still be building the models under `rose up`)."""
    deadline = time.monotonic() + timeout_s
    while not all((directory / n).exists() for n in names):
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"no model at {directory} (missing {[n for n in names if not (directory / n).exists()]}): run `rose models init` or set models.dir"
            )
        log.info("waiting for the model at %s", directory)
        await asyncio.sleep(1.0)
