"""Contracts: property-based round trips for every message, the registry's rules, and the exported documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings

from rose.contracts import SCHEMA_VERSION
from rose.contracts.export import asyncapi_document, export, json_schemas
from rose.contracts.registry import CHANNELS, GENERATE, Encoding, Kind, message_types
from rose.shared.codec import PayloadError, decode, encode
from rose.testing.strategies import strategy_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def validators() -> dict[str, tuple[jsonschema.Validator, jsonschema.Validator]]:
    """Per message: the standalone exported JSON Schema, and the AsyncAPI component schema."""
    doc = asyncapi_document()
    components = json.loads(json.dumps(doc["components"]["schemas"]).replace("#/components/schemas/", "#/$defs/"))
    out = {}
    for name, schema in json_schemas().items():
        jsonschema.Draft202012Validator.check_schema(schema)
        component = {"$defs": components, "$ref": f"#/$defs/{name}"}
        jsonschema.Draft202012Validator.check_schema(component)
        out[name] = (jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(component))
    return out


@pytest.mark.parametrize("message_type", message_types(), ids=lambda t: t.__name__)
def test_every_message_round_trips_and_matches_its_exported_schemas(message_type, validators):
    standalone, component = validators[message_type.__name__]

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(mi.type_info(message_type)))
    def roundtrip(msg):
        assert msg.schema_version == SCHEMA_VERSION
        data = encode(msg)
        assert decode(data, message_type) == msg
        assert decode(msgspec.msgpack.encode(msg), message_type, encoding=Encoding.MSGPACK) == msg
        as_json = json.loads(data)
        assert as_json["schema_version"] == SCHEMA_VERSION
        standalone.validate(as_json)
        component.validate(as_json)

    roundtrip()
    required = [f for f in msgspec.structs.fields(message_type) if f.required]
    if required:
        with pytest.raises(jsonschema.ValidationError):
            standalone.validate({"schema_version": SCHEMA_VERSION})


def test_every_message_carries_a_schema_version_and_rejects_another():
    for t in message_types():
        assert "schema_version" in t.__struct_fields__, t.__name__
    with pytest.raises(PayloadError) as err:
        decode(b'{"schema_version": 99}', message_types()[0])
    assert err.value.kind in {"schema_version", "validation"}


def test_registry_is_complete_and_consistent():
    names = [c.name for c in CHANNELS]
    assert len(names) == len(set(names))
    templates = [c.template for c in CHANNELS if c.kind not in (Kind.KV, Kind.OBJECTS)]
    assert len(templates) == len(set(templates))
    for c in CHANNELS:
        assert c.publishers and c.consumers and c.description, c.name
        assert (c.kind is Kind.REQUEST) == (c.reply is not None), c.name
        assert (c.kind is Kind.STREAM) == (c.stream is not None), c.name
        assert (c.kind is Kind.KV) == (c.kv is not None), c.name
        if c.kind not in (Kind.KV, Kind.OBJECTS):
            assert c.template.startswith("rose."), c.name


def test_subject_tokens_are_validated():
    assert GENERATE.subject(executor_id="ex-1") == "rose.executor.ex-1.generate"
    for bad in ("", "a.b", "*", ">", "has space"):
        with pytest.raises(ValueError, match="not a valid subject token"):
            GENERATE.subject(executor_id=bad)
    with pytest.raises(ValueError, match="needs"):
        GENERATE.subject()


def test_no_subject_string_is_written_outside_contracts():
    pattern = re.compile(r"""["']rose\.(svc|events|dlq|executor|telemetry|slo|scheduler|rollout|weights)[.'"]""")
    offenders = []
    for folder in ("shared", "services", "cli"):
        for path in (REPO / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "getLogger(" not in line:  # logger names are not subjects
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_export_writes_a_schema_per_message_and_the_asyncapi_document(tmp_path):
    written = export(tmp_path)
    assert {p.name for p in written} == {f"{t.__name__}.json" for t in message_types()} | {"asyncapi.json"}
    for t in message_types():
        schema = json.loads((tmp_path / "schemas" / f"{t.__name__}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(schema)


def _resolve(doc: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def test_asyncapi_document_is_well_formed_and_every_ref_resolves(tmp_path):
    export(tmp_path)
    doc = json.loads((tmp_path / "asyncapi.json").read_text())
    assert doc == json.loads(json.dumps(asyncapi_document()))
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["title"] and doc["info"]["version"]
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    refs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    for ref in refs:
        _resolve(doc, ref)
    assert set(doc["channels"]) == {c.name.replace(".", "_") for c in CHANNELS}
    for key, channel in doc["channels"].items():
        if channel["address"] is not None:
            params = re.findall(r"{(\w+)}", channel["address"])
            assert set(params) == set(channel.get("parameters", {})), key
    for op in doc["operations"].values():
        assert op["action"] in ("send", "receive")
        assert _resolve(doc, op["channel"]["$ref"])
