"""Many emulated executors in one process (services/executor/group.py): each its own instance, NKey and port."""

from __future__ import annotations

import msgspec
import pytest

from rose.services.executor.config import ExecutorConfig
from rose.services.executor.group import EmulatedFleet, group_configs, instance_names
from rose.shared.config import ConfigError


def test_a_fleet_spec_is_parsed_and_sized_as_the_simulator_sizes_instances():
    fleet = EmulatedFleet.parse("16xh100:70B+7B")
    assert (fleet.gpus, fleet.device, fleet.serving_model, fleet.policy_model) == (16, "H100", "70B", "7B")
    assert EmulatedFleet.parse("8xH100:7B").instances(dedicated=False) == 8
    assert EmulatedFleet.parse("8xH100:70B").instances(dedicated=False) == 1  # TP8: both 70B models in 65 % of the HBM
    for bad in ("8H100:7B", "0xH100:7B", "8xB200:7B", "8xH100:9B"):
        with pytest.raises(ValueError):
            EmulatedFleet.parse(bad)
    with pytest.raises(ValueError, match="needs 8 GPUs"):
        EmulatedFleet.parse("4xH100:70B").instances(dedicated=False)


def test_each_executor_gets_its_own_instance_seed_and_port(tmp_path):
    names = instance_names("emu-serving", 3)
    for name in names:
        (tmp_path / f"executor@{name}.nk").write_text("SU...")
    base = ExecutorConfig()
    base = msgspec.structs.replace(base, bus=msgspec.structs.replace(base.bus, nkey_seed_file=str(tmp_path / f"executor@{names[0]}.nk")))
    configs = group_configs(base, EmulatedFleet.parse("3xH100:7B"), names)
    assert [c.runtime.instance for c in configs] == names
    assert [c.bus.nkey_seed_file for c in configs] == [str(tmp_path / f"executor@{n}.nk") for n in names]
    assert {c.engine.device for c in configs} == {"emulated:H100"} and {c.emulation.model for c in configs} == {"7B"}
    assert [c.runtime.metrics_port for c in configs] == [0, -1, -1]  # the process's one runtime endpoint
    assert {c.http.port for c in configs} == {0}  # a free port each
    (tmp_path / f"executor@{names[2]}.nk").unlink()
    with pytest.raises(ConfigError, match="emu-serving-2"):
        group_configs(base, EmulatedFleet.parse("3xH100:7B"), names)  # never the shared seed in its place
