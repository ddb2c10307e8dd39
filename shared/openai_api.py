"""The OpenAI API's shapes, shared by ROSE's OpenAI-compatible endpoints (the executor's serving API,
the gateway's agent API): errors, request validation, usage, stream options, logprobs.

Every bad request is an `ApiError` that becomes a 4xx with an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`) whose message says what to fix and whose `param`
names the field; the official `openai` client raises it as its own error type.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rose.shared.errors import RoseError

from .http_server import BODY_READ_TIMEOUT_S, read_body

LOGPROB_FLOOR = -9999.0  # a -inf / NaN logprob as a JSON number (vLLM's convention)
# parameters accepted only at their neutral value: anything else asks for what the engine does not do
NEUTRAL_PARAMS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "echo": (False,),
}


class ApiError(RoseError):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error object: a response's body, or an in-band event of a stream that has begun."""
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError) -> web.Response:
    return web.json_response(error_body(err), status=err.status)


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def number(body: dict[str, Any], name: str, default: float | None, kind: type = float) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    return value


def unicode_text(text: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON may carry lone surrogates (e.g. "\\ud800"), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"`{param}` is not valid Unicode text: {exc.reason} at position {exc.start}", param=param.split("[")[0]) from None
    return text


async def json_body(request: web.Request, timeout_s: float = BODY_READ_TIMEOUT_S) -> dict[str, Any]:
    """The request body as a JSON object, within the body deadline (408) and size limit (413), else 400."""
    raw = await read_body(request, timeout_s)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def refuse_unsupported(body: dict[str, Any], neutral: dict[str, tuple[Any, ...]], who: str) -> None:
    """A 400 naming the first parameter set to something other than its neutral value."""
    for name, values in neutral.items():
        value = body.get(name)
        if value is not None and value not in values:
            raise ApiError(400, f"`{name}` is not supported by {who} (send it unset{' or ' + repr(values[0]) if values else ''})", param=name)


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False  # a last chunk with `usage` and empty `choices`
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, `usage` so far on every chunk too


def stream_options(body: dict[str, Any], stream: bool) -> StreamOptions:
    options = body.get("stream_options")
    if options is None:
        return StreamOptions()
    if not stream:
        raise ApiError(400, "`stream_options` can only be set when `stream` is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "`stream_options` must be an object", param="stream_options")
    flags = {}
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"`stream_options.{name}` must be a boolean", param="stream_options")
        flags[name] = bool(value)
    return StreamOptions(**flags)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(
    token_text: Callable[[int], str],
    token_ids: tuple[int, ...] | list[int],
    logprobs: tuple[float, ...] | list[float],
    tops: tuple[tuple[tuple[int, float], ...], ...] = (),
) -> dict[str, Any]:
    """The chat `logprobs` object: `content`, one entry per token with its `top_logprobs` (k entries)."""

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": finite(lp), "bytes": list(token.encode("utf-8", "replace"))}

    content = []
    for k, (t, lp) in enumerate(zip(token_ids, logprobs)):
        content.append({**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in (tops[k] if k < len(tops) else ())]})
    return {"content": content, "refusal": None}
