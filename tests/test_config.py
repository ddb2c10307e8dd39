"""Configuration from TOML and ROSE_* variables; bad values name the field, the source and what is allowed."""

from __future__ import annotations

import importlib

import msgspec
import pytest

from rose.shared.config import BusConfig, ConfigError, RuntimeConfig, load_config


class DemoConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    quantum_ms: float = 10.0


def test_defaults_toml_and_env_precedence(tmp_path):
    path = tmp_path / "rose.toml"
    path.write_text('quantum_ms = 20.0\n[bus]\nurl = "nats://a:1"\nreplicas = 3\n')
    cfg = load_config(DemoConfig, path=path, env={"ROSE_BUS__URL": "nats://b:2", "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"})
    assert cfg.quantum_ms == 20.0 and cfg.bus.replicas == 3
    assert cfg.bus.url == "nats://b:2"
    assert cfg.runtime.heartbeat_interval_s == 0.5


def test_nats_url_is_honoured_unless_rose_bus_url_is_set():
    assert load_config(DemoConfig, env={"NATS_URL": "nats://n:4"}).bus.url == "nats://n:4"
    cfg = load_config(DemoConfig, env={"NATS_URL": "nats://n:4", "ROSE_BUS__URL": "nats://r:5"})
    assert cfg.bus.url == "nats://r:5"
    assert load_config(DemoConfig, env={"NATS_URL": "nats://a:1,nats://b:2"}).bus.servers() == ["nats://a:1", "nats://b:2"]


def test_bad_env_value_names_field_source_and_rule():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, env={"ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "-1"})
    text = str(err.value)
    assert "runtime.heartbeat_interval_s" in text and "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S" in text and "> 0" in text


def test_bad_type_and_unknown_toml_field(tmp_path):
    with pytest.raises(ConfigError, match="quantum_ms.*Expected `float`"):
        load_config(DemoConfig, env={"ROSE_QUANTUM_MS": "fast"})
    path = tmp_path / "bad.toml"
    path.write_text("[bus]\nulr = 'typo'\n")
    with pytest.raises(ConfigError, match="unknown field `ulr`"):
        load_config(DemoConfig, path=path, env={})


def test_missing_or_broken_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DemoConfig, path="/nonexistent/rose.toml", env={})


def test_a_service_with_a_bad_value_stops_at_start_naming_the_field():
    import os
    import subprocess
    import sys

    env = {**os.environ, "ROSE_ENGINE__QUANTUM_MS": "-3"}
    proc = subprocess.run([sys.executable, "-m", "rose.cli.main", "run", "executor"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "engine.quantum_ms" in proc.stderr and "ROSE_ENGINE__QUANTUM_MS" in proc.stderr and "> 0" in proc.stderr


def test_a_time_scale_scales_every_duration_setting_of_every_service_and_nothing_else():
    """Emulated time (shared/clock.py): with ROSE_TIME_SCALE=4 every *_s / *_ms setting of every service is 4x,
    nested tables too, and no other setting moves; a bad scale is refused naming the variable."""
    from rose.shared.clock import is_duration

    def leaves(config, prefix=""):
        for f in msgspec.structs.fields(config):
            value = getattr(config, f.name)
            if isinstance(value, msgspec.Struct):
                yield from leaves(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    services = ("executor", "slo_monitor", "scheduler", "rollout_worker", "weight_publisher", "trainer")
    checked = 0
    for name in services:
        module = importlib.import_module(f"rose.services.{name}.config")
        cls = next(v for k, v in vars(module).items() if k.endswith("Config") and getattr(v, "__module__", "") == module.__name__)
        plain, scaled = dict(leaves(load_config(cls, env={}))), dict(leaves(load_config(cls, env={"ROSE_TIME_SCALE": "4"})))
        for path, value in plain.items():
            if is_duration(path.rsplit(".", 1)[-1]):
                assert isinstance(value, float), f"{name}.{path}: a duration setting must be a float, got {type(value).__name__}"
                assert scaled[path] == pytest.approx(4.0 * value), f"{name}.{path}"
                checked += 1
            else:
                assert scaled[path] == value, f"{name}.{path} is not a duration but changed under a time scale"
    assert checked > 60
    with pytest.raises(ConfigError, match="ROSE_TIME_SCALE"):
        load_config(RuntimeConfig, env={"ROSE_TIME_SCALE": "fast"})
