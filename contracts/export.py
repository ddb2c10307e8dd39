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
        for t in (channel.payload, channel.reply):
            if t is not None:
                entry["messages"][t.__name__] = {"$ref": f"#/components/messages/{t.__name__}"}
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
        "servers": {
            "embedded": {"host": "127.0.0.1:4222", "protocol": "nats", "description": "`rose up` picks a free port and prints it."}
        },
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
