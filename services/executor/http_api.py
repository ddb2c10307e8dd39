"""Production traffic over HTTP, OpenAI-compatible: completions, chat completions (with SSE), models.

The official `openai` client works against it unchanged. Every bad request gets a 4xx with an
OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`) whose message says
what to fix; the executor keeps serving.

Each request is one trace: a server span `POST /v1/...` (continuing a W3C `traceparent`
header when the caller sends one) with a child `executor.serving` span over the engine's work
(events `scheduled` and `first_token`). TTFT/TPOT are recorded per request as histograms.

`n` samples of each prompt of a batch are separate engine requests through the same scheduler
(choice `i` of prompt `p` has index `p * n + i`, its seed `seed + i`), so a batch is served
exactly as the same requests sent one by one. What differs from OpenAI on purpose is a 4xx
naming the parameter (docs/http-api.md, "Deliberate differences").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from rose.shared.metrics import metrics_handler
from rose.shared.openai_api import (
    NEUTRAL_PARAMS,
    ApiError,
    StreamOptions,
    chat_logprobs,
    error_body,
    error_response,
    finite,
    json_body,
    number,
    refuse_unsupported,
    stream_options,
    unicode_text,
)
from rose.shared.openai_api import usage as usage_of
from rose.shared.tracing import tracer

from .backend import CoServingEngine
from .outputs import RequestHandle
from .protocol import MAX_TOP_LOGPROBS, EngineSampling, GenerationRequest, GenerationResult, InvalidRequest, StreamDelta, TopLogprobs, WorkClass
from .telemetry import Telemetry

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_CHOICES = 128  # prompts x n in one request (each is an engine request)
SEED_SPAN = 2**64  # choice i samples with seed + i, wrapped into [-2**63, 2**63)
MODEL_CARDS: web.AppKey = web.AppKey("rose_model_cards", list)  # callables adding models served by other routes (the SGLang API's policy)
LANE_FAILURE_HEALTH_WINDOW_S = 60.0  # /health says "degraded" this long after a lane's iteration raised
# a serving request the engine ended early (its lane's iteration raised, or the engine stopped): a 503 the client
# retries, not a 200 whose finish_reason ("abort") is none of OpenAI's
CUT_SHORT = "the executor ended this request before it finished (a failed iteration or a stop): retry it"


def lane_failure_body(failure) -> dict[str, Any]:
    """A ``metrics.LaneFailure`` as health endpoints report it."""
    return {"lane": failure.lane, "error": failure.error, "seconds_ago": round(time.monotonic() - failure.at, 3)}


UNTRACED_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # probes and scrapes: no span each


@dataclass(frozen=True)
class Choice:
    """One engine request of an API request: its choice index, prompt and handle."""

    index: int
    prompt_ids: tuple[int, ...]
    handle: RequestHandle


class OpenAIApi:
    def __init__(self, engine: CoServingEngine, telemetry: Telemetry, model_name: str, max_body_bytes: int, stream_interval: int = 1) -> None:
        self.engine = engine
        self.stream_interval = stream_interval
        self.telemetry = telemetry
        self.model_name = model_name
        self.tokenizer = engine.tokenizer_for(WorkClass.SERVING)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._traced, self._errors])
        self.app[MODEL_CARDS] = []
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", metrics_handler),
            ]
        )

    @web.middleware
    async def _traced(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A server span per API request, continuing the caller's trace (HTTP semantic conventions)."""
        if request.path in UNTRACED_PATHS:
            return await handler(request)
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else request.path
        with tracer().start_as_current_span(
            f"{request.method} {route}",
            context=propagate.extract(request.headers),  # case-insensitive: `Traceparent` works too
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "http.route": route,
                "url.path": request.path,
                "rose.executor_id": self.telemetry.executor_id,
            },
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(trace.StatusCode.ERROR)
            return response

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            self._count_error(err.status)
            return error_response(err)
        except InvalidRequest as err:
            self._count_error(400)
            return error_response(ApiError(400, str(err), param=err.param))
        except web.HTTPRequestEntityTooLarge as err:
            self._count_error(413)
            return error_response(ApiError(413, f"request body too large: {err.text}"))
        except web.HTTPException as err:
            self._count_error(err.status)
            return error_response(ApiError(err.status, err.reason or "error", kind="invalid_request_error" if err.status < 500 else "server_error"))

    def _count_error(self, status: int) -> None:
        self.telemetry.http_error(status)

    # ---- parsing ------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await json_body(request)
        model = body.get("model")
        if model != self.model_name:
            others = [card()["id"] for card in request.app[MODEL_CARDS]]
            hint = f" ({', '.join(map(repr, others))}: SGLang API, POST /generate)" if others else ""
            raise ApiError(
                404,
                f"model {model!r} does not exist for this endpoint; available: [{self.model_name!r}]{hint} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        refuse_unsupported(body, NEUTRAL_PARAMS, "this executor")
        return body

    def _sampling(self, body: dict[str, Any], max_tokens_field: str = "max_tokens", top_logprobs: int = 0) -> EngineSampling:
        stop = body.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise ApiError(400, "`stop` must be a string or a list of strings", param="stop")
        max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
        params = EngineSampling(
            temperature=number(body, "temperature", 1.0),
            top_p=number(body, "top_p", 1.0),
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else number({"max_tokens": max_tokens}, "max_tokens", None, int),
            stop=stops,
            seed=number(body, "seed", None, int),
            top_logprobs=top_logprobs,
        )
        try:
            params.validate()
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        return params

    @staticmethod
    def _n(body: dict[str, Any], prompts: int) -> int:
        n = number(body, "n", 1, int)
        if n < 1:
            raise ApiError(400, f"`n` must be an integer >= 1, got {n}", param="n")
        if n * prompts > MAX_CHOICES:
            raise ApiError(400, f"{prompts} prompt(s) x n={n} = {n * prompts} completions: at most {MAX_CHOICES} in one request", param="n")
        best_of = body.get("best_of")
        if best_of is not None and best_of != n:
            raise ApiError(400, f"`best_of` must be unset or equal to n ({n}): this executor returns every sample it draws", param="best_of")
        return n

    def _encode(self, text: str, param: str) -> tuple[int, ...]:
        if not text:
            raise ApiError(400, f"`{param}` is empty: send some text", param="prompt")
        return tuple(self.tokenizer.encode(unicode_text(text, param), add_special_tokens=False))

    def _prompts(self, prompt: Any) -> list[tuple[int, ...]]:
        """Each prompt's token ids: a string, a list of token ids, or a batch (a list of either)."""

        def token_ids(p: Any) -> bool:
            return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if token_ids(prompt):
            return [tuple(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or token_ids(p) for p in prompt):
            return [self._encode(p, f"prompt[{i}]") if isinstance(p, str) else tuple(p) for i, p in enumerate(prompt)]
        raise ApiError(400, "`prompt` must be a non-empty string, a list of token ids, or a non-empty list of either (a batch)", param="prompt")

    def _chat_prompt_ids(self, messages: Any) -> tuple[int, ...]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list of {role, content}", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role (system|user|assistant|tool) and string content", param="messages")
            unicode_text(m["content"], f"messages[{i}].content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return tuple(int(t) for t in ids)

    def _submit(self, prompts: list[tuple[int, ...]], n: int, sampling: EngineSampling, stream: bool) -> list[Choice]:
        """Every (prompt, sample) as its own engine request; all or none are queued."""
        choices: list[Choice] = []
        try:
            for p, prompt_ids in enumerate(prompts):
                for i in range(n):
                    params = sampling if sampling.seed is None or i == 0 else replace(sampling, seed=(sampling.seed + i + 2**63) % SEED_SPAN - 2**63)
                    request = GenerationRequest(
                        request_id=f"srv-{uuid.uuid4().hex[:16]}",
                        work_class=WorkClass.SERVING,
                        prompt_token_ids=prompt_ids,
                        sampling=params,
                        stream=stream,
                        stream_interval=self.stream_interval,
                    )
                    choices.append(Choice(p * n + i, prompt_ids, self.engine.submit(request)))
        except BaseException:
            for choice in choices:
                choice.handle.cancel()
            raise
        return choices

    @staticmethod
    def _usage(prompts: list[tuple[int, ...]], completion_tokens: int) -> dict[str, int]:
        return usage_of(sum(len(p) for p in prompts), completion_tokens)  # each prompt once, whatever n (as vLLM and OpenAI count)

    # ---- logprobs ------------------------------------------------------------------------

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(
        self, token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: tuple[TopLogprobs, ...], offset: int
    ) -> dict[str, Any]:
        """The completions `logprobs` object: each token, its logprob, its top alternatives (the
        sampled token included, as vLLM does) and its character offset in the completion text."""
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_dicts = []
        for k, (token, lp) in enumerate(zip(tokens, logprobs)):
            alternatives = {self._token(t): finite(v) for t, v in (tops[k] if k < len(tops) else ())}
            alternatives.setdefault(token, finite(lp))
            top_dicts.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [finite(lp) for lp in logprobs], "top_logprobs": top_dicts, "text_offset": offsets}

    def _chat_logprobs(self, token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: tuple[TopLogprobs, ...]) -> dict[str, Any]:
        return chat_logprobs(self._token, token_ids, logprobs, tops)

    # ---- endpoints ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ApiError(400, f"`logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {logprobs!r}", param="logprobs")
        sampling = self._sampling(body, top_logprobs=logprobs or 0)
        prompts = self._prompts(body.get("prompt"))
        n = self._n(body, len(prompts))
        stream = bool(body.get("stream", False))
        options = stream_options(body, stream)
        choices = self._submit(prompts, n, sampling, stream)
        offsets: dict[int, int] = {}  # per choice: characters streamed so far (text_offset of the next token)

        def final(index: int, result: GenerationResult) -> dict[str, Any]:
            lp = self._completion_logprobs(result.token_ids, result.logprobs, result.top_logprobs, 0) if logprobs is not None else None
            return {"index": index, "text": result.text, "logprobs": lp, "finish_reason": result.finish_reason}

        def chunk(index: int, delta: StreamDelta, _first: bool) -> dict[str, Any]:
            lp = None
            if logprobs is not None:
                lp = self._completion_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            return {"index": index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason if delta.finished else None}

        cid = f"cmpl-{uuid.uuid4().hex}"
        return await self._answer(request, choices, cid, ("text_completion", "text_completion"), prompts, stream, options, final, chunk)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        want_logprobs = body.get("logprobs")
        if want_logprobs is not None and not isinstance(want_logprobs, bool):
            raise ApiError(400, f"`logprobs` must be a boolean, got {want_logprobs!r}", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", param="top_logprobs")
            if top > 0 and not want_logprobs:
                raise ApiError(400, "`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
        sampling = self._sampling(body, "max_completion_tokens", top_logprobs=top or 0)
        prompts = [self._chat_prompt_ids(body.get("messages"))]
        n = self._n(body, 1)
        stream = bool(body.get("stream", False))
        options = stream_options(body, stream)
        choices = self._submit(prompts, n, sampling, stream)

        def final(index: int, result: GenerationResult) -> dict[str, Any]:
            lp = self._chat_logprobs(result.token_ids, result.logprobs, result.top_logprobs) if want_logprobs else None
            message = {"role": "assistant", "content": result.text, "refusal": None}  # the spec requires `refusal` (null: none)
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": result.finish_reason}

        def chunk(index: int, delta: StreamDelta, first: bool) -> dict[str, Any]:
            piece = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            lp = self._chat_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs) if want_logprobs else None
            return {"index": index, "delta": piece, "logprobs": lp, "finish_reason": delta.finish_reason if delta.finished else None}

        objects = ("chat.completion", "chat.completion.chunk")
        return await self._answer(request, choices, f"chatcmpl-{uuid.uuid4().hex}", objects, prompts, stream, options, final, chunk)

    async def _answer(
        self,
        request: web.Request,
        choices: list[Choice],
        cid: str,
        objects: tuple[str, str],
        prompts: list[tuple[int, ...]],
        stream: bool,
        options: StreamOptions,
        final: Callable[[int, GenerationResult], dict[str, Any]],
        chunk: Callable[[int, StreamDelta, bool], dict[str, Any]],
    ) -> web.StreamResponse:
        """One JSON answer, or server-sent events ending in [DONE]; a departed client cancels the work."""
        head = {"id": cid, "model": self.model_name}
        started_ns = time.time_ns()
        with tracer().start_as_current_span(
            "executor.serving",
            attributes={
                "rose.executor_id": self.telemetry.executor_id,
                "rose.request_id": choices[0].handle.request_id,
                "gen_ai.request.model": self.model_name,
                "gen_ai.usage.input_tokens": sum(len(p) for p in prompts),
                "rose.stream": stream,
                "rose.choices": len(choices),
            },
        ) as span:
            try:
                if not stream:
                    try:
                        results = await asyncio.gather(*(c.handle.result() for c in choices))
                    except InvalidRequest:  # one was refused (a backend server's 400): the others are of no use
                        for choice in choices:
                            choice.handle.cancel()
                        raise
                    for result in results:
                        self._finished(span, result, started_ns)
                    if any(r.finish_reason == "abort" for r in results):
                        raise ApiError(503, CUT_SHORT, kind="server_error")
                    return web.json_response(
                        {
                            **head,
                            "object": objects[0],
                            "created": int(time.time()),
                            "choices": [final(c.index, r) for c, r in zip(choices, results)],
                            "usage": self._usage(prompts, sum(len(r.token_ids) for r in results)),
                        }
                    )
                return await self._stream(request, choices, head, objects[1], prompts, options, span, started_ns, chunk)
            except (ConnectionResetError, asyncio.CancelledError):
                for choice in choices:
                    choice.handle.cancel()  # the client left: free the engine's slots
                span.set_attribute("rose.finish_reason", "client_gone")
                raise

    async def _stream(
        self,
        request: web.Request,
        choices: list[Choice],
        head: dict[str, Any],
        obj: str,
        prompts: list[tuple[int, ...]],
        options: StreamOptions,
        span: trace.Span,
        started_ns: int,
        chunk: Callable[[int, StreamDelta, bool], dict[str, Any]],
    ) -> web.StreamResponse:
        """Every choice's deltas as they come (interleaved, each chunk naming its index), then usage if asked, then [DONE]."""
        events: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for delta in choice.handle:
                events.put_nowait((choice, delta))
            try:
                events.put_nowait((choice, await choice.handle.result()))
            except InvalidRequest as exc:
                events.put_nowait((choice, exc))

        pumps = [asyncio.create_task(pump(c)) for c in choices]
        response = await self._sse_start(request)
        completion_tokens = 0
        started: set[int] = set()
        try:
            for _ in range(len(choices)):
                while True:
                    choice, item = await events.get()
                    if isinstance(item, StreamDelta) and item.finished and item.finish_reason == "abort":  # cut short: say so in-band
                        return await self._stream_error(response, choices, ApiError(503, CUT_SHORT, kind="server_error"))
                    if isinstance(item, StreamDelta):
                        completion_tokens += len(item.token_ids)
                        event = {
                            **head,
                            "object": obj,
                            "created": int(time.time()),
                            "choices": [chunk(choice.index, item, choice.index not in started)],
                        }
                        started.add(choice.index)
                        if options.include_usage and options.continuous_usage_stats:  # vLLM: only together with include_usage
                            event["usage"] = self._usage(prompts, completion_tokens)
                        await response.write(f"data: {json.dumps(event)}\n\n".encode())
                        continue
                    if isinstance(item, InvalidRequest):  # refused after the stream began (a backend server's 400): say so in-band
                        return await self._stream_error(response, choices, ApiError(400, str(item)))
                    self._finished(span, item, started_ns)
                    break
            if options.include_usage:
                usage = {**head, "object": obj, "created": int(time.time()), "choices": [], "usage": self._usage(prompts, completion_tokens)}
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            for task in pumps:
                task.cancel()

    async def _stream_error(self, response: web.StreamResponse, choices: list[Choice], err: ApiError) -> web.StreamResponse:
        """A stream that has begun cannot change its status: the error goes in-band, then [DONE], the other choices cancelled."""
        self._count_error(err.status)
        await response.write(f"data: {json.dumps(error_body(err))}\n\n".encode() + b"data: [DONE]\n\n")
        for other in choices:
            other.handle.cancel()
        return response

    def _finished(self, span: trace.Span, result: GenerationResult, started_ns: int) -> None:
        """Metrics and span attributes of a finished serving request (timings are from submission)."""
        self.telemetry.serving_finished(result)
        t = result.timings
        span.add_event("scheduled", timestamp=started_ns + int(t.queue_ms * 1e6))
        if result.token_ids:
            span.add_event("first_token", timestamp=started_ns + int(t.ttft_ms * 1e6))
        span.set_attributes(
            {
                "gen_ai.usage.output_tokens": len(result.token_ids),
                "rose.finish_reason": result.finish_reason,
                "rose.queue_ms": t.queue_ms,
                "rose.ttft_ms": t.ttft_ms,
                "rose.tpot_ms": t.tpot_ms,
                "rose.preemptions": t.preemptions,
            }
        )

    @staticmethod
    async def _sse_start(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def models(self, request: web.Request) -> web.Response:
        """The serving model, and the models other routes serve (the SGLang API's policy, with its current path as `root`)."""
        serving = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rose", "root": self.model_name, "parent": None}
        return web.json_response({"object": "list", "data": [serving] + [card() for card in request.app[MODEL_CARDS]]})

    async def health(self, _request: web.Request) -> web.Response:
        """ "ok", or "degraded" for LANE_FAILURE_HEALTH_WINDOW_S after an engine iteration raised (its
        running requests were aborted): 503 when it was the serving lane, so that a load balancer
        sends production traffic elsewhere until this replica has run clean for the window; 200 when
        it was the rollout lane, which production traffic does not touch."""
        metrics = self.engine.metrics
        body: dict[str, Any] = {"status": "ok", "policy_version": self.engine.policy_version, "lane_failures": metrics.lane_failures}
        failure = metrics.recent_lane_failure(LANE_FAILURE_HEALTH_WINDOW_S)
        if failure is None:
            return web.json_response(body)
        body["status"] = "degraded"
        body["last_lane_failure"] = lane_failure_body(failure)
        return web.json_response(body, status=503 if failure.lane == WorkClass.SERVING.value else 200)
