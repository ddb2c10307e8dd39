"""`rose bench coserve`'s runs on one engine: the bench's models, its serving trace and rollout backlog, one policy's
run over a trace, and the two baselines every cell is measured against (the serving capacity, the policy model alone on
the device). bench/coserve.py runs them over its grid and reports the figures.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rose.services.executor.config import RolloutMode
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.policies import POLICY_NAMES as POLICIES
from rose.services.executor.protocol import EngineSampling, GenerationRequest, GenerationResult, WorkClass

MIB = 1 << 20
SERVING_PROMPT_TOKENS = 48
SERVING_MAX_TOKENS = 32
ROLLOUT_PROMPT_TOKENS = 32
ROLLOUT_MAX_TOKENS = 128
CAPACITY_REQUESTS = 96
CAPACITY_ROUNDS = 3  # the median sets the rate (see measure_capacity)
BURST_EVERY_S = 5.0
BURST_LEN_S = 0.5
BURST_FACTOR = 3.0
WARMUP_REQUESTS = 8
RECLAIM_PROBES = 20  # serving requests sent into lulls after the trace (rose only): reclaim samples (--reclaim-probes)
RECLAIM_PROBE_SETTLE_S = 0.25  # a lull: the serving lane idles and the rollout lane has widened over its core
GRACE_S = 5.0  # after the trace, unanswered serving requests get this long, then are aborted
NOISE_PERIOD_S = 0.01  # the co-runner's duty-cycle period: busy F of it, asleep the rest
GUARD_SAMPLE_S = 0.01  # how often the rose run records the SLO guard's state
BENCH_CONFIG = EngineConfig(serving_kv_bytes=64 * MIB, rollout_kv_bytes=128 * MIB, device="auto", seed=0, rollout_process=True)
# On a GPU the pools hold GPU-class models' KV (``--preset qwen2.5``: 12 / 28 KiB per token) for full batches.
CUDA_KV_BYTES = {"serving_kv_bytes": 1024 * MIB, "rollout_kv_bytes": 2048 * MIB}


def bench_config(device: str = "auto", dtype: str = "auto") -> EngineConfig:
    """BENCH_CONFIG on ``device``; ``dtype`` auto is bfloat16 on CUDA (its tensor cores), float32 on CPU."""
    from rose.services.executor.device import select_device

    kind = select_device(device).kind  # resolves auto, and refuses cuda where there is none
    if dtype == "auto":
        dtype = "bfloat16" if kind == "cuda" else "float32"
    config = replace(BENCH_CONFIG, device=device, dtype=getattr(torch, dtype))
    if kind == "cuda":
        config = replace(config, serving_kv_bytes=CUDA_KV_BYTES["serving_kv_bytes"], rollout_kv_bytes=CUDA_KV_BYTES["rollout_kv_bytes"])
    return config


CO_BATCHED = "rose+co_batched"  # rose in the co-batched mode (``--lora``): its rollout rows inside serving's own batches


@dataclass(frozen=True)
class Contender:
    """One row of the bench: a co-serving policy in a rollout mode (services/executor/config.py ROLLOUT_MODES)."""

    label: str
    policy: str
    mode: RolloutMode = "two_model"


def contenders(lora: bool) -> list[Contender]:
    """The four policies in the two-model mode, and with a LoRA policy rose in the co-batched mode beside them."""
    rows = [Contender(name, name) for name in POLICIES]
    return rows + ([Contender(CO_BATCHED, "rose", "co_batched")] if lora else [])


@dataclass(frozen=True)
class BenchModels:
    """The serving model, the policy (a model of its own, or with ``adapter`` a copy of the serving model's base) and
    the policy's adapter (``--lora``: version 0 of a LoRA adapter of the serving model; None: a full-weight policy)."""

    serving: tuple[Any, Any]  # (model, tokenizer)
    policy: tuple[Any, Any]
    adapter: Any = None  # shared.lora.Adapter

    def engine(self, contender: Contender, config: EngineConfig) -> Engine:
        (s_model, s_tok), (p_model, p_tok) = self.serving, self.policy
        co_batched = contender.mode == "co_batched"
        cfg = replace(config, rollout_mode=contender.mode)
        return Engine(s_model, s_tok, None if co_batched else p_model, p_tok, cfg, contender.policy, adapter=self.adapter)

    @property
    def vocab(self) -> int:
        return min(self.serving[0].config.vocab_size, self.policy[0].config.vocab_size)


def load_models(model_dir: str | None, seed: int, dtype: torch.dtype, preset: str = "tiny", lora: bool = False) -> BenchModels:
    """The models of ``preset`` (built on the spot unless ``model_dir`` holds them); with ``lora`` the policy is
    an adapter of the serving model (its shape ``rose models init --lora`` builds: shared.lora DEFAULT_LORA)."""
    from rose.shared.lora import DEFAULT_LORA, Adapter, model_fingerprint, new_adapter
    from rose.shared.models import init_models, load_model, load_tokenizer

    root = Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="rose-bench-models-"))
    if not (root / "serving" / "config.json").exists():
        init_models(root, seed, preset=preset)
    serving = (load_model(root / "serving", dtype=dtype), load_tokenizer(root / "serving"))
    if not lora:
        return BenchModels(serving, (load_model(root / "policy", dtype=dtype), load_tokenizer(root / "policy")))
    base = serving[0]
    tensors = new_adapter(base, DEFAULT_LORA, seed=seed)  # version 0: B = 0 (computes as any version does)
    adapter = Adapter(shape=DEFAULT_LORA, tensors=tensors, base="serving", base_fingerprint=model_fingerprint(base.state_dict()))
    return BenchModels(serving, (load_model(root / "serving", dtype=dtype), serving[1]), adapter)


def serving_trace(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times: Poisson at ``rate``, at BURST_FACTOR x rate during periodic bursts."""
    rng = np.random.default_rng(seed)
    t = 0.0
    out: list[float] = []
    while True:
        in_burst = (t % BURST_EVERY_S) > BURST_EVERY_S - BURST_LEN_S
        t += rng.exponential(1.0 / (rate * (BURST_FACTOR if in_burst else 1.0)))
        if t >= duration_s:
            return out
        out.append(t)


def _prompt(rng: np.random.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(10, vocab, n))


def _serving_request(i: int, rng, vocab: int, tag: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{tag}-s{i}",
        work_class=WorkClass.SERVING,
        prompt_token_ids=_prompt(rng, vocab, SERVING_PROMPT_TOKENS),
        sampling=EngineSampling(temperature=0, max_tokens=SERVING_MAX_TOKENS, ignore_eos=True),
    )


def _rollout_request(i: int, rng, vocab: int, tag: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{tag}-r{i}",
        work_class=WorkClass.ROLLOUT,
        prompt_token_ids=_prompt(rng, vocab, ROLLOUT_PROMPT_TOKENS),
        sampling=EngineSampling(temperature=1.0, max_tokens=ROLLOUT_MAX_TOKENS, seed=i, ignore_eos=True),
        stream=False,
    )


async def _consume(handle) -> GenerationResult:
    async for _ in handle:  # stream like an SSE client would
        pass
    return await handle.result()


class _Backlog:
    """Keeps the rollout queue saturated: 2 x max batch requests outstanding."""

    def __init__(self, engine: Engine, vocab: int, seed: int, tag: str) -> None:
        self.engine, self.vocab, self.tag = engine, vocab, tag
        self.rng = np.random.default_rng(seed + 1)
        self.outstanding = 2 * engine.config.rollout_max_batch
        self.count = 0
        self.tasks: set[asyncio.Task] = set()

    def fill(self) -> None:
        while len(self.tasks) < self.outstanding:
            handle = self.engine.submit(_rollout_request(self.count, self.rng, self.vocab, self.tag))
            self.count += 1
            task = asyncio.ensure_future(handle.result())
            self.tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task) -> None:
        self.tasks.discard(task)
        if not self.engine.stopping:
            self.fill()


async def run_policy(
    contender: Contender,
    models: BenchModels,
    config: EngineConfig,
    arrivals: list[float],
    seed: int,
    slo,
    with_rollout: bool = True,
    progress=None,
    reclaim_probes: int = RECLAIM_PROBES,
) -> dict:
    engine = models.engine(contender, config)
    policy = contender.label
    if slo:
        engine.set_slo(*slo)
    engine.start()
    vocab = models.vocab
    rng = np.random.default_rng(seed)
    await asyncio.gather(*[_consume(engine.submit(_serving_request(i, rng, vocab, f"warm-{policy}"))) for i in range(WARMUP_REQUESTS)])
    backlog = None
    if with_rollout and engine.policy.admits_rollout:
        engine.set_rollout_lease(config.rollout_kv_bytes, time.monotonic() + 3600)
        backlog = _Backlog(engine, vocab, seed, policy)
        backlog.fill()
        await asyncio.sleep(0.5)  # let the rollout batch fill up
    engine.stats()  # start a fresh interval
    start = time.monotonic()
    guard_trace: list[tuple[float, float, float]] = []  # (s since start, share, tail ratio)
    sampler = asyncio.ensure_future(_sample_guard(engine, start, guard_trace)) if engine.policy.name == "rose" and slo else None
    tasks, handles = [], []
    for i, at in enumerate(arrivals):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        handles.append(engine.submit(_serving_request(i, rng, vocab, policy)))
        tasks.append(asyncio.ensure_future(_consume(handles[-1])))
        if progress:
            progress(at)
    duration = arrivals[-1] if arrivals else 0.0
    while time.monotonic() - start < duration:
        await asyncio.sleep(0.05)
    window = engine.stats()  # rollout/serving tokens over the trace window
    if sampler is not None:
        sampler.cancel()
    await asyncio.wait(tasks, timeout=GRACE_S)
    for handle in handles:  # still unanswered after the grace period: aborted, an SLO miss
        handle.cancel()
    results = await asyncio.gather(*tasks)
    if backlog and engine.policy.yields_on_arrival:
        await _reclaim_probes(engine, rng, vocab, policy, reclaim_probes)
    co_batched_iterations = engine.metrics.co_batched_iterations
    await engine.stop()  # stopping at once: the backlog stops refilling
    if backlog:
        await asyncio.gather(*backlog.tasks, return_exceptions=True)
    graphs = engine.cuda_graph_stats()
    # An aborted request (unanswered after the grace period) counts as an SLO miss; its latency is
    # reported as a lower bound: the time it had waited when it was aborted.
    aborted = [r.finish_reason == "abort" for r in results]
    return {
        "ttft_ms": [r.timings.total_ms if a and not r.token_ids else r.timings.ttft_ms for r, a in zip(results, aborted)],
        "tpot_ms": [r.timings.total_ms if a and len(r.token_ids) < 2 else r.timings.tpot_ms for r, a in zip(results, aborted)],
        "aborted": aborted,
        "serving_tokens_per_s": sum(len(r.token_ids) for r in results) / max(1e-9, window.interval_s),
        "rollout_tokens_per_s": window.rollout_tokens_per_s,
        "reclaim_ms": list(engine.metrics.reclaim_ms),
        "rss_bytes": window.device.get("process_rss_bytes", 0),
        "cuda_graphs": graphs if any(graphs.values()) else None,
        "lane_failures": engine.metrics.lane_failures,
        "guard_trace": guard_trace,
        "arrivals_s": list(arrivals),
        "mode": contender.mode,
        "co_batched_iterations": co_batched_iterations,
    }


async def _sample_guard(engine: Engine, start: float, out: list) -> None:
    while True:
        state = engine.slo_guard.state
        out.append((time.monotonic() - start, state.share, state.tail_ratio))
        await asyncio.sleep(GUARD_SAMPLE_S)


class Noise:
    """A co-runner process that burns ``fraction`` of one core (busy, then asleep, every NOISE_PERIOD_S)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Noise:
        if self.fraction > 0:
            code = (
                "import time\n"
                f"busy, period = {self.fraction * NOISE_PERIOD_S!r}, {NOISE_PERIOD_S!r}\n"
                "while True:\n"
                "    t = time.perf_counter()\n"
                "    while time.perf_counter() - t < busy: pass\n"
                "    time.sleep(max(0.0, period - busy))\n"
            )
            self.proc = subprocess.Popen([sys.executable, "-c", code])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


async def _reclaim_probes(engine: Engine, rng, vocab: int, tag: str, probes: int = RECLAIM_PROBES) -> None:
    """Serving requests that each arrive into a lull, when the rollout lane has widened over the
    serving lane's idle core: each one's arrival -> rollout narrowed off it is a reclaim sample
    (in the trace above, serving at load 0.3 is rarely idle, so arrivals rarely find it lent)."""
    for i in range(probes):
        await asyncio.sleep(RECLAIM_PROBE_SETTLE_S)
        await _consume(engine.submit(_serving_request(i, rng, vocab, f"{tag}-probe")))


async def measure_capacity(models: BenchModels, config: EngineConfig, seed: int) -> list[float]:
    """Serving requests/s the serving model sustains when saturated (serving only), once per round.

    The median of the rounds sets the trace's rate. Why rounds: one round is ~1.5 s on the
    2-core VM, and a stall of the VM in it moved the rate (so every policy's operating point,
    bursts near saturation or not) by up to a quarter between runs of the same seed."""
    engine = models.engine(Contender("serving_only", "serving_only"), config)
    engine.start()
    rng = np.random.default_rng(seed)
    vocab = models.serving[0].config.vocab_size
    await asyncio.gather(*[_consume(engine.submit(_serving_request(i, rng, vocab, "cap-warm"))) for i in range(WARMUP_REQUESTS)])
    rounds = []
    for r in range(CAPACITY_ROUNDS):
        start = time.monotonic()
        await asyncio.gather(*[_consume(engine.submit(_serving_request(i, rng, vocab, f"cap{r}"))) for i in range(CAPACITY_REQUESTS)])
        rounds.append(CAPACITY_REQUESTS / (time.monotonic() - start))
    await engine.stop()
    return rounds


async def measure_dedicated(models: BenchModels, config: EngineConfig, seconds: float, seed: int) -> dict[int, float]:
    """Rollout tokens/s of the policy model alone, with one thread and with all cores (the best is the baseline)."""
    by_threads: dict[int, float] = {}
    from rose.services.executor.device import select_device

    # on a GPU one host thread drives the lane's stream: more CPU threads are no more device
    threads = [1] if select_device(config.device).kind == "cuda" else sorted({1, os.cpu_count() or 1})
    for n in threads:
        # exactly n threads, in this process: the policy alone has no lock to share, and no pipe to pay
        cfg = EngineConfig(**{**vars(config), "rollout_threads": n, "lend_serving_core": False, "rollout_process": False})
        engine = models.engine(Contender("rose", "rose"), cfg)  # the policy alone (a LoRA policy: base copy + adapter)
        engine.start()
        engine.set_rollout_lease(cfg.rollout_kv_bytes, time.monotonic() + 3600)
        backlog = _Backlog(engine, models.policy[0].config.vocab_size, seed, f"ded{n}")
        backlog.fill()
        await asyncio.sleep(0.5)
        engine.stats()
        await asyncio.sleep(seconds)
        by_threads[n] = engine.stats().rollout_tokens_per_s
        await engine.stop()
        await asyncio.gather(*backlog.tasks, return_exceptions=True)
    return by_threads
