"""Our own forward pass for Qwen2/Llama over paged KV, reading the Hugging Face weights.

Why not ``model(input_ids, past_key_values=...)``: the engine needs KV in *its* block
pool (so memory is accounted in bytes and can be shrunk, retained and shared by block),
and batches of sequences at different positions, some prefilling a chunk and some
decoding one token. So this module runs the architecture itself — RMSNorm, rotary
embeddings (the HF model's own ``inv_freq``, so ``rope_theta`` and static rope scaling
carry over), GQA attention with ``torch.nn.functional.scaled_dot_product_attention``,
SwiGLU MLP, q/k/v biases when present (Qwen2) — using the HF module parameters in place.
Updating those parameters (a policy weight swap) therefore updates this forward too.
A test checks the logits against ``model(input_ids).logits``.

Not supported (checked at construction): sliding-window attention and dynamic rope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from .adapters import NO_LORA, AdapterBank, LoraSegments
from .cuda_graphs import DecodeGraphs, DecodeInputs
from .forward_item import ForwardItem
from .kv_pool import KVShape, PagedKV, key_slots
from .sampling import SamplerState, sample_batch
from .weights import StagedWeights

log = logging.getLogger("rose.executor.model_runner")

HOLD_POLL_S = 0.0002  # how often a held forward asks whether to go on


def kv_shape_of(model: torch.nn.Module) -> KVShape:
    cfg: Any = model.config  # an HF config: typed by nothing torch knows
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, next(model.parameters()).dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF's Qwen2/Llama RMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    if dtype == torch.float32:  # one op instead of seven (each a hand-over of the interpreter lock)
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _linear(weight_bias: tuple, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``(weight, bias)`` applied without ``nn.Module.__call__``'s hook bookkeeping
    (Python, under the interpreter lock)."""
    return F.linear(x, *weight_bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def holding(should_stop: Callable[[], bool] | None, should_hold: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """A layer safepoint that also *holds*: while ``should_hold()`` the forward waits where it is,
    keeping the layers it has done, and goes on when it turns false; ``should_stop`` still wins
    (True: abandon). Why: on CPU a serving burst should have the core now, not after the rest of a
    rollout forward (tens of ms), and abandoning would throw the finished layers away."""
    if should_hold is None:
        return should_stop

    def safepoint() -> bool:
        while True:
            if should_stop is not None and should_stop():
                return True
            if not should_hold():
                return False
            time.sleep(HOLD_POLL_S)

    return safepoint


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The numbers the forward needs from a Qwen2/Llama config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    vocab_size: int
    max_positions: int
    attention_scaling: float  # rotary: HF's ``attention_scaling`` (1.0 unless a static rope scaling sets it)


@dataclass(frozen=True)
class ModelWeights:
    """What ``PagedModelRunner`` reads of an HF model: its architecture numbers, its parameters by
    name and the rotary ``inv_freq`` buffer, and nothing of transformers.

    Why: the rollout forward process receives this, not the model, so unpickling it in a fresh
    interpreter imports torch only (transformers' Qwen2 module alone takes ~3 s to import on the
    development VM, at every executor start). The parameters are the model's own ``Parameter``
    objects: a weight swap re-points their ``.data``, and every holder sees it.
    """

    arch: Architecture
    params: dict[str, torch.nn.Parameter]  # named_parameters(remove_duplicate=False): tied names both present
    inv_freq: torch.Tensor

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelWeights:
        cfg: Any = model.config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the paged runner")
        rope_params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if rope_params.get("rope_type", "default") == "dynamic":
            raise ValueError("dynamic rope scaling is not supported by the paged runner")
        shape = kv_shape_of(model)
        decoder: Any = model.model  # the HF decoder stack
        rotary = decoder.rotary_emb
        arch = Architecture(
            num_layers=shape.num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            eps=cfg.rms_norm_eps,
            vocab_size=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
            attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        )
        return cls(arch, dict(model.named_parameters(remove_duplicate=False)), rotary.inv_freq)

    def linear(self, prefix: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
        return self.params[f"{prefix}.weight"], self.params.get(f"{prefix}.bias")


@dataclass(frozen=True, kw_only=True)
class _AttentionGroup:
    """Attention for some items of a packed batch (the prefilling ones, or the decoding ones):
    their queries as a padded ``[items, heads, max_q, head_dim]`` batch against their keys and
    values gathered from the paged cache, with a causal and context-length mask.

    Why groups: one padded batch for everything would pad every decoding sequence's single
    query to the prefill chunk's length, as many times the attention work; a group of decoding
    sequences has no padding at all, and their rows are a contiguous run of the packed batch.
    """

    batch: int
    max_q: int
    span: tuple[int, int] | None  # the group's packed rows, when they are exactly its padded rows in order
    rows: torch.Tensor | None  # otherwise: packed row of each padded query row (padding repeats a real row)
    valid: torch.Tensor | None  # ... and which padded rows are real, with their packed rows (``targets``)
    targets: torch.Tensor | None
    gather: torch.Tensor  # [items * max_k] cache slot of each key position
    mask: torch.Tensor  # [items, 1, max_q, max_k]: key visible to query
    pool: int = 0  # which of the runner's KV pools the group's items are in

    @classmethod
    def of(cls, items: list[ForwardItem], qlens: list[int], offsets: list[int], members: list[int], bs: int, dev) -> _AttentionGroup:
        max_q = max(qlens[i] for i in members)
        ctx = [items[i].start + qlens[i] for i in members]
        max_k = max(ctx)
        query_positions = [list(range(items[i].start, items[i].start + max_q)) for i in members]
        gather = key_slots([items[i].block_table for i in members], max_k, bs).to(dev)
        kpos = torch.arange(max_k)
        qpos = torch.tensor(query_positions, dtype=torch.long)
        # key j visible to the query at position p iff j <= p and j < the item's context length
        mask = ((kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < torch.tensor(ctx)[:, None, None]))[:, None].to(dev)
        first = offsets[members[0]]
        if all(qlens[i] == max_q and offsets[i] == first + k * max_q for k, i in enumerate(members)):
            return cls(
                batch=len(members),
                max_q=max_q,
                span=(first, first + len(members) * max_q),
                rows=None,
                valid=None,
                targets=None,
                gather=gather,
                mask=mask,
                pool=items[members[0]].pool,
            )
        rows = [offsets[i] + min(j, qlens[i] - 1) for i in members for j in range(max_q)]
        valid = [k * max_q + j for k, i in enumerate(members) for j in range(qlens[i])]
        targets = [offsets[i] + j for i in members for j in range(qlens[i])]
        as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        return cls(
            batch=len(members),
            max_q=max_q,
            span=None,
            rows=as_index(rows),
            valid=as_index(valid),
            targets=as_index(targets),
            gather=gather,
            mask=mask,
            pool=items[members[0]].pool,
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """This group's attention output, ``[padded rows, heads * head_dim]``, from the packed queries."""
        _, heads, hd = q.shape
        kvh = k_cache.shape[1]
        if self.span is not None:
            q = q[self.span[0] : self.span[1]]
        else:
            assert self.rows is not None  # `of` sets one of the two
            q = q.index_select(0, self.rows)
        q = q.view(self.batch, self.max_q, heads, hd).transpose(1, 2)
        keys = k_cache.index_select(0, self.gather).view(self.batch, -1, kvh, hd).transpose(1, 2)  # [B, kvh, max_k, hd]
        values = v_cache.index_select(0, self.gather).view(self.batch, -1, kvh, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(self.batch * self.max_q, heads * hd)

    def attend_into(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Write this group's attention output into its rows of the packed ``out``."""
        result = self.attend(q, k_cache, v_cache)
        if self.span is not None:
            out[self.span[0] : self.span[1]] = result
        else:
            assert self.targets is not None and self.valid is not None  # set with `rows`
            out.index_copy_(0, self.targets, result.index_select(0, self.valid))


@dataclass(frozen=True)
class _LayerWeights:
    input_norm: torch.nn.Parameter
    q: tuple
    k: tuple
    v: tuple
    o: tuple
    post_norm: torch.nn.Parameter
    gate: tuple
    up: tuple
    down: tuple


class PagedModelRunner:
    """Runs one HF Qwen2/Llama model (or its ``ModelWeights``) against its KV pools, with LoRA adapters on the rows
    that name one (``adapters``, adapters.py).

    ``pool``: the KV pool its items are in (``ForwardItem.pool`` 0), or several: a co-batched forward carries
    serving's rows in pool 0 and rollout's in pool 1 (co_batched.py); each pool is its own tensor, read and written
    only through the items in it. ``adapters``: the adapter slots items may name (None: base weights alone)."""

    def __init__(self, model: torch.nn.Module | ModelWeights, pool: PagedKV | Sequence[PagedKV], adapters: AdapterBank | None = None) -> None:
        weights = model if isinstance(model, ModelWeights) else ModelWeights.of(model)
        self.model = None if isinstance(model, ModelWeights) else model
        self.weights = weights
        pools: list[PagedKV] = list(pool) if isinstance(pool, list | tuple) else [cast(PagedKV, pool)]
        if len({p.block_size for p in pools}) != 1:
            raise ValueError("a runner's KV pools must share one block size (a forward's block tables are addressed alike)")
        self.pool: PagedKV = pools[0]
        self.extra_pools: list[PagedKV] = pools[1:]
        self.adapters = adapters
        arch = weights.arch
        self.num_heads = arch.num_heads
        self.eps = arch.eps
        self.vocab_size = arch.vocab_size
        self.max_positions = arch.max_positions
        self._embed = weights.params["model.embed_tokens.weight"]
        self.device = self._embed.device
        self.shape = KVShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, self._embed.dtype)
        self._layers = [self._layer_weights(weights, f"model.layers.{i}") for i in range(arch.num_layers)]
        self._norm = weights.params["model.norm.weight"]
        self._lm_head = weights.linear("lm_head") if "lm_head.weight" in weights.params else (self._embed, None)
        self._storage = list({id(t): t for t in weights.params.values()}.values()) + [weights.inv_freq]
        self.graphs: DecodeGraphs | None = None  # CUDA: decode steps as graph replays (``use_cuda_graphs``)
        self.graph_failures = 0  # captures or replays refused: after the first, this runner runs eagerly

    def use_cuda_graphs(self, max_batch: int) -> None:
        """Run decode-only steps as CUDA graph replays (``cuda_graphs.py``); a no-op off CUDA."""
        if self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_batch)

    def warm_cuda_graphs(self) -> int:
        """Capture the common decode graphs now (``DecodeGraphs.warm``); the count captured. Where the
        device or driver refuses a capture, this runner goes on eagerly."""
        if self.graphs is None:
            return 0
        try:
            return self.graphs.warm()
        except RuntimeError:
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            self.graphs, self.graph_failures = None, self.graph_failures + 1
            return 0

    @property
    def pools(self) -> list[PagedKV]:
        """The KV pools by ``ForwardItem.pool`` index (``pool`` first: a rollout process may re-point it)."""
        return [self.pool, *self.extra_pools]

    def storage_fingerprint(self) -> tuple[int, ...]:
        """Addresses of every weight and of the KV storage: what a captured graph reads."""
        return tuple(t.data_ptr() for t in self._storage) + (self.pool.k.data_ptr(), self.pool.v.data_ptr())

    def forward_sample(
        self,
        items: list[ForwardItem],
        samples: list[tuple[int, SamplerState]],
        should_stop: Callable[[], bool] | None = None,
        should_hold: Callable[[], bool] | None = None,
    ) -> tuple[list[int], list[float]] | None:
        """Forward, then sample one token for each ``(row, sampler)`` (the rows whose item reaches
        its sequence's end): their ids and logprobs, or None when abandoned at a safepoint
        (nothing sampled: preemption never consumes randomness). While ``should_hold`` says so
        the forward waits at its next safepoint (see ``holding``)."""
        logits = self.forward(items, should_stop=holding(should_stop, should_hold))
        if logits is None:
            return None
        if not samples:
            return [], []
        return sample_batch(logits[[row for row, _ in samples]], [state for _, state in samples])

    def host_load(self, tokens: int) -> None:
        """``tokens`` tokens' KV were just restored into this runner's pool from host memory (``KVPool.write_blocks``):
        a real copy, already paid for, so nothing to model (an emulated runner prices it instead)."""

    @staticmethod
    def _layer_weights(weights: ModelWeights, prefix: str) -> _LayerWeights:
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        return _LayerWeights(
            input_norm=weights.params[f"{prefix}.input_layernorm.weight"],
            q=weights.linear(f"{attn}.q_proj"),
            k=weights.linear(f"{attn}.k_proj"),
            v=weights.linear(f"{attn}.v_proj"),
            o=weights.linear(f"{attn}.o_proj"),
            post_norm=weights.params[f"{prefix}.post_attention_layernorm.weight"],
            gate=weights.linear(f"{mlp}.gate_proj"),
            up=weights.linear(f"{mlp}.up_proj"),
            down=weights.linear(f"{mlp}.down_proj"),
        )

    def prepare_weights(self, staged: StagedWeights) -> None:
        """Before the swap, on the caller's thread while forwards go on: nothing to do here (the swap
        re-points or copies); a runner that double-buffers its weights fills its standby copy."""

    def apply_weights(self, staged: StagedWeights) -> float:
        """Swap staged policy weights in (between forwards); returns the pause in ms. With captured
        CUDA graphs the new values are copied in place, so the graphs stay valid (``copy_into``)."""
        if self.model is None:
            raise RuntimeError("a runner built from ModelWeights has no model of its own to swap weights into")
        return staged.copy_into(self.model) if self.graphs is not None else staged.apply(self.model)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], all_logits: bool = False, should_stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Write the new tokens' K/V into the pool and return float32 logits.

        Returns ``[batch, vocab]`` for each item's last token, or, with ``all_logits``,
        ``[batch, max_new_tokens, vocab]`` (rows past an item's length are zeros).

        The batch is *packed*: every item's new tokens are rows of one ``[tokens, hidden]``
        activation, so the linear layers (at small batches, the time to stream the weights)
        run once per layer for a prefill chunk and the decoding sequences beside it, with no
        padding; only attention is done per group of items (see ``_AttentionGroup``).

        ``should_stop`` is asked between layers (a safepoint, as in ConServe's layer-wise
        preemption): when it says yes the forward is abandoned and None returned. Nothing
        is lost: the caller does not advance its sequences, and the K/V slots written by
        the layers that ran are simply written again by the retry.
        """
        dev = self.device
        bs = self.pool.block_size
        qlens = [len(it.token_ids) for it in items]
        plain = all(it.pool == 0 and it.adapter is None for it in items)  # what a captured graph runs: one pool, no adapter
        if self.graphs is not None and plain and max(qlens) == 1 and (key := self.graphs.fits(items)) is not None:
            if should_stop is not None and should_stop():  # a replay runs whole: its one safepoint is before it
                return None
            try:
                logits = self.graphs.run(items, key)
                return logits[:, None] if all_logits else logits
            except RuntimeError:  # a capture this device or driver refuses: this runner goes on eagerly
                log.exception("CUDA graph capture or replay failed; decode steps run eagerly from now on")
                self.graphs, self.graph_failures = None, self.graph_failures + 1
        # Index tensors are built as Python lists and converted once each: a torch op per sequence
        # (several per sequence, 32 sequences) would be most of a decode step's ops, and every op
        # hands the interpreter lock over to the other lane and back.
        offsets: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        for it, q in zip(items, qlens):
            offsets.append(len(tokens))
            tokens.extend(it.token_ids)
            positions.extend(range(it.start, it.start + q))
            write_slots.extend(it.block_table[p // bs] * bs + p % bs for p in range(it.start, it.start + q))
        groups = []
        for pool in sorted({it.pool for it in items}):
            for wanted in (lambda q: q > 1, lambda q: q == 1):  # prefill chunks, then decodes: each its own padded batch
                members = [i for i, q in enumerate(qlens) if items[i].pool == pool and wanted(q)]
                if members:
                    groups.append(_AttentionGroup.of(items, qlens, offsets, members, bs, dev))
        positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
        writes = _KVWrites.of(items, qlens, offsets, write_slots, dev)
        lora = LoraSegments.of(items, offsets, dev) if self.adapters is not None else NO_LORA

        x = self._decoder(torch.tensor(tokens, dtype=torch.long, device=dev), positions_t, writes, groups, should_stop, lora)
        if x is None:
            return None
        if all_logits:
            logits = _linear(self._lm_head, x).float()
            out = logits.new_zeros(len(items), max(qlens), logits.shape[-1])
            rows = torch.tensor([b for b, q in enumerate(qlens) for _ in range(q)], device=dev)
            cols = torch.tensor([j for q in qlens for j in range(q)], device=dev)
            out[rows, cols] = logits
            return out
        last = torch.tensor([o + q - 1 for o, q in zip(offsets, qlens)], device=dev)
        return _linear(self._lm_head, x.index_select(0, last)).float()

    def _decoder(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        writes: _KVWrites,
        groups: list[_AttentionGroup],
        should_stop: Callable[[], bool] | None = None,
        lora: LoraSegments = NO_LORA,
    ) -> torch.Tensor | None:
        """Embedding, every layer (writing K/V where ``writes`` says) and the final norm: ``[tokens, hidden]``,
        or None when ``should_stop`` says so at a safepoint. ``lora``: the rows that also go through an adapter."""
        x = F.embedding(tokens, self._embed)  # [tokens, hidden]
        cos, sin = self._rope(positions, x.dtype)
        for li, layer in enumerate(self._layers):
            if should_stop is not None and should_stop():
                return None
            x = x + self._attention(layer, li, _rms_norm(x, layer.input_norm, self.eps), cos, sin, writes, groups, lora)
            if should_stop is not None and should_stop():  # a second safepoint, between attention and MLP
                return None
            x = x + self._mlp(layer, li, _rms_norm(x, layer.post_norm, self.eps), lora)
        return _rms_norm(x, self._norm, self.eps)

    @torch.inference_mode()
    def decode_step(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode step over fixed-shape inputs, the whole of it in device ops (no host sync, no
        new index tensors): what ``cuda_graphs`` captures. Float32 logits ``[batch, vocab]``."""
        batch = inputs.tokens.shape[0]
        group = _AttentionGroup(batch=batch, max_q=1, span=(0, batch), rows=None, valid=None, targets=None, gather=inputs.gather, mask=inputs.mask)
        x = self._decoder(inputs.tokens, inputs.positions, _KVWrites(((0, None, inputs.slots),)), [group])
        assert x is not None  # no should_stop: it runs to the end
        return _linear(self._lm_head, x).float()

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.weights.inv_freq.float()
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.weights.arch.attention_scaling
        return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]

    def _proj(self, li: int, module: str, weight_bias: tuple, x: torch.Tensor, lora: LoraSegments) -> torch.Tensor:
        """One linear layer over the packed rows, and its adapter on the rows that take one."""
        y = _linear(weight_bias, x)
        if lora and self.adapters is not None:
            y = self.adapters.add_delta(li, module, x, y, lora)
        return y

    def _attention(
        self, layer: _LayerWeights, li: int, h: torch.Tensor, cos, sin, writes: _KVWrites, groups: list[_AttentionGroup], lora: LoraSegments
    ) -> torch.Tensor:
        n = h.shape[0]
        hd, kvh, heads = self.shape.head_dim, self.shape.num_kv_heads, self.num_heads
        q = self._proj(li, "q_proj", layer.q, h, lora).view(n, heads, hd)
        k = self._proj(li, "k_proj", layer.k, h, lora).view(n, kvh, hd)
        v = self._proj(li, "v_proj", layer.v, h, lora).view(n, kvh, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        pools = self.pools
        for pool, rows, slots in writes.by_pool:
            pools[pool].k[li].index_copy_(0, slots, k if rows is None else k.index_select(0, rows))
            pools[pool].v[li].index_copy_(0, slots, v if rows is None else v.index_select(0, rows))
        if len(groups) == 1 and groups[0].rows is None:  # its padded rows are the packed batch: no copy
            g = groups[0]
            out = g.attend(q, pools[g.pool].k[li], pools[g.pool].v[li])
        else:
            out = q.new_empty(n, heads * hd)
            for g in groups:
                g.attend_into(out, q, pools[g.pool].k[li], pools[g.pool].v[li])
        return self._proj(li, "o_proj", layer.o, out, lora)

    def _mlp(self, layer: _LayerWeights, li: int, h: torch.Tensor, lora: LoraSegments) -> torch.Tensor:
        gate, up = self._proj(li, "gate_proj", layer.gate, h, lora), self._proj(li, "up_proj", layer.up, h, lora)
        return self._proj(li, "down_proj", layer.down, F.silu(gate) * up, lora)


@dataclass(frozen=True)
class _KVWrites:
    """Where one forward writes its new tokens' K and V: per pool, its packed rows (None: all of them) and their
    cache slots."""

    by_pool: tuple[tuple[int, torch.Tensor | None, torch.Tensor], ...]

    @classmethod
    def of(cls, items: list[ForwardItem], qlens: list[int], offsets: list[int], write_slots: list[int], dev) -> _KVWrites:
        pools = sorted({it.pool for it in items})
        if len(pools) == 1:
            return cls(((pools[0], None, torch.tensor(write_slots, dtype=torch.long, device=dev)),))
        writes = []
        for pool in pools:
            rows = [offsets[i] + j for i, it in enumerate(items) if it.pool == pool for j in range(qlens[i])]
            as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
            writes.append((pool, as_index(rows), as_index([write_slots[r] for r in rows])))
        return cls(tuple(writes))
