"""Hypothesis strategies for contract messages, built from msgspec's type information: every example
is a valid message (ranges, patterns and lengths honoured)."""

from __future__ import annotations

import msgspec.inspect as mi
from hypothesis import strategies as st


def strategy_for(info: mi.Type) -> st.SearchStrategy:
    """A hypothesis strategy that honours msgspec's constraints (ranges, patterns, lengths)."""
    if isinstance(info, mi.Metadata):
        return strategy_for(info.type)
    if isinstance(info, mi.StructType):
        fields = {f.encode_name: strategy_for(f.type) for f in info.fields if f.name != "schema_version"}
        cls = info.cls
        return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))
    if isinstance(info, mi.IntType):
        lo = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else -(2**53))
        hi = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else 2**53)
        return st.integers(lo, hi)
    if isinstance(info, mi.FloatType):
        low: float | None = info.ge if info.ge is not None else info.gt
        high: float | None = info.le if info.le is not None else info.lt
        return st.floats(
            min_value=low if low is not None else -1e12,
            max_value=high if high is not None else 1e12,
            exclude_min=info.gt is not None,
            exclude_max=info.lt is not None,
            allow_nan=False,
            allow_infinity=False,
        )
    if isinstance(info, mi.StrType):
        if info.pattern:
            return st.from_regex(info.pattern, fullmatch=True)
        return st.text(min_size=info.min_length or 0, max_size=min(info.max_length or 40, 40))
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.BytesType):
        return st.binary(max_size=64)
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.UnionType):
        return st.one_of([strategy_for(t) for t in info.types])
    if isinstance(info, mi.ListType):
        return st.lists(strategy_for(info.item_type), min_size=info.min_length or 0, max_size=min(info.max_length or 5, 5))
    if isinstance(info, mi.DictType):
        return st.dictionaries(strategy_for(info.key_type), strategy_for(info.value_type), max_size=4)
    raise TypeError(f"no strategy for {info!r}")
