"""Helpers for the weight-sync tests: small mixed-dtype models, RL-like steps, a recording executor,
and objects written by hand into the weights object store."""

from __future__ import annotations

import base64
import hashlib
import json

import torch
from nats.js import api
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE
from nats.nuid import NUID

from rose.contracts.registry import WEIGHTS_OBJECTS
from rose.shared.bus import Delivery


def make_state(seed: int = 0, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """A tiny transformer-shaped state dict: bf16 matrices, fp32 norms, an fp16 head."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {"embed.weight": (torch.randn(64 * scale, 32, generator=g) * 0.02).to(torch.bfloat16)}
    for layer in range(3):
        state[f"layers.{layer}.attn.weight"] = (torch.randn(32, 32, generator=g) * 0.02).to(torch.bfloat16)
        state[f"layers.{layer}.mlp.weight"] = (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16)
        state[f"layers.{layer}.norm.weight"] = torch.ones(32) + torch.randn(32, generator=g) * 1e-3
    state["head.weight"] = (torch.randn(16, 32, generator=g) * 0.02).to(torch.float16)
    return state


def rl_step(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """A small multiplicative update: in bf16 only a few percent of elements change, as in RL."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() * (1 + lr * torch.randn(t.shape, generator=g))).to(t.dtype) for n, t in state.items()}


def as_sources(state: dict[str, torch.Tensor]):
    from rose.shared.weight_layout import dtype_name, tensor_bytes

    return {n: (dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t)) for n, t in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.uint8) if a[n].dtype != torch.bool else a[n], b[n].view(torch.uint8) if b[n].dtype != torch.bool else b[n])
        for n in a
    )


class Executor:
    """The apply side of a test: a state dict swapped whole, with every call recorded."""

    def __init__(self, state: dict[str, torch.Tensor], version: int | None, *, refuse: bool = False) -> None:
        self.state = {n: t.clone() for n, t in state.items()}
        self.version = version
        self.calls: list[tuple[int, list[str]]] = []
        self.refuse = refuse

    async def apply(self, update: dict[str, torch.Tensor], version: int) -> float:
        self.calls.append((version, sorted(update)))
        if self.refuse:
            raise ValueError("refused by the test executor")
        for name, tensor in update.items():
            self.state[name].copy_(tensor)
        self.version = version
        return 0.1


class Events:
    """WeightApplied / WeightFailed events seen on the bus."""

    def __init__(self) -> None:
        self.applied: list = []
        self.failed: list = []

    async def on_applied(self, msg, d: Delivery) -> None:
        self.applied.append(msg)

    async def on_failed(self, msg, d: Delivery) -> None:
        self.failed.append(msg)


async def craft(js, name: str, chunks: list[bytes], *, size: int, digest_of: bytes) -> None:
    """Write an object of the weights bucket by hand in the standard layout, with whatever size and digest we like."""
    bucket = WEIGHTS_OBJECTS.bucket
    nuid = NUID().next().decode()
    for chunk in chunks:
        await js.publish(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid), chunk)
    digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(digest_of).digest()).decode()
    info = api.ObjectInfo(
        name=name, bucket=bucket, nuid=nuid, size=size, chunks=len(chunks), digest=digest, options=api.ObjectMetaOptions(max_chunk_size=1 << 20)
    )
    meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())
    await js.publish(meta_subject, json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT})
