"""The base of every message on the bus: a msgspec Struct that carries a schema version.

Schema evolution follows msgspec's rules: new fields are added with defaults and existing
fields never change meaning. A reader accepts unknown fields (a newer writer may add some),
but rejects a different *major* schema version, because that is a promise that meanings
changed.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

SCHEMA_VERSION = 1

# Reusable constrained scalar types: validated on decode, emitted into the JSON Schema.
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Identifier = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="A subject-safe identifier: letters, digits, '_' and '-'.",
    ),
]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
UnixSeconds = Annotated[float, msgspec.Meta(ge=0.0, description="Seconds since the Unix epoch.")]


class Message(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Every message that crosses the bus inherits this."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not supported; this build speaks schema_version {SCHEMA_VERSION}")
