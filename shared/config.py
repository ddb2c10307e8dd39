"""Typed configuration: one msgspec Struct per service, from a TOML file and `ROSE_*` variables.

Precedence: defaults < TOML file (`--config FILE` or `ROSE_CONFIG`) < environment. A nested
field is named with `__` in the environment: `ROSE_BUS__URL` sets `bus.url`. `NATS_URL` is
also honoured for `bus.url`, as every NATS tool does. One validation pass runs at start; a
bad value fails with the field's name, where it came from and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from rose.shared.errors import RoseError

from .clock import is_duration, time_scale

DTypeName = Literal["float32", "bfloat16", "float16"]  # a model's dtype as a setting names it (torch's attribute name)

ENV_PREFIX = "ROSE_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

T = TypeVar("T", bound=msgspec.Struct)

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0)]


class ConfigError(RoseError, ValueError):
    """A configuration value is missing or not allowed; the message names the field and its source."""


class BusConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a service reaches NATS. Credentials and TLS are per service."""

    url: str = DEFAULT_NATS_URL  # one URL or a comma-separated list for a cluster
    creds_file: str = ""  # NATS .creds (JWT + NKey seed)
    nkey_seed_file: str = ""
    user: str = ""
    password: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    connect_timeout_s: PositiveSeconds = 5.0
    initial_connect_deadline_s: PositiveSeconds = 30.0
    reconnect_wait_s: PositiveSeconds = 1.0
    max_reconnect_attempts: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: forever
    request_timeout_s: PositiveSeconds = 5.0
    drain_timeout_s: PositiveSeconds = 10.0
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1  # of streams, buckets and stores

    def servers(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]

    def display_url(self) -> str:
        """The URL(s) for logs and messages: any `user:password@` is replaced by `***@`."""
        return ",".join(re.sub(r"//[^/@]*@", "//***@", u) for u in self.servers())

    def __repr__(self) -> str:  # secrets never reach a log line through a config dump
        return f"BusConfig(url={self.display_url()!r}, user={self.user!r}, password={'***' if self.password else ''!r}, ...)"


class RuntimeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What every service's lifecycle needs."""

    instance: str = ""  # defaults to <service>-<host>-<pid>
    heartbeat_interval_s: PositiveSeconds = 2.0
    log_level: str = "INFO"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # Prometheus endpoint of this service (GET /metrics), advertised in its heartbeat as `metrics`.
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container
    metrics_port: Annotated[int, msgspec.Meta(ge=-1, le=65535)] = 0  # 0: a free port; -1: no endpoint
    metrics_public_host: str = ""  # the host name to advertise (default: metrics_host, or the host name for 0.0.0.0)


def _env_overrides(cls: type, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Nested dict of the ROSE_* variables that name fields of `cls`, and field path -> variable name."""
    fields = {f.name: f.type for f in msgspec.structs.fields(cls)}
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or key == "ROSE_CONFIG":
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in fields:
            continue
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _parse_env_value(value)
        sources["$." + ".".join(path)] = key
    if "NATS_URL" in env and "bus" in fields and "$.bus.url" not in sources:
        data.setdefault("bus", {})["url"] = env["NATS_URL"]
        sources["$.bus.url"] = "NATS_URL"
    return data, sources


def _parse_env_value(value: str) -> Any:
    """Lists and tables may be given as JSON; anything else stays a string for msgspec to convert."""
    stripped = value.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return msgspec.json.decode(stripped)
        except msgspec.DecodeError:
            return value
    return value


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls: type[T], *, path: str | Path | None = None, env: Mapping[str, str] | None = None) -> T:
    """Build `cls` from defaults, the TOML file and the environment, validating once."""
    env = os.environ if env is None else env
    path = path or env.get("ROSE_CONFIG") or None
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"configuration file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"configuration file {path} is not valid TOML: {exc}") from exc
    overrides, sources = _env_overrides(cls, env)
    data = _merge(data, overrides)
    try:
        config = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(cls, exc, sources, path)) from exc
    try:
        scale = time_scale(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return config if scale == 1.0 else scaled_durations(config, scale)


def scaled_durations(config: T, scale: float) -> T:
    """``config`` with every duration field (``*_s``, ``*_ms``, nested tables included) times ``scale``:
    one emulated second takes ``scale`` wall seconds (shared/clock.py)."""
    changes: dict[str, Any] = {}
    for f in msgspec.structs.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, msgspec.Struct):
            changes[f.name] = scaled_durations(value, scale)
        elif is_duration(f.name) and isinstance(value, int | float) and not isinstance(value, bool):
            changes[f.name] = float(value) * scale
    return msgspec.structs.replace(config, **changes)


def _explain(cls: type, exc: msgspec.ValidationError, sources: dict[str, str], path: Any) -> str:
    text = str(exc)
    field_path = text.rsplit(" - at `", 1)[1].rstrip("`") if " - at `" in text else ""
    reason = text.split(" - at `", 1)[0]
    where = sources.get(field_path) or (f"file {path}" if path else "defaults")
    if field_path:
        name = field_path.removeprefix("$.")
        return f"invalid configuration for {cls.__name__}: field `{name}` (from {where}): {reason}"
    return f"invalid configuration for {cls.__name__} (from {where}): {reason}"
