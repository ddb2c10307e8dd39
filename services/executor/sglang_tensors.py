"""Named tensors in SGLang's `update_weights_from_tensor` wire format, and a safe way to read them.

SGLang (``MultiprocessingSerializer``) pickles a list of ``(name, tensor)`` with
multiprocessing's ``ForkingPickler`` and base64-encodes it. The pickle does not carry the
bytes: torch's reductions share the storage (a file descriptor or a /dev/shm file for host
tensors, a CUDA IPC handle for device tensors), so sender and receiver must be on the same
machine and the sender must keep the tensors alive until the receiver has answered — which
is how RL frameworks use it (trainer and engine colocated on one node). We send host tensors
with torch's "file_system" strategy (a /dev/shm file per storage), which any local process can
open; CUDA tensors travel as CUDA IPC handles whatever the strategy.

A pickle runs whatever callables it names, so the receiver never uses a plain ``pickle.loads``:
``deserialize_named_tensors`` allows only the torch rebuild functions and types the format
needs and refuses anything else with ``UnsafePayload``.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions
from multiprocessing.reduction import ForkingPickler

_ALLOWED: dict[str, set[str]] = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child", "rebuild_storage_fd", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_cuda_tensor", "rebuild_event",
    },
    "torch": {"Tensor", "Size", "device"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "multiprocessing.resource_sharer": {"DupFd"},
    "copyreg": {"_reconstructor"},
    "builtins": {"object"},
    "collections": {"OrderedDict"},
}


class FlattenedTensorMetadata:
    """Stands in for `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` when reading
    slime's `load_format: "flattened_bucket"` payloads (same fields; SGLang is not installed here)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_STAND_INS = {("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata}


class UnsafePayload(ValueError):
    """The payload is not a list of named tensors in the expected format."""


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafePayload(f"refusing to load {module}.{name}: only torch tensors may travel in serialized_named_tensors")


def serialize_named_tensors(named: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)``: keep `named` alive until answered."""
    buf = io.BytesIO()
    previous = torch.multiprocessing.get_sharing_strategy()
    # Host tensors travel as named shared-memory files: the default (file descriptors passed by
    # multiprocessing's resource sharer) only works between processes of one multiprocessing family.
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str | bytes, *, flattened: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a payload; `flattened`: SGLang's "flattened_bucket" format
    (one 1-D tensor plus per-tensor metadata: name, shape, dtype, start and end index)."""
    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayload(f"not base64: {exc}") from None
    try:
        loaded = _TensorsOnly(io.BytesIO(payload)).load()
    except UnsafePayload:
        raise
    except Exception as exc:  # truncated pickle, a sender that is gone, a bad fd ...
        raise UnsafePayload(f"cannot load the tensors: {type(exc).__name__}: {exc}") from None
    if flattened:
        return _unflatten(loaded)
    if isinstance(loaded, dict):
        loaded = list(loaded.items())
    if not isinstance(loaded, list) or not all(
        isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor) for item in loaded
    ):
        raise UnsafePayload("expected a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in loaded]


def _unflatten(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(bucket, dict) or not isinstance(bucket.get("flattened_tensor"), torch.Tensor) or not isinstance(bucket.get("metadata"), list):
        raise UnsafePayload('a "flattened_bucket" payload is {"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata, ...]}')
    flat = bucket["flattened_tensor"]
    out = []
    for meta in bucket["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise UnsafePayload("flattened_bucket metadata entries must be FlattenedTensorMetadata")
        try:
            start, end, shape = int(meta.start_idx), int(meta.end_idx), torch.Size(meta.shape)
        except (AttributeError, TypeError, ValueError) as exc:
            raise UnsafePayload(f"bad flattened_bucket metadata: {exc}") from None
        if not (0 <= start <= end <= flat.numel()) or shape.numel() != end - start:
            raise UnsafePayload(f"flattened_bucket metadata of {getattr(meta, 'name', '?')!r} does not fit the flattened tensor ({flat.numel()} elements)")
        if flat.dtype != meta.dtype:
            raise UnsafePayload(f"{meta.name!r}: metadata says {meta.dtype}, the bucket holds {flat.dtype}")
        out.append((str(meta.name), flat[start:end].reshape(shape)))
    return out
