"""Many emulated executors in one process: `rose run executor --emulate 8xH100:7B [--role serving]`.

As NVIDIA Dynamo's mocker runs `--num-workers` engines in one process, an emulated fleet of GPUs
runs here as one executor per instance of the fleet (8 H100s hold eight 7B serving instances, two
70B ones at TP4...), each exactly what `rose run executor` runs: its own instance name, NATS
credentials (`executor@NAME`), bus connection, lease, subscriptions, engine (two lane threads over
its own ``EmulatedAccelerator``) and HTTP port. What they share is what a process has one of: the
interpreter and event loop, the tracer and meter providers and the log setup (each series, span
and log line names its executor), the runtime's Prometheus endpoint (the first executor's; every
executor's own HTTP serves ``/metrics`` too) and the signal handlers (this module stops them all).

An emulated device computes nothing on the host, so one process can hold a fleet: what the host
still pays is each executor's real scheduling, bookkeeping, HTTP and bus work, which the devices'
``forward_lag`` telemetry shows when the host falls behind.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from rose.shared.config import ConfigError, load_config
from rose.shared.devices import DEVICES, model_spec
from rose.shared.service import ServiceRuntime

from .config import ExecutorConfig
from .emulated import EMULATED_PREFIX, instance_tp
from .main import run

FLEET_RE = re.compile(r"^(\d+)\s*x\s*([A-Za-z0-9]+)\s*:\s*([0-9]+B)(?:\s*\+\s*([0-9]+B))?$", re.IGNORECASE)


@dataclass(frozen=True)
class EmulatedFleet:
    """``COUNTxKIND:MODEL[+POLICY]``: COUNT GPUs of KIND serving MODEL (co-hosting POLICY, default MODEL)."""

    gpus: int
    device: str
    serving_model: str
    policy_model: str

    @classmethod
    def parse(cls, text: str) -> EmulatedFleet:
        match = FLEET_RE.match(text.strip())
        if not match:
            raise ValueError(f"--emulate {text!r}: expected COUNTxKIND:MODEL[+POLICY], e.g. 8xH100:7B or 16xH100:70B+7B")
        count, kind, model, policy = match.groups()
        kind = next((k for k in DEVICES if k.lower() == kind.lower()), None)
        if kind is None or int(count) < 1:
            raise ValueError(f"--emulate {text!r}: COUNT must be positive and KIND one of {', '.join(DEVICES)}")
        return cls(int(count), kind, model_spec(model).name, model_spec(policy or model).name)

    def tp(self, dedicated: bool) -> int:
        return instance_tp(self.device, self.serving_model, self.policy_model, dedicated)

    def instances(self, dedicated: bool) -> int:
        """Executors the fleet's GPUs make (one per instance of ``tp`` GPUs)."""
        tp = self.tp(dedicated)
        if self.gpus < tp:
            role = "a dedicated" if dedicated else "a serving"
            raise ValueError(f"{self.gpus}x{self.device}: {role} instance of {self.serving_model}+{self.policy_model} needs {tp} GPUs")
        return self.gpus // tp


def instance_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(count)]


def group_configs(base: ExecutorConfig, fleet: EmulatedFleet, names: list[str]) -> list[ExecutorConfig]:
    """One executor's configuration per name: ``base`` on the fleet's emulated device, each with its own
    instance, HTTP port (0: a free one each; N: N, N+1, ...) and, where ``base`` authenticates with an
    NKey seed, its instance's own seed beside it (``executor@NAME.nk``, made by ``rose security init
    --instance executor=NAME``): never the shared one, with which it could answer for any executor."""
    seeds: list[str] = [base.bus.nkey_seed_file] * len(names)
    if base.bus.nkey_seed_file:
        folder = Path(base.bus.nkey_seed_file).parent
        seeds = [str(folder / f"executor@{name}.nk") for name in names]
        missing = [s for s in seeds if not Path(s).exists()]
        if missing:
            raise ConfigError(f"no credentials of executor instances {missing[:3]}: declare them (`rose security init --instance executor=NAME,...`)")
    configs = []
    for i, (name, seed) in enumerate(zip(names, seeds)):
        configs.append(
            msgspec.structs.replace(
                base,
                bus=msgspec.structs.replace(base.bus, nkey_seed_file=seed),
                runtime=msgspec.structs.replace(base.runtime, instance=name, metrics_port=base.runtime.metrics_port if i == 0 else -1),
                engine=msgspec.structs.replace(base.engine, device=EMULATED_PREFIX + fleet.device),
                emulation=msgspec.structs.replace(base.emulation, model=fleet.serving_model, policy_model=fleet.policy_model),
                http=msgspec.structs.replace(base.http, port=base.http.port + i if base.http.port else 0),
            )
        )
    return configs


def import_model_code() -> None:
    """Import transformers' tokenizer classes once, before the executors load their tokenizers in threads at once:
    its lazily loaded module raised ImportError when several threads imported it for the first time together
    (the models need no transformers: shared.models.load_for_inference; its fallback, load_model, takes turns)."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401


# How long a thread may hold the interpreter before another that is ready gets it (Python's default: 5 ms).
# A group runs two lane threads per executor; an emulated forward ends by waking its lane, which then waits
# for the interpreter behind the others: at 5 ms that wait alone is a large share of a decode step.
GROUP_SWITCH_INTERVAL_S = 0.0005


async def run_group(configs: list[ExecutorConfig]) -> None:
    """Run every executor on this loop until SIGTERM / SIGINT, which drains them all."""
    sys.setswitchinterval(GROUP_SWITCH_INTERVAL_S)
    import_model_code()
    runtimes: list[ServiceRuntime] = []
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for rt in runtimes:
            rt.request_shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    await asyncio.gather(*(run(config, on_runtime=runtimes.append) for config in configs))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rose run executor", description="Run a group of emulated executors in one process.")
    parser.add_argument("--config", default=None, help="TOML file (ROSE_* variables override it): every executor's settings")
    parser.add_argument("--emulate", required=True, metavar="COUNTxKIND:MODEL[+POLICY]", help="the emulated fleet, e.g. 8xH100:7B")
    parser.add_argument("--role", choices=("serving", "dedicated"), default=None, help="the executors' role (default: the config's)")
    parser.add_argument(
        "--instance-prefix", default=None, help="instances are PREFIX-0, PREFIX-1, ... (default: the config's runtime.instance, else executor-HOST)"
    )
    args = parser.parse_args(argv)
    try:
        base = load_config(ExecutorConfig, path=args.config)
        if args.role:
            base = msgspec.structs.replace(base, role=args.role)
        fleet = EmulatedFleet.parse(args.emulate)
        prefix = args.instance_prefix or base.runtime.instance or f"executor-{re.sub(r'[^A-Za-z0-9_-]', '-', socket.gethostname())}"
        configs = group_configs(base, fleet, instance_names(prefix, fleet.instances(base.role == "dedicated")))
    except (ConfigError, ValueError) as exc:
        print(f"rose run executor: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run_group(configs))
    return 0
