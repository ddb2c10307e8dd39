"""The sglang backend's per-request state and what it reads of a model directory.

A module of its own because sglang_backend.py (the lending, requests and weights) holds a ``Job`` for every request
it has sent or will send: its request, handle, the server's id for it, and the output absorbed so far.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from .outputs import RequestHandle
from .protocol import FinishReason, GenerationRequest, TopLogprobs, WorkClass
from .sglang_lora import AdapterVersion


@dataclass(kw_only=True)
class Job:
    request: GenerationRequest
    handle: RequestHandle
    rid: str  # the id on the SGLang server (unique, fixed length: SGLang aborts by rid prefix)
    arrival: float
    task: asyncio.Task | None = None
    posted: bool = False
    aborted: bool = False
    done: bool = False
    accepted_at: float | None = None  # the server answered (headers)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when the request asked for alternatives
    versions: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0
    finish: FinishReason | None = None
    cached_tokens: int = 0
    retractions: int = 0
    adapter: AdapterVersion | None = None  # LoRA mode: the policy version's adapter this rollout request names

    @property
    def rollout(self) -> bool:
        return self.request.work_class is WorkClass.ROLLOUT


@dataclass(frozen=True)
class ModelInfo:
    """What we need of a model directory without loading its weights."""

    vocab_size: int
    max_positions: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, directory: str, dtype: torch.dtype) -> ModelInfo:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = torch.empty((), dtype=dtype).element_size()
        return cls(cfg.vocab_size, cfg.max_position_embeddings, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem)
