"""The engine's device paths: CPU here, and CUDA wherever a GPU is present.

Each test runs once per device. The CPU run is the fallback the development machines and CI
take; the CUDA run (stream priorities, device-memory accounting, nvidia-ml-py telemetry,
bfloat16) runs on GPU nodes (``scripts/gpu-check``) and is skipped where torch sees no GPU.

Self-contained on purpose: no fixture from a conftest, so a GPU node runs this module with
``pytest --noconftest`` and needs none of the bus's packages (NATS, OpenTelemetry).
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from rose.services.executor.cuda_graphs import DecodeInputs
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.forward_item import ForwardItem
from rose.services.executor.kv_pool import KVPool
from rose.services.executor.model_runner import PagedModelRunner, kv_shape_of
from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass
from rose.shared.models import init_models, load_model

MIB = 1 << 20
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: runs on GPU nodes"))]
# (device, dtype) pairs of the forward check, and the relative error each may show against HF's own forward
FORWARD_CASES = [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.float32, 1e-3, marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return init_models(tmp_path_factory.mktemp("device-models"), seed=0)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _hf_last_logits(model_dirs, engine_policy: torch.nn.Module, ids: list[int], device: str) -> torch.Tensor:
    """HF's forward over the engine's current policy weights (the engine holds parameters only): the reference
    the paged forward must match."""
    hf = load_model(model_dirs.policy, device, next(engine_policy.parameters()).dtype)
    hf.load_state_dict(engine_policy.state_dict())
    with torch.inference_mode():
        return hf(torch.tensor(ids, device=device)[None]).logits[0, -1].float()


def _engine(model_dirs, device: str, policy: str = "rose") -> Engine:
    config = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device=device, dtype=_dtype(device), seed=0)
    return Engine.from_dirs(str(model_dirs.serving), str(model_dirs.policy), config, policy)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_serving_and_rollout_lanes_get_prioritised_streams_on_cuda_and_threads_on_cpu(model_dirs, device):
    engine = _engine(model_dirs, device)
    serving, rollout = engine.work_for(WorkClass.SERVING).lane, engine.work_for(WorkClass.ROLLOUT).lane
    assert serving is not rollout
    if device == "cuda":
        assert serving.stream.device.type == rollout.stream.device.type == "cuda"
        assert serving.stream.priority < rollout.stream.priority  # lower number = higher priority
        assert engine.device.lanes_overlap(1)  # two streams share the SMs: a serving arrival makes rollout yield
    else:
        assert serving.stream is None and rollout.stream is None  # each lane is its own thread on its own core
    for work_class in WorkClass:
        pool = engine.work_for(work_class).pool
        assert pool.k.device.type == device and pool.k.dtype == _dtype(device)


@pytest.mark.parametrize(("device", "dtype", "tolerance"), FORWARD_CASES)
def test_the_packed_paged_forward_matches_hf_on_the_device(model_dirs, device, dtype, tolerance):
    """Prefill chunks beside decode steps in one forward, against the HF model's own forward
    on the same device and dtype (bfloat16 on a GPU: the two orders of operations round apart)."""
    model = load_model(model_dirs.policy, device, dtype)
    pool = KVPool("check", kv_shape_of(model), 4 * MIB, 16, torch.device(device))
    runner = PagedModelRunner(model, pool)
    gen = torch.Generator().manual_seed(3)
    lengths = (29, 17, 8)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    with torch.inference_mode():
        refs = [model(s[None].to(device)).logits[0].float() for s in seqs]
    tables = [pool.allocate(pool.blocks_for(32)) for _ in seqs]
    prefilled = [n - 3 for n in lengths]
    out = runner.forward([ForwardItem(t, 0, s[:p].tolist()) for t, s, p in zip(tables, seqs, prefilled)], all_logits=True)
    for b, (ref, p) in enumerate(zip(refs, prefilled)):
        assert out.device.type == device
        assert _relative_error(out[b, :p], ref[:p]) < tolerance
    # then one forward with the first sequence's last three tokens as a chunk beside two decode steps
    items = [ForwardItem(tables[0], prefilled[0], seqs[0][prefilled[0] :].tolist())]
    items += [ForwardItem(t, p, [s[p].item()]) for t, s, p in zip(tables[1:], seqs[1:], prefilled[1:])]
    out = runner.forward(items, all_logits=True)
    assert _relative_error(out[0, :3], refs[0][prefilled[0] :]) < tolerance
    for b in (1, 2):
        assert _relative_error(out[b, 0], refs[b][prefilled[b]]) < tolerance


@pytest.mark.parametrize("device", DEVICES)
def test_both_classes_generate_on_the_device_and_telemetry_reports_it(model_dirs, device):
    engine = _engine(model_dirs, device)
    vocab = min(engine.work_for(work_class).model.config.vocab_size for work_class in WorkClass)

    async def run():
        engine.start()
        try:
            engine.set_rollout_lease(engine.config.rollout_kv_bytes, time.monotonic() + 600)
            rollout = [
                engine.submit(
                    GenerationRequest(
                        request_id=f"r{i}",
                        work_class=WorkClass.ROLLOUT,
                        prompt_token_ids=tuple(range(10 + i, 30 + i)),
                        sampling=EngineSampling(temperature=1.0, max_tokens=12, seed=i, ignore_eos=True),
                        stream=False,
                    )
                )
                for i in range(4)
            ]
            serving = engine.submit(
                GenerationRequest(
                    request_id="s",
                    work_class=WorkClass.SERVING,
                    prompt_token_ids=tuple(range(40, 60)),
                    sampling=EngineSampling(temperature=0, max_tokens=8, ignore_eos=True),
                )
            )
            return await asyncio.wait_for(asyncio.gather(serving.result(), *(h.result() for h in rollout)), 120), engine.stats()
        finally:
            await engine.stop()

    (served, *rolled), stats = asyncio.run(run())
    assert served.finish_reason == "length" and len(served.token_ids) == 8
    for result in rolled:
        assert result.finish_reason == "length" and len(result.token_ids) == len(result.logprobs) == 12
        assert all(0 <= t < vocab for t in result.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in result.logprobs)
    telemetry = stats.device
    assert telemetry["kind"] == device and telemetry["name"]
    assert 0 < telemetry["memory_used_bytes"] <= telemetry["memory_total_bytes"]
    assert 0.0 <= telemetry["utilization"] <= 1.0 and telemetry["process_rss_bytes"] > 0
    if device == "cuda":
        assert "NVIDIA" in telemetry["name"] or torch.cuda.get_device_name() in telemetry["name"]  # from nvidia-ml-py
        for runner in (engine.work_for(wc).runner for wc in WorkClass):  # decode steps were graph replays, on both lanes
            assert runner.graphs is not None and runner.graphs.replays > 0
        for runner in (engine.work_for(wc).runner for wc in WorkClass):  # each lane captured its common buckets before its first request
            assert runner.graphs.captures >= len(runner.graphs.batch_buckets) and runner.graph_failures == 0
    else:
        assert engine.cuda_graph_stats() == {"serving": None, "rollout": None}


@pytest.mark.parametrize("device", DEVICES)
def test_rollout_memory_given_back_and_taken_again_is_device_memory(model_dirs, device):
    """``release_rollout_memory`` reports the bytes it gave back; on a GPU the allocator shows the
    same bytes leaving the device (KV pool storage; policy weights moved to pinned host memory)."""
    engine = _engine(model_dirs, device)  # not started: controls run at once
    pool, policy = engine.work_for(WorkClass.ROLLOUT).pool, engine.work_for(WorkClass.ROLLOUT).model
    pool_bytes = pool.num_blocks * pool.block_bytes
    weight_bytes = sum(t.numel() * t.element_size() for t in list(policy.parameters()) + list(policy.buffers()))
    allocated = torch.cuda.memory_allocated if device == "cuda" else (lambda: 0)
    before = allocated()
    freed = engine.control.release_memory(("kv_cache", "weights")).result(timeout=60)
    assert freed["kv_cache"] == pool_bytes and pool.released
    if device == "cuda":
        assert freed["weights"] == weight_bytes
        assert next(policy.parameters()).device.type == "cpu" and next(policy.parameters()).is_pinned()
        assert before - allocated() >= pool_bytes + weight_bytes
    else:
        assert freed["weights"] == 0  # host memory already: nothing leaves a device
    restored = engine.control.resume_memory(("kv_cache", "weights")).result(timeout=60)
    assert restored["kv_cache"] == pool_bytes and not pool.released
    assert next(policy.parameters()).device.type == device
    if device == "cuda":
        assert restored["weights"] == weight_bytes and allocated() - before >= -MIB  # all of it back on the device
    # and the restored policy still computes what it did
    runner = PagedModelRunner(policy, KVPool("after", kv_shape_of(policy), 2 * MIB, 16, torch.device(device)))
    ref = _hf_last_logits(model_dirs, policy, list(range(5, 14)), device)
    out = runner.forward([ForwardItem(runner.pool.allocate(1), 0, list(range(5, 14)))])[0]
    assert _relative_error(out, ref) < (3e-2 if device == "cuda" else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_policy_weight_update_from_host_memory_lands_on_the_device_whole(model_dirs, device):
    """A new version arrives as host tensors (as the weight follower decodes it) and is swapped
    in on the device between iterations; the serving model is never touched; a misfit update
    leaves the old version serving."""
    engine = _engine(model_dirs, device)  # not started: the swap runs at once
    policy, serving = engine.work_for(WorkClass.ROLLOUT).model, engine.work_for(WorkClass.SERVING).model
    serving_before = {n: t.clone() for n, t in serving.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    name = "model.layers.0.mlp.down_proj.weight"
    live = policy.state_dict()[name]
    new = (torch.randn(live.shape, generator=gen) * 0.05).to(live.dtype)  # on the host
    with pytest.raises(ValueError, match="shape"):
        engine.apply_policy_weights({name: new[:, :-1]}, 1)
    assert torch.equal(policy.state_dict()[name], live)
    pause_ms = engine.apply_policy_weights({name: new}, 2).result(timeout=60)
    swapped = policy.state_dict()[name]
    assert engine.metrics.max_swap_pause_ms == pause_ms and engine.policy_version == 2  # the swap's pause, recorded
    assert swapped.device.type == device and torch.equal(swapped.cpu(), new)
    assert all(torch.equal(t, serving_before[n]) for n, t in serving.state_dict().items())
    # the paged forward reads the new weights, as HF's forward does
    runner = engine.work_for(WorkClass.ROLLOUT).runner
    ref = _hf_last_logits(model_dirs, policy, list(range(3, 15)), device)
    runner.pool.set_budget_bytes(runner.pool.block_bytes)
    out = runner.forward([ForwardItem(runner.pool.allocate(1), 0, list(range(3, 15)))])[0]
    assert _relative_error(out, ref) < (3e-2 if device == "cuda" else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_replay_cuda_graphs_on_cuda_and_run_eagerly_on_cpu(model_dirs, device):
    """A decode step padded to its (batch, context) bucket computes what the packed forward does;
    on CUDA it is a graph replay, recaptured once a weight swap has moved the weights."""
    model = load_model(model_dirs.policy, device, torch.float32)
    pool = KVPool("graphs", kv_shape_of(model), 4 * MIB, 16, torch.device(device))
    eager, graphed = PagedModelRunner(model, pool), PagedModelRunner(model, pool)  # one cache: they write the same K/V
    graphed.use_cuda_graphs(max_batch=8)
    assert (graphed.graphs is not None) == (device == "cuda")
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (20, 9, 33)]
    tables = [pool.allocate(pool.blocks_for(40)) for _ in seqs]
    eager.forward([ForwardItem(t, 0, s[:-3].tolist()) for t, s in zip(tables, seqs)])

    def step(k: int) -> list[ForwardItem]:
        return [ForwardItem(t, len(s) - 3 + k, [s[len(s) - 3 + k].item()]) for t, s in zip(tables, seqs)]

    for k in range(2):
        items = step(k)
        want = eager.forward(items)
        padded = DecodeInputs.of(items, pool.block_size, 4, 128).to(device)  # one copy of the last row, 128 keys
        assert _relative_error(eager.decode_step(padded)[:3], want) < 1e-4
        assert _relative_error(graphed.forward(items), want) < 1e-4
    if device == "cuda":
        assert graphed.graphs.captures == 1 and graphed.graphs.replays == 2
        assert graphed.graphs.fits(step(0)) == (4, 128)
    # a weight swap re-points a parameter (StagedWeights.apply): the graphs see the new weights
    param = dict(model.named_parameters())["model.layers.1.self_attn.o_proj.weight"]
    param.data = param.data * 1.5
    items = step(2)
    want = eager.forward(items)
    assert _relative_error(graphed.forward(items), want) < 1e-4
    if device == "cuda":
        assert graphed.graphs.captures == 2


def test_a_runner_with_decode_graphs_takes_weight_updates_in_place(model_dirs):
    """Graphs read the weights by address: a runner that holds them copies an update into the live
    tensors (same addresses, new values), where a plain runner re-points its parameters."""
    from rose.services.executor.cuda_graphs import DecodeGraphs
    from rose.services.executor.weights import stage

    model = load_model(model_dirs.policy)
    runner = PagedModelRunner(model, KVPool("w", kv_shape_of(model), 2 * MIB, 16, torch.device("cpu")))
    name = "model.layers.0.self_attn.q_proj.weight"
    param = dict(model.named_parameters())[name]
    address, fingerprint = param.data_ptr(), runner.storage_fingerprint()
    new = torch.randn(param.shape, generator=torch.Generator().manual_seed(9))
    runner.graphs = DecodeGraphs(runner, 8)  # what use_cuda_graphs sets on CUDA (capture itself needs a GPU)
    runner.apply_weights(stage(model, {name: new}, 1))
    assert param.data_ptr() == address and torch.equal(param.data, new) and runner.storage_fingerprint() == fingerprint
    runner.graphs = None
    runner.apply_weights(stage(model, {name: new * 2}, 2))
    assert param.data_ptr() != address and torch.equal(param.data, new * 2)
