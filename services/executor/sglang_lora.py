"""The sglang backend's LoRA mode: the policy's versions as named adapters on the one SGLang server that serves.

When the policy is a LoRA adapter of the serving model, one SGLang server (`--enable-lora`) runs both: serving
requests name no adapter (the base), rollout requests name the live version's adapter (`lora_path`). Each policy
version is a peft adapter directory (shared/lora.py ``write_adapter``) that the server loads with
`POST /load_lora_adapter {"lora_name", "lora_path"}` (SGLang's ``LoadLoRAAdapterReqInput``; it answers
``LoRAUpdateOutput`` {success, error_message, loaded_adapters}, 400 when it failed). Version 0 is the policy directory
itself; a later version is written under the staging directory (the server must see the same path, as for
`/update_weights_from_disk`). Once loaded, new rollout requests name it; the previous version is unloaded
(`POST /unload_lora_adapter {"lora_name"}`) once no request in flight names it, so a request never loses its adapter
halfway and each token keeps the version that made it.

Who owns what: ``LoraVersions`` lives on the backend's event loop; the backend's weights lock serialises ``update``;
a rollout job takes the live version at dispatch (``acquire``) and gives it back when it ends (``release``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rose.shared.lora import Adapter, write_adapter

from .sglang_wire import ServerError
from .weights import StagedWeights, WeightUpdateError, checked_version

log = logging.getLogger("rose.executor.sglang")

ADAPTER_PREFIX = "rose-policy"  # the server's name of version N is f"{ADAPTER_PREFIX}-v{N}"

Call = Callable[..., Awaitable[Any]]  # the backend's admin call: (base url, path, JSON body) -> the answer, ServerError on 4xx/5xx


@dataclass(frozen=True)
class AdapterVersion:
    """One policy version as the server holds it: its name there, its version, the directory it was loaded from."""

    name: str
    version: int
    path: Path


class LoraVersions:
    """The policy's adapter versions on one SGLang server (the module doc)."""

    def __init__(self, adapter: Adapter, policy_dir: Path, staging_dir: Path, url: str, call: Call) -> None:
        self.adapter = adapter  # version 0: its shape, base and fingerprint are every version's
        self.mirror: dict[str, torch.Tensor] = dict(adapter.tensors)  # the live version's tensors, by peft name
        self.policy_dir, self.staging_dir, self.url, self._call = policy_dir, staging_dir, url, call
        self.live: AdapterVersion | None = None  # what new rollout requests name (None: nothing loaded yet)
        self._users: dict[str, int] = {}  # name -> rollout requests in flight that name it
        self._retired: dict[str, AdapterVersion] = {}  # replaced, unloaded once its last request ends
        self._unloads: set[asyncio.Task] = set()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.mirror)

    def loaded(self) -> list[str]:
        """The names this backend holds on the server now: the live one, and replaced ones still in use."""
        return ([self.live.name] if self.live else []) + sorted(self._retired)

    # ---- versions
    def stage(self, state: dict[str, torch.Tensor], version: int) -> StagedWeights:
        """The whole adapter of ``version``: ``state`` (every tensor, or the ones a delta changed) over the live one's.
        WeightUpdateError, nothing changed, for a state that is not this adapter's. An empty state is a version that
        changed no weight: ``update`` then only relabels the live adapter."""
        if not state:
            return StagedWeights({}, checked_version(version))
        checked_version(version)
        unknown = sorted(set(state) - set(self.mirror))
        if unknown:
            raise WeightUpdateError(f"not tensors of the policy's adapter (its rank, targets and layers are fixed): {unknown[:5]}")
        bad = [
            f"{name}: {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} != {tuple(self.mirror[name].shape)}"
            for name, t in state.items()
            if not isinstance(t, torch.Tensor) or t.shape != self.mirror[name].shape
        ]
        if bad:
            raise WeightUpdateError("state dict does not match the policy's adapter: " + "; ".join(bad[:5]))
        changed = {n: t.detach().to("cpu", self.mirror[n].dtype, copy=True).contiguous() for n, t in state.items()}
        return StagedWeights({**self.mirror, **changed}, version)

    async def load_first(self) -> None:
        """Load version 0 (the policy directory) unless a version is live already."""
        if self.live is not None:
            return
        first = AdapterVersion(f"{ADAPTER_PREFIX}-v0", 0, self.policy_dir)
        await self._load(first)
        if self.live is None:
            self.live = first
        else:  # a newer version went live while this one loaded
            self._retired[first.name] = first
            self._unload_if_unused(first.name)

    async def update(self, staged: StagedWeights) -> float:
        """Write the staged version as an adapter directory, load it, make it the live one; the milliseconds the
        server's load took (its scheduler loads between batches). ServerError, aiohttp's errors, OSError: the live
        version stays. A version that changed no weight (no tensor staged) is the live adapter under the new label:
        nothing written or loaded, later requests record the new version, those in flight keep theirs."""
        tensors, version = staged.tensors, staged.version
        if not tensors:
            if self.live is None:
                raise ServerError(self.url, 0, f"version {version} changed no weight, and no adapter is loaded on the server to relabel")
            self.live = replace(self.live, version=version)
            log.info("policy version %d changed no weight: adapter %s on %s now carries its label", version, self.live.name, self.url)
            return 0.0
        target = AdapterVersion(f"{ADAPTER_PREFIX}-v{version}", version, self.staging_dir / f"v{version}")
        await asyncio.to_thread(self._write, target.path, tensors)
        started = time.perf_counter()
        try:
            await self._load(target)
        except BaseException:
            shutil.rmtree(target.path, ignore_errors=True)
            raise
        pause_ms = (time.perf_counter() - started) * 1000.0
        previous, self.live, self.mirror = self.live, target, tensors
        if previous is not None and previous.name != target.name:
            self._retired[previous.name] = previous
            self._unload_if_unused(previous.name)
        log.info("policy version %d's adapter %s loaded on %s in %.1f ms; rollout requests name it now", version, target.name, self.url, pause_ms)
        return pause_ms

    def _write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        if path.exists():
            shutil.rmtree(path)
        a = self.adapter
        write_adapter(path, Adapter(shape=a.shape, tensors=tensors, base=a.base, base_fingerprint=a.base_fingerprint))

    async def _load(self, target: AdapterVersion) -> None:
        body = {"lora_name": target.name, "lora_path": str(target.path)}
        try:
            reply = await self._call(self.url, "/load_lora_adapter", body)
        except ServerError as exc:
            if "already loaded" not in exc.message and "already exists" not in exc.message:
                raise
            # left by an earlier run of this executor (a name is a version): the server's copy may not be this one
            log.info("SGLang server %s already holds %s: unloading it and loading %s", self.url, target.name, target.path)
            await self._call(self.url, "/unload_lora_adapter", {"lora_name": target.name})
            reply = await self._call(self.url, "/load_lora_adapter", body)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise ServerError(self.url + "/load_lora_adapter", 200, str(reply.get("error_message") or reply))

    # ---- requests
    def acquire(self) -> AdapterVersion:
        """The version a rollout request names now, counted in use until ``release``."""
        if self.live is None:
            raise ServerError(self.url, 0, "the policy's adapter is not loaded on the server (its load failed: see the log)")
        self._users[self.live.name] = self._users.get(self.live.name, 0) + 1
        return self.live

    def release(self, version: AdapterVersion) -> None:
        self._users[version.name] -= 1
        self._unload_if_unused(version.name)

    def _unload_if_unused(self, name: str) -> None:
        if name in self._retired and not self._users.get(name):
            self._users.pop(name, None)
            task = asyncio.get_running_loop().create_task(self._unload(self._retired.pop(name)), name=f"sglang-unload-{name}")
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, old: AdapterVersion, drop_files: bool = True) -> None:
        try:
            await self._call(self.url, "/unload_lora_adapter", {"lora_name": old.name})
        except Exception as exc:  # the server keeps a stale adapter: logged, the live version is unaffected
            log.warning("could not unload %s from %s: %s", old.name, self.url, exc)
            return
        if drop_files and old.path != self.policy_dir:
            shutil.rmtree(old.path, ignore_errors=True)
        log.info("policy version %d's adapter %s unloaded from %s", old.version, old.name, self.url)

    async def unload_all(self) -> None:
        """The executor stops: every adapter it holds on the server is unloaded (its requests were aborted first)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)
        held = [v for v in [self.live, *self._retired.values()] if v is not None]
        self.live, self._retired = None, {}
        await asyncio.gather(*(self._unload(v, drop_files=False) for v in held))
