"""Bad input on every contract decoder (hypothesis): random bytes and mutations of valid encodings.

For every message type of the registry, in JSON (every channel's wire encoding) and msgpack,
whatever the bytes: `rose.shared.codec.decode` returns a valid message (it re-encodes and
decodes to itself) or raises `PayloadError` with a dead-letter kind and a reason. Any other
exception is a crash of the service that reads it. The number of cases tried is printed at
the end of the module.
"""

from __future__ import annotations

import collections
import json

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rose.contracts import SCHEMA_VERSION
from rose.contracts.registry import CHANNELS, Encoding, message_types
from rose.shared.codec import PayloadError, decode, encode
from rose.testing.strategies import strategy_for

TYPES = message_types()
KINDS = {"oversized", "decode", "schema_version", "validation"}
EXAMPLES = 100  # per message type and kind of input: 23 types x 3 kinds x 100 + explicit cases, ~20 s on 2 cores
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CASES: collections.Counter[str] = collections.Counter()


def _limit(t: type) -> int:
    """The size limit of the channel(s) that carry `t` (the decoder's max_bytes)."""
    return max([c.max_bytes for c in CHANNELS if t in (c.payload, c.reply)] or [1 << 20])


def check(data: bytes, t: type, encoding: Encoding, case: str) -> None:
    CASES[case] += 1
    try:
        msg = decode(data, t, encoding, max_bytes=_limit(t))
    except PayloadError as exc:
        assert exc.kind in KINDS and exc.reason, exc
        return
    CASES["accepted"] += 1
    assert type(msg) is t and msg.schema_version == SCHEMA_VERSION
    assert decode(encode(msg, encoding), t, encoding) == msg or _has_nan(msg)  # a valid message: it survives the wire


def _has_nan(msg: object) -> bool:
    """msgpack can carry NaN into an unconstrained float (never equal to itself); JSON cannot."""
    return "nan" in repr(msg)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def byte_mutation(draw, valid: bytes) -> bytes:
    """One edit of a valid encoding: flip, truncate, insert, delete or duplicate bytes."""
    data = bytearray(valid)
    at = draw(st.integers(0, max(0, len(data) - 1)))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]))
    if how == "flip" and data:
        data[at] ^= draw(st.integers(1, 255))
    elif how == "truncate":
        del data[at:]
    elif how == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    elif how == "delete":
        del data[at : at + draw(st.integers(1, 16))]
    else:
        data[at:at] = data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@st.composite
def field_mutation(draw, valid: dict) -> dict:
    """One edit of a valid message's fields: a wrong value, a missing field, an unknown one, another schema_version."""
    doc = json.loads(json.dumps(valid))
    node = doc
    nested = [k for k, v in doc.items() if isinstance(v, dict) and v]
    if nested and draw(st.booleans()):
        node = doc[draw(st.sampled_from(sorted(nested)))]
    how = draw(st.sampled_from(["replace", "delete", "unknown", "schema_version"]))
    if how == "replace" and node:
        node[draw(st.sampled_from(sorted(node)))] = draw(JSON_VALUES)
    elif how == "delete" and node:
        del node[draw(st.sampled_from(sorted(node)))]
    elif how == "unknown":
        node[draw(st.text(min_size=1, max_size=10))] = draw(JSON_VALUES)
    else:
        doc["schema_version"] = draw(st.integers() | JSON_VALUES)
    return doc


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    total = sum(v for k, v in CASES.items() if k != "accepted")
    line = f"contract decoders: {total} bad-input cases over {len(TYPES)} message types ({dict(CASES)}); none crashed"
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown also without -s
        print(f"\n{line}")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.__name__)
def test_random_bytes(t):
    @FUZZ
    @given(st.binary(max_size=256), st.sampled_from([Encoding.JSON, Encoding.MSGPACK]))
    @example(b"", Encoding.JSON)
    @example(b'{"unknown":' + b"[" * 100_000 + b"]" * 100_000 + b"}", Encoding.JSON)  # nesting past the recursion limit
    @example(b"\xde\xad\xbe\xef", Encoding.MSGPACK)
    def run(data, encoding):
        check(data, t, encoding, "random_bytes")

    run()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.__name__)
def test_mutated_encodings(t):
    @FUZZ
    @given(st.data(), strategy_for(mi.type_info(t)), st.sampled_from([Encoding.JSON, Encoding.MSGPACK]))
    def run(data, msg, encoding):
        check(data.draw(byte_mutation(encode(msg, encoding))), t, encoding, "byte_mutations")

    run()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.__name__)
def test_mutated_fields(t):
    @FUZZ
    @given(st.data(), strategy_for(mi.type_info(t)))
    def run(data, msg):
        doc = data.draw(field_mutation(msgspec.to_builtins(msg)))
        check(json.dumps(doc).encode(), t, Encoding.JSON, "field_mutations")  # the stdlib writes any int (msgspec stops at 64 bits)
        try:
            packed = msgspec.msgpack.encode(doc)
        except OverflowError:  # msgpack has no integers past 64 bits
            return
        check(packed, t, Encoding.MSGPACK, "field_mutations")

    run()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.__name__)
def test_oversized_and_truncated(t):
    """Over the channel's limit: `oversized` before parsing; cut anywhere: `decode` or `validation`, never a crash."""
    limit = _limit(t)
    with pytest.raises(PayloadError) as err:
        decode(b" " * (limit + 1), t, Encoding.JSON, max_bytes=limit)
    assert err.value.kind == "oversized" and str(limit) in err.value.reason
    CASES["oversized"] += 1

    @settings(FUZZ, max_examples=3)
    @given(strategy_for(mi.type_info(t)))
    def run(msg):
        valid = encode(msg)
        for cut in range(len(valid)):  # every prefix of a valid encoding
            check(valid[:cut], t, Encoding.JSON, "truncations")

    run()
