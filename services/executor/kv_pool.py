"""Paged KV-cache memory: one preallocated block pool per model, accounted in bytes.

Why blocks: like vLLM/SGLang, each sequence owns a table of fixed-size blocks, so memory
use is exact (bytes = blocks x block_bytes), there is no fragmentation, and a pool can
shrink by freeing whole blocks. The serving model and the policy model have different
shapes, so each has its own pool (its own tensor): rollout can never take a serving
block. The rollout pool is preallocated at its maximum and then *bounded* by a budget
(the lease); blocks above the budget are not handed out.

Isolation: a block is zeroed when it is freed, so whoever is handed it next (another user's
request, another trajectory) never finds the previous owner's keys and values in it. No
block ever changes class: each pool is its own tensor, allocated once. Copies leave a pool
and come back only through ``read_blocks`` / ``write_blocks`` (the rollout pool's host tier),
into blocks just allocated for the same owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_BLOCK_SIZE = 16  # tokens per block


def key_slots(block_tables: list[list[int]], length: int, block_size: int) -> torch.Tensor:
    """The cache slot of key positions ``0 .. length-1`` of each sequence, ``[len(block_tables) * length]``
    (tables cut or padded with block 0 to cover ``length``: positions past a sequence's context must
    be masked by the caller)."""
    n_blocks = -(-length // block_size)
    tables = [list(t[:n_blocks]) + [0] * (n_blocks - min(n_blocks, len(t))) for t in block_tables]
    kpos = torch.arange(length)
    return (torch.tensor(tables, dtype=torch.long)[:, kpos // block_size] * block_size + kpos % block_size).reshape(-1)


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem  # K and V


@dataclass(frozen=True)
class PoolUsage:
    """Same fields as contracts.executor.PoolUsage."""

    block_bytes: int
    total_blocks: int  # usable now (the budget for rollout)
    used_blocks: int  # held by sequences or by the prefix cache
    cached_blocks: int = 0  # of used_blocks, those held only by the prefix cache

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * self.block_bytes


@dataclass(frozen=True)
class KVPayload:
    """Copies of some blocks' K and V, every layer, in host memory (``KVPool.read_blocks``): each
    ``[layers, blocks, block_size, kv_heads, head_dim]``, the blocks in the order they were read."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def head(self, n: int) -> KVPayload:
        """The first ``n`` blocks (a restore that reuses a shorter prefix than was retained)."""
        return KVPayload(self.k[:, :n], self.v[:, :n])


class PagedKV(Protocol):
    """What a forward reads of a pool: the paged K/V tensors and their block size (a `KVPool`, or
    the rollout child's view of the same shared tensors, which allocates nothing itself)."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int


class KVPool:
    """Block allocator plus the K/V tensors: ``k[layer]`` is ``[num_blocks * block_size, kv_heads, head_dim]``.

    ``storage=False``: the blocks are accounted, never backed (an emulated accelerator's pool, whose
    gigabytes exist only on the emulated device: ``emulated.py``); ``k`` and ``v`` stay empty."""

    def __init__(self, name: str, shape: KVShape, capacity_bytes: int, block_size: int, device: torch.device, storage: bool = True) -> None:
        self.name = name
        self.shape = shape
        self.block_size = block_size
        self.block_bytes = shape.bytes_per_token() * block_size
        self.num_blocks = capacity_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"{name} KV pool of {capacity_bytes} bytes holds no {self.block_bytes}-byte block")
        slots = self.num_blocks * block_size
        dims = (shape.num_layers, slots, shape.num_kv_heads, shape.head_dim)
        self._dims, self._device, self._storage = dims, device, storage
        self._released = False
        self.k = torch.zeros(dims if storage else 0, dtype=shape.dtype, device=device)
        self.v = torch.zeros(dims if storage else 0, dtype=shape.dtype, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._budget_blocks = self.num_blocks

    # -- budget (the lease bounds the rollout pool)
    @property
    def budget_blocks(self) -> int:
        return self._budget_blocks

    def set_budget_bytes(self, budget_bytes: int) -> None:
        self._budget_blocks = max(0, min(self.num_blocks, budget_bytes // self.block_bytes))

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        """Blocks that may be allocated now (free and within the budget)."""
        return max(0, self._budget_blocks - self.used_blocks)

    @property
    def over_budget_blocks(self) -> int:
        return max(0, self.used_blocks - self._budget_blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int, beyond_budget: bool = False) -> list[int]:
        """``n`` free blocks within the budget, or (``beyond_budget``: a scratch use while the pool
        holds no work, e.g. capturing CUDA graphs before the first lease) any of the pool's free ones."""
        free = len(self._free) if beyond_budget else self.free_blocks
        if n > free:
            raise MemoryError(f"{self.name} KV pool: {n} blocks requested, {free} free")
        return [self._free.pop() for _ in range(n)]

    @property
    def unallocated_blocks(self) -> int:
        """Blocks nobody holds, whatever the budget."""
        return len(self._free)

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool, zeroed (their K/V must not reach the next owner)."""
        if not blocks:
            return
        self.scrub(blocks)
        self._free.extend(blocks)

    def scrub(self, blocks: list[int]) -> None:
        """Zero the K and V of `blocks` in every layer (one kernel per tensor, on the caller's stream)."""
        if not self._storage:
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        for tensor in (self.k, self.v):
            self._by_block(tensor).index_fill_(1, index, 0)

    # -- copies to and from host memory (the executor's host tier, prefix_cache.HostTier)
    def read_blocks(self, blocks: list[int]) -> KVPayload | None:
        """Copies of ``blocks``' K and V, every layer, on the CPU; None for a pool without storage (nothing to copy:
        an emulated device prices the copy instead)."""
        if not self._storage:
            return None
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        k, v = (self._by_block(t).index_select(1, index).to("cpu") for t in (self.k, self.v))
        return KVPayload(k, v)

    def write_blocks(self, blocks: list[int], payload: KVPayload | None) -> None:
        """Write ``payload`` (``read_blocks``' copies) into ``blocks``, which the caller has just allocated: a block
        restored here receives only what the caller read for the same owner (the engine matches the trajectory's
        tokens first), and is zeroed again when freed, as every block is."""
        if payload is None or not self._storage:
            return
        if payload.num_blocks != len(blocks):
            raise ValueError(f"{self.name} KV pool: a payload of {payload.num_blocks} blocks written into {len(blocks)}")
        if not set(blocks).isdisjoint(self._free):
            raise ValueError(f"{self.name} KV pool: a payload written into blocks nobody holds")
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        for tensor, copy in ((self.k, payload.k), (self.v, payload.v)):
            self._by_block(tensor).index_copy_(1, index, copy.to(device=tensor.device, dtype=tensor.dtype))

    def _by_block(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (``k`` or ``v``) viewed as ``[layers, blocks, block_size, kv_heads, head_dim]``."""
        layers, _, heads, dim = tensor.shape
        return tensor.view(layers, self.num_blocks, self.block_size, heads, dim)

    # -- lending the storage itself (SGLang's release/resume_memory_occupation)
    @property
    def released(self) -> bool:
        return self._released

    @property
    def capacity_bytes(self) -> int:
        """What the pool's K and V take on its device while not released."""
        return self.num_blocks * self.block_bytes

    def release(self) -> int:
        """Free the K/V storage (every block must be free); returns the bytes given back."""
        if self.released:
            return 0
        if self.used_blocks:
            raise RuntimeError(f"{self.name} KV pool: {self.used_blocks} blocks still in use, cannot release its memory")
        self._released = True
        if not self._storage:
            return self.capacity_bytes
        freed = (self.k.numel() + self.v.numel()) * self.k.element_size()
        self.k = self.v = torch.empty(0, dtype=self.shape.dtype, device=self._device)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def restore(self) -> int:
        """Allocate the K/V storage again (zeroed); returns the bytes taken."""
        if not self.released:
            return 0
        self._released = False
        if not self._storage:
            return self.capacity_bytes
        self.k = torch.zeros(self._dims, dtype=self.shape.dtype, device=self._device)
        self.v = torch.zeros(self._dims, dtype=self.shape.dtype, device=self._device)
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    def usage(self, cached_blocks: int = 0) -> PoolUsage:
        return PoolUsage(self.block_bytes, self._budget_blocks, self.used_blocks, cached_blocks)
