"""Decode steps as CUDA graph replays (GPU only; the CPU runs every step eagerly).

Why: a decode step of a 24-28 layer model is about a thousand small kernels. Launched one by
one from Python the host is the bottleneck, not the GPU (H200, measured eagerly: the 1.3B
policy at batch 32 took ~40 ms a step, for ~1 ms of weight streaming), and the serving and
rollout lanes take turns on the interpreter lock to launch them. A captured graph launches a
whole step in one call. As SGLang's ``CudaGraphRunner`` does, one graph per batch-size
bucket; our attention gathers keys up to a fixed length, so per context-length bucket too.

A step is padded to its bucket by repeating its last sequence: the same token at the same
position writes the same K/V to the same slot, and the copies' logits are dropped. Keys past
a sequence's position are masked, so a longer bucket changes nothing but work.

Graphs hold raw pointers to the weights and the KV storage: a weight swap re-points
parameters, and releasing memory reallocates them, so every replay first compares those
pointers with the ones its graphs were captured against and recaptures on a change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .forward_item import ForwardItem
from .kv_pool import key_slots

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
CONTEXT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
WARMUP_STEPS = 1  # eager runs on a side stream before capture (cuBLAS and allocator state)
WARM_CONTEXTS = 2  # context buckets a serving lane captures at start (every batch bucket of each)


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``value`` (None: larger than every bucket)."""
    return next((b for b in buckets if b >= value), None)


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step's tensors, padded to a (batch, context) bucket: what a graph reads."""

    tokens: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slots: torch.Tensor  # [batch]: where each new K/V is written
    gather: torch.Tensor  # [batch * context]: cache slot of each key position
    mask: torch.Tensor  # [batch, 1, 1, context]: key visible to the query

    @classmethod
    def of(cls, items, block_size: int, batch: int, context: int) -> DecodeInputs:
        """Host tensors for decode ``items`` (one new token each), padded with copies of the last."""
        rows = list(items) + [items[-1]] * (batch - len(items))
        gather = key_slots([it.block_table for it in rows], context, block_size)
        kpos = torch.arange(context)
        positions = torch.tensor([it.start for it in rows], dtype=torch.long)
        slots = torch.tensor([it.block_table[it.start // block_size] * block_size + it.start % block_size for it in rows], dtype=torch.long)
        tokens = torch.tensor([it.token_ids[0] for it in rows], dtype=torch.long)
        mask = (kpos[None, :] <= positions[:, None])[:, None, None, :]
        return cls(tokens, positions, slots, gather, mask)

    def to(self, device) -> DecodeInputs:
        return DecodeInputs(*(t.to(device) for t in (self.tokens, self.positions, self.slots, self.gather, self.mask)))

    def copy_into(self, static: DecodeInputs) -> None:
        for src, dst in zip(
            (self.tokens, self.positions, self.slots, self.gather, self.mask),
            (static.tokens, static.positions, static.slots, static.gather, static.mask),
        ):
            dst.copy_(src)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs  # static, on the device: each replay copies the step's inputs in
    logits: torch.Tensor  # static output [batch, vocab]


class DecodeGraphs:
    """The captured decode graphs of one ``PagedModelRunner`` (see the module docstring)."""

    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.context_buckets = tuple(c for c in CONTEXT_BUCKETS if c < runner.max_positions) + (runner.max_positions,)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: _POOL_HANDLE | None = None  # one memory pool for this runner's graphs (they never replay at once)
        self._fingerprint: tuple[int, ...] | None = None
        self.captures = 0
        self.replays = 0

    def fits(self, items) -> tuple[int, int] | None:
        """The (batch, context) bucket of a decode step, or None: run it eagerly."""
        batch = bucket(len(items), self.batch_buckets)
        context = bucket(max(it.start for it in items) + 1, self.context_buckets)
        return None if batch is None or context is None else (batch, context)

    def run(self, items, key: tuple[int, int]) -> torch.Tensor:
        """Logits ``[len(items), vocab]`` of one decode step, by replay (capturing on first use)."""
        self._check_pointers()
        inputs = DecodeInputs.of(items, self.runner.pool.block_size, *key)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(inputs)
        else:
            inputs.copy_into(graph.inputs)
            graph.graph.replay()
        self.replays += 1
        return graph.logits[: len(items)].clone()  # the static buffer is the next replay's output

    def warm(self, contexts: int = WARM_CONTEXTS) -> int:
        """Capture every batch bucket of the first ``contexts`` context buckets now, against a scratch
        sequence's blocks (freed, so zeroed, after; taken whatever the pool's budget, so call this only
        while the pool holds no work): each lane does this before its first request, so no request
        pays a capture (one can take ~0.1 s of launches that no arrival interrupts). Returns the
        graphs captured (0 when the pool has no room)."""
        self._check_pointers()
        pool = self.runner.pool
        before = self.captures
        for context in self.context_buckets[:contexts]:
            if all((batch, context) in self._graphs for batch in self.batch_buckets):
                continue
            if pool.blocks_for(context) > pool.unallocated_blocks:
                break
            table = pool.allocate(pool.blocks_for(context), beyond_budget=True)
            try:
                for batch in self.batch_buckets:
                    if (batch, context) not in self._graphs:
                        inputs = DecodeInputs.of([ForwardItem(table, 0, [0])], pool.block_size, batch, context)
                        self._graphs[(batch, context)] = self._capture(inputs)
            finally:
                pool.free(table)
        return self.captures - before

    def _check_pointers(self) -> None:
        fingerprint = self.runner.storage_fingerprint()
        if fingerprint != self._fingerprint:
            self._graphs.clear()  # captured against storage that has moved (weight swap, memory released)
            self._fingerprint = fingerprint

    def _capture(self, host_inputs: DecodeInputs) -> _Graph:
        """Warm up on a side stream, then capture; the capture's own run is this step's result.

        Capture errors are thread-local: the other lane keeps launching on its own stream."""
        inputs = host_inputs.to(self.runner.device)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=self.runner.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.runner.decode_step(inputs)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            logits = self.runner.decode_step(inputs)
        current.wait_stream(side)
        graph.replay()  # capture only records: run it once for this step
        self.captures += 1
        return _Graph(graph, inputs, logits)
