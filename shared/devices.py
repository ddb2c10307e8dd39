"""Device kinds, dense model shapes and a roofline model of prefill and decode step time.

Device figures are the public spec-sheet numbers (SXM form factor, dense BF16 tensor-core
throughput, i.e. *without* the 2:4 sparsity figure NVIDIA quotes alongside):

=======  ========  ============  ===============  ==========  ==========  ==========================================
kind     HBM       bandwidth     BF16 dense       NVLink      PCIe        source
=======  ========  ============  ===============  ==========  ==========  ==========================================
A100     80 GB     2.039 TB/s    312 TFLOP/s      600 GB/s    32 GB/s     NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)
H100     80 GB     3.35 TB/s     989 TFLOP/s      900 GB/s    64 GB/s     NVIDIA H100 Tensor Core GPU datasheet (SXM5)
H200     141 GB    4.8 TB/s      989 TFLOP/s      900 GB/s    64 GB/s     NVIDIA H200 Tensor Core GPU datasheet (SXM)
=======  ========  ============  ===============  ==========  ==========  ==========================================

PCIe is the host link, one direction: the datasheets quote both directions together (PCIe Gen4 x16:
64 GB/s on the A100, Gen5 x16: 128 GB/s on the H100 and H200). It prices restoring a retained prefix's
KV from host memory (``Roofline.host_load_s``, the executor's host tier).

Model shapes are the published ``config.json`` of each checkpoint on the Hugging Face Hub
(all bf16, head_dim 128, grouped-query attention):

=====  ============================  ======  ======  =====  ========  =======  ==============
size   checkpoint                    params  layers  heads  kv heads  hidden   intermediate
=====  ============================  ======  ======  =====  ========  =======  ==============
7B     Qwen/Qwen2.5-7B               7.61 B  28      28     4         3584     18944
14B    Qwen/Qwen2.5-14B              14.7 B  48      40     8         5120     13824
32B    Qwen/Qwen2.5-32B              32.5 B  64      40     8         5120     27648
70B    meta-llama/Llama-3.1-70B      70.6 B  80      64     8         8192     28672
=====  ============================  ======  ======  =====  ========  =======  ==============

The roofline (Williams, Waterman, Patterson, CACM 2009) of one forward step on one
tensor-parallel instance of ``tp`` GPUs is the larger of its compute time and its
memory time, plus fixed costs:

    step = overhead + 2 x layers x allreduce(tp) + max(FLOPs / (tp x peak x eff_flops),
                                                      bytes / (tp x bw x eff_bw))

- decode of a batch of B sequences at mean context C: FLOPs = 2 x params x B
  + 4 x layers x heads x head_dim x C x B (QK^T and AV); bytes = the weights once
  (2 x params in bf16) + the KV cache read, B x C x kv_bytes_per_token.
- prefill of P new tokens after C0 cached ones: FLOPs = 2 x params x P
  + 4 x layers x heads x head_dim x (P x C0 + P^2 / 2) (causal); bytes = the weights + the KV
  written and read.

Assumptions (not spec-sheet figures; change them with ``Roofline(...)``):
- ``eff_bw = 0.80``: the share of peak HBM bandwidth a decode step achieves (large copy
  kernels reach ~80-90 % of the datasheet figure on A100/H100);
- ``eff_flops = 0.70``: the share of dense BF16 peak large GEMMs reach (public cuBLAS BF16
  GEMM results on H100 SXM are ~650-750 TFLOP/s);
- ``overhead_s = 1.5 ms`` per step: scheduling, sampling and kernel-launch time of an engine
  with CUDA graphs (vLLM/SGLang-class);
- ``allreduce_latency_s = 8 us`` per all-reduce on NVLink (two per layer with tensor
  parallelism; the payload term uses the NVLink bandwidth above);
- ``eff_host_bw = 0.80``: the share of the PCIe figure a pinned host-to-device copy reaches
  (measured cudaMemcpy from pinned memory: ~25 of 32 GB/s on Gen4, ~50-55 of 64 on Gen5);
- ``memory_utilization = 0.90`` of HBM given to the engine (vLLM's default
  ``gpu_memory_utilization``), less ``workspace_bytes = 2 GB`` per GPU for activations.

A LoRA adapter (``LoraShape``, shared/lora.py) adds, to a pass whose ``adapted_tokens`` go through it, the adapter's
own kernels, after the base projections (``Roofline.adapter_s``; co-batched rollout rows, every token of a
LoRA policy's dedicated instance):

    adapter = layers x adapted linears x LORA_LINEAR_S + max(2 x lora_params x adapted tokens / (tp x peak x eff_flops),
                                                            (adapter bytes + adapted tokens x activation bytes) / (tp x bw x eff_bw))

- FLOPs: x @ A^T then @ B^T, 2 x rank x (in + out) per adapted linear and token (``ModelSpec.lora_params``);
- bytes: the adapter's weights once per pass, and each adapted token's activations, which the two low-rank kernels
  read (x, in) and add into (y, out: read and written) apart from the base GEMM: (in + 2 x out) x 2 bytes per linear;
- ``LORA_LINEAR_S``: the fixed time of one adapted linear's pair of kernels, measured (its comment says where).

Known figures this reproduces (tests/sim/test_devices.py): a 70B decode step on H100 is
memory-bound at batch 1..64 (arithmetic intensity far below the H100's ridge point of
~295 FLOP/byte); Llama-70B at TP8 decodes at ~8 ms/token at batch 1 and a 7B on one H100 at
~7 ms/token (public vLLM / TensorRT-LLM figures are ~8-12 ms and ~6-8 ms); a 2k-token
prefill is compute-bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .lora import LoraShape

GB = 1e9
# The fixed time of one adapted linear layer's low-rank kernels (the shrink x @ A^T and the expand @ B^T with its add),
# per pass, whatever the rows: a pair of small kernels is bound by launch and synchronisation, not by its FLOPs or
# bytes. Punica (Chen et al., MLSys 2024, arXiv 2310.18547) measures its SGMV kernels "adding 2 ms latency per token"
# on LLaMA-2 7B (32 layers, rank 16 on all 7 dense projections, A100): 2 ms / (32 x 7) = 8.9 us per adapted linear.
# Its own kernel plots put one operator at ~37-45 us at batch 1-64 (rank 8-64, Figures 8-9), so a launch-bound pair is
# the right shape; its 70B TP8 decode (441-446 against vLLM's 457 tokens/s at batch 32, Figure 12) reads ~4 us per
# linear, so 8.9 us is the conservative end. The same on every GPU kind: a small kernel's floor, not its throughput.
LORA_LINEAR_S = 2e-3 / (32 * 7)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    nvlink_bw: float  # bytes/s per GPU
    host_bw: float  # bytes/s per GPU, host to device (PCIe, one direction)
    source: str

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.bf16_flops / self.hbm_bw


DEVICES: dict[str, DeviceSpec] = {
    "A100": DeviceSpec("A100", 80 * GB, 2.039e12, 312e12, 600 * GB, 32 * GB, "NVIDIA A100 datasheet, SXM4 80GB"),
    "H100": DeviceSpec("H100", 80 * GB, 3.35e12, 989e12, 900 * GB, 64 * GB, "NVIDIA H100 datasheet, SXM5"),
    "H200": DeviceSpec("H200", 141 * GB, 4.8e12, 989e12, 900 * GB, 64 * GB, "NVIDIA H200 datasheet, SXM"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    head_dim: int = 128
    bytes_per_param: int = 2  # bf16
    source: str = ""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attn_flops_per_token_ctx(self) -> float:
        """FLOPs per (query token x context token): QK^T and AV, 2 x 2 x heads x head_dim per layer."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(in, out) features of one decoder block's linear layer (shared/lora.py names them as peft does)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        return shapes[module]

    def lora_params(self, shape: LoraShape) -> float:
        """Parameters of a LoRA adapter of this model: rank x (in + out) of every adapted linear, times the layers
        (A is rank x in, B is out x rank)."""
        return float(shape.rank * self.layers * sum(sum(self.linear_shape(m)) for m in shape.targets))

    def adapted_weight_bytes(self, shape: LoraShape) -> float:
        """Bytes of the base's linear weights an adapter of ``shape`` adapts (all-linear: nearly the whole model)."""
        return float(self.layers * sum(i * o for i, o in (self.linear_shape(m) for m in shape.targets)) * self.bytes_per_param)

    def lora_activation_bytes_per_token(self, shape: LoraShape) -> float:
        """Bytes each adapted token moves through the adapter's kernels: every adapted linear reads its input (in)
        and adds its low-rank output into the base's (out, read and written), apart from the base GEMM."""
        per_layer = sum(i + 2 * o for i, o in (self.linear_shape(m) for m in shape.targets))
        return float(self.layers * per_layer * self.bytes_per_param)


MODELS: dict[str, ModelSpec] = {
    "7B": ModelSpec("7B", 7.61e9, 28, 28, 4, 3584, 18944, source="Qwen/Qwen2.5-7B config.json"),
    "14B": ModelSpec("14B", 14.7e9, 48, 40, 8, 5120, 13824, source="Qwen/Qwen2.5-14B config.json"),
    "32B": ModelSpec("32B", 32.5e9, 64, 40, 8, 5120, 27648, source="Qwen/Qwen2.5-32B config.json"),
    "70B": ModelSpec("70B", 70.6e9, 80, 64, 8, 8192, 28672, source="meta-llama/Llama-3.1-70B config.json"),
}


@lru_cache(maxsize=64)
def _adapter_figures(model: ModelSpec, lora: LoraShape) -> tuple[float, float]:
    """(parameters, activation bytes per adapted token) of ``lora`` on ``model``: the simulator prices thousands of
    passes a second, and both are sums over the adapted modules."""
    return model.lora_params(lora), model.lora_activation_bytes_per_token(lora)


@dataclass(frozen=True)
class Roofline:
    """Step-time model of one model on one tensor-parallel instance (see the module doc)."""

    device: DeviceSpec
    model: ModelSpec
    tp: int = 1
    eff_bw: float = 0.80
    eff_flops: float = 0.70
    eff_host_bw: float = 0.80
    overhead_s: float = 1.5e-3
    allreduce_latency_s: float = 8e-6
    name: str = field(default="")

    @property
    def _fixed_s(self) -> float:
        if self.tp == 1:
            return self.overhead_s
        return self.overhead_s + 2 * self.model.layers * self.allreduce_latency_s

    def _allreduce_payload_s(self, tokens):
        if self.tp == 1:
            return 0.0
        nbytes = np.asarray(tokens, dtype=float) * self.model.hidden * 2.0
        return 2 * self.model.layers * (2.0 * (self.tp - 1) / self.tp) * nbytes / self.device.nvlink_bw

    def decode_bounds(self, batch, ctx) -> tuple[np.ndarray, np.ndarray]:
        """(compute seconds, memory seconds) of one decode step, before fixed costs."""
        m, d = self.model, self.device
        b = np.asarray(batch, dtype=float)
        c = np.asarray(ctx, dtype=float)
        flops = 2.0 * m.params * b + m.attn_flops_per_token_ctx * c * b
        nbytes = m.weight_bytes + b * c * m.kv_bytes_per_token
        return flops / (self.tp * d.bf16_flops * self.eff_flops), nbytes / (self.tp * d.hbm_bw * self.eff_bw)

    def decode_s(self, batch, ctx):
        """Seconds of one decode step of ``batch`` sequences at mean context ``ctx`` (arrays broadcast)."""
        comp, mem = self.decode_bounds(batch, ctx)
        return self._fixed_s + self._allreduce_payload_s(batch) + np.maximum(comp, mem)

    def host_load_s(self, tokens):
        """Seconds to copy ``tokens`` tokens' KV from host memory to the instance: each of its ``tp`` GPUs
        loads its shard over its own PCIe link (a copy engine's work: the SMs keep computing meanwhile)."""
        nbytes = np.asarray(tokens, dtype=float) * self.model.kv_bytes_per_token
        return nbytes / (self.tp * self.device.host_bw * self.eff_host_bw)

    def prefill_s(self, tokens, cached=0.0):
        """Seconds to prefill ``tokens`` new tokens after ``cached`` tokens already in the KV cache."""
        m, d = self.model, self.device
        p = np.asarray(tokens, dtype=float)
        c0 = np.asarray(cached, dtype=float)
        flops = 2.0 * m.params * p + m.attn_flops_per_token_ctx * (p * c0 + p * p / 2.0)
        nbytes = m.weight_bytes + (p + c0) * m.kv_bytes_per_token
        t = np.maximum(flops / (self.tp * d.bf16_flops * self.eff_flops), nbytes / (self.tp * d.hbm_bw * self.eff_bw))
        return np.where(p > 0, self._fixed_s + self._allreduce_payload_s(p) + t, 0.0)

    def forward_s(
        self,
        decode_contexts: Sequence[float],
        prefill_chunks: Sequence[tuple[float, float]],
        *,
        adapted_tokens: float = 0.0,
        lora: LoraShape | None = None,
    ) -> float:
        """Seconds of one packed forward, as the executor runs it: one decode token for each of
        ``decode_contexts`` (the sequence's context after it) and each ``(new tokens, cached)``
        prefill chunk, in a single pass that reads the weights once. Decodes alone equal
        ``decode_s(B, mean context)`` and one chunk alone ``prefill_s`` (tests/test_devices.py).

        Co-batched (a LoRA policy of this model): ``adapted_tokens`` of the pass's tokens (its rollout rows' decodes
        and prefill) also go through the ``lora`` adapter, ``adapter_s`` more; 0 or None: exactly the pass alone."""
        decodes = float(len(decode_contexts))
        ctx = float(sum(decode_contexts))
        new = float(sum(p for p, _ in prefill_chunks))
        if decodes == 0 and new == 0:
            return 0.0
        attn = sum(p * c0 + p * p / 2.0 for p, c0 in prefill_chunks)
        base = float(self._pass_s(decodes + new, ctx + attn, ctx + sum(p + c0 for p, c0 in prefill_chunks)))
        if lora is None or adapted_tokens <= 0:
            return base
        return base + float(self.adapter_s(adapted_tokens, lora))

    def adapter_s(self, adapted_tokens, lora: LoraShape):
        """Seconds the adapter's own kernels add to a pass in which ``adapted_tokens`` go through it (arrays
        broadcast; 0 where none do): their fixed time per adapted linear, then the larger of their FLOPs and their
        bytes (the module doc). The kernels run after the base projections, so they add to the pass, not overlap."""
        m, d = self.model, self.device
        n = np.asarray(adapted_tokens, dtype=float)
        params, activation_bytes = _adapter_figures(m, lora)
        flops = 2.0 * params * n
        nbytes = params * m.bytes_per_param + n * activation_bytes
        t = np.maximum(flops / (self.tp * d.bf16_flops * self.eff_flops), nbytes / (self.tp * d.hbm_bw * self.eff_bw))
        return np.where(n > 0, m.layers * len(lora.targets) * LORA_LINEAR_S + t, 0.0)

    def _pass_s(self, tokens, attended, kv_tokens):
        """One pass that reads the weights once: ``tokens`` computed, ``attended`` token-contexts of attention,
        ``kv_tokens`` of KV read (arrays broadcast)."""
        m, d = self.model, self.device
        flops = 2.0 * m.params * tokens + m.attn_flops_per_token_ctx * attended
        nbytes = m.weight_bytes + kv_tokens * m.kv_bytes_per_token
        t = np.maximum(flops / (self.tp * d.bf16_flops * self.eff_flops), nbytes / (self.tp * d.hbm_bw * self.eff_bw))
        return self._fixed_s + self._allreduce_payload_s(tokens) + t

    def mixed_s(self, batch, ctx, chunk, cached=0.0, *, adapted_tokens=0.0, lora: LoraShape | None = None):
        """``forward_s`` over arrays: ``batch`` decodes at mean context ``ctx`` and one prefill chunk of ``chunk``
        tokens after ``cached``, in one pass that reads the weights once (a chunk rides on the decode step);
        ``adapted_tokens`` of them through the ``lora`` adapter (co-batched: the rollout rows and their prefill)."""
        b, c = np.asarray(batch, dtype=float), np.asarray(ctx, dtype=float)
        p, c0 = np.asarray(chunk, dtype=float), np.asarray(cached, dtype=float)
        t = self._pass_s(b + p, b * c + p * c0 + p * p / 2.0, b * c + np.where(p > 0, p + c0, 0.0))
        if lora is not None:
            t = t + self.adapter_s(adapted_tokens, lora)
        return np.where((b > 0) | (p > 0), t, 0.0)

    @property
    def rollout_prefill_tokens(self) -> int:
        """Prefill tokens an emulated executor's rollout iteration takes (services/executor/device.py): the ridge."""
        return self.ridge_tokens()

    def ridge_tokens(self) -> int:
        """Prefill tokens at which a forward turns from reading the weights to computing: a chunk of fewer
        takes as long as one token (the weights are read once either way), each token past it adds compute."""
        m, d = self.model, self.device
        return max(1, int(m.weight_bytes * d.bf16_flops * self.eff_flops / (2.0 * m.params * d.hbm_bw * self.eff_bw)))

    def label(self) -> str:
        return self.name or f"{self.model.name} on {self.tp}x{self.device.name}"


# A CPU executor's rollout prefill chunk: its forward is the host's own eager work, and a chunk of 64 on a tiny model
# is about a quantum (an emulated or GPU executor uses the roofline's ridge instead, ``Roofline.ridge_tokens``)
HOST_ROLLOUT_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class MeasuredSteps:
    """A step-time model measured on a real engine instead of the roofline.

    decode: ``decode_base_s + decode_per_seq_s x B + decode_per_ctx_token_s x B x C``;
    prefill: ``prefill_base_s + prefill_per_token_s x P`` (a least-squares fit of measured
    steps, see calibration.py). Same interface as ``Roofline``.
    """

    decode_base_s: float
    decode_per_seq_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    decode_per_ctx_token_s: float = 0.0
    host_load_per_token_s: float = 0.0  # restoring a prefix from the host tier (not measured: 0)
    adapter_per_token_s: float = 0.0  # a LoRA adapter's time per adapted token (not measured: 0)
    name: str = "measured"

    def host_load_s(self, tokens):
        """The measured engines are CPU ones, whose KV pool is host memory already: a restore copies within RAM, at
        ``host_load_per_token_s`` (calibration does not measure it: 0 unless given)."""
        return np.asarray(tokens, dtype=float) * self.host_load_per_token_s

    def decode_s(self, batch, ctx):
        b = np.asarray(batch, dtype=float)
        return self.decode_base_s + self.decode_per_seq_s * b + self.decode_per_ctx_token_s * b * np.asarray(ctx, dtype=float)

    def prefill_s(self, tokens, cached=0.0):
        p = np.asarray(tokens, dtype=float)
        return np.where(p > 0, self.prefill_base_s + self.prefill_per_token_s * p, 0.0)

    def forward_s(
        self,
        decode_contexts: Sequence[float],
        prefill_chunks: Sequence[tuple[float, float]],
        *,
        adapted_tokens: float = 0.0,
        lora: LoraShape | None = None,
    ) -> float:
        """One packed forward (see ``Roofline.forward_s``): the decode step of the batch plus each chunk's
        per-token prefill time (a forward with no decode pays the prefill base once), plus ``adapter_s``."""
        b = len(decode_contexts)
        new = sum(p for p, _ in prefill_chunks)
        if b == 0 and new == 0:
            return 0.0
        base = float(self.decode_s(b, sum(decode_contexts) / b)) if b else self.prefill_base_s
        if lora is None or adapted_tokens <= 0:
            return base + self.prefill_per_token_s * new
        return base + self.prefill_per_token_s * new + float(self.adapter_s(adapted_tokens, lora))

    def adapter_s(self, adapted_tokens, lora: LoraShape):
        """The adapter's time: ``adapter_per_token_s`` per adapted token (see ``Roofline.adapter_s``)."""
        return np.asarray(adapted_tokens, dtype=float) * self.adapter_per_token_s

    def mixed_s(self, batch, ctx, chunk, cached=0.0, *, adapted_tokens=0.0, lora: LoraShape | None = None):
        """``forward_s`` over arrays (see ``Roofline.mixed_s``)."""
        b, p = np.asarray(batch, dtype=float), np.asarray(chunk, dtype=float)
        t = np.where(b > 0, self.decode_s(b, ctx) + self.prefill_per_token_s * p, self.prefill_s(p, cached))
        if lora is not None:
            t = t + self.adapter_s(adapted_tokens, lora)
        return t

    @property
    def rollout_prefill_tokens(self) -> int:
        """A CPU executor's rollout prefill chunk (services/executor/device.py), what these steps were measured on."""
        return HOST_ROLLOUT_PREFILL_TOKENS

    def label(self) -> str:
        return self.name


# ---- memory and instance sizing -----------------------------------------------------------
MEMORY_UTILIZATION = 0.90
WORKSPACE_BYTES_PER_GPU = 2 * GB
COHOST_WEIGHT_FRACTION = 0.65  # serving + policy weights may take at most this share of an instance's HBM
DEDICATED_WEIGHT_FRACTION = 0.50  # a dedicated rollout instance: the policy's weights at most half its HBM


def usable_bytes(device: DeviceSpec, tp: int) -> float:
    """HBM an engine gets on ``tp`` GPUs: memory_utilization x HBM less the activation workspace."""
    return tp * (MEMORY_UTILIZATION * device.hbm_bytes - WORKSPACE_BYTES_PER_GPU)


def smallest_tp(weight_bytes: float, device: DeviceSpec, fraction: float, max_tp: int = 8) -> int:
    """The smallest power-of-two TP whose HBM holds ``weight_bytes`` within ``fraction`` of it."""
    tp = 1
    while tp < max_tp and weight_bytes > fraction * tp * device.hbm_bytes:
        tp *= 2
    return tp


def serving_tp(serving: ModelSpec, policy: ModelSpec, device: DeviceSpec) -> int:
    """TP of a serving instance: the serving model and a copy of the policy fit in 65 % of HBM.

    One rule for every policy, so the serving fleet is the same machine in every row of the
    table; with it, 7B..70B serving instances keep ~55-65 % of HBM for KV, in line with the
    30-50 % memory the paper measures as spare on production serving GPUs.
    """
    return smallest_tp(serving.weight_bytes + policy.weight_bytes, device, COHOST_WEIGHT_FRACTION)


def rollout_tp(policy: ModelSpec, device: DeviceSpec) -> int:
    """TP of a dedicated rollout instance: the policy's weights in at most half its HBM."""
    return smallest_tp(policy.weight_bytes, device, DEDICATED_WEIGHT_FRACTION)


def parse_fleet(text: str) -> tuple[int, DeviceSpec]:
    """``64xH100`` -> (64, H100)."""
    try:
        count, kind = text.lower().split("x", 1)
        n = int(count)
    except ValueError:
        raise ValueError(f"fleet {text!r}: expected COUNTxKIND, e.g. 64xH100") from None
    spec = next((d for k, d in DEVICES.items() if k.lower() == kind.strip()), None)
    if spec is None or n <= 0:
        raise ValueError(f"fleet {text!r}: COUNT must be positive and KIND one of {', '.join(DEVICES)}")
    return n, spec


def device_spec(name: str) -> DeviceSpec:
    """``H100`` (any case) -> its DeviceSpec; a ValueError names the kinds."""
    spec = next((d for k, d in DEVICES.items() if k.lower() == name.strip().lower()), None)
    if spec is None:
        raise ValueError(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    return spec


def model_spec(name: str) -> ModelSpec:
    key = name.upper()
    if key not in MODELS:
        raise ValueError(f"model {name!r}: choose one of {', '.join(MODELS)}")
    return MODELS[key]


def instances(gpus: int, tp: int) -> int:
    return max(0, math.floor(gpus / tp))


# ---- links: weight sync after a training step ---------------------------------------------
# Weight sync after each training step: full broadcast vs lossless delta, over link bandwidth.
#
# The trainer and the dedicated rollout pool sit in one cluster (InfiniBand-class fabric); the
# serving fleet sits in another, reached over ordinary Ethernet (mission.md). A new version
# crosses the inter-cluster link once and is relayed inside the serving cluster (a relay tree,
# as INTELLECT-2's Shardcast or our weight publisher over NATS), so the time to reach every
# serving executor is
#
#     encode + bytes / cross_link + bytes / intra_link      (pipelined shards: the max would be
#                                                             the bound; we take the sum, which is
#                                                             conservative)
#
# Parameters and their sources:
# - ``cross_link_gbps = 100``: one 100 GbE path between the clusters (assumption; the paper's
#   setting is "ordinary Ethernet");
# - ``intra_link_gbps = 400``: a 400 Gb/s NIC per node inside a cluster (NDR InfiniBand /
#   400 GbE, the usual H100/H200 node fabric);
# - ``delta_bytes_fraction = 0.02``: bytes of a lossless delta as a share of the bf16 weights.
#   Public figures: verl ``delta_sharded`` changed ratio 2.1-2.6 % on a 72B model; slime
#   "~3 % density"; our ``rose bench weights`` sent 1.15 % of the bytes on a 26 M model
#   (anchors.md);
# - ``encode_bytes_per_s = 20 GB/s``: delta encoding of the model bytes, ~1.3 GB/s per core
#   (anchors.md: numpy encode 1.1-1.7 GB/s on one core) on 16 cores in parallel over shards.
# A full broadcast needs no encoding.
# - ``host_link_bytes_per_s = 50 GB/s``: a GPU's host link, PCIe Gen5 x16 (64 GB/s a direction; pinned
#   host-to-device copies on H100/H200 measure 50-55 GB/s, NVIDIA's nvbandwidth). A LoRA policy run as a model
#   of its own (the two-model mode) folds each version into its base copy over pristine weights held on the host:
#   those weights cross this link once per version (``fold_seconds``).


@dataclass(frozen=True)
class SyncSpec:
    cross_link_gbps: float = 100.0
    intra_link_gbps: float = 400.0
    delta_bytes_fraction: float = 0.02
    encode_bytes_per_s: float = 20e9
    host_link_bytes_per_s: float = 50e9


def sync_seconds(weight_bytes: float, mode: str, spec: SyncSpec, cross_cluster: bool) -> float:
    """Seconds until a new version of ``weight_bytes`` is usable on the targets.

    ``mode``: ``full`` or ``delta``; ``cross_cluster``: the targets are serving executors in
    the other cluster (else the dedicated pool beside the trainer).
    """
    if mode not in ("full", "delta"):
        raise ValueError(f"weight sync mode {mode!r}: full or delta")
    nbytes = weight_bytes * (spec.delta_bytes_fraction if mode == "delta" else 1.0)
    encode = weight_bytes / spec.encode_bytes_per_s if mode == "delta" else 0.0
    intra = nbytes * 8 / (spec.intra_link_gbps * 1e9)
    if not cross_cluster:
        return encode + intra
    return encode + nbytes * 8 / (spec.cross_link_gbps * 1e9) + intra


def fold_seconds(adapted_weight_bytes: float, spec: SyncSpec) -> float:
    """Seconds to fold a LoRA version into a policy copy of its base (services/executor/weights.py
    ``MergedAdapterWeights``): the adapted layers' pristine weights cross the host link; the low-rank product and
    the add on the device are noise beside that copy."""
    return adapted_weight_bytes / spec.host_link_bytes_per_s


def bytes_sent(weight_bytes: float, mode: str, spec: SyncSpec) -> float:
    return weight_bytes * (spec.delta_bytes_fraction if mode == "delta" else 1.0)


# ---- training time --------------------------------------------------------------------------
TRAIN_FLOPS_PER_PARAM_TOKEN = 8.0  # forward + backward = 6, the old-logprob forward = 2 FLOPs per parameter and token
TRAIN_MFU = 0.4  # model FLOPs utilisation of a training step (assumption; large-scale RL trainers report 0.3-0.5)


def train_seconds(model: ModelSpec, tokens: float, gpus: float, device: DeviceSpec, mfu: float = TRAIN_MFU) -> float:
    """Seconds of one GRPO optimizer step over ``tokens`` tokens (prompts and generations) on ``gpus`` trainer GPUs."""
    return TRAIN_FLOPS_PER_PARAM_TOKEN * model.params * tokens / (max(1.0, gpus) * device.bf16_flops * mfu)
