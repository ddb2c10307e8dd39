"""`rose bench weights`: real RL-like weight deltas through the whole sync path, against nats-py's object store.

A Qwen2 transformer (random init, ~`params` parameters) keeps fp32 master weights and takes
`steps` AdamW steps on real gradients (LM loss on random token batches) at learning rate
`lr`; after each step the weights are cast to bf16 and published as a new version with the
trainer SDK (`WeightsClient`, staging through a shared path) to a `weight_publisher` service
process, which delta-encodes and stores them. A real executor process (`rose run executor`,
the policy loaded in bf16) follows the versions with its `WeightFollower`, verifies every
shard digest and swaps each version into its engine between quanta; its `WeightApplied`
events carry the engine's pause and a digest of its live policy parameters, compared with the
trainer's bf16 weights version by version (`bit_exact`).

The swap pause against how much of the model changed (`pause_by_changed_shards`): every version's
pause beside its changed shards and tensors, and two more versions after the AdamW ones, one that
changes a single tensor and one that changes every tensor (the lowest bit of each bf16 element), so
a pause that grew with the bytes or tensors copied (rather than a flip of the double-buffered
weights, services/executor/rollout_process.py) shows.

Same server, same run: nats-py `ObjectStore.put` (default 128 KiB chunks) and
`get(writeinto=BytesIO)` of a full bf16 snapshot, against our keyframe path (dense encode,
pipelined put, streaming fetch with decode and SHA-256 verification). The codec's
throughput (`encode_mb_s`, `decode_mb_s`) is measured on the real shards of each version, on
one core, as dense model bytes per second (best of `CODEC_REPEATS`, median over versions).

Auth is on, as in the embedded default: the server has the per-service permissions of `rose
security init`; the bench's client connects as the `trainer` (it publishes with the SDK) and as the operator
(`cli`: provisioning, and watching the executor's `WeightApplied` events), the two service processes with their own credentials, and both sides of
the full-snapshot comparison as the `weight_publisher` (the only service that writes the weights
store).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rose.bench.bus import refuses_anonymous
from rose.client import WeightsClient
from rose.contracts.registry import WEIGHT_APPLIED, WEIGHTS_OBJECTS
from rose.contracts.weights import WeightApplied, WeightManifest
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, Credentials, inbox_prefix, init_credentials
from rose.shared.weight_codec import ShardDecoder, decode_shard, encode_shard
from rose.shared.weight_layout import DEFAULT_SHARD_BYTES, layout_of, pack_shards, state_bytes, state_digest
from rose.shared.weight_store import WeightStore

DEFAULT_PARAMS = 25_000_000
DEFAULT_STEPS = 10
DEFAULT_LR = 1e-6
DEFAULT_SEED = 0
MODEL = "bench-policy"
EXECUTOR_ID = "bench-executor"
VOCAB = 4096
SEQ_LEN = 64
BATCH = 4
CODEC_REPEATS = 3
APPLY_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 120.0
TARGETS = {
    "ratio_vs_changed": 0.8,
    "ratio_when_sparse": 0.03,
    "sparse_changed": 0.01,
    "full_snapshot_speedup": 3.0,
    "apply_pause_ms": 50.0,
    "codec_mb_s": 1000.0,
}


# ---- the model ------------------------------------------------------------------------


def qwen2_config(params: int) -> dict[str, Any]:
    """A Qwen2 shape with about `params` parameters (untied embeddings, GQA 2:1, vocab 4096)."""
    hidden = 256
    for h in (256, 512, 768, 1024, 2048):
        if 2 * VOCAB * h <= 0.3 * params:
            hidden = h
    inter = int(hidden * 2.75) // 64 * 64
    heads = max(1, hidden // 64)
    kv_heads = max(1, heads // 2)
    kv = kv_heads * (hidden // heads)
    per_layer = 2 * (hidden * hidden + hidden) - hidden + 2 * (hidden * kv + kv) + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * VOCAB * hidden - hidden) / per_layer))
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


class Trainer:
    """fp32 master weights, AdamW on an LM loss; `bf16()` is what gets published."""

    def __init__(self, config: dict[str, Any], lr: float, seed: int) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM(Qwen2Config(**config)).float().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items()}


# ---- measurements ---------------------------------------------------------------------


def codec_speed(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> tuple[float, float, bool]:
    """Encode and decode MB/s of dense bytes over every shard of one version (one core), and exactness."""
    layout = layout_of(cur, DEFAULT_SHARD_BYTES)
    old, new = pack_shards(layout, state_bytes(prev)), pack_shards(layout, state_bytes(cur))
    total = sum(layout.shard_sizes)
    enc_best = dec_best = float("inf")
    exact = True
    for _ in range(CODEC_REPEATS):
        t0 = time.perf_counter()
        encoded = {sid: encode_shard(new[sid], old[sid], layout.segments(sid)) for sid in new}
        t1 = time.perf_counter()
        decoded = {sid: decode_shard(e.payload, old[sid]) for sid, e in encoded.items()}
        t2 = time.perf_counter()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
        exact = exact and all(np.array_equal(decoded[sid], new[sid]) for sid in new)
    return total / enc_best / 1e6, total / dec_best / 1e6, exact


async def full_snapshot(url: str, state: dict[str, torch.Tensor], creds: Credentials) -> dict[str, float]:
    """nats-py put/get of a dense snapshot vs our keyframe path (encode+put, fetch+decode+verify), one connection as the weight publisher."""
    import nats

    layout = layout_of(state, DEFAULT_SHARD_BYTES)
    shards = pack_shards(layout, state_bytes(state))
    blob = b"".join(shards[s].data for s in sorted(shards))
    nc = await nats.connect(url, nkeys_seed=str(creds.seed_file("weight_publisher")), inbox_prefix=inbox_prefix("weight_publisher"))
    try:
        js = nc.jetstream()
        theirs = await js.object_store(WEIGHTS_OBJECTS.bucket)
        t0 = time.perf_counter()
        await theirs.put("bench/baseline", blob)
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sink = io.BytesIO()
        await theirs.get("bench/baseline", writeinto=sink)
        get_s = time.perf_counter() - t0
        assert sink.getvalue() == blob
        await theirs.delete("bench/baseline")

        ours = WeightStore(js, WEIGHTS_OBJECTS.bucket)
        t0 = time.perf_counter()
        payloads = {sid: encode_shard(buf, None, layout.segments(sid)) for sid, buf in shards.items()}
        digests = {sid: hashlib.sha256(buf.data).hexdigest() for sid, buf in shards.items()}
        await asyncio.gather(*(ours.put(f"bench/full/{sid}", p.payload) for sid, p in payloads.items()))
        our_put_s = time.perf_counter() - t0

        async def fetch(sid: int) -> bool:
            box: list[ShardDecoder] = []

            def sink(size: int) -> ShardDecoder:
                box.append(ShardDecoder(size, None, 1 << 40))
                return box[0]

            await ours.fetch(f"bench/full/{sid}", sink, verify_digest=False)  # the content digest below covers it
            out = box[0].finish()
            return hashlib.sha256(out.data).hexdigest() == digests[sid]

        t0 = time.perf_counter()
        ok = await asyncio.gather(*(fetch(sid) for sid in shards))
        our_get_s = time.perf_counter() - t0
        assert all(ok)
        for sid in shards:
            await ours.delete(f"bench/full/{sid}")
    finally:
        await nc.close()
    return {"put_s": put_s, "get_s": get_s, "our_put_s": our_put_s, "our_get_s": our_get_s, "bytes": len(blob)}


# ---- processes ------------------------------------------------------------------------


def _start_publisher(url: str, workdir: Path, keyframe_interval: int, creds: Credentials) -> subprocess.Popen:
    config = workdir / "weight_publisher.toml"
    config.write_text(
        f'[bus]\nurl = "{url}"\nnkey_seed_file = "{creds.seed_file("weight_publisher")}"\n[runtime]\ninstance = "bench-publisher"\nlog_level = '
        '"WARNING"\n'
        f"[publisher]\nkeyframe_interval = {keyframe_interval}\n"
    )
    env = {**os.environ, "ROSE_STATE_DIR": str(workdir)}  # this run's weight-signing keys, never ./.rose
    return subprocess.Popen(
        [sys.executable, "-m", "rose.cli.main", "run", "weight_publisher", "--config", str(config)], stdout=subprocess.DEVNULL, env=env
    )


def _executor_models(trainer: Trainer, workdir: Path) -> tuple[Path, Path]:
    """A serving model (the tiny default) and the bench's policy at version 0, as HF directories."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rose.shared.models import init_models, load_tokenizer

    paths = init_models(workdir / "models", seed=0)
    policy_dir = workdir / "models" / "bench-policy"
    model = Qwen2ForCausalLM(Qwen2Config(**trainer.model.config.to_dict())).bfloat16()
    model.load_state_dict(trainer.bf16())
    model.save_pretrained(policy_dir)
    load_tokenizer(paths.serving).save_pretrained(policy_dir)
    return paths.serving, policy_dir


def _start_executor(url: str, serving_dir: Path, policy_dir: Path, workdir: Path, creds: Credentials) -> ServiceProcess:
    """The real executor service, following MODEL's versions in bf16 and reporting a digest per version."""
    env = {
        **creds.env("executor", EXECUTOR_ID),  # its instance's own NKey (declared in run_weights_bench)
        "ROSE_STATE_DIR": str(workdir),  # trusts the publisher's key of this run (see _start_publisher)
        "NATS_URL": url,
        "ROSE_MODELS__SERVING_DIR": str(serving_dir),
        "ROSE_MODELS__POLICY_DIR": str(policy_dir),
        "ROSE_ENGINE__DTYPE": "bfloat16",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "16",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "32",
        "ROSE_WEIGHTS__MODEL": MODEL,
        "ROSE_WEIGHTS__REPORT_DIGEST": "true",
    }
    return ServiceProcess("executor", EXECUTOR_ID, env, workdir / "executor.log").start()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the bench ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WeightsOptions:
    """What a `rose bench weights` run measures (module docstring): a Qwen2 policy of about ``params`` parameters taking
    ``steps`` AdamW steps at ``lr``, one published version each; ``seed`` of the weights and the training batches."""

    params: int = DEFAULT_PARAMS
    steps: int = DEFAULT_STEPS
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED


async def run_weights_bench(options: WeightsOptions, out_json: str, console: Console | None = None) -> dict[str, Any]:
    """Every version through a real publisher and executor, then the full-snapshot comparison; the result (also
    written to ``out_json``, plotted beside it)."""
    console = console or Console()
    params, steps, lr, seed = options.params, options.steps, options.lr, options.seed
    config = qwen2_config(params)
    trainer = Trainer(config, lr, seed)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        # auth on, as in production: each process gets its own NKey, the executor one of its own instance
        creds = init_credentials(workdir / "security", instances={"executor": [EXECUTOR_ID]})
        with NatsServer(workdir / "nats", extra_config=creds.server_config()) as server:
            auth = await refuses_anonymous(server.url)
            result, baseline, digests = await _bench(console, trainer, steps, server.url, workdir, creds)
    per_version = result["per_version"]
    bit_exact = result["codec_exact"] and all(digests.get(v["version"]) == v["sha256"] for v in per_version + result["sparse_versions"])
    deltas = [v for v in per_version if not v["keyframe"]]
    full_bytes = result["full_bytes"]
    wire_mean = statistics.mean(v["wire_bytes"] for v in deltas) if deltas else 0.0
    out: dict[str, Any] = {
        "params": trainer.params,
        "model": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "full_bytes": full_bytes,
        "wire_bytes": wire_mean,
        "wire_ratio": wire_mean / full_bytes,
        "changed_fraction": statistics.mean(v["changed_fraction"] for v in deltas) if deltas else 0.0,
        "bit_exact": bit_exact,
        "publish_s": statistics.mean(v["publish_s"] for v in deltas) if deltas else 0.0,
        "fetch_apply_s": statistics.mean(v["fetch_apply_s"] for v in deltas) if deltas else 0.0,
        "objstore_baseline": {"put_s": baseline["put_s"], "get_s": baseline["get_s"]},
        "full_snapshot": {"put_s": baseline["our_put_s"], "get_s": baseline["our_get_s"], "bytes": baseline["bytes"]},
        "full_snapshot_speedup": (baseline["put_s"] + baseline["get_s"]) / (baseline["our_put_s"] + baseline["our_get_s"]),
        "apply_pause_ms": max(v["pause_ms"] for v in per_version),
        "apply_pause_ms_median": statistics.median(v["pause_ms"] for v in per_version),
        "pause_by_changed_shards": result["pause_by_changed_shards"],
        "encode_mb_s": statistics.median(result["encode_mb_s"]) if result["encode_mb_s"] else 0.0,
        "decode_mb_s": statistics.median(result["decode_mb_s"]) if result["decode_mb_s"] else 0.0,
        "per_version": per_version,
        "apply_process": "the executor service (`rose run executor`, bf16 policy, WeightFollower -> engine swap)",
        "auth": auth,  # NATS auth on (an unauthenticated client was refused); every client connected with its own credentials
    }
    out["meets_target"] = _targets(out, deltas)
    path = Path(out_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    _plot(out, path.with_suffix(".png"))
    _table(console, out, path)
    return out


async def _bench(
    console: Console, trainer: Trainer, steps: int, url: str, workdir: Path, creds: Credentials
) -> tuple[dict[str, Any], dict[str, float], dict[int, str]]:
    """The publisher and executor processes, every version through them, then the full-snapshot comparison.

    Returns the versions' rows, the full-snapshot timings and the executor's digest of each applied version.
    """
    applied: dict[int, WeightApplied] = {}
    arrived = asyncio.Event()

    async def on_applied(event: WeightApplied, d: Delivery) -> None:
        if event.model == MODEL:
            applied[event.version] = event
            arrived.set()

    async def wait_applied(version: int) -> WeightApplied:
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while version not in applied:
            arrived.clear()
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} was not applied within {APPLY_TIMEOUT_S}s")
            try:
                await asyncio.wait_for(arrived.wait(), 1.0)
            except TimeoutError:
                pass
        return applied[version]

    async with (
        Bus(BusConfig(url=url, nkey_seed_file=str(creds.seed_file(OPERATOR))), service=OPERATOR, instance="bench-operator") as operator,
        Bus(BusConfig(url=url, nkey_seed_file=str(creds.seed_file("trainer"))), service="trainer", instance="bench-trainer") as bus,
    ):
        await provision(operator.js)  # creating storage is the operator's right
        await operator.subscribe(WEIGHT_APPLIED, on_applied)  # the executors' public events: watched as the operator (`rose events`)
        publisher = _start_publisher(url, workdir, steps + 3, creds)  # no keyframe among the versions after the first (the two sparse ones included)
        serving_dir, policy_dir = _executor_models(trainer, workdir)
        applier = _start_executor(url, serving_dir, policy_dir, workdir, creds)
        try:
            await applier.wait_ready(operator, READY_TIMEOUT_S)
            result = await _run_versions(console, trainer, bus, workdir, steps, wait_applied)
            baseline = await full_snapshot(url, result.pop("_last_state"), creds)
        finally:
            applier.stop()
            _stop(publisher)
    return result, baseline, {v: event.params_sha256 for v, event in applied.items()}


async def _run_versions(console: Console, trainer: Trainer, bus: Bus, workdir: Path, steps: int, wait_applied) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    enc_rates: list[float] = []
    dec_rates: list[float] = []
    codec_exact = True
    prev: dict[str, torch.Tensor] | None = None
    async with WeightsClient(bus, MODEL, staging_dir=workdir / "staging") as client:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("versions", total=steps + 1)
            for version in range(steps + 1):
                loss = trainer.step() if version else float("nan")
                state = trainer.bf16()
                t0 = time.perf_counter()
                await client.publish(state, version)
                manifest: WeightManifest = await client.published(version)
                publish_s = time.perf_counter() - t0
                event = await wait_applied(version)
                if prev is not None:
                    enc, dec, exact = await asyncio.to_thread(codec_speed, prev, state)
                    enc_rates.append(enc)
                    dec_rates.append(dec)
                    codec_exact = codec_exact and exact
                shards, tensors = _changed(manifest)
                rows.append(
                    {
                        "version": version,
                        "kind": "keyframe" if manifest.keyframe else "adamw_delta",
                        "changed_shards": shards,
                        "shards": len(manifest.shards),
                        "changed_tensors": tensors,
                        "keyframe": manifest.keyframe,
                        "loss": loss,
                        "wire_bytes": manifest.wire_bytes,
                        "wire_ratio": manifest.wire_bytes / manifest.full_bytes,
                        "changed_fraction": manifest.changed_fraction,
                        "encodings": sorted({s.encoding for s in manifest.shards}),
                        "publish_s": publish_s,
                        "encode_s": manifest.encode_s,
                        "fetch_apply_s": event.fetch_apply_ms / 1000.0,
                        "pause_ms": event.pause_ms,
                        "sha256": state_digest(state),
                    }
                )
                prev = state
                progress.advance(task)
            assert prev is not None  # steps + 1 >= 1 versions went out
            sparse = await _sparse_versions(client, prev, steps + 1, wait_applied)
    full_bytes = sum(t.numel() * t.element_size() for t in prev.values())
    pauses = [{k: r[k] for k in ("version", "kind", "changed_shards", "shards", "changed_tensors", "pause_ms")} for r in rows + sparse]
    return {
        "per_version": rows,
        "sparse_versions": sparse,
        "pause_by_changed_shards": pauses,
        "encode_mb_s": enc_rates,
        "decode_mb_s": dec_rates,
        "codec_exact": codec_exact,
        "full_bytes": full_bytes,
        "_last_state": prev,
    }


def _changed(manifest: WeightManifest) -> tuple[int, int]:
    """(changed shards, tensors in them) of a version: what the executor is handed to swap in."""
    changed = {s.shard_id for s in manifest.shards if s.encoding != "unchanged"}
    return len(changed), sum(1 for t in manifest.tensors if t.shard_id in changed)


async def _sparse_versions(client: WeightsClient, state: dict[str, torch.Tensor], first: int, wait_applied) -> list[dict[str, Any]]:
    """One version that changes a single tensor, then one that changes all: the pause beside what changed."""
    rows = []
    names = sorted(state)
    for offset, (kind, picked) in enumerate((("one_tensor", names[-1:]), ("all_tensors", names))):
        state = {n: (t.view(torch.int16) ^ 1).view(torch.bfloat16) if n in picked else t for n, t in state.items()}
        version = first + offset
        await client.publish(state, version)
        manifest: WeightManifest = await client.published(version)
        event = await wait_applied(version)
        shards, tensors = _changed(manifest)
        rows.append(
            {
                "version": version,
                "kind": kind,
                "changed_shards": shards,
                "shards": len(manifest.shards),
                "changed_tensors": tensors,
                "pause_ms": event.pause_ms,
                "sha256": state_digest(state),
            }
        )
    return rows


def _targets(out: dict[str, Any], deltas: list[dict[str, Any]]) -> dict[str, bool]:
    t = TARGETS
    return {
        "bit_exact": bool(out["bit_exact"]),
        "wire_ratio_vs_changed": all(v["wire_ratio"] <= t["ratio_vs_changed"] * v["changed_fraction"] for v in deltas),
        "wire_ratio_when_sparse": all(v["wire_ratio"] <= t["ratio_when_sparse"] for v in deltas if v["changed_fraction"] <= t["sparse_changed"]),
        "full_snapshot_speedup": out["full_snapshot_speedup"] >= t["full_snapshot_speedup"],
        "apply_pause_ms": out["apply_pause_ms"] <= t["apply_pause_ms"],
        "encode_mb_s": out["encode_mb_s"] >= t["codec_mb_s"],
        "decode_mb_s": out["decode_mb_s"] >= t["codec_mb_s"],
    }


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["per_version"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(
        [r["version"] for r in rows],
        [r["wire_bytes"] for r in rows],
        color=["tab:orange" if r["keyframe"] else "tab:blue" for r in rows],
        label="sent (orange: keyframe)",
    )
    ax.plot([r["version"] for r in rows], [r["changed_fraction"] * out["full_bytes"] for r in rows], "k.--", label="bytes of the changed elements")
    ax.axhline(out["full_bytes"], color="tab:red", linestyle=":", label="full bf16 snapshot")
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.set_ylabel("bytes")
    ax.set_title(f"Weight sync: {out['params'] / 1e6:.1f} M params, lr {out['lr']:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(console: Console, out: dict[str, Any], path: Path) -> None:
    table = Table(title=f"rose bench weights  ({out['params'] / 1e6:.1f} M params, {out['steps']} AdamW steps at lr {out['lr']:g})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    met = out["meets_target"]
    mark = lambda ok: "[green]ok[/]" if ok else "[red]missed[/]"  # noqa: E731
    table.add_row("full bf16 bytes", f"{out['full_bytes'] / 1e6:.1f} MB", "")
    table.add_row("changed fraction (mean)", f"{out['changed_fraction']:.4f}", "")
    table.add_row("wire bytes per delta (mean)", f"{out['wire_bytes'] / 1e6:.3f} MB", "")
    table.add_row("wire ratio (mean)", f"{out['wire_ratio']:.5f}", f"<= 0.8 x changed, every version {mark(met['wire_ratio_vs_changed'])}")
    table.add_row("bit exact", str(out["bit_exact"]), mark(met["bit_exact"]))
    table.add_row("publish (SDK -> manifest)", f"{out['publish_s'] * 1e3:.0f} ms", "")
    table.add_row("fetch + apply", f"{out['fetch_apply_s'] * 1e3:.0f} ms", "")
    b = out["objstore_baseline"]
    f = out["full_snapshot"]
    table.add_row("full snapshot: nats-py put + get", f"{b['put_s']:.2f} + {b['get_s']:.2f} s", "")
    table.add_row("full snapshot: ours", f"{f['put_s']:.2f} + {f['get_s']:.2f} s", "")
    table.add_row("full snapshot speedup", f"{out['full_snapshot_speedup']:.1f}x", f">= 3 {mark(met['full_snapshot_speedup'])}")
    table.add_row("apply pause (max)", f"{out['apply_pause_ms']:.1f} ms", f"<= 50 {mark(met['apply_pause_ms'])}")
    table.add_row("codec encode", f"{out['encode_mb_s']:.0f} MB/s", f">= 1000 {mark(met['encode_mb_s'])}")
    table.add_row("codec decode", f"{out['decode_mb_s']:.0f} MB/s", f">= 1000 {mark(met['decode_mb_s'])}")
    console.print(table)
    versions = Table(title="per version")
    for col in ("v", "kind", "changed", "wire ratio", "ratio/changed", "publish ms", "fetch+apply ms", "pause ms"):
        versions.add_column(col, justify="right")
    for r in out["per_version"]:
        ratio = r["wire_ratio"] / r["changed_fraction"] if r["changed_fraction"] and not r["keyframe"] else float("nan")
        versions.add_row(
            str(r["version"]),
            "key" if r["keyframe"] else "delta",
            f"{r['changed_fraction']:.4f}",
            f"{r['wire_ratio']:.5f}",
            f"{ratio:.3f}",
            f"{r['publish_s'] * 1e3:.0f}",
            f"{r['fetch_apply_s'] * 1e3:.0f}",
            f"{r['pause_ms']:.1f}",
        )
    console.print(versions)
    pauses = ", ".join(f"v{r['version']} {r['changed_shards']}/{r['shards']} shards {r['pause_ms']:.1f} ms" for r in out["pause_by_changed_shards"])
    console.print(f"swap pause by changed shards: {pauses}")
    console.print(f"wrote {path} and {path.with_suffix('.png')}")
