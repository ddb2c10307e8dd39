"""SGLang's adapter API on a co-batched engine (a LoRA policy of the serving model) behind a real aiohttp server:
/load_lora_adapter, /unload_lora_adapter and `lora_path` on /generate, replayed as SGLang's own server test
(test/srt/lora/test_lora_update.py) sends them, and the tokens checked against peft's under each adapter."""

from __future__ import annotations

import asyncio
import copy
import time
import warnings

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from rose.services.executor.adapters import NAMED_SLOTS
from rose.services.executor.config import SGLangApiSettings
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.http_api import OpenAIApi
from rose.services.executor.protocol import EngineSampling, GenerationRequest, InvalidRequest, WorkClass
from rose.services.executor.sglang_api import SGLangApi
from rose.services.executor.sglang_lora_api import SGLangSettingsError
from rose.services.executor.telemetry import Telemetry
from rose.shared.lora import Adapter, LoraShape, lora_config, model_fingerprint, new_adapter, write_adapter
from rose.testing.polling import until

MIB = 1 << 20
SHAPE = LoraShape(rank=4, alpha=8.0)
# the engine plays a dedicated SGLang server: rollout is no guest on it
CO_BATCHED = EngineConfig(
    serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0, rollout_mode="co_batched", rollout_is_guest=False
)
OPEN = SGLangApiSettings(allow_unauthenticated_admin=True)
PROMPT = [5, 6, 7, 8, 9, 10]
FAR_S = 3600.0


def trained(model, seed: int) -> Adapter:
    """An adapter of ``model`` whose B is not zero (version 0's is), so its tokens differ from the base's."""
    tensors = new_adapter(model, SHAPE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (t + 0.05 * torch.randn(t.shape, generator=gen)) if ".lora_B." in n else t for n, t in tensors.items()}
    return Adapter(shape=SHAPE, tensors=tensors, base="", base_fingerprint=model_fingerprint(model.state_dict()))


def peft_greedy(base, adapter: Adapter | None, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation peft's own model gives under ``adapter`` (None: the base alone)."""
    from peft import get_peft_model, set_peft_model_state_dict

    model = base
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(copy.deepcopy(base), lora_config(adapter.shape))
        set_peft_model_state_dict(model, adapter.tensors)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def adapters(loaded, tmp_path_factory):
    """The policy and three more adapters of the session's serving model, each written as peft writes one."""
    base, _ = loaded["serving"]
    root = tmp_path_factory.mktemp("adapters")
    made = {name: trained(base, seed) for name, seed in (("policy", 1), ("a1", 2), ("a2", 3), ("a3", 4))}
    return {name: (str(write_adapter(root / name, adapter)), adapter) for name, adapter in made.items()}


@pytest.fixture(scope="module")
def expected(loaded, adapters):
    """peft's greedy 10 tokens after PROMPT under an adapter by name (None: the base), each computed once."""
    base, _ = loaded["serving"]
    memo: dict[str | None, list[int]] = {}

    def tokens(name: str | None) -> list[int]:
        if name not in memo:
            memo[name] = peft_greedy(base, adapters[name][1] if name is not None else None, PROMPT, 10)
        return memo[name]

    return tokens


@pytest.fixture
async def serve(loaded, adapters, make_engine, model_paths):
    """Start an engine (co-batched with the LoRA policy, or two-model) behind the OpenAI app with the SGLang routes;
    yields (session, base URL, engine)."""
    started = []

    async def start(settings: SGLangApiSettings = OPEN, co_batched: bool = True):
        if co_batched:
            model, tok = loaded["serving"]
            engine = Engine(model, tok, None, tok, CO_BATCHED, adapter=adapters["policy"][1])
            engine.start()
            engine.set_rollout_lease(CO_BATCHED.rollout_kv_bytes, time.monotonic() + FAR_S)
            policy_dir = adapters["policy"][0]
        else:
            engine, policy_dir = make_engine(fresh_policy=True), str(model_paths.policy)
        openai = OpenAIApi(engine, Telemetry(engine, "ex-test", "dedicated", 1.0), "rose-serving", 64 << 20)
        SGLangApi(engine, settings, model_dir=policy_dir, served_name="policy", follows_bus_weights=False).mount(openai.app)
        server = TestServer(openai.app)
        await server.start_server()
        session = aiohttp.ClientSession()
        started.append((server, session, engine if co_batched else None))
        return session, str(server.make_url("")), engine

    yield start
    for server, session, engine in started:
        await session.close()
        await server.close()
        if engine is not None:
            await engine.stop()


async def post(session, url, body=None):
    async with session.post(url, json=body) as r:
        return r.status, (await r.json() if "json" in r.headers.get("Content-Type", "") else await r.text())


def greedy(n: int) -> dict:
    return {"temperature": 0, "top_k": 1, "max_new_tokens": n, "ignore_eos": True}


async def test_sglangs_own_update_sequence_replayed(serve, adapters):
    """test_lora_update.py's server session: load, a name loaded twice, unload, batches naming several adapters and
    none, an adapter never loaded, an unloaded one named again (loaded again from its path)."""
    session, base, _ = await serve()
    expected = {"policy"}

    async def load(name: str, error: str | None = None) -> None:
        status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name][0], "pinned": False})
        if error:
            assert status == 400 and error in str(out) and out["success"] is False, out
            return
        expected.add(name)
        assert status == 200 and out["success"] and out["error_message"] == "" and set(out["loaded_adapters"]) == expected, out
        assert out["loaded_adapters"][name] == adapters[name][0]  # name -> path, as lora_manager.py's result

    async def unload(name: str) -> None:
        expected.discard(name)
        status, out = await post(session, f"{base}/unload_lora_adapter", {"lora_name": name})
        assert status == 200 and out["success"] and set(out["loaded_adapters"]) == expected, out

    async def forward(names: list, error: str | None = None) -> list[str]:
        prompts = ["SGL is a", "AI is a field of", "Write a short story."]
        batch = [(p, a) for p in prompts for a in names]
        body = {"text": [p for p, _ in batch], "lora_path": [a for _, a in batch], "sampling_params": greedy(8)}
        status, out = await post(session, f"{base}/generate", body)
        if error:
            assert status == 400 and error in out["error"]["message"] and out["error"]["param"] == "lora_path", out
            return []
        assert status == 200 and len(out) == len(batch), out
        expected.update(a for a in names if a is not None)
        return [o["text"] for o in out]

    for name in ("a1", "a2", "a3"):
        await load(name)
    await load("a1", error="already loaded")
    await unload("a1")
    await load("a1")
    outputs = await forward(["a1", "a2", "a3", None])
    assert len(set(outputs)) > 1  # the adapters answer differently
    await unload("a2")
    await forward(["a2"])  # named again after its unload: SGLang loads it again from its path
    info = await (await session.get(f"{base}/get_server_info")).json()
    assert set(info["internal_states"][0]["loaded_lora_adapters"]) == expected and info["enable_lora"] is True
    await forward(["never-loaded"], error="never been loaded")
    status, out = await post(session, f"{base}/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 400 and out["success"] is False and "does not exist" in out["error_message"]


async def test_each_lora_path_runs_its_adapter_and_none_runs_the_policy(serve, adapters, expected):
    session, base, _ = await serve()
    await post(session, f"{base}/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"][0]})
    body = {"input_ids": [PROMPT] * 3, "lora_path": ["a1", None, "policy"], "sampling_params": greedy(10)}
    status, (named, unnamed, policy) = await post(session, f"{base}/generate", body)
    assert status == 200
    assert named["output_ids"] == expected("a1")
    assert unnamed["output_ids"] == policy["output_ids"] == expected("policy")
    assert named["output_ids"] != unnamed["output_ids"]
    assert set(named["meta_info"]["rose_token_versions"]) == {0}  # a named adapter's tokens: SGLang's adapters carry no version


async def test_generate_without_lora_path_runs_the_base_as_serving_when_set(serve, expected):
    session, base, engine = await serve(SGLangApiSettings(allow_unauthenticated_admin=True, generate_without_lora="base"))
    engine.revoke_rollout()  # base requests are serving work: no lease needed
    status, out = await post(session, f"{base}/generate", {"input_ids": PROMPT, "sampling_params": greedy(10)})
    assert status == 200 and out["output_ids"] == expected(None), out
    stats = engine.stats()
    assert stats.serving_completed == 1 and engine.metrics.rollout_tokens_total == 0  # it ran as serving work, on the base
    engine.set_rollout_lease(CO_BATCHED.rollout_kv_bytes, time.monotonic() + FAR_S)
    status, out = await post(session, f"{base}/generate", {"input_ids": PROMPT, "lora_path": "policy", "sampling_params": greedy(10)})
    assert status == 200 and out["output_ids"] == expected("policy")


async def test_an_unload_waits_for_the_requests_that_name_the_adapter(serve, adapters, loaded):
    session, base, engine = await serve()
    await post(session, f"{base}/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"][0]})
    before = engine.metrics.rollout_tokens_total
    running = asyncio.create_task(post(session, f"{base}/generate", {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": greedy(120)}))
    await until(lambda: engine.metrics.rollout_tokens_total > before, 30, "the request's first token", step=0.01)
    status, out = await post(session, f"{base}/unload_lora_adapter", {"lora_name": "a1"})
    assert running.done() and status == 200 and out["success"] and "a1" not in out["loaded_adapters"]
    status, done = running.result()
    assert status == 200 and len(done["output_ids"]) == 120 and done["meta_info"]["finish_reason"]["type"] == "length"


async def test_adapters_that_cannot_be_held_are_refused_with_what_to_change(serve, adapters, loaded, tmp_path):
    session, base, _ = await serve()
    status, out = await post(session, f"{base}/load_lora_adapter", {"lora_path": adapters["a1"][0]})
    assert status == 400 and out["error"]["param"] == "lora_name"
    status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 400 and out["success"] is False and "adapter_config.json" in out["error_message"]
    model, _ = loaded["serving"]
    foreign = Adapter(shape=SHAPE, tensors=adapters["a1"][1].tensors, base="elsewhere", base_fingerprint="sha256:" + "0" * 32)
    status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": "x", "lora_path": str(write_adapter(tmp_path / "foreign", foreign))})
    assert status == 400 and "not the base this adapter was built on" in out["error_message"]
    wide = Adapter(shape=LoraShape(rank=8, alpha=8.0), tensors=new_adapter(model, LoraShape(rank=8, alpha=8.0)), base="", base_fingerprint=None)
    status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": "x", "lora_path": str(write_adapter(tmp_path / "wide", wide))})
    assert status == 400 and "rank 8" in out["error_message"] and "policy's shape" in out["error_message"]
    for i in range(NAMED_SLOTS):
        status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": f"n{i}", "lora_path": adapters["a1"][0]})
        assert status == 200, out
    status, out = await post(session, f"{base}/load_lora_adapter", {"lora_name": "one-more", "lora_path": adapters["a2"][0]})
    assert status == 400 and f"Maximum number of loaded LoRA adapters is {NAMED_SLOTS}" in out["error_message"]
    assert set(out["loaded_adapters"]) == {"policy"} | {f"n{i}" for i in range(NAMED_SLOTS)}
    status, out = await post(session, f"{base}/unload_lora_adapter", {"lora_name": "policy"})
    assert status == 400 and "never unloaded" in out["error_message"]
    for lora_path in (7, ["n0"], [None, 3]):  # not a name, or not one per prompt
        status, out = await post(session, f"{base}/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": lora_path, "sampling_params": greedy(2)})
        assert status == 400 and out["error"]["param"] == "lora_path" and "one per prompt" in out["error"]["message"], out


async def test_the_two_model_mode_has_no_adapters_and_says_why(serve, adapters):
    session, base, _ = await serve(co_batched=False)
    for path, body, param in (
        ("/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"][0]}, "lora_path"),
        ("/unload_lora_adapter", {"lora_name": "a1"}, "lora_name"),
        ("/generate", {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": greedy(2)}, "lora_path"),
    ):
        status, out = await post(session, base + path, body)
        assert status == 400 and out["error"]["param"] == param and "LoRA is not enabled" in out["error"]["message"], out
    info = await (await session.get(f"{base}/get_server_info")).json()
    assert info["enable_lora"] is False and info["internal_states"][0]["loaded_lora_adapters"] == {}
    with pytest.raises(SGLangSettingsError, match='generate_without_lora = "base"'):
        await serve(SGLangApiSettings(allow_unauthenticated_admin=True, generate_without_lora="base"), co_batched=False)


async def test_the_engine_runs_named_adapter_rows_beside_the_policys_and_servings(serve, adapters, expected):
    """One engine, one batch: a row through a named adapter, one through the policy, one of serving; each gets its own
    model's tokens, and the named adapter's tokens record its version label."""
    _, _, engine = await serve()
    engine.load_adapter("a3", adapters["a3"][1], version=7, source="test")

    def request(rid: str, work_class=WorkClass.ROLLOUT, **kw) -> GenerationRequest:
        sampling = EngineSampling(temperature=0.0, max_tokens=10, ignore_eos=True)
        return GenerationRequest(request_id=rid, work_class=work_class, prompt_token_ids=tuple(PROMPT), sampling=sampling, **kw)

    handles = [engine.submit(request("named", lora="a3")), engine.submit(request("policy")), engine.submit(request("serving", WorkClass.SERVING))]
    named, policy, serving = [await h.result() for h in handles]
    assert list(named.token_ids) == expected("a3") and set(named.token_versions) == {7}
    assert list(policy.token_ids) == expected("policy") and set(policy.token_versions) == {0}
    assert list(serving.token_ids) == expected(None)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'nope'") as refused:
        engine.submit(request("unknown", lora="nope"))
    assert refused.value.param == "lora_path"
    with pytest.raises(InvalidRequest, match="rollout requests"):
        engine.submit(request("serving-lora", WorkClass.SERVING, lora="a3"))
    with pytest.raises(InvalidRequest, match="trajectory_id"):
        engine.submit(request("traj-lora", lora="a3", trajectory_id="t"))
