"""Production traffic over HTTP, OpenAI-compatible: completions, chat completions (with SSE), models.

The official `openai` client works against it unchanged. Every bad request gets a 4xx with an
OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`) whose message says
what to fix; the executor keeps serving.

Each request is one trace: a server span `POST /v1/...` (continuing a W3C `traceparent`
header when the caller sends one) with a child `executor.serving` span over the engine's work
(events `scheduled` and `first_token`). TTFT/TPOT are recorded per request as histograms.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from rose.shared.metrics import metrics_handler
from rose.shared.tracing import tracer

from .engine import Engine, RequestHandle
from .protocol import GenerationRequest, GenerationResult, InvalidRequest, SamplingParams, StreamDelta, WorkClass
from .telemetry import Telemetry

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
LANE_FAILURE_HEALTH_WINDOW_S = 60.0  # /health says "degraded" this long after a lane's iteration raised


def lane_failure_body(failure) -> dict[str, Any]:
    """A ``metrics.LaneFailure`` as health endpoints report it."""
    return {"lane": failure.lane, "error": failure.error, "seconds_ago": round(time.monotonic() - failure.at, 3)}
UNTRACED_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # probes and scrapes: no span each


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _error_response(err: ApiError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    return web.json_response(body, status=err.status)


def _number(body: dict[str, Any], name: str, default: float | None, kind: type = float) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    return value


def _unicode(text: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON may carry lone surrogates (e.g. "\\ud800"), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"`{param}` is not valid Unicode text: {exc.reason} at position {exc.start}", param=param.split("[")[0]) from None
    return text


class OpenAIApi:
    def __init__(self, engine: Engine, telemetry: Telemetry, model_name: str, max_body_bytes: int) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.model_name = model_name
        self.tokenizer = engine.tokenizer_for(WorkClass.SERVING)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._traced, self._errors])
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
            attributes={"http.request.method": request.method, "http.route": route, "url.path": request.path, "rose.executor_id": self.telemetry.executor_id},
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
            return _error_response(err)
        except InvalidRequest as err:
            self._count_error(400)
            return _error_response(ApiError(400, str(err)))
        except web.HTTPRequestEntityTooLarge as err:
            self._count_error(413)
            return _error_response(ApiError(413, f"request body too large: {err.text}"))
        except web.HTTPException as err:
            self._count_error(err.status)
            return _error_response(ApiError(err.status, err.reason or "error", kind="invalid_request_error" if err.status < 500 else "server_error"))

    def _count_error(self, status: int) -> None:
        self.telemetry.http_error(status)

    # ---- parsing ------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to parse") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; available: [{self.model_name!r}] (see GET /v1/models)", param="model", code="model_not_found")
        if _number(body, "n", 1, int) != 1:
            raise ApiError(400, "only n=1 is supported: send one request per completion", param="n")
        return body

    def _sampling(self, body: dict[str, Any], max_tokens_field: str = "max_tokens") -> SamplingParams:
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
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", None, int),
            stop=stops,
            seed=_number(body, "seed", None, int),
        )
        try:
            params.validate()
        except InvalidRequest as exc:
            raise ApiError(400, str(exc)) from exc
        return params

    def _prompt_ids(self, prompt: Any) -> tuple[int, ...]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "`prompt` is empty: send some text", param="prompt")
            return tuple(self.tokenizer.encode(_unicode(prompt, "prompt"), add_special_tokens=False))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(400, "batched prompts are not supported: send one request per prompt", param="prompt")
        raise ApiError(400, "`prompt` must be a non-empty string or a list of token ids", param="prompt")

    def _chat_prompt_ids(self, messages: Any) -> tuple[int, ...]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list of {role, content}", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role (system|user|assistant|tool) and string content", param="messages")
            _unicode(m["content"], f"messages[{i}].content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return tuple(int(t) for t in ids)

    def _submit(self, prompt_ids: tuple[int, ...], sampling: SamplingParams, stream: bool) -> tuple[str, RequestHandle]:
        request = GenerationRequest(
            request_id=f"srv-{uuid.uuid4().hex[:16]}", work_class=WorkClass.SERVING, prompt_token_ids=prompt_ids, sampling=sampling, stream=stream
        )
        return request.request_id, self.engine.submit(request)

    @staticmethod
    def _usage(prompt_len: int, result: GenerationResult) -> dict[str, int]:
        return {"prompt_tokens": prompt_len, "completion_tokens": len(result.token_ids), "total_tokens": prompt_len + len(result.token_ids)}

    # ---- endpoints ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if body.get("echo"):
            raise ApiError(400, "`echo` is not supported", param="echo")
        sampling = self._sampling(body)
        prompt_ids = self._prompt_ids(body.get("prompt"))
        want_logprobs = body.get("logprobs") is not None
        stream = bool(body.get("stream", False))
        request_id, handle = self._submit(prompt_ids, sampling, stream)

        def final(result: GenerationResult) -> dict[str, Any]:
            lp = self._logprobs(result.token_ids, result.logprobs) if want_logprobs else None
            return {"index": 0, "text": result.text, "logprobs": lp, "finish_reason": result.finish_reason}

        def chunk(delta: StreamDelta, _first: bool) -> dict[str, Any]:
            lp = self._logprobs(delta.token_ids, delta.logprobs) if want_logprobs else None
            return {"index": 0, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason if delta.finished else None}

        return await self._answer(request, handle, f"cmpl-{request_id}", ("text_completion", "text_completion"), len(prompt_ids), stream, final, chunk)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        sampling = self._sampling(body, "max_completion_tokens")
        prompt_ids = self._chat_prompt_ids(body.get("messages"))
        stream = bool(body.get("stream", False))
        request_id, handle = self._submit(prompt_ids, sampling, stream)

        def final(result: GenerationResult) -> dict[str, Any]:
            return {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": result.finish_reason}

        def chunk(delta: StreamDelta, first: bool) -> dict[str, Any]:
            piece = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            return {"index": 0, "delta": piece, "finish_reason": delta.finish_reason if delta.finished else None}

        objects = ("chat.completion", "chat.completion.chunk")
        return await self._answer(request, handle, f"chatcmpl-{request_id}", objects, len(prompt_ids), stream, final, chunk)

    async def _answer(
        self,
        request: web.Request,
        handle: RequestHandle,
        cid: str,
        objects: tuple[str, str],
        prompt_len: int,
        stream: bool,
        final: Callable[[GenerationResult], dict[str, Any]],
        chunk: Callable[[StreamDelta, bool], dict[str, Any]],
    ) -> web.StreamResponse:
        """One JSON answer, or server-sent events ending in [DONE]; a departed client cancels the work."""
        head = {"id": cid, "model": self.model_name}
        started_ns = time.time_ns()
        with tracer().start_as_current_span(
            "executor.serving",
            attributes={"rose.executor_id": self.telemetry.executor_id, "rose.request_id": handle.request_id, "gen_ai.request.model": self.model_name,
                        "gen_ai.usage.input_tokens": prompt_len, "rose.stream": stream},
        ) as span:
            try:
                if not stream:
                    result = await handle.result()
                    self._finished(span, result, started_ns)
                    return web.json_response(
                        {**head, "object": objects[0], "created": int(time.time()), "choices": [final(result)], "usage": self._usage(prompt_len, result)}
                    )
                response = await self._sse_start(request)
                first = True
                async for delta in handle:
                    event = {**head, "object": objects[1], "created": int(time.time()), "choices": [chunk(delta, first)]}
                    first = False
                    await response.write(f"data: {json.dumps(event)}\n\n".encode())
                try:
                    result = await handle.result()
                except InvalidRequest as exc:  # refused after the stream began (a backend server's 400): say so in-band
                    self._count_error(400)
                    error = {"error": {"message": str(exc), "type": "invalid_request_error", "param": None, "code": None}}
                    await response.write(f"data: {json.dumps(error)}\n\n".encode() + b"data: [DONE]\n\n")
                    return response
                await response.write(b"data: [DONE]\n\n")
                self._finished(span, result, started_ns)
                return response
            except (ConnectionResetError, asyncio.CancelledError):
                handle.cancel()  # the client left: free the engine's slot
                span.set_attribute("rose.finish_reason", "client_gone")
                raise

    def _finished(self, span: trace.Span, result: GenerationResult, started_ns: int) -> None:
        """Metrics and span attributes of a finished serving request (timings are from submission)."""
        self.telemetry.serving_finished(result)
        t = result.timings
        span.add_event("scheduled", timestamp=started_ns + int(t.queue_ms * 1e6))
        if result.token_ids:
            span.add_event("first_token", timestamp=started_ns + int(t.ttft_ms * 1e6))
        span.set_attributes(
            {"gen_ai.usage.output_tokens": len(result.token_ids), "rose.finish_reason": result.finish_reason, "rose.queue_ms": t.queue_ms,
             "rose.ttft_ms": t.ttft_ms, "rose.tpot_ms": t.tpot_ms, "rose.preemptions": t.preemptions}
        )

    def _logprobs(self, token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": None}

    @staticmethod
    async def _sse_start(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rose"}]})

    async def health(self, _request: web.Request) -> web.Response:
        """"ok", or "degraded" for LANE_FAILURE_HEALTH_WINDOW_S after an engine iteration raised (its
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
