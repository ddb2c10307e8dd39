"""Export the contracts for integrators: a JSON Schema per message and an AsyncAPI 3.0 document.

FastStream's own AsyncAPI generator cannot describe msgspec Structs (pydantic raises
"schema-for-unknown-type"), so the document is built here from `msgspec.json.schema_components`
and the channel registry, which also lets it describe KV buckets and object stores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from rose import __version__

from .base import SCHEMA_VERSION
from .registry import CHANNELS, Channel, Kind, message_types

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
REF_TEMPLATE = "#/components/schemas/{name}"


def json_schemas() -> dict[str, dict[str, Any]]:
    """A standalone JSON Schema (2020-12) per top-level message, nested types under $defs."""
    out: dict[str, dict[str, Any]] = {}
    for t in message_types():
        schema = msgspec.json.schema(t)
        schema["$schema"] = JSON_SCHEMA_DIALECT
        schema["$id"] = f"https://rose.dev/schemas/v{SCHEMA_VERSION}/{t.__name__}.json"
        out[t.__name__] = schema
    return out


def _channel_params(channel: Channel) -> dict[str, Any]:
    return {token: {"description": f"The {token.replace('_', ' ')} token of the subject."} for token in channel.tokens}


def _channel_bindings(channel: Channel) -> dict[str, Any]:
    """Where the channel's messages live in JetStream (x- extension; AsyncAPI has no NATS JetStream binding)."""
    storage: dict[str, Any] = {"kind": channel.kind.value, "encoding": channel.encoding.value, "maxBytes": channel.max_bytes}
    if channel.stream is not None:
        storage["stream"] = channel.stream.name
        storage["retention"] = channel.stream.retention.value
    if channel.kv is not None:
        storage["kvBucket"] = channel.kv.bucket
    if channel.objects is not None:
        storage["objectStore"] = channel.objects.bucket
    return storage


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document for every channel in the registry."""
    types = message_types()
    _, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for t in types:
        messages[t.__name__] = {
            "name": t.__name__,
            "title": t.__name__,
            "summary": (t.__doc__ or "").strip().splitlines()[0] if t.__doc__ else t.__name__,
            "contentType": "application/json",
            "payload": {"$ref": REF_TEMPLATE.format(name=t.__name__)},
        }
    for channel in CHANNELS:
        key = channel.name.replace(".", "_")
        address = channel.template if channel.kind not in (Kind.KV, Kind.OBJECTS) else None
        entry: dict[str, Any] = {
            "address": address,
            "title": channel.name,
            "description": channel.description
            + (f" Key `{channel.template}` in KV bucket `{channel.kv.bucket}`." if channel.kv else "")
            + (f" Objects in store `{channel.objects.bucket}`." if channel.objects else ""),
            "messages": {},
            "x-rose": {**_channel_bindings(channel), "publishers": list(channel.publishers), "consumers": list(channel.consumers)},
        }
        if channel.tokens and address is not None:
            entry["parameters"] = _channel_params(channel)
        for message_type in (channel.payload, channel.reply):
            if message_type is not None:
                entry["messages"][message_type.__name__] = {"$ref": f"#/components/messages/{message_type.__name__}"}
        channels[key] = entry
        if channel.payload is None:
            continue
        ref = {"$ref": f"#/channels/{key}"}
        msg_ref = [{"$ref": f"#/channels/{key}/messages/{channel.payload.__name__}"}]
        operations[f"{key}_send"] = {
            "action": "send",
            "channel": ref,
            "summary": f"Published by {', '.join(channel.publishers)}.",
            "messages": msg_ref,
        }
        receive: dict[str, Any] = {
            "action": "receive",
            "channel": ref,
            "summary": f"Consumed by {', '.join(channel.consumers)}.",
            "messages": msg_ref,
        }
        if channel.reply is not None:
            receive["reply"] = {
                "channel": ref,
                "messages": [{"$ref": f"#/channels/{key}/messages/{channel.reply.__name__}"}],
            }
        operations[f"{key}_receive"] = receive
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "ROSE bus",
            "version": __version__,
            "description": "Every subject of ROSE on NATS JetStream. Control messages and events are JSON; "
            f"every message carries schema_version={SCHEMA_VERSION}.",
        },
        "defaultContentType": "application/json",
        "servers": {"embedded": {"host": "127.0.0.1:4222", "protocol": "nats", "description": "`rose up` picks a free port and prints it."}},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": components, "messages": messages},
    }


def export(directory: str | Path) -> list[Path]:
    """Write `schemas/<Message>.json` and `asyncapi.json` under `directory`; return the paths."""
    root = Path(directory)
    (root / "schemas").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, schema in json_schemas().items():
        path = root / "schemas" / f"{name}.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    path = root / "asyncapi.json"
    path.write_text(json.dumps(asyncapi_document(), indent=2) + "\n")
    written.append(path)
    return written


# ---- the public events, as Markdown ----------------------------------------------------

INTEGRATIONS = "integrations"
EVENTS_DOC_HEADER = """# ROSE events

<!-- Generated by `rose contracts docs docs/events.md` from the AsyncAPI export
     (rose.contracts.export.events_markdown); a test fails when it is out of date. Do not edit. -->

Every public event ROSE publishes for other systems: leases, SLO alerts, weight versions,
trajectories, placements and services coming and going. Each is a JSON object (a msgspec
Struct from `rose.contracts`, with `schema_version`) on a NATS subject kept in a JetStream
stream, so a consumer can replay what it missed. Tokens in braces are subject tokens: subscribe
with `*` in their place (`rose.events.lease.*.*`) or `>` for a whole family (`rose.events.>`).
Every message also carries W3C trace context (`traceparent`) in its NATS headers.

Three ways to integrate (see `examples/`):

- **NATS, live**: `examples/subscribe_events.py` subscribes with plain nats-py and decodes each
  event into its `rose.contracts` type with msgspec.
- **NATS, durable**: a JetStream durable consumer on the stream named below keeps your place
  across restarts (`rose events forward` does this).
- **HTTP webhooks**: `rose events forward --to URL --subjects 'rose.events.>'` POSTs each event
  (a CloudEvents 1.0 JSON envelope: `subject`, `type`, `id`, `time` and the event as `data`),
  retries with backoff, and appends what the URL refuses to a dead-letter file (JSON lines).
"""


def public_event_channels(doc: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(key, channel) of every AsyncAPI channel whose consumers include integrations, in registry order."""
    doc = doc or asyncapi_document()
    return [(key, ch) for key, ch in doc["channels"].items() if INTEGRATIONS in ch["x-rose"]["consumers"]]


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type_of(schema: dict[str, Any]) -> str:
    """A short human type for a JSON Schema node (links nested types to their section)."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_type_of(s) for s in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map of string to {_type_of(schema['additionalProperties'])}"
    bounds = []
    if "minimum" in schema:
        bounds.append(f"≥ {schema['minimum']:g}")
    if "maximum" in schema:
        bounds.append(f"≤ {schema['maximum']:g}")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _fields_table(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    lines = ["| field | type | required | notes |", "| --- | --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        notes = []
        if prop.get("description") and "subject-safe" not in prop["description"]:
            notes.append(prop["description"].strip().replace("\n", " "))
        if "pattern" in prop:
            notes.append("subject-safe id")
        if "default" in prop and prop["default"] not in ("", [], {}, None):
            notes.append(f"default `{json.dumps(prop['default'])}`")
        lines.append(f"| `{name}` | {_type_of(prop)} | {'yes' if name in required else 'no'} | {'; '.join(notes)} |")
    return lines


def _nested_refs(schema: dict[str, Any]) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                found.append(_ref_name(node["$ref"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema.get("properties", {}))
    return found


def events_markdown(doc: dict[str, Any] | None = None) -> str:
    """docs/events.md: every public event channel of the AsyncAPI document, its payload and nested types."""
    doc = doc or asyncapi_document()
    schemas = doc["components"]["schemas"]
    channels = public_event_channels(doc)
    out = [EVENTS_DOC_HEADER, "", "## Index", "", "| event | subject | stream | payload |", "| --- | --- | --- | --- |"]
    for key, ch in channels:
        payload = next(iter(ch["messages"]))
        out.append(
            f"| [{ch['title']}](#{key.replace('_', '-')}) | `{ch['address']}` | `{ch['x-rose']['stream']}` | [{payload}](#{payload.lower()}) |"
        )
    nested: list[str] = []
    for key, ch in channels:
        payload = next(iter(ch["messages"]))
        schema = schemas[payload]
        out += ["", f'<a id="{key.replace("_", "-")}"></a>', f"## {ch['title']}", "", ch["description"], ""]
        out.append(f"- subject: `{ch['address']}`")
        for token in ch.get("parameters", {}):
            values = schema.get("properties", {}).get(token, {}).get("enum")
            meaning = f"one of {', '.join(f'`{v}`' for v in values)}" if values else f"the {token.replace('_', ' ')}"
            out.append(f"  - `{{{token}}}`: {meaning}")
        out.append(f"- stream: `{ch['x-rose']['stream']}` (retention `{ch['x-rose']['retention']}`), at most {ch['x-rose']['maxBytes']} bytes")
        out.append(f"- published by: {', '.join(ch['x-rose']['publishers'])}; consumed by: {', '.join(ch['x-rose']['consumers'])}")
        out.append(f"- payload: [{payload}](#{payload.lower()}), JSON")
        out += ["", f"### {payload}", "", (schema.get("description") or "").strip(), "", *_fields_table(schema)]
        nested += [n for n in _nested_refs(schema) if n not in nested]
    seen = {next(iter(ch["messages"])) for _, ch in channels}
    queue = [n for n in nested if n not in seen]
    if queue:
        out += ["", "## Nested types"]
    while queue:
        name = queue.pop(0)
        if name in seen:
            continue
        seen.add(name)
        schema = schemas[name]
        out += ["", f"### {name}", ""]
        if schema.get("description"):
            out += [schema["description"].strip(), ""]
        out += _fields_table(schema)
        queue += [n for n in _nested_refs(schema) if n not in seen]
    return "\n".join(line.rstrip() for line in out).rstrip() + "\n"
