"""The one shim TRL 1.16's `AsyncGRPOTrainer` needs off CUDA: two module attributes, each replaced where TRL reads it.

Nothing else of TRL changes (no file is patched; everything else goes through TRL's arguments and
protocols). Each replacement keeps TRL's own behaviour on CUDA and adds a CPU path beside it:

* `trl/experimental/async_grpo/packing.py:160` `_flash_attn()` fetches the flash-attn3 kernel from the
  Hugging Face Hub (`kernels.get_kernel("kernels-community/flash-attn3")`) for the packed "tree"
  attention (`tree_attention`, packing.py:187). On a CPU tensor it is answered here by the same
  variable-length causal attention in plain torch (`varlen_attention`): per segment, its queries
  against the keys of its root-to-segment path, bottom-right aligned as flash-attn aligns them.
* `trl/experimental/async_grpo/async_grpo_trainer.py:1240` calls `get_peak_flops_per_device`
  (trl/trainer/utils.py:1824: `torch.cuda.get_device_name`), which raises without CUDA. Off CUDA it
  answers None, which TRL already reads as "peak unknown: no MFU metrics" (utils.py:1826).

The third thing the trainer needs off vLLM is an argument, not a shim: `AsyncGRPOConfig(token_budget=N)`
(or `<= 0`), else it asks a vLLM server for its `max_model_len` (async_grpo_trainer.py:1437).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rose.shared.errors import RoseError


class UnsupportedAttention(RoseError, NotImplementedError):
    """An attention option the CPU path does not implement."""


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **_: Any,
) -> torch.Tensor:
    """flash-attn's `flash_attn_varlen_func` in torch: q [Tq, H, D], k/v [Tk, Hkv, D], segments by cumulative lengths.

    A segment's queries are the last `len_q` positions of its `len_k` keys (causal, bottom-right aligned);
    grouped-query heads are repeated. Returns [Tq, H, D]."""
    if softcap:
        raise UnsupportedAttention("logit softcapping is not implemented in the CPU tree attention (rose.integrations.trl.cpu)")
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    left = window_size[0]
    for s in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        c, d = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        if a == b:
            continue
        qs = q[a:b].transpose(0, 1)
        ks = k[c:d].transpose(0, 1).repeat_interleave(repeat, dim=0)
        vs = v[c:d].transpose(0, 1).repeat_interleave(repeat, dim=0)
        row = torch.arange(b - a, device=q.device)[:, None] + (d - c) - (b - a)  # each query's own key position
        col = torch.arange(d - c, device=q.device)[None, :]
        allowed = col <= row if causal else torch.ones_like(col <= row)
        if left >= 0:
            allowed = allowed & (col >= row - left)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=softmax_scale).transpose(0, 1)
    return out


class _VarlenKernel:
    """What `packing._flash_attn()` returns: TRL's Hub kernel for CUDA tensors, `varlen_attention` for the others."""

    def __init__(self, cuda_kernel: Any) -> None:
        self._cuda_kernel = cuda_kernel  # TRL's own loader, called only when a CUDA tensor comes

    def flash_attn_varlen_func(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if q.is_cuda:
            return self._cuda_kernel().flash_attn_varlen_func(q, *args, **kwargs)
        return varlen_attention(q, *args, **kwargs)


def install_cpu_fallbacks() -> None:
    """Let `AsyncGRPOTrainer` train on a CPU (idempotent; CUDA training still takes TRL's own paths)."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    if getattr(packing._flash_attn, "rose_cpu_fallback", False):
        return
    kernel = _VarlenKernel(packing._flash_attn)

    def flash_attn() -> _VarlenKernel:
        return kernel

    flash_attn.rose_cpu_fallback = True  # type: ignore[attr-defined]
    packing._flash_attn = flash_attn  # type: ignore[assignment]  # TRL's is a functools.cache of the Hub loader
    peak_flops = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops_on_cuda_only(accelerator: Any, dtype: str) -> float | None:
        return peak_flops(accelerator, dtype) if accelerator.device.type == "cuda" else None

    async_grpo_trainer.get_peak_flops_per_device = peak_flops_on_cuda_only
