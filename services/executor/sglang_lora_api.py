"""SGLang's LoRA adapter API on the co-batched executor: `/load_lora_adapter`, `/unload_lora_adapter` and `lora_path` on
`/generate`, answered as SGLang answers them, so a client of an SGLang server started with `--enable-lora` (the sglang
backend's LoRA mode among them, sglang_backend.py) drives this executor unchanged.

We follow SGLang's source (sgl-project/sglang):
- `python/sglang/srt/entrypoints/http_server.py` at 0025436e: both routes answer the update's result, 200 when
  `success`, else 400.
- `python/sglang/srt/managers/io_struct.py` at 001067ff: the bodies `LoadLoRAAdapterReqInput` {lora_name, lora_path,
  pinned, lora_id} and `UnloadLoRAAdapterReqInput` {lora_name, lora_id}, and the answer `LoRAUpdateOutput` {success,
  error_message, loaded_adapters}, `loaded_adapters` mapping each loaded name to its path (lora_manager.py's
  `create_lora_update_result`).
- `python/sglang/srt/managers/tokenizer_communicator_mixin.py` at 00096b5f: a load is registered only once it
  succeeded; an unload first unregisters the name (new requests naming it are refused), waits until no request in
  flight uses it, then unloads, so an unload of a name in use succeeds once those requests are done; without
  `--enable-lora` both are refused ("LoRA is not enabled"); one load or unload at a time (`lora_update_lock`).
- `python/sglang/srt/lora/lora_registry.py` at 0270cffc: unloading an unknown name is "LoRA with name X does not exist".
- `test/srt/lora/test_lora_update.py` at 0db36366, SGLang's own server test (replayed in
  tests/executor/test_sglang_lora_endpoints.py): a name loaded twice is a 400 saying "already loaded"; `/generate`
  naming an adapter never loaded is a 400 saying "never been loaded"; an adapter loaded once and unloaded since is
  loaded again from its path when a request names it (`lora_ref_cache`); `lora_path` is one name for every prompt or a
  list of one name (or null) per prompt.

What `/generate` without `lora_path` runs is a setting, `sglang_api.generate_without_lora`, never a silent difference:
"policy" (the default) keeps the meaning slime, verl and AReaL rely on, the policy's live adapter as rollout work
under the lease; "base" is SGLang's own meaning, the base model (the serving model) as serving work. Either way the
policy is also loaded under its served name (`weights.model`): `lora_path` = that name runs the policy's live version
(it follows the policy's versions and is never unloaded), and `loaded_adapters` lists it.

What differs from SGLang, on purpose:
- Every loaded adapter stays resident, in a slot of the policy's adapter bank (adapters.py): `NAMED_SLOTS` of them
  (SGLang's `--max-loras-per-batch` default); one more is refused (400, SGLang's `--max-loaded-loras` words), never
  evicted behind a request. `pinned` is accepted: every adapter here is.
- An adapter must be a LoRA adapter of this executor's serving model (its fingerprint, shared/lora.py) in the policy's
  shape (rank, alpha, targets); else the load is a 400 that says which.
- Tokens of a named adapter record version 0 in `meta_info.rose_token_versions` (SGLang's adapters carry no version).
- In the two-model mode (a full-weight policy) there are no adapters: a load, an unload or a `lora_path` is a 400
  naming the parameter and saying why.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from safetensors import SafetensorError

from rose.shared.errors import RoseError
from rose.shared.lora import read_adapter
from rose.shared.openai_api import ApiError

from .adapters import NamedAdapterError
from .protocol import WorkClass

if TYPE_CHECKING:
    from .sglang_api import SGLangApi


class SGLangSettingsError(RoseError, ValueError):
    """The SGLang API's settings do not fit this executor (``generate_without_lora = "base"`` without a base to run)."""


@dataclass(frozen=True)
class Target:
    """Where one `/generate` prompt runs: its work class, and the named adapter its rows take (None: the class's own
    weights: rollout runs the policy's live version, serving the serving model)."""

    work_class: WorkClass
    lora: str | None = None


POLICY = Target(WorkClass.ROLLOUT)
BASE = Target(WorkClass.SERVING)


class LoraRoutes:
    """The adapter endpoints and `lora_path` resolution of one ``SGLangApi`` (the module doc)."""

    def __init__(self, api: SGLangApi) -> None:
        self.api = api
        self.named = api.engine.named_adapters  # None: the two-model mode, no adapters
        if api.settings.generate_without_lora == "base" and self.named is None:
            raise SGLangSettingsError(
                'sglang_api.generate_without_lora = "base" runs the base model of a LoRA policy, which this executor does not have '
                '(its policy is a model of its own, engine.rollout_mode = "two_model"): set it to "policy", or run a LoRA policy of '
                'the serving model with engine.rollout_mode = "co_batched"'
            )
        self.unnamed = BASE if api.settings.generate_without_lora == "base" else POLICY  # what a request without lora_path runs
        self._paths: dict[str, str] = {}  # every adapter loaded here once, by name: its path (SGLang's lora_ref_cache)
        self._lock = asyncio.Lock()  # one load or unload at a time (SGLang's lora_update_lock)

    def mount(self, app: web.Application) -> None:
        app.add_routes([web.post("/load_lora_adapter", self.load_lora_adapter), web.post("/unload_lora_adapter", self.unload_lora_adapter)])

    def loaded(self) -> dict[str, str]:
        """Every name a request may give as `lora_path`, with its adapter's path: the policy's own first."""
        if self.named is None:
            return {}
        return {self.api.served_name: self.api.model_dir, **self.named.sources()}

    def server_args(self) -> dict[str, Any]:
        """SGLang's LoRA server arguments as they apply here (the policy's slot counts with the named ones)."""
        slots = self.named.capacity + 1 if self.named is not None else 0
        return {"enable_lora": self.named is not None, "max_loras_per_batch": slots, "max_loaded_loras": slots}

    # ---- /generate -----------------------------------------------------------------------

    async def targets(self, lora_path: Any, prompts: int) -> list[Target]:
        """Where each of a request's ``prompts`` runs, from its `lora_path` (before `n` copies them)."""
        if lora_path is None:
            return [self.unnamed] * prompts
        if isinstance(lora_path, str):
            names: list[str | None] = [lora_path] * prompts
        elif isinstance(lora_path, list) and len(lora_path) == prompts and all(p is None or isinstance(p, str) for p in lora_path):
            names = list(lora_path)
        else:
            raise ApiError(400, f"`lora_path` must be an adapter's name, or a list of {prompts} names (or nulls), one per prompt", param="lora_path")
        return [self.unnamed if not name else await self._target(name) for name in names]

    async def _target(self, name: str) -> Target:
        if self.named is None:
            raise ApiError(400, self._not_enabled("a request names no adapter here: leave lora_path out"), param="lora_path")
        if name == self.api.served_name:
            return POLICY
        if name not in self.named.sources():
            path = self._paths.get(name)
            if path is None:
                raise ApiError(
                    400, f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {sorted(self.loaded())}.", param="lora_path"
                )
            failure = await self._load(name, path)  # SGLang loads an unloaded adapter again when a request names it
            if failure is not None and "already loaded" not in failure:
                raise ApiError(400, f"Failed to implicitly load LoRA adapter {name}: {failure}", param="lora_path")
        return Target(WorkClass.ROLLOUT, name)

    # ---- load / unload ---------------------------------------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        api = self.api
        api._admin(request)
        body = await api._optional_body(request)
        name, path = api._field(body, "lora_name", str, ""), api._field(body, "lora_path", str, "")
        api._field(body, "pinned", bool, False)  # accepted: every adapter here stays resident until unloaded
        if self.named is None:
            raise ApiError(400, self._not_enabled("no adapter can be loaded"), param="lora_path")
        if not name:
            raise ApiError(400, "`lora_name` is required: the name requests give as lora_path", param="lora_name")
        if not path:
            raise ApiError(400, "`lora_path` is required: a directory with a peft LoRA adapter of this executor's serving model", param="lora_path")
        if name == api.served_name:
            return self._answer(f"Failed to load LoRA adapter {name} because it is already loaded (it is this executor's policy)")
        return self._answer(await self._load(name, path))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        api = self.api
        api._admin(request)
        body = await api._optional_body(request)
        name = api._field(body, "lora_name", str, "")
        if self.named is None:
            raise ApiError(400, self._not_enabled("no adapter is loaded"), param="lora_name")
        if not name:
            raise ApiError(400, "`lora_name` is required: the name the adapter was loaded under", param="lora_name")
        if name == api.served_name:
            return self._answer(f"LoRA adapter {name} is this executor's policy: it follows the policy's versions and is never unloaded")
        async with self._lock:
            try:
                await api.engine.unload_adapter(name)  # waits for the requests in flight that name it
            except NamedAdapterError as exc:
                return self._answer(str(exc))
        return self._answer(None)

    async def _load(self, name: str, path: str) -> str | None:
        """Read and load one adapter; SGLang's failure message, or None once it is loaded."""
        async with self._lock:
            try:
                adapter = await asyncio.to_thread(read_adapter, path)
                await asyncio.to_thread(self.api.engine.load_adapter, name, adapter, source=path)
            except (ValueError, OSError, SafetensorError) as exc:  # AdapterError, NamedAdapterError: nothing was loaded
                return f"Failed to load LoRA adapter {name} from {path}: {exc}" if "already loaded" not in str(exc) else str(exc)
        self._paths[name] = path
        return None

    def _answer(self, failure: str | None) -> web.Response:
        """SGLang's `LoRAUpdateOutput`: 200 when it succeeded, 400 with its message when not."""
        body = {"success": failure is None, "error_message": failure or "", "loaded_adapters": self.loaded()}
        return web.json_response(body, status=200 if failure is None else 400)

    def _not_enabled(self, consequence: str) -> str:
        return (
            f"LoRA is not enabled on this executor: {consequence}. Its policy is a model of its own (engine.rollout_mode = "
            '"two_model"); named adapters ride in serving\'s batches, which needs engine.rollout_mode = "co_batched" and a policy '
            "that is a LoRA adapter of the serving model (SGLang: --enable-lora)"
        )
