"""LoRA adapters inside the paged forward: a row of a batch goes through the base projections, and through its
adapter if it has one (Punica's segmented gathered matmul, SGMV, in plain torch).

Why: when the policy is a LoRA adapter of the serving model, a rollout sequence is one more row in serving's own
batch (co_batched.py): every row reads the base weights once, together, and only the rollout rows add their
adapter's low-rank product, ``y[rows] += scale * (x[rows] @ A^T) @ B^T`` per adapted linear layer. The rows of one
adapter are one segment: one gather, two small matmuls and one scatter-add per segment and linear layer, whatever
the number of rows (``LoraSegments``). A forward whose rows all take one adapter needs no gather at all. (The
two-model mode runs a LoRA policy folded into its own copy of the base instead: weights.py ``MergedAdapterWeights``.)

Who owns what: the ``AdapterBank`` holds the adapter versions resident on the device, each in a *slot*: one stacked
``A`` [slots, rank, in] and ``B`` [slots, out, rank] per adapted (layer, module), allocated once. A new version is
written into a free slot on the caller's thread while forwards read another (double-buffered, as the rollout
process's weight banks); the engine then flips the policy's live slot between iterations, and each ``ForwardItem``
names the slot its rows use. So a swap's pause is a pointer move, and a row never sees half a version.

Beside the policy's own slots, the co-batched mode holds adapters *by name* (``NamedAdapters``, SGLang's
``/load_lora_adapter``): each in a slot of the same bank, named by the requests that run on it (``lora_path``), and
freed only once no request in flight names it, so a slot is never rewritten under a row that reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rose.shared.errors import RoseError
from rose.shared.lora import Adapter, AdapterError, LoraShape, adapter_targets, adapter_tensor_name

from .forward_item import ForwardItem

POLICY_SLOTS = 2  # the live version and the one being written: enough to double-buffer the policy's updates
# Adapters held by name at once (co-batched mode): SGLang's --max-loras-per-batch default (server_args.py), the adapters
# one of its batches can hold; every one is resident here, so one more is refused, never swapped in silently.
NAMED_SLOTS = 8


@dataclass(frozen=True)
class LoraSegments:
    """Which rows of one packed forward take which adapter slot: ``(slot, rows)`` per slot in use, ``rows`` None
    when every row of the forward takes that slot. Empty: no row is adapted (a serving-only forward)."""

    segments: tuple[tuple[int, torch.Tensor | None], ...]

    def __bool__(self) -> bool:
        return bool(self.segments)

    @classmethod
    def of(cls, items: Sequence[ForwardItem], offsets: Sequence[int], device: torch.device) -> LoraSegments:
        """The segments of a forward whose item ``i`` takes packed rows ``offsets[i] ..`` (its new tokens)."""
        slots = {it.adapter for it in items}
        if slots == {None}:
            return NO_LORA
        if len(slots) == 1:
            (slot,) = slots
            assert slot is not None
            return cls(((slot, None),))
        rows: dict[int, list[int]] = {}
        for it, start in zip(items, offsets):
            if it.adapter is not None:
                rows.setdefault(it.adapter, []).extend(range(start, start + len(it.token_ids)))
        return cls(tuple((slot, torch.tensor(r, dtype=torch.long, device=device)) for slot, r in sorted(rows.items())))


NO_LORA = LoraSegments(())


class AdapterBank:
    """Adapter versions of one shape, resident beside one model's base weights, by slot (the module doc)."""

    def __init__(
        self, shape: LoraShape, targets: Mapping[tuple[int, str], tuple[int, int]], *, slots: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        """``targets``: (layer, module) -> (in, out) features of every adapted linear layer."""
        self.shape = shape
        self.scale = shape.scale
        self.slots = slots
        self._a = {key: torch.zeros(slots, shape.rank, fan_in, device=device, dtype=dtype) for key, (fan_in, _) in targets.items()}
        self._b = {key: torch.zeros(slots, fan_out, shape.rank, device=device, dtype=dtype) for key, (_, fan_out) in targets.items()}
        # peft name -> the bank tensor holding it (every slot), for loads and state dicts
        self._by_name = {adapter_tensor_name(layer, module, "A"): self._a[(layer, module)] for layer, module in targets} | {
            adapter_tensor_name(layer, module, "B"): self._b[(layer, module)] for layer, module in targets
        }
        self.version: list[int | None] = [None] * slots  # the policy version each slot holds (None: being written, or empty)

    @classmethod
    def for_adapter(cls, adapter: Adapter, *, slots: int, device: torch.device, dtype: torch.dtype) -> AdapterBank:
        targets = {key: (int(a.shape[1]), int(b.shape[0])) for key, (a, b) in adapter_targets(adapter.tensors).items()}
        return cls(adapter.shape, targets, slots=slots, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """What the bank takes on its device: every slot of every adapted module."""
        return sum(t.numel() * t.element_size() for t in self._by_name.values())

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """AdapterError unless every tensor is one of this adapter's, in its shape: a whole version, or the subset a
        delta changed."""
        for name, tensor in tensors.items():
            held = self._by_name.get(name)
            if held is None:
                raise AdapterError(f"{name!r} is not a tensor of the live adapter (its rank, targets and layers are fixed at load)")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(held.shape[1:]):
                found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise AdapterError(f"{name!r} is {found}, the live adapter's is {tuple(held.shape[1:])}")

    @torch.no_grad()
    def load(self, slot: int, tensors: Mapping[str, torch.Tensor], version: int, base_slot: int | None = None) -> None:
        """Write a version into ``slot``: ``tensors`` over a copy of ``base_slot``'s (a delta names only what changed;
        None: ``tensors`` is the whole version). Checked first (AdapterError): a refused version changes nothing."""
        self.check(tensors)
        if base_slot is None and set(tensors) != set(self._by_name):
            raise AdapterError(f"a whole adapter version names all {len(self._by_name)} tensors, this one {len(tensors)}")
        self.version[slot] = None
        if base_slot is not None and base_slot != slot:
            for held in self._by_name.values():
                held[slot].copy_(held[base_slot])
        for name, tensor in tensors.items():
            self._by_name[name][slot].copy_(tensor)
        self.version[slot] = version

    def state_dict(self, slot: int) -> dict[str, torch.Tensor]:
        """The version in ``slot`` by peft name (views into the bank: read, never write)."""
        return {name: held[slot] for name, held in sorted(self._by_name.items())}

    def add_delta(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor, lora: LoraSegments) -> torch.Tensor:
        """``y`` (the base projection of ``x``, packed rows) plus each segment's adapter product on its rows."""
        a, b = self._a.get((layer, module)), self._b.get((layer, module))
        if a is None or b is None:
            return y  # a module this adapter leaves alone
        for slot, rows in lora.segments:
            if rows is None:
                y = y + F.linear(F.linear(x, a[slot]), b[slot]) * self.scale
            else:
                y = y.index_add(0, rows, F.linear(F.linear(x.index_select(0, rows), a[slot]), b[slot]), alpha=self.scale)
        return y


class NamedAdapterError(RoseError, ValueError):
    """A named adapter that cannot be loaded or found: the name is taken, unknown, or every named slot is in use.
    The message is SGLang's own for the case (sglang_api.py answers it as SGLang does)."""


@dataclass
class NamedAdapter:
    """One adapter loaded by name: its slot, the version label its tokens record, where it came from, and the
    requests in flight that name it (their handles: an unload waits for each result)."""

    name: str
    slot: int
    version: int
    source: str
    users: list[Any] = field(default_factory=list)


class NamedAdapters:
    """Adapters held by name in the policy bank's slots from ``first_slot`` on (the module doc).

    Loaded (``load``), named by requests at submit (``acquire``), then ``unregister``-ed (new requests naming it are
    refused) and ``release``-d once its requests are done, as SGLang's registry unregisters an adapter and then waits
    for the requests that use it before it unloads. A lock guards the names and free slots: ``load`` may run on a
    worker thread (it writes a slot) while the event loop submits."""

    def __init__(self, bank: AdapterBank, first_slot: int) -> None:
        self.bank = bank
        self.capacity = bank.slots - first_slot
        self._free = list(range(first_slot, bank.slots))
        self._loaded: dict[str, NamedAdapter] = {}
        self._lock = threading.Lock()

    def sources(self) -> dict[str, str]:
        """Every loaded name and where its adapter came from (SGLang's ``loaded_adapters``)."""
        with self._lock:
            return {name: entry.source for name, entry in self._loaded.items()}

    def load(self, name: str, adapter: Adapter, version: int, source: str) -> NamedAdapter:
        """Write ``adapter`` into a free slot under ``name``; NamedAdapterError (name taken, no slot) or AdapterError
        (not this bank's shape) leave everything as it was."""
        if adapter.shape != self.bank.shape:
            raise AdapterError(
                f"LoRA adapter {name} is rank {adapter.shape.rank}, alpha {adapter.shape.alpha:g}, targets {list(adapter.shape.targets)}; "
                f"this executor's adapter slots hold rank {self.bank.shape.rank}, alpha {self.bank.shape.alpha:g}, targets "
                f"{list(self.bank.shape.targets)} (the policy's shape): train the adapter in that shape"
            )
        with self._lock:
            if name in self._loaded:
                raise NamedAdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            if not self._free:
                raise NamedAdapterError(
                    f"Cannot load LoRA adapter {name} at path {source}. Maximum number of loaded LoRA adapters is {self.capacity}. "
                    "Please unload some LoRA adapters before loading new ones."
                )
            slot = self._free.pop(0)  # taken before the write: a concurrent load gets another
        try:
            self.bank.load(slot, adapter.tensors, version)  # a free slot: no row reads it
        except Exception:
            with self._lock:
                self._free.insert(0, slot)
            raise
        entry = NamedAdapter(name, slot, version, source)
        with self._lock:
            self._loaded[name] = entry
        return entry

    def acquire(self, name: str, user: Any) -> NamedAdapter:
        """The adapter a request names, counting the request (``user``: its handle) as one that uses it."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is None:
                raise NamedAdapterError(f"no LoRA adapter named {name!r} is loaded here (loaded: {sorted(self._loaded)}): load it first")
            entry.users = [u for u in entry.users if not u.done()]
            entry.users.append(user)
            return entry

    def unregister(self, name: str) -> NamedAdapter:
        """Take ``name`` out: no new request names it; its slot stays until ``release``."""
        with self._lock:
            entry = self._loaded.pop(name, None)
            if entry is None:
                raise NamedAdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self._loaded)}")
            return entry

    def release(self, entry: NamedAdapter) -> None:
        """Free an unregistered adapter's slot (its requests are done: no row reads it)."""
        with self._lock:
            self.bank.version[entry.slot] = None
            self._free.append(entry.slot)
