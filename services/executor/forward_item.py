"""One sequence's slice of a forward batch: the input type of the model runner and of its CUDA graphs.

A module of its own because both model_runner.py (which runs batches of these) and cuda_graphs.py
(which pads them into a graph's static tensors, and builds a scratch one to capture against) need it,
and model_runner.py imports cuda_graphs.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardItem:
    """One sequence in a batch: compute ``token_ids`` at positions ``start .. start+len-1``.

    ``pool``: which of the runner's KV pools holds its blocks (a co-batched forward carries serving's rows in
    pool 0 and rollout's in pool 1; a lane's own forward has one pool). ``adapter``: the adapter slot its rows
    go through (lora.py), None for the base weights alone."""

    block_table: list[int]  # must cover start + len(token_ids) positions
    start: int  # tokens already in the KV cache
    token_ids: list[int]
    pool: int = 0
    adapter: int | None = None
