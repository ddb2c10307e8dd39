"""The gateway's OpenAI-compatible API as the official `openai` client uses it, and as an adversary would:
tool calls, token ids, streaming, retries, segment breaks, the ways an episode ends, a restart, and the
refusals (each a 4xx naming the parameter, or the key)."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import openai
import pytest

from rose.bench.gateway import CALC
from rose.services.gateway.agents import SpawnedAgents
from rose.services.gateway.chat import ChatFormat, HermesCalls, normalize_tools
from rose.services.gateway.config import EpisodeSettings, GatewayConfig
from rose.services.trainer.batch import sequences_of
from rose.shared.agentic.env_arithmetic import ArithmeticEnv, calculate
from rose.shared.bus import Delivery
from rose.shared.turns.settings import TurnSettings
from rose.testing.gateway import arithmetic_task, checkpoints, start_gateway
from rose.testing.polling import until

MODEL = "rose-policy"


@pytest.fixture(scope="module")
async def gateway(gw_bus, fleet, models_dir, tmp_path_factory):
    gw = await start_gateway(gw_bus, models_dir, None, tmp_path_factory.mktemp("gw-api"))
    yield gw
    await gw.close()


async def _client(gateway, task):
    episode = await gateway.episodes.open(task)
    _, base = gateway.episodes.urls(episode)
    return episode, openai.AsyncOpenAI(base_url=base, api_key=episode.key, max_retries=0)


def _question(task) -> tuple[str, str]:
    problem = ArithmeticEnv(9).problem_of(task)
    return problem.question, problem.data


async def test_tool_calls_token_ids_streaming_retries_and_a_segment_break(gateway, fleet, fmt):
    task = arithmetic_task(31, "api-main")
    episode, client = await _client(gateway, task)
    question, expression = _question(task)
    messages: list = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=CALC, logprobs=True, extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": expression}
    raw = first.model_dump()
    assert raw["prompt_token_ids"] == raw["choices"][0]["prompt_token_ids"] == fmt.encode(ArithmeticEnv(9).reset(task))  # vLLM's and SGLang's fields
    ids = raw["choices"][0]["token_ids"]
    assert ids == episode.turns[0].record.token_ids and len(choice.logprobs.content) == len(ids)
    assert [e.logprob for e in choice.logprobs.content] == episode.turns[0].record.logprobs

    asked = len(fleet.requests)
    again = await client.chat.completions.create(model=MODEL, messages=messages, tools=CALC, extra_body={"return_token_ids": True})
    assert again.model_dump()["choices"][0]["token_ids"] == ids and again.choices[0].message.tool_calls[0].id == call.id
    assert len(fleet.requests) == asked and len(episode.turns) == 1, "a retry was sampled again"

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": calculate(expression)}]
    stream = await client.chat.completions.create(model=MODEL, messages=messages, tools=CALC, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"<answer>{calculate(expression)}</answer>" and chunks[-1].usage.completion_tokens == len(episode.turns[1].record.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    second = episode.turns[1].record
    assert second.prompt_token_ids[: len(ids) + len(episode.turns[0].record.prompt_token_ids)] == episode.turns[0].record.prompt_token_ids + ids

    answer = {"role": "assistant", "content": text}
    edited = [
        {"role": "user", "content": "What is 2+2?"},
        *messages[1:],
        answer,
        {"role": "user", "content": "Sure?"},
    ]  # the agent rewrote its history
    await client.chat.completions.create(model=MODEL, messages=edited, tools=CALC)
    assert episode.turns[2].extends == -1 and "messages[0]" in episode.turns[2].segment_reason

    root, _ = gateway.episodes.urls(episode)
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {episode.key}"}) as http,
        http.post(f"{root}/reward", json={"reward": 0.25}) as r,
    ):
        assert r.status == 200, await r.text()
    await gateway.episodes.publish(episode)  # what the work-queue handler does once the episode has ended
    t = gateway.trajectory(task.task_id) or await until(lambda: gateway.trajectory(task.task_id))
    assert t.status == "completed" and t.reward == 0.25 and len(t.turns) == 3
    assert [(b.turn_index, "edited its history" in b.reason) for b in t.segment_breaks] == [(2, True)]
    assert t.turns[0].observation.startswith("\n<|im_start|>tool\n<result>") and t.turns[0].tool_calls[0].result == calculate(expression)
    runs = sequences_of(t)  # the trainer trains each segment as one sequence, every sampled token once
    assert len(runs) == 2 and [tok for seq in runs for tok, m in zip(seq.tokens, seq.mask) if m] == [tok for u in t.turns for tok in u.token_ids]
    with pytest.raises(openai.PermissionDeniedError, match="has ended"):  # the key is past its episode's end
        await client.chat.completions.create(model=MODEL, messages=messages, tools=CALC)


async def test_refusals_name_the_parameter_and_keys_open_only_their_episode(gateway):
    episode, client = await _client(gateway, arithmetic_task(32, "api-refusals"))
    other, _ = await _client(gateway, arithmetic_task(33, "api-refusals-other"))
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for change, param in (
        ({"temperature": 0.2}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"n": 2}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"tools": CALC, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**{**ok, **change})
        assert err.value.body["param"] == param, (change, err.value.body)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(**{**ok, "model": "gpt-4o"})
    _, base = gateway.episodes.urls(episode)
    _, other_base = gateway.episodes.urls(other)
    for url, key in ((base, other.key), (other_base, episode.key), (base, ""), (base, episode.key[:-1])):
        stranger = openai.AsyncOpenAI(base_url=url, api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(**ok)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {episode.key}"}) as http:
        async with http.post(f"{base}/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/chat/completions", data=json.dumps({**ok, "messages": "x" * 5_000_000}).encode()) as r:
            assert r.status == 413
    assert episode.turns == [] and other.turns == []  # nothing was sampled for any of it


async def test_a_malformed_tool_call_comes_back_as_text(gateway, fleet):
    task = arithmetic_task(34, "api-malformed")
    fleet.script[task.task_id] = ["<tool>calc: 1+", "<tool>rm: -rf /</tool>", "<answer>3</answer>"]
    episode, client = await _client(gateway, task)
    messages: list = [{"role": "user", "content": "What is 1+2?"}]
    for expected in fleet.script[task.task_id][:2]:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=CALC)
        assert reply.choices[0].message.content == expected and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop"
        messages += [reply.choices[0].message, {"role": "user", "content": "Use the calculator."}]
    assert [t.extends for t in episode.turns] == [-1, 0]


def test_qwen2_style_tool_calls_parse_and_a_broken_one_is_text():
    tools = normalize_tools(CALC)
    calls = HermesCalls()
    good = calls.parse('Let me.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>', tools)
    assert good.content == "Let me." and good.calls == [{"name": "calc", "arguments": {"expression": "2*3"}}]
    two = calls.parse(
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call><tool_call>{"name": "calc", "arguments": {}}</tool_call>',
        tools,
    )
    assert len(two.calls) == 2 and two.calls[0]["arguments"] == {"expression": "1"}
    for broken in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "shell", "arguments": {}}</tool_call>',
        "<tool_call>{",
        '<tool_call>["calc"]</tool_call>',
    ):
        parsed = calls.parse(broken, tools)
        assert parsed.calls == [] and parsed.content == broken and (parsed.malformed or "<tool_call>" in broken)


async def test_a_dropped_connection_keeps_its_turn_and_the_retry_gets_it(gateway, fleet):
    task = arithmetic_task(35, "api-dropped")
    fleet.delay_s[task.task_id] = 1.0
    episode, _ = await _client(gateway, task)
    _, base = gateway.episodes.urls(episode)
    impatient = openai.AsyncOpenAI(base_url=base, api_key=episode.key, max_retries=0, timeout=0.3)
    question, _ = _question(task)
    with pytest.raises(openai.APITimeoutError):
        await impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=CALC)
    asked = len([r for r in fleet.requests if r.task_id == task.task_id])
    patient = openai.AsyncOpenAI(base_url=base, api_key=episode.key, max_retries=0)
    reply = await patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=CALC)
    assert reply.choices[0].message.tool_calls and len(episode.turns) == 1
    assert len([r for r in fleet.requests if r.task_id == task.task_id]) == asked == 1


async def test_completions_extend_their_tokens(gateway, fmt):
    episode, client = await _client(gateway, arithmetic_task(36, "api-completions"))
    first = await client.completions.create(model=MODEL, prompt="What is 4+4? ", extra_body={"return_token_ids": True})
    raw = first.model_dump()["choices"][0]
    follow = "What is 4+4? " + first.choices[0].text + " Again."
    await client.completions.create(model=MODEL, prompt=follow)
    held = raw["prompt_token_ids"] + raw["token_ids"]
    assert episode.turns[1].extends == 0 and episode.turns[1].record.prompt_token_ids[: len(held)] == held
    by_ids = episode.turns[1].record.prompt_token_ids + episode.turns[1].record.token_ids + fmt.encode(" More.")
    await client.completions.create(model=MODEL, prompt=by_ids)
    assert episode.turns[2].extends == 1 and episode.turns[2].record.prompt_token_ids == by_ids


async def test_a_restarted_gateway_answers_from_the_checkpoints(gw_bus, fleet, models_dir, tmp_path, fmt):
    task = arithmetic_task(37, "api-restart")
    first = await start_gateway(gw_bus, models_dir, None, tmp_path / "a")
    episode, client = await _client(first, task)
    question, _ = _question(task)
    asked = [{"role": "user", "content": question}]
    before = await client.chat.completions.create(model=MODEL, messages=asked, tools=CALC, extra_body={"return_token_ids": True})
    await first.close()  # the gateway goes away with the episode open
    assert len(await checkpoints(gw_bus, task.task_id)) == 1
    second = await start_gateway(gw_bus, models_dir, None, tmp_path / "b")
    try:
        reopened, client = await _client(second, task)  # the task delivered again: a new key, the turns restored
        assert reopened.key != episode.key and len(reopened.turns) == 1
        sampled = len(fleet.requests)
        after = await client.chat.completions.create(model=MODEL, messages=asked, tools=CALC, extra_body={"return_token_ids": True})
        assert after.model_dump()["choices"][0]["token_ids"] == before.model_dump()["choices"][0]["token_ids"] and len(fleet.requests) == sampled
        asked += [after.choices[0].message, {"role": "tool", "tool_call_id": after.choices[0].message.tool_calls[0].id, "content": "7"}]
        await client.chat.completions.create(model=MODEL, messages=asked, tools=CALC)
        assert reopened.turns[1].extends == 0 and second.episodes.stats["restored_turns"] == 1
    finally:
        await second.close()


async def test_turn_limit_deadline_and_a_crashing_agent_end_the_episode_with_the_reason(gw_bus, fleet, models_dir, tmp_path):
    config = GatewayConfig(turns=TurnSettings(hedge=False, retry_backoff_s=0.05), episodes=EpisodeSettings(deadline_s=1.5), ack_wait_s=3.0)
    crash = [sys.executable, "-c", "import sys; print('the agent broke'); sys.exit(3)"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for command, task_id, status, words in (
        (crash, "api-crash", "failed", ("code 3", "the agent broke")),
        (sleeper, "api-sleep", "truncated", ("deadline",)),
    ):
        gw = await start_gateway(gw_bus, models_dir, SpawnedAgents(command, tmp_path / task_id), tmp_path / task_id, config=config)
        try:
            await asyncio.wait_for(gw.episodes.handle(arithmetic_task(38, task_id), Delivery("test", attempt=1)), 20.0)
            t = await until(lambda gw=gw, task_id=task_id: gw.trajectory(task_id))
            assert t.status == status and all(w in t.reason for w in words), t.reason
        finally:
            await gw.close()
    gw = await start_gateway(gw_bus, models_dir, None, tmp_path / "limit")
    try:
        task = arithmetic_task(39, "api-limit", max_turns=1)
        episode, client = await _client(gw, task)
        ask = [{"role": "user", "content": _question(task)[0]}]
        reply = await client.chat.completions.create(model=MODEL, messages=ask, tools=CALC)
        ask += [reply.choices[0].message, {"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "1"}]
        with pytest.raises(openai.PermissionDeniedError, match="turn limit"):
            await client.chat.completions.create(model=MODEL, messages=ask, tools=CALC)
        await gw.episodes.publish(episode)
        t = await until(lambda: gw.trajectory(task.task_id))
        assert t.status == "truncated" and "turn limit" in t.reason and len(t.turns) == 1
    finally:
        await gw.close()


def test_a_template_without_tools_refuses_them(models_dir):
    from rose.shared.models import load_tokenizer
    from rose.shared.openai_api import ApiError

    tokenizer = load_tokenizer(models_dir / "policy")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fmt = ChatFormat(tokenizer)
    with pytest.raises(ApiError) as err:
        fmt.render([{"role": "user", "content": "x"}], normalize_tools(CALC))
    assert err.value.param == "tools" and fmt.calls.name == "none"


async def test_a_streamed_tool_call_and_a_full_context(gateway, fleet):
    task = arithmetic_task(40, "api-stream-tools")
    episode, client = await _client(gateway, task)
    question, expression = _question(task)
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=CALC, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            got = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += delta.id or ""
            got["name"] += delta.function.name or ""
            got["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "calc"
    assert json.loads(calls[0]["arguments"]) == {"expression": expression} and calls[0]["id"].startswith("call_")

    full, client = await _client(gateway, arithmetic_task(41, "api-full"))
    gateway.episodes.max_positions = 8  # a policy whose context this conversation fills
    try:
        with pytest.raises(openai.PermissionDeniedError, match="context full"):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=CALC)
    finally:
        gateway.episodes.max_positions = 0
    assert full.ending is not None and full.ending.status == "truncated" and full.turns == []


async def test_an_ended_episodes_key_opens_no_route(gateway):
    """Once the agent posts its reward, its key gets 403 on every route, the read routes included, before the
    episode is published (the agent may take `agent.exit_grace_s` to exit) and after."""
    task = arithmetic_task(42, "api-ended-key")
    episode, client = await _client(gateway, task)
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _question(task)[0]}], tools=CALC)
    root, base = gateway.episodes.urls(episode)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {episode.key}"}) as http:
        async with http.get(root) as r:
            assert r.status == 200 and (await r.json())["status"] == "open"
        async with http.post(f"{root}/reward", json={"reward": 1.0}) as r:
            assert r.status == 200
        for published in (False, True):
            assert (episode.episode_id in gateway.episodes.active) is not published
            for method, url, body in (
                ("GET", root, None),
                ("GET", f"{base}/models", None),
                ("POST", f"{root}/reward", {"reward": 0.0}),
                ("POST", f"{base}/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                ("POST", f"{base}/completions", {"model": MODEL, "prompt": "hi"}),
            ):
                async with http.request(method, url, json=body) as r:
                    error = (await r.json())["error"]
                    assert r.status == 403 and error["code"] == "episode_ended" and "completed" in error["message"], (published, method, url)
            with pytest.raises(openai.PermissionDeniedError, match="has ended"):
                await client.models.list()
            if not published:
                await gateway.episodes.publish(episode)
    assert len(episode.turns) == 1


async def test_each_answer_has_an_id_of_its_own(gateway):
    """A completion's id names one answer: a retry and a replay get the id of the turn they repeat, a new turn a new
    id, and a streamed answer the same id as the same answer unstreamed."""
    task = arithmetic_task(43, "api-ids", max_turns=6)
    episode, client = await _client(gateway, task)
    first_ask = [{"role": "user", "content": _question(task)[0]}]
    first = await client.chat.completions.create(model=MODEL, messages=first_ask, tools=CALC)
    call = first.choices[0].message.tool_calls[0]
    second_ask = [*first_ask, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = await client.chat.completions.create(model=MODEL, messages=second_ask, tools=CALC)
    retried = await client.chat.completions.create(model=MODEL, messages=second_ask, tools=CALC)
    streamed_retry = [c.id async for c in await client.chat.completions.create(model=MODEL, messages=second_ask, tools=CALC, stream=True)]
    replayed = await client.chat.completions.create(model=MODEL, messages=first_ask, tools=CALC)
    third_ask = [*second_ask, second.choices[0].message, {"role": "user", "content": "Sure?"}]
    streamed_third = [c.id async for c in await client.chat.completions.create(model=MODEL, messages=third_ask, tools=CALC, stream=True)]
    third = await client.chat.completions.create(model=MODEL, messages=third_ask, tools=CALC)
    assert len(episode.turns) == 3, "a retry or a replay was sampled again"
    assert len({first.id, second.id, third.id}) == 3, (first.id, second.id, third.id)
    assert retried.id == second.id and set(streamed_retry) == {second.id} and replayed.id == first.id
    assert set(streamed_third) == {third.id}
    texts = [await client.completions.create(model=MODEL, prompt=p) for p in ("What is 1+1? ", "What is 2+2? ", "What is 1+1? ")]
    assert texts[0].id == texts[2].id and len({texts[0].id, texts[1].id, first.id, second.id, third.id}) == 5


async def test_completion_token_ids_outside_the_vocabulary_are_refused(gateway, fmt):
    """A token id the policy does not have is the agent's mistake: a 400 naming `prompt`, nothing sent to an executor
    (where it used to fail the turn on every try; found by the fuzz of OpenAI's spec, whose `prompt` ids are any integers)."""
    episode, client = await _client(gateway, arithmetic_task(45, "api-token-range"))
    for prompt in ([len(fmt.tokenizer)], [5, 2**40], [-1]):
        with pytest.raises(openai.BadRequestError) as err:
            await asyncio.wait_for(client.completions.create(model=MODEL, prompt=prompt), 10.0)
        assert err.value.body["param"] == "prompt" and str(len(fmt.tokenizer)) in err.value.message
    assert episode.turns == []
