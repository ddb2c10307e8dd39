"""How a model's tensors map onto shards, and how tensors become bytes and back.

A version of a model is a set of named tensors. They are packed, in name order, into shards
of about `shard_bytes` each (a tensor is never split; one bigger than a shard gets a shard of
its own), every tensor aligned to `ALIGN` bytes so zero-copy numpy/torch views of it are
aligned. The layout depends only on the names, dtypes, shapes and `shard_bytes`, so it is the
same version after version and a shard can be delta-encoded against the same shard of the
previous version. A shard is also the unit a rank fetches: a follower that needs any tensor
of a shard fetches the whole shard.

This module also reads safetensors files without torch's help (header + mmap), so a
publisher maps the trainer's files into memory instead of copying them. It imports torch only inside
the functions that take or make tensors: the weight publisher lays out and packs bytes and never
needs it (importing it cost each publisher start about 1.8 s of CPU and ~300 MB).
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rose.shared.errors import RoseError

if TYPE_CHECKING:
    import torch

ALIGN = 64
DEFAULT_SHARD_BYTES = 32 << 20

# Our dtype names (torch's) and their width in bytes; `torch_dtypes` maps them to torch's dtypes.
ITEMSIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
SAFETENSORS_DTYPES: dict[str, str] = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# Floating dtypes whose values the lossy mode may approximate; the rest are always exact.
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


class LayoutError(RoseError, ValueError):
    """Tensors that cannot be laid out or do not match a layout (name, dtype, shape)."""


# A published tensor may go into a wider live tensor when every value survives exactly.
LOSSLESS_UPCASTS = {("bfloat16", "float32"), ("float16", "float32")}


def fits_live(published: str, live: str) -> bool:
    """Whether a tensor published as `published` can be applied bit-exactly to a `live` one."""
    return published == live or (published, live) in LOSSLESS_UPCASTS


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Our dtype names -> torch's dtypes (the names are torch's own); built once, on the first tensor."""
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZES}


def dtype_name(dtype: torch.dtype) -> str:
    for name, t in torch_dtypes().items():
        if t == dtype:
            return name
    raise LayoutError(f"dtype {dtype} is not supported for weight sync; use one of {sorted(ITEMSIZES)}")


def itemsize(name: str) -> int:
    return ITEMSIZES[name]


@dataclass(frozen=True, kw_only=True)
class TensorSlot:
    """Where one tensor lives: its shard and its byte range inside the shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Every tensor's slot and every shard's size, for one model at one shard size."""

    slots: tuple[TensorSlot, ...]
    shard_sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def by_name(self) -> dict[str, TensorSlot]:
        return {s.name: s for s in self.slots}

    def shard_slots(self, shard_id: int) -> list[TensorSlot]:
        return [s for s in self.slots if s.shard_id == shard_id]

    def segments(self, shard_id: int) -> list[tuple[int, int, int]]:
        """(start, length, element width) runs of a shard: consecutive tensors of one width, padding included.

        The codec works on whole elements, so it needs runs of one element width; padding
        between tensors is a multiple of `ALIGN` and therefore of every width.
        """
        out: list[tuple[int, int, int]] = []
        size = self.shard_sizes[shard_id]
        slots = self.shard_slots(shard_id)
        for i, slot in enumerate(slots):
            width = itemsize(slot.dtype)
            end = slots[i + 1].offset if i + 1 < len(slots) else size
            if out and out[-1][2] == width and out[-1][0] + out[-1][1] == slot.offset:
                start, length, _ = out[-1]
                out[-1] = (start, end - start, width)
            else:
                out.append((slot.offset, end - slot.offset, width))
        return out


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(tensors: Iterable[tuple[str, str, tuple[int, ...]]], shard_bytes: int = DEFAULT_SHARD_BYTES) -> Layout:
    """Pack (name, dtype, shape) in name order into shards of at most `shard_bytes` (bigger tensors alone)."""
    if shard_bytes <= 0:
        raise LayoutError(f"shard_bytes must be positive, got {shard_bytes}")
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    for name, dtype, shape in sorted(tensors):
        if dtype not in ITEMSIZES:
            raise LayoutError(f"tensor {name!r} has dtype {dtype!r}, not one of {sorted(ITEMSIZES)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        if not sizes or (sizes[-1] > 0 and _aligned(sizes[-1]) + nbytes > shard_bytes):
            sizes.append(0)
        offset = _aligned(sizes[-1])
        slots.append(TensorSlot(name=name, dtype=dtype, shape=tuple(int(d) for d in shape), shard_id=len(sizes) - 1, offset=offset, nbytes=nbytes))
        sizes[-1] = offset + nbytes
    return Layout(tuple(slots), tuple(_aligned(s) for s in sizes))


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over (name, raw bytes) of every tensor in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(tensor_bytes(state[name]).data)
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a uint8 array (zero-copy when contiguous)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_from_bytes(buf: np.ndarray | memoryview | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `buf` without copying (buf must be writable and stay alive)."""
    import torch

    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(view.cast("B")) else torch.empty(0, dtype=torch.uint8)
    if dtype == "bool":
        return raw.view(torch.bool).reshape(shape)
    return raw.view(torch_dtypes()[dtype]).reshape(shape)


def layout_of(state: Mapping[str, torch.Tensor], shard_bytes: int = DEFAULT_SHARD_BYTES) -> Layout:
    return plan_layout(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()), shard_bytes)


def pack_shards(layout: Layout, sources: Mapping[str, np.ndarray], shard_ids: Iterable[int] | None = None) -> dict[int, np.ndarray]:
    """Copy each tensor's bytes into its shard buffer (uint8, zero padding)."""
    wanted = set(range(len(layout.shard_sizes))) if shard_ids is None else set(shard_ids)
    shards = {sid: np.zeros(layout.shard_sizes[sid], dtype=np.uint8) for sid in wanted}
    for slot in layout.slots:
        if slot.shard_id not in wanted:
            continue
        src = sources.get(slot.name)
        if src is None:
            raise LayoutError(f"tensor {slot.name!r} is missing")
        if src.nbytes != slot.nbytes:
            raise LayoutError(f"tensor {slot.name!r} has {src.nbytes} bytes, the layout says {slot.nbytes}")
        shards[slot.shard_id][slot.offset : slot.offset + slot.nbytes] = src.reshape(-1).view(np.uint8)
    return shards


def state_bytes(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: tensor_bytes(t) for n, t in state.items()}


# ---- safetensors, read without copying ------------------------------------------------


@dataclass
class SafetensorsFile:
    """A memory-mapped safetensors file: tensor name -> (dtype, shape, bytes as a uint8 view)."""

    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]
    _map: mmap.mmap | None = None

    def close(self) -> None:
        """Drop our references; the map is unmapped once no array views it any more."""
        self.tensors = {}
        self._map = None


def parse_safetensors(buf: memoryview | bytes | bytearray | mmap.mmap, where: str = "<bytes>") -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """Tensors of a safetensors blob as zero-copy uint8 views; a malformed blob raises LayoutError."""
    view = memoryview(buf).cast("B")
    if len(view) < 8:
        raise LayoutError(f"{where}: not a safetensors file (shorter than its header length)")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > len(view) - 8 or header_len > 100 << 20:
        raise LayoutError(f"{where}: not a safetensors file (header length {header_len} does not fit its {len(view)} bytes)")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except ValueError as exc:
        raise LayoutError(f"{where}: safetensors header is not JSON: {exc}") from exc
    data = np.frombuffer(view, dtype=np.uint8, offset=8 + header_len)
    out: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        code = entry.get("dtype")
        if code not in SAFETENSORS_DTYPES:
            raise LayoutError(f"{where}: tensor {name!r} has dtype {code!r}, not supported")
        begin, end = entry["data_offsets"]
        dtype, shape = SAFETENSORS_DTYPES[code], tuple(int(d) for d in entry["shape"])
        if not 0 <= begin <= end <= data.size or end - begin != int(np.prod(shape, dtype=np.int64)) * itemsize(dtype):
            raise LayoutError(f"{where}: tensor {name!r} has byte range {begin}..{end} that does not match its shape")
        out[name] = (dtype, shape, data[begin:end])
    return out


def open_safetensors(path: str | Path) -> SafetensorsFile:
    path = Path(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return SafetensorsFile(path, parse_safetensors(mapped, str(path)), mapped)


def read_safetensors_dir(directory: str | Path) -> tuple[dict[str, tuple[str, tuple[int, ...], np.ndarray]], list[SafetensorsFile]]:
    """Every tensor of every `*.safetensors` file of a directory (a sharded HF checkpoint included)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else [directory]
    if not files:
        raise LayoutError(f"{directory}: no .safetensors files")
    opened = [open_safetensors(p) for p in files]
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for f in opened:
        for name, value in f.tensors.items():
            if name in tensors:
                raise LayoutError(f"{directory}: tensor {name!r} appears in two files")
            tensors[name] = value
    return tensors, opened


def safetensors_header(state: Mapping[str, torch.Tensor]) -> tuple[bytes, list[np.ndarray]]:
    """The safetensors header (length-prefixed, padded to 8) and the tensors' bytes, in file order.

    Written here rather than with `safetensors.torch.save` so tensors that share storage (tied
    embeddings) need no clone and the bytes can be streamed to a file without a second copy.
    """
    codes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {}
    parts: list[np.ndarray] = []
    offset = 0
    for name in sorted(state):
        t = state[name]
        data = tensor_bytes(t)
        header[name] = {"dtype": codes[dtype_name(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + data.nbytes]}
        parts.append(data)
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, parts


def safetensors_blob(state: Mapping[str, torch.Tensor]) -> bytearray:
    head, parts = safetensors_header(state)
    out = bytearray(len(head) + sum(p.nbytes for p in parts))
    out[: len(head)] = head
    view = np.frombuffer(out, dtype=np.uint8)
    pos = len(head)
    for p in parts:
        view[pos : pos + p.nbytes] = p
        pos += p.nbytes
    return out


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write a safetensors file (atomically: a temp name, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    head, parts = safetensors_header(state)
    with open(tmp, "wb") as f:
        f.write(head)
        for p in parts:
            f.write(p.data)
    tmp.replace(path)
    return path
