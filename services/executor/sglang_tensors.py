"""Named tensors in SGLang's `update_weights_from_tensor` wire format, and a safe way to read them.

SGLang (``MultiprocessingSerializer``) pickles a list of ``(name, tensor)`` with
multiprocessing's ``ForkingPickler`` and base64-encodes it. The pickle does not carry the
bytes: torch's reductions share the storage (a file descriptor or a /dev/shm file for host
tensors, a CUDA IPC handle for device tensors), so sender and receiver must be on the same
machine and the sender must keep the tensors alive until the receiver has answered — which
is how RL frameworks use it (trainer and engine colocated on one node). We send host tensors
with torch's "file_system" strategy (a /dev/shm segment per storage); CUDA tensors travel as
CUDA IPC handles whatever the strategy.

A pickle runs whatever callables it names, and torch's own rebuild functions open what the
payload names: `DupFd` and `rebuild_storage_fd` dial the sender's address to receive a file
descriptor, `rebuild_storage_filename` connects to the socket the payload names (torch's shm
manager) and maps any segment. So the receiver never uses a plain ``pickle.loads`` nor those
functions: ``deserialize_named_tensors`` resolves the few names the format needs to rebuild
functions of its own, which

* take no file descriptor and dial no socket (`DupFd`, `rebuild_storage_fd`, `rebuild_event` are
  refused; the shm manager socket a payload names is ignored);
* read host storages from /dev/shm only, by a name of torch's own form (`/torch_<pid>_<n>_<n>`),
  a regular file owned by this user, never a link, copied (not mapped) into fresh memory;
* check every size against the model's own parameters BEFORE anything is allocated, mapped or
  converted: a storage holds at most the policy's bytes (all storages together too), a tensor
  has the shape and a dtype of one of its parameters, lies inside its storage, and afterwards
  every name is a parameter with exactly that shape and a dtype that applies to it losslessly;
* hand out classes (Tensor, storages) only as markers, so the pickle cannot call
  ``torch.Tensor(10**12)`` or ``UntypedStorage(10**12)`` to allocate at will.

Anything else is refused with ``UnsafePayload``.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import pickle
import re
import stat
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions
import torch.multiprocessing.reductions as torch_reductions

from rose.shared.errors import RoseError
from rose.shared.weight_layout import fits_live, torch_dtypes

SHM_DIR = "/dev/shm"
SHM_HEADER = 64  # torch's RefcountedMapAllocator keeps the segment's refcount in its first 64 bytes (c10's alignment); data follows
SHM_NAME_RE = re.compile(rb"^/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}$")  # what torch's file_system strategy names its segments


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


class UnsafePayload(RoseError, ValueError):
    """The payload is not a list of named tensors in the expected format, or does not fit the model."""


class PolicyMismatch(UnsafePayload):
    """Well-formed tensors that are not the policy's: an unknown name, another shape, a dtype that does not apply."""


@dataclass(frozen=True)
class _ClassRef:
    """A class the format names only as an argument (never called by the pickle)."""

    name: str


_TENSOR, _PARAMETER = _ClassRef("torch.Tensor"), _ClassRef("torch.nn.parameter.Parameter")
_UNTYPED, _TYPED = _ClassRef("torch.storage.UntypedStorage"), _ClassRef("torch.storage.TypedStorage")
_CLASS_REFS = {
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "TypedStorage"): _TYPED,
    ("torch", "TypedStorage"): _TYPED,
}
_VALUES = {("torch", "Size"): torch.Size, ("torch", "device"): torch.device, ("collections", "OrderedDict"): OrderedDict}
_DTYPES = torch_dtypes()


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def param_specs(params: Mapping[str, Any]) -> dict[str, ParamSpec]:
    """name -> (shape, dtype) of the live parameters (tensors, or ParamSpec already)."""
    out = {}
    for name, p in params.items():
        out[name] = p if isinstance(p, ParamSpec) else ParamSpec(tuple(p.shape), p.dtype)
    return out


def _dtype_name(dtype: torch.dtype) -> str | None:
    return next((n for n, d in _DTYPES.items() if d == dtype), None)


def _applies(published: torch.dtype, live: torch.dtype) -> bool:
    """A tensor of dtype `published` may replace a `live` parameter bit-exactly."""
    p, lv = _dtype_name(published), _dtype_name(live)
    return p is not None and lv is not None and fits_live(p, lv)


class _Budget:
    """What the payload may rebuild, from the model's own parameters; checked before each allocation."""

    def __init__(self, specs: dict[str, ParamSpec], flattened: bool) -> None:
        if not specs:
            raise UnsafePayload("the model has no parameters to update")
        self.specs, self.flattened = specs, flattened
        self.total_bytes = sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs.values())
        self.left_bytes = self.total_bytes
        self.total_numel = sum(math.prod(s.shape) for s in specs.values())
        self.dtypes = {d for d in _DTYPES.values() if any(_applies(d, s.dtype) for s in specs.values())}
        self.shapes: dict[tuple[int, ...], set[torch.dtype]] = {}
        for s in specs.values():
            self.shapes.setdefault(s.shape, set()).update(d for d in _DTYPES.values() if _applies(d, s.dtype))

    def storage(self, nbytes: Any) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise UnsafePayload(f"storage size {nbytes!r} is not a byte count")
        if nbytes > self.left_bytes:
            raise UnsafePayload(f"storages of {nbytes} more bytes exceed the policy's own size ({self.total_bytes} bytes): refused before allocating")
        self.left_bytes -= nbytes
        return nbytes

    def dtype(self, dtype: Any) -> torch.dtype:
        if not isinstance(dtype, torch.dtype) or dtype not in self.dtypes:
            raise PolicyMismatch(
                f"dtype {dtype!r} applies to no parameter of the policy (its dtypes: {sorted(str(s.dtype) for s in self.specs.values())})"
            )
        return dtype

    def tensor(self, size: Any, stride: Any, offset: Any, dtype: torch.dtype, storage_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Check a tensor's geometry: a parameter's shape and dtype (flattened: 1-D, at most the policy's elements), inside its storage."""
        shape, strides = _ints(size, "size"), _ints(stride, "stride")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise UnsafePayload(f"storage offset {offset!r} is not a non-negative integer")
        if len(strides) != len(shape) or any(s < 0 for s in strides):
            raise UnsafePayload(f"strides {strides} do not fit shape {shape}")
        if self.flattened:
            if len(shape) != 1 or shape[0] > self.total_numel:
                raise UnsafePayload(f"a flattened bucket is one 1-D tensor of at most {self.total_numel} elements, not {shape}")
        elif shape not in self.shapes:
            raise PolicyMismatch(f"unknown parameter names or shapes: no parameter of the policy has shape {shape}")
        elif dtype not in self.shapes[shape]:
            raise PolicyMismatch(f"no parameter of shape {shape} takes dtype {dtype}")
        span = 0 if 0 in shape else offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        if span * itemsize > storage_bytes:
            raise UnsafePayload(f"a tensor of shape {shape} at offset {offset} reaches past its storage of {storage_bytes} bytes")
        return shape, strides, offset


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, (tuple, list, torch.Size))
        or len(value) > 8
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise UnsafePayload(f"tensor {what} {value!r} is not a short tuple of non-negative integers")
    return tuple(int(v) for v in value)


class _TensorsOnly(pickle.Unpickler):
    """Resolves only the names a tensor list needs, to rebuild functions that check `budget` first."""

    def __init__(self, data: bytes, budget: _Budget) -> None:
        super().__init__(io.BytesIO(data))
        self.budget = budget
        self._functions = {
            ("torch.multiprocessing.reductions", "rebuild_tensor"): self._rebuild_tensor,
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"): self._rebuild_typed_storage,
            ("torch.multiprocessing.reductions", "rebuild_storage_empty"): self._rebuild_storage_empty,
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"): self._read_shm_segment,
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): self._rebuild_cuda_tensor,
        }

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _STAND_INS:
            return _STAND_INS[key]
        if key in self._functions:
            return self._functions[key]
        if key in _CLASS_REFS:
            return _CLASS_REFS[key]
        if key in _VALUES:
            return _VALUES[key]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayload(
            f"refusing to load {module}.{name}: only torch tensors in shared memory or CUDA IPC may travel in serialized_named_tensors "
            "(no file descriptors, sockets or other callables)"
        )

    # ---- storages -------------------------------------------------------------------------

    def _read_shm_segment(self, cls: Any, _manager: Any, handle: Any, size: Any, dtype: Any = None) -> torch.UntypedStorage | torch.TypedStorage:
        """torch's `rebuild_storage_filename`, without its manager socket: read the named /dev/shm segment
        (torch's naming, a regular file of ours, no link) into fresh memory, after the size check."""
        if cls not in (_UNTYPED, _TYPED):
            raise UnsafePayload(f"a shared-memory storage must be an UntypedStorage or TypedStorage, not {cls!r}")
        if isinstance(handle, str):
            handle = handle.encode()
        if not isinstance(handle, bytes) or not SHM_NAME_RE.match(handle):
            raise UnsafePayload(f"shared-memory name {handle[:80]!r} is not a torch segment name (/torch_<pid>_<n>_<n>)")
        itemsize = 1 if dtype is None else torch.empty((), dtype=self.budget.dtype(dtype)).element_size()
        if not isinstance(size, int) or isinstance(size, bool):
            raise UnsafePayload(f"storage size {size!r} is not an integer")
        nbytes = self.budget.storage(size * itemsize)
        path = SHM_DIR + handle.decode()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise UnsafePayload(f"cannot open shared-memory segment {path}: {exc.strerror} (is the sender keeping its tensors alive?)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise UnsafePayload(f"{path} is not a regular file owned by this executor's user")
            if st.st_size < SHM_HEADER + nbytes:
                raise UnsafePayload(f"{path} holds {max(0, st.st_size - SHM_HEADER)} bytes of data, the payload claims {nbytes}")
            buf = bytearray(nbytes)
            view, got = memoryview(buf), 0
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], SHM_HEADER + got)
                if n <= 0:
                    raise UnsafePayload(f"{path} ended after {got} of {nbytes} bytes")
                got += n
        finally:
            os.close(fd)
        untyped = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage() if nbytes else torch.UntypedStorage(0)
        if dtype is None:
            return untyped
        return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    def _rebuild_storage_empty(self, cls: Any) -> torch.UntypedStorage:
        if cls not in (_UNTYPED, _TYPED):
            raise UnsafePayload(f"an empty storage must be an UntypedStorage, not {cls!r}")
        return torch.UntypedStorage(0)

    def _rebuild_typed_storage(self, storage: Any, dtype: Any) -> torch.TypedStorage:
        if not isinstance(storage, torch.UntypedStorage):
            raise UnsafePayload("a typed storage must wrap a storage of the payload")
        dtype = self.budget.dtype(dtype)
        if storage.nbytes() % torch.empty((), dtype=dtype).element_size():
            raise UnsafePayload(f"a storage of {storage.nbytes()} bytes does not hold whole {dtype} elements")
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    # ---- tensors --------------------------------------------------------------------------

    def _rebuild_tensor(self, cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
        if cls not in (_TENSOR, _PARAMETER):
            raise UnsafePayload(f"tensors must be torch.Tensor or Parameter, not {cls!r}")
        if not isinstance(storage, torch.TypedStorage):
            raise UnsafePayload("a tensor must be built on a typed storage of the payload")
        if not isinstance(metadata, tuple) or len(metadata) != 4:
            raise UnsafePayload("tensor metadata is (offset, size, stride, requires_grad)")
        offset, size, stride, _requires_grad = metadata
        with warnings.catch_warnings():  # torch deprecates TypedStorage, yet its own reductions still build tensors on them
            warnings.simplefilter("ignore", UserWarning)
            nbytes = storage.nbytes()
        shape, strides, offset = self.budget.tensor(size, stride, offset, storage.dtype, nbytes)
        return torch_reductions.rebuild_tensor(torch.Tensor, storage, (offset, torch.Size(shape), strides, False))

    def _rebuild_cuda_tensor(
        self,
        tensor_cls: Any,
        tensor_size: Any,
        tensor_stride: Any,
        tensor_offset: Any,
        storage_cls: Any,
        dtype: Any,
        storage_device: Any,
        storage_handle: Any,
        storage_size_bytes: Any,
        storage_offset_bytes: Any,
        requires_grad: Any,
        ref_counter_handle: Any,
        ref_counter_offset: Any,
        event_handle: Any,
        event_sync_required: Any,
    ) -> torch.Tensor:
        """torch's `rebuild_cuda_tensor` (a CUDA IPC handle), once the sizes, shape, dtype and the ref counter's segment name are checked."""
        if tensor_cls not in (_TENSOR, _PARAMETER) or storage_cls not in (_UNTYPED, _TYPED):
            raise UnsafePayload("a CUDA tensor must be a torch.Tensor on an UntypedStorage")
        dtype = self.budget.dtype(dtype)
        nbytes = self.budget.storage(storage_size_bytes)
        self.budget.tensor(tensor_size, tensor_stride, tensor_offset, dtype, nbytes)
        if not isinstance(storage_device, int) or isinstance(storage_device, bool) or storage_device < 0:
            raise UnsafePayload(f"CUDA device {storage_device!r} is not a device index")
        if not isinstance(ref_counter_handle, bytes) or not SHM_NAME_RE.match(ref_counter_handle):
            raise UnsafePayload("the CUDA ref counter must be a torch shared-memory segment name")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (storage_offset_bytes, ref_counter_offset)):
            raise UnsafePayload("CUDA storage and ref counter offsets must be non-negative integers")
        if not isinstance(storage_handle, bytes) or not (event_handle is None or isinstance(event_handle, bytes)):
            raise UnsafePayload("CUDA IPC handles must be bytes")
        if not torch.cuda.is_available():
            raise UnsafePayload("this executor has no CUDA device: send host tensors")
        return torch_reductions.rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(_ints(tensor_size, "size")),
            tuple(tensor_stride),
            tensor_offset,
            torch.UntypedStorage,
            dtype,
            storage_device,
            storage_handle,
            nbytes,
            storage_offset_bytes,
            False,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            bool(event_sync_required),
        )


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


def deserialize_named_tensors(payload: str | bytes, *, params: Mapping[str, Any], flattened: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a payload, each a parameter of `params` (the live policy's tensors,
    or their `ParamSpec`s) with its exact shape and a dtype that applies to it losslessly.

    `flattened`: SGLang's "flattened_bucket" format (one 1-D tensor plus per-tensor metadata:
    name, shape, dtype, start and end index).
    """
    specs = param_specs(params)
    budget = _Budget(specs, flattened)
    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayload(f"not base64: {exc}") from None
    try:
        loaded = _TensorsOnly(payload, budget).load()
    except UnsafePayload:
        raise
    except Exception as exc:  # truncated pickle, a sender that is gone, a call with the wrong arguments ...
        raise UnsafePayload(f"cannot load the tensors: {type(exc).__name__}: {exc}") from None
    if flattened:
        return _check_names(_unflatten(loaded, specs), specs)
    if isinstance(loaded, dict):
        loaded = list(loaded.items())
    if not isinstance(loaded, list) or not all(
        isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor) for item in loaded
    ):
        raise UnsafePayload("expected a list of (name, tensor) pairs")
    return _check_names([(name, tensor) for name, tensor in loaded], specs)


def _check_names(named: list[tuple[str, torch.Tensor]], specs: dict[str, ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for name, tensor in named:
        spec = specs.get(name)
        if spec is None:
            raise PolicyMismatch(f"unknown parameter names (not in the policy model): {name[:120]!r}")
        if name in seen:
            raise UnsafePayload(f"{name!r} appears twice")
        seen.add(name)
        if tuple(tensor.shape) != spec.shape:
            raise PolicyMismatch(f"{name!r}: shape {tuple(tensor.shape)} != the policy's {spec.shape}")
        if not _applies(tensor.dtype, spec.dtype):
            raise PolicyMismatch(f"{name!r}: dtype {tensor.dtype} does not apply losslessly to the policy's {spec.dtype}")
    return named


def _unflatten(bucket: Any, specs: dict[str, ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(bucket, dict) or not isinstance(bucket.get("flattened_tensor"), torch.Tensor) or not isinstance(bucket.get("metadata"), list):
        raise UnsafePayload('a "flattened_bucket" payload is {"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata, ...]}')
    flat = bucket["flattened_tensor"]
    out = []
    for meta in bucket["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise UnsafePayload("flattened_bucket metadata entries must be FlattenedTensorMetadata")
        try:
            name, start, end, shape = str(meta.name), int(meta.start_idx), int(meta.end_idx), tuple(_ints(meta.shape, "shape"))
        except (AttributeError, TypeError, ValueError) as exc:
            raise UnsafePayload(f"bad flattened_bucket metadata: {exc}") from None
        spec = specs.get(name)
        if spec is None or shape != spec.shape:
            raise PolicyMismatch(f"flattened_bucket entry {name[:120]!r} of shape {shape} is not a parameter of the policy with that shape")
        if not (0 <= start <= end <= flat.numel()) or math.prod(shape) != end - start:
            raise UnsafePayload(f"flattened_bucket metadata of {name!r} does not fit the flattened tensor ({flat.numel()} elements)")
        if flat.dtype != getattr(meta, "dtype", None):
            raise UnsafePayload(f"{name!r}: metadata says {getattr(meta, 'dtype', None)}, the bucket holds {flat.dtype}")
        out.append((name, flat[start:end].reshape(shape)))
    return out
