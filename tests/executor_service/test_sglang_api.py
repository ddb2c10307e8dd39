"""A real executor process driven the way slime drives an SGLang server, over real HTTP (aiohttp, as
verl's async SGLang client): health and flush at start, pause -> flush -> tensor update from another
process -> continue, rollouts with logprobs and the new weight version; the admin key is enforced."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from rose.services.executor.sglang_tensors import serialize_named_tensors
from rose.shared.bus import Bus
from rose.shared.launch import ServiceProcess
from rose.shared.models import load_model
from rose.shared.provisioning import provision

KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
async def sglang_executor(nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
    env = {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_ROLE": "dedicated",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "8",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
        "ROSE_WEIGHTS__FOLLOW": "false",
        "ROSE_SGLANG_API__ADMIN_API_KEY": KEY,
    }
    log = tmp_path_factory.mktemp("sglang-executor") / "executor.log"
    proc = ServiceProcess("executor", "ex-sglang-api", env, log).start()
    try:
        async with Bus(bus_config, service="tests", instance="sglang-api-fixture") as bus:
            await provision(bus.js)
            endpoints = await proc.wait_ready(bus, START_TIMEOUT_S)
        yield endpoints["http"], log
    finally:
        proc.stop()


class _Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self.text = status, body.decode()

    def json(self):
        import json

        return json.loads(self.text)


class _Http:
    """get/post returning status and body, in the shape of slime's httpx calls."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def get(self, path: str, **kw) -> _Response:
        async with self.session.get(path.lstrip("/"), **kw) as r:
            return _Response(r.status, await r.read())

    async def post(self, path: str, **kw) -> _Response:
        async with self.session.post(path.lstrip("/"), **kw) as r:
            return _Response(r.status, await r.read())


async def test_slime_style_session_against_a_real_executor(sglang_executor, models_dir):
    base, log = sglang_executor
    async with aiohttp.ClientSession(base_url=base + "/", timeout=aiohttp.ClientTimeout(total=60)) as session:
        http = _Http(session)
        assert (await http.get("/health_generate")).status_code == 200
        assert (await http.get("/flush_cache")).status_code == 401  # admin: no key, no entry
        assert (await http.get("/flush_cache", headers={"Authorization": "Bearer nope"})).status_code == 401
        unset = await http.get("/flush_cache", headers={"Authorization": "Bearer None"})  # slime's external mode: its api_key is None
        assert unset.status_code == 401 and unset.json()["error"]["param"] == "Authorization" and "Bearer None" in unset.json()["error"]["message"]
        assert (await http.get("/flush_cache", headers=AUTH)).status_code == 200

        tokenizer_ids = list(range(5, 25))
        params = {
            "temperature": 0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 16,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        before = (await http.post("/generate", json={"sampling_params": params, "return_logprob": True, "input_ids": tokenizer_ids})).json()
        assert before["meta_info"]["weight_version"] == "0" and len(before["meta_info"]["output_token_logprobs"]) == 16

        policy = load_model(str(models_dir / "policy"))
        state = policy.state_dict()
        name = next(n for n in state if n.endswith("self_attn.o_proj.weight"))
        update = [(name, (state[name] * -1.0).contiguous())]  # held here until the executor has answered
        assert (await http.post("/pause_generation", json={}, headers=AUTH)).json()["status"] == "ok"
        assert (await http.get("/flush_cache", headers=AUTH)).status_code == 200
        body = {
            "serialized_named_tensors": [await asyncio.to_thread(serialize_named_tensors, update)],
            "load_format": None,
            "flush_cache": False,
            "weight_version": "1",
        }
        reply = await http.post("/update_weights_from_tensor", json=body, headers=AUTH)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
        assert (await http.post("/continue_generation", json={}, headers=AUTH)).status_code == 200

        rows = (await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 2}, headers=AUTH)).json()
        assert torch.equal(torch.tensor(rows), update[0][1][:2])  # bit-exact across processes
        after = (await http.post("/generate", json={"sampling_params": params, "return_logprob": True, "input_ids": tokenizer_ids})).json()
        assert after["meta_info"]["weight_version"] == "1" and after["meta_info"]["rose_token_versions"] == [1] * 16
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        assert (await http.get("/get_weight_version")).json() == {"weight_version": "1"}
    assert KEY not in log.read_text()  # the admin key never reaches the log
