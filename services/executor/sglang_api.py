"""SGLang's RL admin API on our executor, so RL frameworks written against SGLang drive ROSE unchanged.

We follow the HTTP surface of SGLang 0.5.3 (`python/sglang/srt/entrypoints/http_server.py` at
commit 0025436e, request structs of `managers/io_struct.py` at 001067ff for the pause modes and
`managers/tokenizer_manager.py` for the response shapes). What slime, verl and AReaL call:
`/generate`, `/pause_generation` (abort | retract | in_place), `/continue_generation`,
`/update_weights_from_tensor`, `/update_weights_from_disk`, `/get_weight_version`,
`/update_weight_version`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/flush_cache`, `/abort_request`, `/get_model_info`, `/get_server_info`, `/get_weights_by_name`,
`/health_generate`,
and the `sglang:*` Prometheus metrics on `/metrics` (sglang_metrics.py). In the co-batched mode (the policy a LoRA
adapter of the serving model) also SGLang's adapter API: `/load_lora_adapter`, `/unload_lora_adapter` and `lora_path`
on `/generate` (sglang_lora_api.py: the SGLang source it follows, and what `/generate` without `lora_path` runs).

An SGLang server runs one model; these endpoints run the executor's *policy* model as rollout
work: `/generate` requests queue like any rollout and run only under the executor's lease (a
dedicated executor holds a standing one), yielding to serving traffic within a quantum (a request
naming an adapter, `lora_path`, runs that adapter the same way; one that runs the base, with
`sglang_api.generate_without_lora = "base"`, is serving work). What differs from SGLang, on purpose:
- Admin endpoints (everything that changes weights, pauses, memory, caches or aborts) need
  `Authorization: Bearer <sglang_api.admin_api_key>`; with no key set they are refused (403)
  unless `sglang_api.allow_unauthenticated_admin` (SGLang leaves them open by default). A client
  whose key is unset sends `Bearer None` (slime's external-engine mode does): with no admin key
  and `allow_unauthenticated_admin` that header is ignored; with a key set it is a 401 saying so.
- Weight pushes over HTTP are refused (409) while the executor follows the policy's signed
  versions on the bus (`weights.follow`): one source of weights at a time.
- `/update_weights_from_tensor` unpickles only torch tensors (see sglang_tensors.py).
- No input-token logprobs, top-logprobs, penalties, constrained decoding or images: asking for
  them is a 400 that names the parameter, never a silently different answer (`image_data` /
  `video_data` / `audio_data` entries that are null mean "no image", as in SGLang: accepted).
- Memory tags: `kv_cache` and `weights` are released and resumed; `cuda_graph` is never released
  (the captured graphs stay resident), so resuming it is already done (200) and releasing it
  alone is a 400 naming `tags`.
- A weight update does not wait for in-flight requests: it lands between quanta and each
  token records the version that sampled it (SGLang's writer lock waits for them).
"""

from __future__ import annotations

import asyncio
import glob
import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from aiohttp import web

from rose.shared.http_server import read_body, same_secret
from rose.shared.lora import Adapter
from rose.shared.openai_api import ApiError, unicode_text

from . import http_api
from .adapters import NamedAdapters
from .backend import CoServingEngine
from .batcher import Batcher
from .config import SGLangApiSettings
from .http_api import MODEL_CARDS
from .outputs import RequestHandle
from .policy_updates import PolicyUpdates
from .protocol import MAX_TOP_LOGPROBS, EngineSampling, GenerationRequest, GenerationResult, InvalidRequest, RolloutRejected, WorkClass
from .rollout_control import RolloutControl
from .sglang_lora_api import LoraRoutes
from .sglang_metrics import GAUGES, observe_finished
from .sglang_tensors import PolicyMismatch, UnsafePayload, deserialize_named_tensors
from .weights import WeightUpdateError

SGLANG_VERSION = "0.5.3"  # the SGLang HTTP surface these endpoints follow
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
LEASE_POLL_S = 0.02
# sampling_params keys accepted with no effect here (text formatting of special tokens, SGLang plug-ins)
IGNORED_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "custom_params", "stream_interval", "logit_bias"}
# accepted only at their neutral value: anything else asks for a feature this engine does not have
NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
}
MEMORY_TAGS_KEPT = ("cuda_graph",)  # SGLang memory tags this executor never releases (always resident)
UNSET_KEY_TOKEN = "None"  # what `f"Bearer {api_key}"` sends when the client's api_key is None (slime's external mode)
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass(frozen=True)
class OutputOptions:
    """How a /generate answer is shaped (what the request asked for)."""

    return_logprob: bool
    text_in_logprobs: bool
    no_stop_trim: bool
    sampling: EngineSampling


@runtime_checkable
class SGLangServable(CoServingEngine, Protocol):
    """An engine this API can front: a co-serving engine that also offers SGLang-style rollout control
    (``control``: pause, abort, flush, memory), its rollout batch to read (``work_for``: queue lengths, pool,
    batch limit), adapters held by name (co-batched mode), and the liveness of its lanes. Our own engine
    (engine.Engine) is one."""

    control: RolloutControl
    named_adapters: NamedAdapters | None  # adapters held by name (co-batched mode), else None

    def work_for(self, work_class: WorkClass) -> Batcher: ...

    def load_adapter(self, name: str, adapter: Adapter, *, version: int = 0, source: str = "") -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    @property
    def lanes_alive(self) -> bool: ...

    @property
    def holds_rollout_lease(self) -> bool: ...


class SGLangApi:
    def __init__(
        self,
        engine: SGLangServable,
        settings: SGLangApiSettings,
        *,
        model_dir: str,
        served_name: str,
        follows_bus_weights: bool,
        executor_id: str = "",
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.model_dir = model_dir
        self.served_name = served_name
        self.follows_bus_weights = follows_bus_weights
        self.executor_id = executor_id
        self.tokenizer = engine.tokenizer_for(WorkClass.ROLLOUT)  # (co-batched: the serving model's, the base's)
        self.updates = PolicyUpdates(engine)
        self.active: dict[str, RequestHandle] = {}  # rid -> handle of this API's /generate requests
        self._label: tuple[int, str] | None = None  # (policy version it names, weight_version label)
        self._weights_lock = asyncio.Lock()
        self._prompt_tokens = 0  # of finished /generate requests (sglang:cache_hit_rate)
        self._cached_tokens = 0
        self._throughput_mark = (time.monotonic(), engine.metrics.rollout_tokens_total)  # (when, tokens) of the last scrape
        self.lora = LoraRoutes(self)  # the adapter endpoints and what a request's lora_path runs (sglang_lora_api.py)
        GAUGES.apis.add(self)

    def model_card(self) -> dict[str, Any]:
        """The policy model as `/v1/models` lists it: its name, and the path its weights came from (as `/get_model_info`)."""
        return {
            "id": self.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "rose-policy",
            "root": self.model_dir,
            "parent": None,
            "max_model_len": self.engine.max_positions(WorkClass.ROLLOUT),
        }

    def mount(self, app: web.Application) -> None:
        if MODEL_CARDS in app:
            app[MODEL_CARDS].append(self.model_card)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.put("/generate", self.generate),
                web.post("/pause_generation", self.pause_generation),
                web.post("/continue_generation", self.continue_generation),
                web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
                web.post("/update_weights_from_disk", self.update_weights_from_disk),
                web.get("/get_weight_version", self.get_weight_version),
                web.route("*", "/get_weights_by_name", self.get_weights_by_name),
                web.post("/update_weight_version", self.update_weight_version),
                web.route("*", "/release_memory_occupation", self.release_memory_occupation),
                web.route("*", "/resume_memory_occupation", self.resume_memory_occupation),
                web.route("*", "/flush_cache", self.flush_cache),
                web.post("/abort_request", self.abort_request),
                web.get("/get_model_info", self.get_model_info),
                web.get("/get_server_info", self.get_server_info),
                web.get("/health_generate", self.health_generate),
            ]
        )
        self.lora.mount(app)

    # ---- helpers -------------------------------------------------------------------------

    def _admin(self, request: web.Request) -> None:
        key = self.settings.admin_api_key
        if key:
            sent = request.headers.get("Authorization", "")
            token = sent[7:] if sent.startswith("Bearer ") else request.headers.get("x-api-key", "")
            if not same_secret(token, key):
                hint = (
                    (
                        " (the client sent `Bearer None`: its api key is unset, as in slime's external-engine mode; give it the key, or run this "
                        "executor with no admin key and sglang_api.allow_unauthenticated_admin = true on a private address)"
                    )
                    if token == UNSET_KEY_TOKEN
                    else ""
                )
                raise ApiError(
                    401,
                    "Unauthorized: admin endpoints need `Authorization: Bearer <sglang_api.admin_api_key>`" + hint,
                    param="Authorization",
                    code="unauthorized",
                )
        elif not self.settings.allow_unauthenticated_admin:
            raise ApiError(
                403,
                f"{request.path} is an admin endpoint and this executor has no admin key: set sglang_api.admin_api_key "
                "(ROSE_SGLANG_API__ADMIN_API_KEY) and send it as a Bearer token, or sglang_api.allow_unauthenticated_admin = true",
                code="forbidden",
            )

    @staticmethod
    async def _optional_body(request: web.Request) -> dict[str, Any]:
        """The JSON object body, or {} when there is none (several endpoints take an empty POST)."""
        raw = await read_body(request)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to parse") from None
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    @staticmethod
    def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
        value = body.get(name, default)
        if value is None:
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,))):
            raise ApiError(400, f"`{name}` has the wrong type: {type(value).__name__}", param=name)
        return value

    def weight_version(self) -> str:
        label = self._label
        version = self.engine.policy_version
        return label[1] if label is not None and label[0] == version else str(version)

    def scheduler_state(self) -> dict[str, Any]:
        running, queued = self.engine.work_for(WorkClass.ROLLOUT).queue_lengths()  # a scrape may be a little stale
        pool = self.engine.work_for(WorkClass.ROLLOUT).pool
        return {
            "num_running_reqs": running,
            "num_queue_reqs": queued,
            "token_usage": pool.used_blocks / pool.num_blocks if pool.num_blocks else 0.0,
            "num_used_tokens": pool.used_blocks * pool.block_size,
        }

    def gen_throughput(self) -> float:
        """Rollout tokens per second since the previous call (one call per scrape)."""
        now, tokens = time.monotonic(), self.engine.metrics.rollout_tokens_total
        then, before = self._throughput_mark
        self._throughput_mark = (now, tokens)
        return (tokens - before) / (now - then) if now > then else 0.0

    def cache_hit_rate(self) -> float:
        return self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    # ---- /generate -----------------------------------------------------------------------

    def _sampling(self, params: Any) -> tuple[EngineSampling, bool]:
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ApiError(400, "`sampling_params` must be an object", param="sampling_params")
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "sampling_seed", "n", "no_stop_trim"}
        unknown = sorted(set(params) - known - IGNORED_SAMPLING_KEYS - set(NEUTRAL_SAMPLING))
        if unknown:
            raise ApiError(400, f"unknown sampling_params {unknown}: supported are {sorted(known)}", param="sampling_params")
        for key, neutral in NEUTRAL_SAMPLING.items():
            if params.get(key) is not None and params[key] != neutral:
                raise ApiError(
                    400, f"sampling_params.{key} = {params[key]!r} is not supported by this engine (only {neutral!r})", param="sampling_params"
                )
        stop = params.get("stop")
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else None
        if stops is None:
            raise ApiError(400, "sampling_params.stop must be a string or a list of strings", param="sampling_params")
        stop_ids = params.get("stop_token_ids") or ()
        if not isinstance(stop_ids, (list, tuple)):
            raise ApiError(400, "sampling_params.stop_token_ids must be a list of token ids", param="sampling_params")
        max_new = params.get("max_new_tokens")
        temperature = params.get("temperature")
        top_p, top_k = params.get("top_p"), params.get("top_k")
        sampling = EngineSampling(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=-1 if top_k is None else top_k,
            max_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
            stop=stops,
            stop_token_ids=tuple(stop_ids),
            seed=params.get("sampling_seed"),
            ignore_eos=bool(params.get("ignore_eos", False)),
        )
        try:
            sampling.validate()
        except InvalidRequest as exc:
            raise ApiError(400, f"sampling_params: {exc}", param="sampling_params") from None
        return sampling, bool(params.get("no_stop_trim", False))

    def _prompts(self, body: dict[str, Any]) -> tuple[list[tuple[int, ...]], bool]:
        """Token ids of each prompt, and whether the request was a batch."""
        text, ids = body.get("text"), body.get("input_ids")
        if text is not None and ids is not None:
            raise ApiError(400, "send either `text` or `input_ids`, not both", param="input_ids")
        if body.get("input_embeds") is not None:
            raise ApiError(400, "only text prompts are supported: `input_embeds` is not", param="input_embeds")
        for media in ("image_data", "video_data", "audio_data"):
            if not _all_null(body.get(media)):  # verl sends `[null, ...]` for text prompts: null means none, as in SGLang
                raise ApiError(400, f"only text prompts are supported: `{media}` must be null or a list of nulls", param=media)
        if text is not None:
            if isinstance(text, str):
                texts, batch = [text], False
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                texts, batch = text, True
            else:
                raise ApiError(400, "`text` must be a string or a non-empty list of strings", param="text")
            out = []
            for i, t in enumerate(texts):
                if not t:
                    raise ApiError(400, "`text` is empty: send some text", param="text")
                out.append(tuple(self.tokenizer.encode(unicode_text(t, f"text[{i}]"), add_special_tokens=False)))
            return out, batch
        if ids is None:
            raise ApiError(400, "Either text or input_ids should be provided.", param="input_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return [tuple(ids)], False
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in ids)
        ):
            return [tuple(p) for p in ids], True
        raise ApiError(400, "input_ids cannot be empty: send a list of token ids (or a list of such lists for a batch)", param="input_ids")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._optional_body(request)
        prompts, batch = self._prompts(body)
        sampling, no_stop_trim = self._sampling(body.get("sampling_params"))
        n = self._field(body.get("sampling_params") or {}, "n", int, 1)
        if n < 1:
            raise ApiError(400, "sampling_params.n must be >= 1", param="sampling_params")
        targets = [t for t in await self.lora.targets(body.get("lora_path"), len(prompts)) for _ in range(n)]
        prompts = [p for p in prompts for _ in range(n)]
        batch = batch or n > 1
        return_logprob = bool(self._field(body, "return_logprob", bool, False))
        logprob_start = self._field(body, "logprob_start_len", int, -1)
        if logprob_start != -1 and any(logprob_start < len(p) for p in prompts):
            raise ApiError(
                400, "input-token logprobs are not supported: use logprob_start_len = -1 (output logprobs only)", param="logprob_start_len"
            )
        if self._field(body, "top_logprobs_num", int, 0):
            raise ApiError(
                400,
                "top_logprobs_num is not supported on /generate: only the sampled token's logprob is returned (the OpenAI API "
                f"on the serving model returns up to {MAX_TOP_LOGPROBS} alternatives)",
                param="top_logprobs_num",
            )
        if body.get("token_ids_logprob"):
            raise ApiError(400, "token_ids_logprob is not supported: only the sampled token's logprob is returned", param="token_ids_logprob")
        text_in_logprobs = bool(self._field(body, "return_text_in_logprobs", bool, False))
        stream = bool(self._field(body, "stream", bool, False))
        if stream and batch:
            raise ApiError(400, "streaming a batch is not supported: send one streaming request per prompt", param="stream")
        self._field(body, "priority", int, 0)  # accepted: rollout work runs below serving whatever its priority
        rids = self._rids(body.get("rid"), len(prompts), batch)
        waiting = self.scheduler_state()["num_queue_reqs"]
        if waiting + len(prompts) > self.settings.max_waiting_requests:
            raise ApiError(
                503,
                f"{waiting} rollout requests are already waiting (sglang_api.max_waiting_requests = {self.settings.max_waiting_requests}): retry "
                "later",
                code="overloaded",
            )
        if any(t.work_class is WorkClass.ROLLOUT for t in targets):
            await self._await_lease()
        handles = []
        try:
            for rid, prompt, target in zip(rids, prompts, targets):
                engine_request = GenerationRequest(
                    request_id=rid, work_class=target.work_class, prompt_token_ids=prompt, sampling=sampling, stream=stream, lora=target.lora
                )
                handles.append(self.engine.submit(engine_request, require_lease=False))
                self.active[rid] = handles[-1]
        except InvalidRequest as exc:
            self._abandon(handles)
            raise ApiError(400, str(exc), param=exc.param) from None
        except RolloutRejected as exc:
            self._abandon(handles)
            raise ApiError(503, f"this executor runs no rollout now ({exc})", code=exc.reason) from None
        started = time.monotonic()
        options = OutputOptions(return_logprob, text_in_logprobs, no_stop_trim, sampling)
        try:
            if stream:
                return await self._stream(request, handles[0], prompts[0], started, options)
            results = await asyncio.gather(*(h.result() for h in handles))
        except asyncio.CancelledError:
            self._abandon(handles)  # the client left: free the engine's slots
            raise
        finally:
            for rid in rids:
                self.active.pop(rid, None)
        outs = [self._output(r, p, started, options) for r, p in zip(results, prompts)]
        for r, p in zip(results, prompts):
            self._observe(r, len(p), started)
        return web.json_response(outs if batch else outs[0])

    async def _await_lease(self) -> None:
        """Wait (bounded) until this executor may run rollout; queued requests then survive a revoke."""
        if not self.engine.policy.admits_rollout:
            raise ApiError(503, f"this executor runs no rollout (policy {self.engine.policy.name})", code="no_rollout")
        deadline = time.monotonic() + self.settings.lease_wait_s
        while not self.engine.holds_rollout_lease:
            if time.monotonic() >= deadline:
                raise ApiError(
                    503,
                    f"no rollout lease on this executor within {self.settings.lease_wait_s:g} s: a serving executor lends "
                    "to rollout only while its SLO allows; retry, or send rollout to a dedicated executor",
                    code="no_lease",
                )
            await asyncio.sleep(LEASE_POLL_S)

    def _rids(self, rid: Any, count: int, batch: bool) -> list[str]:
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(count)]
        elif isinstance(rid, str) and rid:
            rids = [rid] if not batch else [f"{rid}_{i}" for i in range(count)]
        elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) and r for r in rid):
            rids = list(rid)
        else:
            raise ApiError(400, f"`rid` must be a non-empty string or a list of {count} strings", param="rid")
        clash = [r for r in rids if r in self.active] + ([r for r in rids if rids.count(r) > 1])
        if clash:
            raise ApiError(400, f"duplicate request id(s) {sorted(set(clash))[:3]}: a request with this rid is still running", param="rid")
        return rids

    def _abandon(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            handle.cancel()
            self.active.pop(handle.request_id, None)

    async def _stream(
        self, request: web.Request, handle: RequestHandle, prompt: tuple[int, ...], started: float, options: OutputOptions
    ) -> web.StreamResponse:
        """SGLang's default stream: every event carries the whole output so far (text, ids, logprobs)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        async for delta in handle:
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            text += delta.text
            if delta.finished:
                break
            meta = self._meta(handle.request_id, None, len(prompt), len(ids), 0, ids, logprobs, options)
            await response.write(b"data: " + json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode() + b"\n\n")
        result = await handle.result()
        self._observe(result, len(prompt), started)
        await response.write(b"data: " + json.dumps(self._output(result, prompt, started, options)).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def _output(self, result: GenerationResult, prompt: tuple[int, ...], started: float, options: OutputOptions) -> dict[str, Any]:
        ids = list(result.token_ids)
        full = self.tokenizer.decode(ids, skip_special_tokens=True) if (options.no_stop_trim or result.finish_reason == "stop") else result.text
        finish = self._finish_reason(result, options.sampling, full)
        meta = self._meta(result.request_id, finish, len(prompt), len(ids), result.prefix_cached_tokens, ids, list(result.logprobs), options)
        meta["e2e_latency"] = time.monotonic() - started
        meta["rose_token_versions"] = list(result.token_versions)  # which policy version sampled each token
        return {"text": full if options.no_stop_trim else result.text, "output_ids": ids, "meta_info": meta}

    def _meta(
        self,
        rid: str,
        finish: dict | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached: int,
        ids: list[int],
        logprobs: list[float],
        options: OutputOptions,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached,
            "weight_version": self.weight_version(),
        }
        if options.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, t, self.tokenizer.decode([t]) if options.text_in_logprobs else None] for lp, t in zip(logprobs, ids)
            ]
        return meta

    def _finish_reason(self, result: GenerationResult, sampling: EngineSampling, full_text: str) -> dict[str, Any]:
        if result.finish_reason == "length":
            return {"type": "length", "length": len(result.token_ids)}
        if result.finish_reason == "abort":
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        last = result.token_ids[-1] if result.token_ids else None
        tail = full_text[len(result.text) :]
        matched = next((s for s in sampling.stop if tail.startswith(s)), None)
        return {"type": "stop", "matched": matched if matched is not None else last}

    def _observe(self, result: GenerationResult, prompt_tokens: int, started: float) -> None:
        self._prompt_tokens += prompt_tokens
        self._cached_tokens += result.prefix_cached_tokens
        observe_finished(self.served_name, result, prompt_tokens, started)

    # ---- pause / continue / abort ----------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._optional_body(request)
        mode = self._field(body, "mode", str, "abort")
        try:
            await asyncio.wrap_future(self.engine.control.pause_generation(mode))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param="mode") from None
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._admin(request)
        await self._optional_body(request)
        self.engine.control.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._optional_body(request)
        rid = self._field(body, "rid", str, "")
        if self._field(body, "abort_all", bool, False):
            self.engine.control.abort(None)
            for handle in list(self.active.values()):  # /generate's serving work too (generate_without_lora = "base")
                handle.cancel()
        elif rid:
            matched = [r for r in self.active if r.startswith(rid)]  # SGLang matches rid prefixes (a batch's items)
            for active in matched:
                self.active[active].cancel()
            if not matched:
                self.engine.control.abort(rid)
        return web.Response(status=200)

    # ---- weights ---------------------------------------------------------------------------

    def _weights_allowed(self) -> None:
        if self.follows_bus_weights:
            raise ApiError(
                409,
                "this executor follows the policy's signed versions on the bus (weights.follow = true): "
                "set weights.follow = false (ROSE_WEIGHTS__FOLLOW=false) to push weights over HTTP",
                code="conflict",
            )

    def _version_for(self, label: str | None) -> int:
        """The engine's integer version for a new state: the label itself when it is an integer, else the next one."""
        if label is not None and label.isdigit() and int(label) < 2**62:
            return int(label)
        return self.engine.policy_version + 1

    async def _apply(self, state: dict[str, torch.Tensor], label: str | None, body: dict[str, Any]) -> web.Response:
        if self._field(body, "abort_all_requests", bool, False):
            self.engine.control.abort(None)
        version = self._version_for(label)
        async with self._weights_lock:
            try:
                await self.updates.apply(state, version)
            except WeightUpdateError as exc:
                return web.json_response(
                    {"success": False, "message": f"Failed to update weights: {exc}. The previous weights keep serving."}, status=400
                )
            self._label = (version, label) if label is not None else None
            if self._field(body, "flush_cache", bool, True):
                await asyncio.wrap_future(self.engine.control.flush_cache())
        message = "Succeeded to update model weights."
        if label is not None:
            message += f" Weight version updated to {label}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        self._admin(request)
        self._weights_allowed()
        body = await self._optional_body(request)
        serialized = body.get("serialized_named_tensors")
        if not isinstance(serialized, list) or not serialized or not all(isinstance(s, str) for s in serialized):
            raise ApiError(
                400, "`serialized_named_tensors` must be a non-empty list of base64 strings (one per TP rank)", param="serialized_named_tensors"
            )
        if len(serialized) != 1:
            raise ApiError(
                400, f"this executor is a single rank (tp_size 1): send one serialized entry, got {len(serialized)}", param="serialized_named_tensors"
            )
        load_format = self._field(body, "load_format", str, "direct")
        if load_format not in ("direct", "flattened_bucket"):
            raise ApiError(400, f'load_format {load_format!r} is not supported: use null/"direct" or "flattened_bucket"', param="load_format")
        label = self._field(body, "weight_version", str, None)
        try:
            loaded = await asyncio.to_thread(  # sizes and shapes checked against the live policy before anything is allocated
                deserialize_named_tensors, serialized[0], params=self.engine.policy_state_dict(), flattened=load_format == "flattened_bucket"
            )
        except PolicyMismatch as exc:  # well-formed tensors that are not this policy's: refused as SGLang refuses them
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc}. The previous weights keep serving."}, status=400
            )
        except UnsafePayload as exc:
            return web.json_response({"success": False, "message": f"Failed to load serialized_named_tensors: {exc}"}, status=400)
        return await self._apply(dict(loaded), label, body)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        self._admin(request)
        self._weights_allowed()
        body = await self._optional_body(request)
        path = self._field(body, "model_path", str, "")
        if not path:
            raise ApiError(400, "`model_path` is required: a directory with the policy's safetensors", param="model_path")
        load_format = self._field(body, "load_format", str, "safetensors")
        if load_format not in ("auto", "safetensors"):
            raise ApiError(400, f"load_format {load_format!r} is not supported: weights are read from safetensors", param="load_format")
        try:
            state = await asyncio.to_thread(_read_safetensors_dir, path)
        except (OSError, ValueError) as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to read weights from {path}: {exc}", "num_paused_requests": 0}, status=400
            )
        response = await self._apply(state, self._field(body, "weight_version", str, None), body)
        if response.status == 200:
            self.model_dir = path  # /get_model_info, /get_server_info and /v1/models now name it (SGLang's tokenizer_manager does too)
        return response

    async def get_weight_version(self, _request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version()})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The first `truncate_size` rows of one live policy parameter (how RL frameworks check a sync landed)."""
        self._admin(request)
        body = await self._optional_body(request) if request.method != "GET" else dict(request.query)
        name = self._field(body, "name", str, "")
        truncate = int(body.get("truncate_size", 100)) if str(body.get("truncate_size", 100)).isdigit() else None
        if truncate is None:
            raise ApiError(400, "`truncate_size` must be a non-negative integer", param="truncate_size")
        live = self.engine.policy_state_dict()
        if name not in live:
            raise ApiError(400, f"no parameter named {name!r} in the policy model", param="name")
        tensor = live[name].reshape(1) if live[name].dim() == 0 else live[name]
        return web.json_response(tensor[:truncate].float().tolist())

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._optional_body(request)
        new = self._field(body, "new_version", str, "")
        if not new:
            raise ApiError(400, "`new_version` is required (a string)", param="new_version")
        if self._field(body, "abort_all_requests", bool, True):
            self.engine.control.abort(None)
        self._label = (self.engine.policy_version, new)
        return web.json_response({"success": True, "message": f"Weight version updated to {new}", "new_version": new})

    # ---- memory and cache --------------------------------------------------------------------

    async def _tags(self, request: web.Request) -> tuple[str, ...]:
        body = await self._optional_body(request) if request.method != "GET" else {}
        tags = body.get("tags")
        if tags is None:
            return ("kv_cache", "weights")
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ApiError(400, "`tags` must be a list of strings (kv_cache, weights, cuda_graph) or null for all", param="tags")
        return tuple(tags)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Give the rollout side's KV cache and/or weights memory back (rollout holds still meanwhile)."""
        return await self._memory(request, self.engine.control.release_memory, releasing=True)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.engine.control.resume_memory, releasing=False)

    async def _memory(self, request: web.Request, action, *, releasing: bool) -> web.Response:
        self._admin(request)
        tags = await self._tags(request)
        kept = [t for t in tags if t in MEMORY_TAGS_KEPT]
        tags = tuple(t for t in tags if t not in MEMORY_TAGS_KEPT)
        if kept and releasing:
            raise ApiError(
                400,
                f"memory tags {kept} are never released on this executor (captured CUDA graphs stay resident): "
                "release kv_cache and/or weights, or send tags null",
                param="tags",
            )
        if not tags:  # resuming only what is never released: already resident
            return web.json_response(None)
        try:
            await asyncio.wrap_future(action(tags))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param="tags") from None
        return web.json_response(None)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self._admin(request)
        await asyncio.wrap_future(self.engine.control.flush_cache())  # retained prefixes only: in-use KV is never touched
        return web.Response(text=FLUSH_CACHE_TEXT)

    # ---- information -------------------------------------------------------------------------

    async def get_model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_dir,
                "tokenizer_path": self.model_dir,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version(),
            }
        )

    def server_args(self, request: web.Request) -> dict[str, Any]:
        """SGLang's ServerArgs as they apply to this executor: one process, one device, one node.

        slime's external-engine mode asserts host, port, nnodes, node_rank, gpu_id_step,
        base_gpu_id, tp/dp/pp/ep_size and enable_memory_saver against what it would have
        launched (slime/backends/sglang_utils/sglang_engine.py, `_compute_server_args`).
        host and port are the address this request reached (the bound port, even with
        http.port = 0), IPv6 in brackets as slime writes it.
        """
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        host, port = (sockname[0], sockname[1]) if sockname else ("", 0)
        if host and ":" in host:
            host = f"[{host}]"
        device = self.engine.device
        index = device.torch_device.index
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "served_model_name": self.served_name,
            "host": host,
            "port": port,
            "nnodes": 1,
            "node_rank": 0,
            "gpu_id_step": 1,
            "base_gpu_id": index or 0,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "enable_memory_saver": True,
            "skip_tokenizer_init": False,
            "is_embedding": False,
            "trust_remote_code": False,
            "context_length": self.engine.max_positions(WorkClass.ROLLOUT),
            "device": device.kind,
            "random_seed": None,
            "enable_metrics": True,
            "disaggregation_mode": "null",
            "load_format": "auto",
            "max_running_requests": self.engine.work_for(WorkClass.ROLLOUT).max_batch,
            "stream_output": False,
            "hostname": socket.gethostname(),
            **self.lora.server_args(),
        }

    async def get_server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        rollout = engine.work_for(WorkClass.ROLLOUT)
        pool = rollout.pool
        lease = engine.lease.current
        return web.json_response(
            {
                **self.server_args(request),
                "weight_version": self.weight_version(),
                "status": "ready",
                "max_total_num_tokens": pool.num_blocks * pool.block_size,
                "max_req_input_len": engine.max_positions(WorkClass.ROLLOUT) - 1,
                "internal_states": [
                    {
                        **self.scheduler_state(),
                        "paused": engine.control.paused,
                        "released_memory": sorted(engine.control.released),
                        "kv_cache_released": pool.released,
                        "policy_version": engine.policy_version,
                        "lease_id": lease.lease_id if lease else None,
                        "lease_expires_in_s": (
                            None if lease is None or math.isinf(lease.expires_at) else max(0.0, lease.expires_at - time.monotonic())
                        ),
                        "prefix_cached_blocks": rollout.prefixes.cached_blocks if rollout.prefixes is not None else 0,
                        "loaded_lora_adapters": self.lora.loaded(),  # name -> path, as /load_lora_adapter answers
                        "executor_id": self.executor_id,
                    }
                ],
                "version": f"{SGLANG_VERSION} (ROSE executor, SGLang-compatible API)",
            }
        )

    async def health_generate(self, _request: web.Request) -> web.Response:
        """200 while the lanes run; 503 when they do not, or for ``http_api.LANE_FAILURE_HEALTH_WINDOW_S``
        after a rollout iteration raised (these endpoints generate on the rollout lane: SGLang answers
        503 when its generation fails, and a router then stops sending it work)."""
        if not self.engine.lanes_alive:
            return web.Response(status=503)
        failure = self.engine.metrics.recent_lane_failure(http_api.LANE_FAILURE_HEALTH_WINDOW_S, WorkClass.ROLLOUT.value)
        if failure is not None:
            return web.json_response({"status": "degraded", "last_lane_failure": http_api.lane_failure_body(failure)}, status=503)
        return web.Response(status=200)


def _read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in a Hugging Face model directory (sharded or not)."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError("not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError("no *.safetensors file in it")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def _all_null(value: Any) -> bool:
    """None, or a (nested) list of Nones: SGLang's "no image/video/audio" for each prompt of a batch."""
    return value is None or (isinstance(value, list) and all(_all_null(v) for v in value))
