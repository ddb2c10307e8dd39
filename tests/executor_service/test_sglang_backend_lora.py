"""The SGLang backend's LoRA mode against a real HTTP server that speaks SGLang's LoRA API.

SGLang itself cannot be installed here, so the stand-in for one SGLang server with `--enable-lora` is one of our own
executors (a real process) in the co-batched mode, its policy a LoRA adapter of its serving model, answering SGLang's
adapter endpoints (sglang_lora_api.py) with `generate_without_lora = "base"`: a request without `lora_path` runs the
base, as SGLang's does. The backend is driven in-process (its engine surface) and its tokens are checked against
peft's own under each adapter version.
"""

from __future__ import annotations

import asyncio
import copy
import time
import warnings

import aiohttp
import pytest
import torch

from rose.services.executor.adapters import NAMED_SLOTS
from rose.services.executor.config import SGLangBackendSettings
from rose.services.executor.protocol import EngineSampling, GenerationRequest, RolloutRejected, WorkClass
from rose.services.executor.sglang_backend import BackendModeError, SGLangBackend
from rose.services.executor.weights import WeightUpdateError
from rose.shared.bus import Bus
from rose.shared.launch import ServiceProcess
from rose.shared.lora import Adapter, AdapterError, LoraShape, lora_config, model_fingerprint, new_adapter, write_adapter
from rose.shared.models import init_models, load_model, load_tokenizer
from rose.shared.provisioning import provision
from rose.testing.polling import until

START_TIMEOUT_S = 120.0
FAR = 3600.0  # a lease that outlives the test
SHAPE = LoraShape(rank=4, alpha=8.0)
PROMPT = (5, 6, 7, 8, 9)
TOKENS = 10  # greedy tokens checked against peft's


def trained(model, seed: int) -> dict[str, torch.Tensor]:
    """An adapter's tensors whose B is not zero (version 0's is): what training leaves, so its tokens differ."""
    tensors = new_adapter(model, SHAPE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=gen)) if ".lora_B." in n else t for n, t in tensors.items()}


def peft_greedy(base, tensors: dict[str, torch.Tensor] | None, n: int = TOKENS) -> list[int]:
    """peft's greedy continuation of PROMPT under the adapter ``tensors`` (None: the base alone)."""
    from peft import get_peft_model, set_peft_model_state_dict

    model = base
    if tensors is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(copy.deepcopy(base), lora_config(SHAPE))
        set_peft_model_state_dict(model, tensors)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """A serving model and its LoRA policy (`rose models init --lora`'s layout), the policy trained away from the base;
    with the base, the policy and a second version, as tensors."""
    root = tmp_path_factory.mktemp("lora-models")
    paths = init_models(root, seed=0, lora=SHAPE)
    base = load_model(paths.serving)
    fingerprint = model_fingerprint(base.state_dict())
    v0, v1 = trained(base, 11), trained(base, 12)
    write_adapter(paths.policy, Adapter(shape=SHAPE, tensors=v0, base=str(paths.serving), base_fingerprint=fingerprint))
    return {"root": root, "serving": paths.serving, "policy": paths.policy, "base": base, "v0": v0, "v1": v1}


@pytest.fixture(scope="module")
async def server(nats_server, bus_config, lora_models, tmp_path_factory, state_dir):
    """The stand-in SGLang server: a co-batched executor process; yields its URL."""
    env = {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(lora_models["root"]),
        "ROSE_ROLE": "dedicated",  # a standing lease: the server runs whatever it is sent, as SGLang does
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__ROLLOUT_MODE": "co_batched",
        "ROSE_ENGINE__SERVING_KV_MIB": "8",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
        "ROSE_WEIGHTS__FOLLOW": "false",
        "ROSE_SGLANG_API__ALLOW_UNAUTHENTICATED_ADMIN": "true",
        "ROSE_SGLANG_API__GENERATE_WITHOUT_LORA": "base",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
    }
    proc = ServiceProcess("executor", "sglang-lora-stand-in", env, tmp_path_factory.mktemp("sglang-lora") / "server.log").start()
    try:
        async with Bus(bus_config, service="tests", instance="sglang-lora-fixture") as bus:
            await provision(bus.js)
            yield (await proc.wait_ready(bus, START_TIMEOUT_S))["http"]
    finally:
        proc.stop()


@pytest.fixture
async def backend(server, lora_models, tmp_path):
    settings = SGLangBackendSettings(serving_url=server, scrape_interval_s=0.2, staging_dir=str(tmp_path / "staging"), abort_grace_s=10.0)
    b = SGLangBackend(
        settings, serving_dir=str(lora_models["serving"]), policy_dir=str(lora_models["policy"]), device="cpu", rollout_mode="co_batched"
    )
    b.start()
    yield b
    await b.stop()
    await until(lambda: _adapters(server, {"policy"}), 15, "the backend's adapters unloaded from the stand-in")


async def _loaded(url: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
        return set((await r.json())["internal_states"][0]["loaded_lora_adapters"])


async def _adapters(url: str, expected: set[str]) -> bool:
    return await _loaded(url) == expected


async def _rollout_running(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]["num_running_reqs"]


def _request(work_class: WorkClass, max_tokens: int = TOKENS, *, stream: bool = False) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{work_class.value}-{time.monotonic_ns()}",
        work_class=work_class,
        prompt_token_ids=PROMPT,
        sampling=EngineSampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=stream,
    )


async def test_serving_runs_the_base_and_rollout_the_policys_adapter(backend, server, lora_models):
    with pytest.raises(RolloutRejected) as refused:  # the lease still governs rollout
        backend.submit(_request(WorkClass.ROLLOUT))
    assert refused.value.reason == "no_lease"
    backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-1")
    served, turn = await asyncio.gather(backend.submit(_request(WorkClass.SERVING)).result(), backend.submit(_request(WorkClass.ROLLOUT)).result())
    assert list(served.token_ids) == peft_greedy(lora_models["base"], None) and set(served.token_versions) == {0}
    assert list(turn.token_ids) == peft_greedy(lora_models["base"], lora_models["v0"]) and set(turn.token_versions) == {0}
    assert await _loaded(server) == {"policy", "rose-policy-v0"}  # version 0: the policy directory, loaded by name
    stats = backend.stats()  # one server: serving's latencies measured here, per request
    assert stats.ttft_ms["count"] >= 1 and stats.rollout_pool.total_blocks == 0 and stats.policy_version == 0


async def test_a_new_version_is_loaded_and_the_old_one_unloaded_once_unused(backend, server, lora_models, tmp_path):
    backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-2")
    await backend.submit(_request(WorkClass.ROLLOUT, 2)).result()  # version 0 loaded
    long = backend.submit(_request(WorkClass.ROLLOUT, 1500, stream=True))
    first = await anext(aiter(long))
    assert first.token_ids
    pause_ms = await asyncio.wrap_future(backend.apply_policy_weights(lora_models["v1"], 1))
    assert pause_ms > 0 and backend.policy_version == 1
    assert await _loaded(server) == {"policy", "rose-policy-v0", "rose-policy-v1"}  # v0 still has a request in flight
    turn = await backend.submit(_request(WorkClass.ROLLOUT)).result()
    assert list(turn.token_ids) == peft_greedy(lora_models["base"], lora_models["v1"]) and set(turn.token_versions) == {1}
    long.cancel()
    cut = await asyncio.wait_for(long.result(), 15)
    assert cut.finish_reason == "abort" and set(cut.token_versions) == {0}  # every token of it: the version that made it
    await until(lambda: _adapters(server, {"policy", "rose-policy-v1"}), 15, "version 0's adapter unloaded")

    name = next(n for n in lora_models["v1"] if ".lora_B." in n)  # a delta: one tensor changed over the live version
    delta = {name: lora_models["v1"][name] * 2}
    await asyncio.wrap_future(backend.apply_policy_weights(delta, 2))
    assert torch.equal(backend.policy_state_dict()[name], delta[name])
    await until(lambda: _adapters(server, {"policy", "rose-policy-v2"}), 15, "version 1's adapter unloaded")
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["v2"]  # the unloaded version's directory is gone
    turn = await backend.submit(_request(WorkClass.ROLLOUT)).result()
    assert list(turn.token_ids) == peft_greedy(lora_models["base"], {**lora_models["v1"], **delta}) and set(turn.token_versions) == {2}
    # a version that changed no weight (the weight follower hands it over as an empty state): v2's adapter under label 3
    assert await asyncio.wrap_future(backend.apply_policy_weights({}, 3)) == 0.0 and backend.policy_version == 3
    assert await _loaded(server) == {"policy", "rose-policy-v2"} and sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["v2"]
    turn = await backend.submit(_request(WorkClass.ROLLOUT)).result()
    assert list(turn.token_ids) == peft_greedy(lora_models["base"], {**lora_models["v1"], **delta}) and set(turn.token_versions) == {3}
    with pytest.raises(WeightUpdateError, match="adapter"):  # refused here, before anything is written or sent
        backend.apply_policy_weights({name: torch.zeros(3, 3)}, 4)
    assert backend.policy_version == 3


async def test_a_version_the_server_refuses_leaves_the_live_one(backend, server, lora_models, tmp_path):
    backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, "lease-r")
    await backend.submit(_request(WorkClass.ROLLOUT, 2)).result()  # version 0 loaded: one named slot taken
    async with aiohttp.ClientSession() as s:  # someone else fills the server's other adapter slots
        for i in range(NAMED_SLOTS - 1):
            async with s.post(server + "/load_lora_adapter", json={"lora_name": f"other-{i}", "lora_path": str(lora_models["policy"])}) as r:
                assert r.status == 200, await r.text()
        try:
            with pytest.raises(WeightUpdateError, match="refused version 1.*Maximum number of loaded LoRA adapters"):
                await asyncio.wrap_future(backend.apply_policy_weights(lora_models["v1"], 1))
            assert backend.policy_version == 0 and not (tmp_path / "staging" / "v1").exists()
            turn = await backend.submit(_request(WorkClass.ROLLOUT)).result()
            assert list(turn.token_ids) == peft_greedy(lora_models["base"], lora_models["v0"]) and set(turn.token_versions) == {0}
        finally:
            for i in range(NAMED_SLOTS - 1):
                async with s.post(server + "/unload_lora_adapter", json={"lora_name": f"other-{i}"}) as r:
                    assert r.status == 200


async def test_a_revoked_lease_aborts_rollout_on_the_server_and_serving_carries_on(backend, server):
    for lease_id, end in (("lease-3", backend.revoke_rollout), ("lease-4", lambda: backend.park_rollout(time.monotonic() + FAR))):
        backend.set_rollout_lease(8 << 20, time.monotonic() + FAR, lease_id)
        long = backend.submit(_request(WorkClass.ROLLOUT, 1500, stream=True))
        await anext(aiter(long))
        end()
        cut = await asyncio.wait_for(long.result(), 15)
        assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 1500  # its partial output kept, as a revoked turn's
        assert await _rollout_running(server) == 0
        with pytest.raises(RolloutRejected) as refused:
            backend.submit(_request(WorkClass.ROLLOUT))
        assert refused.value.reason == "lease_revoked"
        served = await backend.submit(_request(WorkClass.SERVING, 4)).result()  # serving keeps the server
        assert served.finish_reason == "length"
    assert backend.stats().reclaim_latency_ms


def test_a_lora_policy_is_held_against_the_serving_model_and_its_mode(lora_models, models_dir, tmp_path):
    settings = SGLangBackendSettings()

    def backend(serving, policy, mode: str) -> SGLangBackend:
        return SGLangBackend(settings, serving_dir=str(serving), policy_dir=str(policy), device="cpu", rollout_mode=mode)

    other = write_adapter(
        tmp_path / "foreign", Adapter(shape=SHAPE, tensors=lora_models["v1"], base="elsewhere", base_fingerprint="sha256:" + "0" * 32)
    )
    load_tokenizer(lora_models["serving"]).save_pretrained(other)  # an adapter directory holds its tokenizer too
    with pytest.raises(AdapterError, match="not the base this adapter was built on"):
        backend(lora_models["serving"], other, "co_batched")
    with pytest.raises(BackendModeError, match='rollout_mode = "co_batched"'):
        backend(lora_models["serving"], lora_models["policy"], "two_model")
    with pytest.raises(BackendModeError, match="a model"):
        backend(models_dir / "serving", models_dir / "policy", "co_batched")
