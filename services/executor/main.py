"""The co-serving executor service: both models on one device, OpenAI API for serving, bus for rollout.

connect -> load models -> start engine -> lease guard -> bus endpoints -> HTTP -> telemetry -> wait -> drain.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import fcntl
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from aiohttp import web

from rose.contracts.registry import EXECUTOR_BURST, GENERATE
from rose.contracts.slo import SloAlert
from rose.shared.bursts import BurstTrip
from rose.shared.bus import Bus
from rose.shared.http_server import HardenedAppRunner
from rose.shared.lora import is_adapter_dir, read_adapter
from rose.shared.models import POLICY_DIRNAME, SERVING_DIRNAME, init_models, models_root
from rose.shared.service import ServiceRuntime, service_main
from rose.shared.weight_signing import ManifestVerifier
from rose.shared.weight_sync import WeightFollower

from .adapters import NAMED_SLOTS
from .backend import CoServingEngine
from .config import MIB, ExecutorConfig
from .emulated import EMULATED_PREFIX, emulation_spec
from .engine import Engine, EngineConfig
from .http_api import OpenAIApi
from .leases import LeaseGuard
from .policy_updates import PolicyUpdates
from .rollout_api import RolloutApi
from .sglang_api import SGLangApi, SGLangServable
from .sglang_backend import SGLangBackend
from .telemetry import Telemetry

log = logging.getLogger("rose.executor")


def model_dirs(config: ExecutorConfig) -> tuple[Path, Path]:
    """The serving and policy model directories, built with `rose models init` logic if missing."""
    m = config.models
    root = models_root(m.dir)
    serving = Path(m.serving_dir) if m.serving_dir else root / SERVING_DIRNAME
    policy = Path(m.policy_dir) if m.policy_dir else root / POLICY_DIRNAME
    missing = [p for p in (serving, policy) if not ((p / "config.json").exists() or is_adapter_dir(p))]  # a LoRA policy: an adapter
    if missing and not (m.init_if_missing and not m.serving_dir and not m.policy_dir):
        raise FileNotFoundError(f"no model at {', '.join(map(str, missing))}: run `rose models init {root}` or set models.dir")
    if missing:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".init.lock", "w") as lock:  # several executors may start at once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not all((p / "config.json").exists() or is_adapter_dir(p) for p in (serving, policy)):
                log.info("building tiny models in %s", root)
                init_models(root, seed=m.seed)
    return serving, policy


def build_engine(config: ExecutorConfig) -> CoServingEngine:
    """Our own engine, or (`engine.backend = "sglang"`) the backend that drives two SGLang servers."""
    e = config.engine
    serving_dir, policy_dir = model_dirs(config)
    if e.backend == "sglang":
        return SGLangBackend.from_dirs(
            str(serving_dir),
            str(policy_dir),
            config.sglang_backend,
            dtype=getattr(torch, e.dtype),
            policy=e.policy,
            device=e.device,
            slo_ttft_ms=e.slo_ttft_ms,
            slo_tpot_ms=e.slo_tpot_ms,
            rollout_kv_bytes=int(e.rollout_kv_mib * MIB),
            bursts=config.bursts,
            burst_baseline_s=config.burst_baseline_s,
            rollout_mode=e.rollout_mode,  # one setting picks the mode: a LoRA policy runs co_batched only when told so
        )
    lora = read_adapter(policy_dir).shape if is_adapter_dir(policy_dir) else None  # a LoRA policy: the emulated model takes its shape
    emulation = (
        emulation_spec(
            e.device,
            config.emulation,
            dedicated=config.role == "dedicated",
            quantum_ms=e.quantum_ms,
            lora=lora,
            co_batched=e.rollout_mode == "co_batched",
        )
        if e.device.startswith(EMULATED_PREFIX)
        else None
    )
    engine_config = dataclasses.replace(
        EngineConfig.from_settings(e),
        rollout_is_guest=config.role != "dedicated",
        emulation=emulation,
        bursts=config.bursts,
        burst_baseline_s=config.burst_baseline_s,
        # adapters loaded by name (SGLang's /load_lora_adapter) only where the SGLang API that loads them is on
        named_adapter_slots=NAMED_SLOTS if config.sglang_api.enabled else 0,
    )
    return Engine.from_dirs(str(serving_dir), str(policy_dir), engine_config, policy=e.policy)


async def serve_http(api: OpenAIApi, config: ExecutorConfig) -> tuple[web.AppRunner, str]:
    runner = HardenedAppRunner(api.app, access_log=None)  # a deadline on request heads (see shared/http_server.py)
    await runner.setup()
    site = web.TCPSite(runner, config.http.host, config.http.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://{config.http.public_host or config.http.host}:{port}"


async def follow_weights(rt: ServiceRuntime, engine: CoServingEngine, config: ExecutorConfig) -> WeightFollower | None:
    """Join the policy's version stream (latest keyframe, then every delta) unless told not to."""
    if not config.weights.follow:
        return None
    updates = PolicyUpdates(engine)
    verifier = ManifestVerifier.from_settings(config.weights.trusted_keys) if config.weights.require_signed else None
    if verifier is None:
        log.warning("weights.require_signed is false: unsigned policy versions will be applied")
    else:
        keys, problems = verifier.keys()
        if keys:
            log.info("trusting weight-signing keys %s", sorted(keys))
        else:  # not fatal: the publisher may create the default pair later; until then every version is refused
            log.warning(
                "no trusted weight-signing key yet (%s); policy versions are refused until one is there", "; ".join(problems) or verifier.trusted
            )
    follower = WeightFollower(
        rt.bus,
        model=config.weights.model,
        apply=updates.apply,
        executor_id=rt.instance,
        digest=updates.digest if config.weights.report_digest else None,
        verifier=verifier,
    )
    await follower.start(engine.policy_state_dict(), None)
    return follower


def publish_bursts(engine: CoServingEngine, bus: Bus, executor_id: str, telemetry: Telemetry) -> None:
    """When the engine's own burst detector trips (shared/bursts.py), publish the alert for this executor
    at once: the scheduler stops routing turns here and revokes the lease (the engine yields on its own)."""
    pending: set[asyncio.Task] = set()

    async def send(alert: SloAlert) -> None:
        try:
            await bus.publish(EXECUTOR_BURST, alert, executor_id=executor_id)
        except Exception as exc:  # reconnecting: the monitor's detector still sees the burst in the metrics
            log.warning("could not publish a burst alert: %r", exc)

    def on_burst(trip: BurstTrip) -> None:
        alert = SloAlert(
            executor_id=executor_id,
            at=time.time(),
            severity="burst",
            reason=trip.reason,
            arrival_rate_rps=trip.arrival_rate_rps,
            serving_queue=trip.serving_queue,
        )
        telemetry.burst_alerted()
        # a trace of its own: the serving request whose arrival tripped the detector is not its cause
        task = asyncio.get_running_loop().create_task(send(alert), context=contextvars.Context())
        pending.add(task)
        task.add_done_callback(pending.discard)

    engine.on_burst.append(on_burst)


async def run(config: ExecutorConfig, *, on_runtime: Callable[[ServiceRuntime], None] | None = None) -> None:
    """One executor until it is told to stop. ``on_runtime``: several executors share this process (group.py),
    whose owner handles the signals and stops each runtime it is handed here."""
    engine = await asyncio.to_thread(build_engine, config)
    telemetry = Telemetry(engine, "", config.role, config.metrics_interval_s)
    runtime = ServiceRuntime("executor", bus=config.bus, runtime=config.runtime, load=telemetry.load, handle_signals=on_runtime is None)
    if on_runtime is not None:
        on_runtime(runtime)
    async with runtime as rt, engine:
        telemetry.bind(rt.instance)
        guard = LeaseGuard(engine, rt.instance, dedicated=config.role == "dedicated", rollout_kv_bytes=engine.lendable_kv_bytes)
        await guard.start(rt.bus)
        if config.role != "dedicated":
            publish_bursts(engine, rt.bus, rt.instance, telemetry)
        await rt.bus.serve(GENERATE, RolloutApi(engine, guard, rt.instance, telemetry).generate, executor_id=rt.instance)
        follower = await follow_weights(rt, engine, config)
        openai_api = OpenAIApi(engine, telemetry, config.models.serving_name, config.http.max_body_bytes, config.http.stream_interval)
        # SGLang's RL admin API on the policy model, for frameworks written against SGLang (our engine only:
        # behind the sglang backend, the SGLang servers answer these calls themselves)
        if config.sglang_api.enabled and isinstance(engine, SGLangServable):
            SGLangApi(
                engine,
                config.sglang_api,
                model_dir=str(model_dirs(config)[1]),
                served_name=config.weights.model,
                follows_bus_weights=config.weights.follow,
                executor_id=rt.instance,
            ).mount(openai_api.app)
        runner, base_url = await serve_http(openai_api, config)
        metrics_task = asyncio.create_task(telemetry.run(rt.bus), name="telemetry")
        rt.labels.update({"role": config.role, "device": engine.device.kind, "model": config.models.serving_name, "mode": config.engine.rollout_mode})
        if engine.device.emulates is not None:
            rt.labels["emulated"] = engine.device.emulates
        rt.ready(endpoints={"http": base_url, "openai": f"{base_url}/v1", "metrics": f"{base_url}/metrics"})
        log.info("executor %s serving on %s (%s)", rt.instance, base_url, config.role)
        try:
            await rt.wait_for_shutdown()
        finally:
            metrics_task.cancel()
            if follower is not None:
                await follower.stop()
            await runner.cleanup()  # stop taking HTTP traffic, let in-flight responses finish (the engine stops after)


def main(argv: list[str]) -> int:
    """`rose run executor [--config F]`: one executor (with `--emulate 8xH100:7B`, cli runs group.py's main instead)."""
    return service_main(argv, service="executor", description="Run a co-serving executor.", config_cls=ExecutorConfig, run=run)
