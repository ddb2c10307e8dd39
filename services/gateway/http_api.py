"""The agents' HTTP API: OpenAI-compatible, one base URL and one key per episode.

    POST /episodes/{id}/v1/chat/completions   a turn (messages, tools, tool_choice; streaming)
    POST /episodes/{id}/v1/completions        a turn on a raw prompt (text or token ids)
    GET  /episodes/{id}/v1/models             the policy
    GET  /episodes/{id}                       the task, the turns so far, the limits
    POST /episodes/{id}/reward                {"reward": x}: the episode ends, completed
    GET  /health, /metrics

Every route under /episodes/{id} needs `Authorization: Bearer <key>`, the key handed to that episode's
agent (compared in constant time); any other key, or the key of an episode that has ended (from the moment
it ends, before its trajectory is published), is refused (401; 403 naming why it ended). The server is
the executor's hardened one (shared/http_server.py: request heads within 10 s, bodies within 60 s, body
size `http.max_body_bytes`).

What differs from OpenAI on purpose is a 4xx naming the parameter (docs/gateway.md): the policy samples
at the RL job's temperature with top_p 1 (anything else would make the trajectory off-policy), one
choice, no stop strings, no alternatives' logprobs, no forced tool call, no structured output. With
`"return_token_ids": true` an answer carries `prompt_token_ids` and each choice `token_ids` (and
`prompt_token_ids`), as vLLM and SGLang return them. An answer's id names the turn that answered (a retry
or a replay carries the id of the turn it repeats). A streamed answer sends its first chunk once the turn
is planned and the rest when the turn is done (an executor returns a rollout turn whole).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from aiohttp import web

from rose.shared.http_server import BODY_READ_TIMEOUT_S, same_secret
from rose.shared.metrics import metrics_handler
from rose.shared.openai_api import (
    NEUTRAL_PARAMS,
    ApiError,
    chat_logprobs,
    error_body,
    error_response,
    json_body,
    number,
    refuse_unsupported,
    stream_options,
    unicode_text,
    usage,
)

from .chat import ChatFormat, normalize_messages, normalize_tools, tool_choice
from .episode import Ending, Episode, Turn
from .runner import Answer, Ask, Ended, Episodes
from .telemetry import traced

log = logging.getLogger(__name__)

# what the serving API refuses, less what the gateway does: tools (parsed from the policy's own format)
UNSUPPORTED = {name: values for name, values in NEUTRAL_PARAMS.items() if name != "tools"}


def _finish_reason(turn: Turn) -> str:
    if turn.reply.get("tool_calls"):
        return "tool_calls"
    return "stop" if turn.record.finish_reason == "stop" else "length"


def answer_id(prefix: str, episode: Episode, index: int) -> str:
    """An answer's id: its episode and the turn that answered, so a retry or a replay gets the id of the answer it repeats."""
    return f"{prefix}-{episode.episode_id}-{index}"


def _token_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _wire_calls(turn: Turn) -> list[dict[str, Any]]:
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in turn.reply.get("tool_calls") or ()
    ]


class GatewayApi:
    def __init__(
        self,
        episodes: Episodes,
        fmt: ChatFormat,
        model_name: str,
        max_body_bytes: int,
        temperature: float,
        body_timeout_s: float = BODY_READ_TIMEOUT_S,
    ) -> None:
        self.episodes, self.fmt, self.model_name, self.temperature = episodes, fmt, model_name, temperature
        self.body_timeout_s = body_timeout_s
        self.created = int(time.time())
        self.errors: dict[int, int] = {}
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[traced, self._errors])
        root = "/episodes/{episode_id}"
        self.app.add_routes(
            [
                web.post(f"{root}/v1/chat/completions", self.chat_completions),
                web.post(f"{root}/v1/completions", self.completions),
                web.get(f"{root}/v1/models", self.models),
                web.get(root, self.episode),
                web.post(f"{root}/reward", self.reward),
                web.get("/health", self.health),
                web.get("/metrics", metrics_handler),
            ]
        )

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            self._count(err.status)
            return error_response(err)
        except web.HTTPRequestEntityTooLarge as err:
            self._count(413)
            return error_response(ApiError(413, f"request body too large: {err.text}"))
        except web.HTTPException as err:
            self._count(err.status)
            kind = "invalid_request_error" if err.status < 500 else "server_error"
            return error_response(ApiError(err.status, err.reason or "error", kind=kind))

    def _count(self, status: int) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1
        self.episodes.metrics.http_errors.add(1, {"status": str(status)})

    # ---- who asks ----

    def _episode(self, request: web.Request) -> Episode:
        """The episode the path names, if the key is its own; else 401 (unknown key) or 403 (its episode ended)."""
        eid = request.match_info["episode_id"]
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        episode = self.episodes.active.get(eid)
        if episode is not None and key and same_secret(key, episode.key):
            if episode.ending is None:
                return episode
            ended: Ended | Ending | None = episode.ending  # ended, not yet published (its agent has `agent.exit_grace_s` to exit)
        else:
            ended = self.episodes.ended.get(eid)
            if ended is not None and not (key and same_secret(key, ended.key)):
                ended = None
        if ended is not None:
            raise ApiError(403, f"episode {eid} has ended ({ended.status}: {ended.reason}); its key opens nothing now", code="episode_ended")
        raise ApiError(
            401, "this key opens no episode here: send `Authorization: Bearer <key>` with the key handed to this episode", code="invalid_api_key"
        )

    async def _request(self, request: web.Request) -> tuple[Episode, dict[str, Any]]:
        episode = self._episode(request)  # before the body: an unauthenticated caller gets nothing read
        body = await json_body(request, self.body_timeout_s)
        if body.get("model") != self.model_name:
            raise ApiError(
                404, f"model {body.get('model')!r} does not exist here; the policy is {self.model_name!r} (GET .../v1/models)", param="model"
            )
        refuse_unsupported(body, UNSUPPORTED, "the gateway")
        return episode, body

    def _sampling(self, body: dict[str, Any], max_field: str) -> tuple[int | None, int | None]:
        """(max_tokens, seed); sampling that would make the trajectory off-policy is refused, naming the parameter."""
        temperature = number(body, "temperature", None)
        if temperature is not None and temperature != self.temperature:
            raise ApiError(
                400,
                f"`temperature` must be unset or {self.temperature:g}: the policy samples at the RL job's temperature (on-policy)",
                param="temperature",
            )
        top_p = number(body, "top_p", None)
        if top_p is not None and top_p != 1:
            raise ApiError(400, "`top_p` must be unset or 1: rollout samples the policy's whole distribution", param="top_p")
        n = number(body, "n", None, int)
        if n is not None and n != 1:
            raise ApiError(400, "`n` must be unset or 1: each call is one turn of the episode", param="n")
        if body.get("stop") not in (None, [], ""):
            raise ApiError(400, "`stop` is not supported: a turn ends at the policy's end of message or its token limit", param="stop")
        max_tokens = body.get(max_field, body.get("max_tokens"))
        if max_tokens is not None:
            max_tokens = number({"max_tokens": max_tokens}, "max_tokens", None, int)
            if max_tokens < 1:
                raise ApiError(400, f"`{max_field}` must be >= 1", param=max_field)
        return max_tokens, number(body, "seed", None, int)

    @staticmethod
    def _flag(body: dict[str, Any], name: str) -> bool:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"`{name}` must be a boolean", param=name)
        return bool(value)

    # ---- chat ----

    def _own_time(self, started: float, answer: Answer) -> None:
        if not answer.replayed:
            self.episodes.metrics.own_time.record(time.perf_counter() - started - answer.sampling_s)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        episode, body = await self._request(request)
        want_logprobs = self._flag(body, "logprobs")
        if number(body, "top_logprobs", None, int):
            raise ApiError(400, "`top_logprobs` must be unset or 0: rollout returns the sampled token's logprob only", param="top_logprobs")
        max_tokens, seed = self._sampling(body, "max_completion_tokens")
        messages = normalize_messages(body.get("messages"))
        tools = normalize_tools(body.get("tools"))
        ask = Ask("chat", messages, tools, tool_choice(body.get("tool_choice"), tools), max_tokens=max_tokens, seed=seed)
        ids = self._flag(body, "return_token_ids")
        stream = self._flag(body, "stream")
        options = stream_options(body, stream)
        if not stream:
            answer = await self.episodes.turn(episode, ask)
            answered = web.json_response(self._chat_body(answer, answer_id("chatcmpl", episode, answer.index), want_logprobs, ids))
            self._own_time(started, answer)
            return answered
        planned: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(self.episodes.turn(episode, ask, planned))
        either: set[asyncio.Future[Any]] = {planned, running}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        # refused before it was planned (the episode ended, the turn limit): an ordinary error response, raised here
        index = planned.result() if planned.done() else (await running).index
        response = await self._sse(request)
        head = {"id": answer_id("chatcmpl", episode, index), "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        await self._send(
            response, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        )
        try:
            answer = await running
        except ApiError as err:  # after the stream began: in-band, as OpenAI's streams report errors
            self._count(err.status)
            await self._send(response, error_body(err))
            await response.write(b"data: [DONE]\n\n")
            return response
        turn = answer.turn
        content = turn.reply.get("content") or ""
        delta: dict[str, Any] = {"content": content} if content else {}
        calls = _wire_calls(turn)
        if calls:
            delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        if want_logprobs:
            choice["logprobs"] = chat_logprobs(self.fmt.token_text, turn.record.token_ids, turn.record.logprobs)
        extra = self._token_ids(turn) if ids else {}
        await self._send(response, {**head, "choices": [{**choice, **extra}], **({"prompt_token_ids": extra["prompt_token_ids"]} if ids else {})})
        await self._send(response, {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(turn)}]})
        if options.include_usage:
            await self._send(response, {**head, "choices": [], "usage": self._usage(turn)})
        await response.write(b"data: [DONE]\n\n")
        return response

    def _chat_body(self, answer: Answer, cid: str, want_logprobs: bool, ids: bool) -> dict[str, Any]:
        turn = answer.turn
        calls = _wire_calls(turn)
        content = turn.reply.get("content") or ""
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(turn)}
        if want_logprobs:
            choice["logprobs"] = chat_logprobs(self.fmt.token_text, turn.record.token_ids, turn.record.logprobs)
        body: dict[str, Any] = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if ids:
            extra = self._token_ids(turn)
            choice.update(extra)
            body["prompt_token_ids"] = extra["prompt_token_ids"]
        return {**body, "choices": [choice], "usage": self._usage(turn)}

    @staticmethod
    def _token_ids(turn: Turn) -> dict[str, list[int]]:
        return {"prompt_token_ids": list(turn.record.prompt_token_ids), "token_ids": list(turn.record.token_ids)}

    @staticmethod
    def _usage(turn: Turn) -> dict[str, Any]:
        return {
            **usage(len(turn.record.prompt_token_ids), len(turn.record.token_ids)),
            "prompt_tokens_details": {"cached_tokens": turn.record.prefix_cached_tokens},
        }

    # ---- completions ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        episode, body = await self._request(request)
        logprobs = number(body, "logprobs", None, int)
        if logprobs:
            raise ApiError(400, "`logprobs` must be unset or 0: rollout returns the sampled token's logprob only", param="logprobs")
        max_tokens, seed = self._sampling(body, "max_tokens")
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            wire: dict[str, Any] = {"text": unicode_text(prompt, "prompt")}
        elif isinstance(prompt, list) and prompt and all(_token_id(t, self.fmt.vocab_size) for t in prompt):
            wire = {"ids": prompt}
        else:
            raise ApiError(
                400,
                f"`prompt` must be a non-empty string or list of token ids in [0, {self.fmt.vocab_size}) (one prompt: each call is one turn)",
                param="prompt",
            )
        ids = self._flag(body, "return_token_ids")
        stream = self._flag(body, "stream")
        options = stream_options(body, stream)
        answer = await self.episodes.turn(episode, Ask("completion", prompt=wire, max_tokens=max_tokens, seed=seed))
        turn = answer.turn
        choice: dict[str, Any] = {"index": 0, "text": turn.reply["text"], "logprobs": None, "finish_reason": _finish_reason(turn)}
        if logprobs is not None:
            tokens = [self.fmt.token_text(t) for t in turn.record.token_ids]
            offsets, at = [], 0
            for token in tokens:
                offsets.append(at)
                at += len(token)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": list(turn.record.logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, turn.record.logprobs)],
                "text_offset": offsets,
            }
        if ids:
            choice.update(self._token_ids(turn))
        head = {
            "id": answer_id("cmpl", episode, answer.index),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if not stream:
            answered = web.json_response({**head, "choices": [choice], "usage": self._usage(turn)})
            self._own_time(started, answer)
            return answered
        response = await self._sse(request)
        await self._send(response, {**head, "choices": [choice]})
        if options.include_usage:
            await self._send(response, {**head, "choices": [], "usage": self._usage(turn)})
        await response.write(b"data: [DONE]\n\n")
        return response

    # ---- the rest ----

    async def models(self, request: web.Request) -> web.Response:
        self._episode(request)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rose", "root": self.model_name, "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    async def episode(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        t = episode.task
        return web.json_response(
            {
                "episode_id": episode.episode_id,
                "task": {"task_id": t.task_id, "env": t.env, "prompt": t.prompt, "env_args": t.env_args},
                "turns": len(episode.turns),
                "max_turns": episode.max_turns,
                "seconds_left": round(max(0.0, episode.deadline - time.monotonic()), 3),
                "status": "open",
            }
        )

    async def reward(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        body = await json_body(request, self.body_timeout_s)
        reward = number(body, "reward", None)
        if reward is None or not math.isfinite(reward):
            raise ApiError(400, '`reward` is required, a finite number: {"reward": <number>}', param="reward")
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise ApiError(400, "`reason` must be a string", param="reason")
        await self.episodes.post_reward(episode, float(reward), unicode_text(reason, "reason")[:500])
        return web.json_response({"episode_id": episode.episode_id, "status": "completed", "reward": float(reward)})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "episodes": len(self.episodes.active)})

    @staticmethod
    async def _sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
