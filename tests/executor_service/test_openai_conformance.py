"""The OpenAI API as the official `openai` client and vLLM's own server tests use it, against the
folder's real executor (tests/executor_service/conftest.py): each test replays the requests of
vllm-project/vllm `tests/entrypoints/openai/completion/test_completion.py` or
`tests/entrypoints/openai/chat_completion/test_chat.py` (cited per test) through the official
client, and reads the fields those tests read. Bad values must raise `openai.BadRequestError`
(a 4xx in OpenAI's error shape naming the parameter), never `InternalServerError`.

Also here: the HTTP limits of docs/http-api.md (a request head sent at one byte a second is cut
off by the server; a slow body is not).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import openai
import pytest

MODEL = "rose-serving"
PROMPT = "What is an LLM?"


@pytest.fixture
def client(executor):
    _, base = executor
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


async def complete(client, **kw):
    return await client.completions.create(model=MODEL, **{"max_tokens": 5, "temperature": 0.0, **kw})


# ---- completions (vLLM test_completion.py) ---------------------------------------------------


async def test_single_completion_usage_and_token_ids(client):
    # test_single_completion: text and token-id prompts, finish_reason "length", exact usage
    completion = await complete(client, prompt="Hello, my name is")
    choice = completion.choices[0]
    assert completion.id and len(completion.choices) == 1 and choice.finish_reason == "length" and choice.text
    assert completion.usage.completion_tokens == 5 and completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    by_ids = await complete(client, prompt=[5, 6, 7, 8, 9])
    assert by_ids.usage.prompt_tokens == 5 and by_ids.choices[0].text


@pytest.mark.parametrize("k", [None, 0, 3])
async def test_no_zero_and_some_logprobs(client, k):
    # test_no_logprobs / test_zero_logprobs / test_some_logprobs: `top_logprobs` holds k alternatives (+ the sampled token)
    completion = await complete(client, prompt=[5, 6, 7, 8, 9], logprobs=k)
    lp = completion.choices[0].logprobs
    if k is None:
        assert lp is None
        return
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= k + 1 and token in top  # distinct ids can decode alike: a dict may hold fewer
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    if k == 0:
        assert all(len(top) == 1 for top in lp.top_logprobs)


async def test_too_many_completion_logprobs_are_refused_and_serving_goes_on(client):
    # test_too_many_completion_logprobs: logprobs=21 (and 30 streamed) -> BadRequestError; the server still works
    with pytest.raises(openai.BadRequestError) as err:
        await complete(client, prompt=[5, 6, 7, 8, 9], logprobs=21)
    assert err.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError):
        stream = await complete(client, prompt=[5, 6, 7, 8, 9], logprobs=30, stream=True)
        async for _ in stream:
            pass
    assert (await complete(client, prompt=[5, 6, 7, 8, 9])).choices[0].text is not None


async def test_completion_streaming_matches_and_finishes_once(client):
    # test_completion_streaming
    single = (await complete(client, prompt=PROMPT)).choices[0].text
    stream = await complete(client, prompt=PROMPT, stream=True)
    chunks, finishes = [], 0
    async for chunk in stream:
        chunks.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length" and "".join(chunks) == single


async def test_parallel_sampling_n3_is_n_seeded_requests(client):
    # test_parallel_no_streaming: n=3, temperature 1, logprobs=0, seed=42; index i is a request with seed 42 + i
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, logprobs=0, seed=42)
    assert [c.index for c in completion.choices] == [0, 1, 2] and all(c.finish_reason for c in completion.choices)
    assert completion.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in completion.choices)
    alone = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=43)
    assert completion.choices[1].text == alone.choices[0].text
    again = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, logprobs=0, seed=42)
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]


async def test_parallel_streaming_flattens_choices_by_index(client):
    # test_parallel_streaming: one stream, each chunk one choice with its index, n finish reasons
    n = 3
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=n, temperature=1.0, stream=True, seed=42)
    texts, finishes = [""] * n, 0
    async for chunk in stream:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
        finishes += chunk.choices[0].finish_reason is not None
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=n, temperature=1.0, seed=42)
    assert finishes == n and texts == [c.text for c in plain.choices]


async def test_completion_stream_options(client):
    # test_completion_stream_options: the four include_usage x continuous_usage_stats cases, {} and the stream=False refusals
    async def chunks(options):
        return [c async for c in await complete(client, prompt=PROMPT, stream=True, stream_options=options)]

    for options in ({"include_usage": False, "continuous_usage_stats": False}, {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(c.usage is None for c in await chunks(options))
    got = await chunks({"include_usage": True, "continuous_usage_stats": False})
    assert all(c.usage is None for c in got[:-1]) and got[-2].choices[0].finish_reason is not None
    final = got[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5 and final.usage.prompt_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    got = await chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None and c.usage.completion_tokens > 0 for c in got) and got[-1].choices == []
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError) as err:
            await complete(client, prompt=PROMPT, stream=False, stream_options=options)
        assert err.value.param == "stream_options"


async def test_batch_completions_text_and_token_ids(client):
    # test_batch_completions: a list of prompts (text, and token ids), n=2 over a batch, and streamed
    for prompts in (["Hello, my name is"] * 2, [[5, 6, 7, 8, 9]] * 2):
        batch = await complete(client, prompt=prompts)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        batch = await complete(client, prompt=prompts, n=2, temperature=1.0, seed=7)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.choices[0].text == batch.choices[2].text and batch.choices[1].text == batch.choices[3].text  # same prompt, same seeds
        texts = [""] * 2
        async for chunk in await complete(client, prompt=prompts, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1]


async def test_a_batch_of_four_prompts_is_four_requests(client):
    prompts = ["2+3=", "The sky is", "def f(x):", "Once upon"]
    batch = await complete(client, prompt=prompts, max_tokens=6)
    singles = [await complete(client, prompt=p, max_tokens=6) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


async def test_stop_string_cuts_the_text(client):
    free = (await complete(client, prompt="Question: 12+7?", max_tokens=24)).choices[0].text
    assert len(free) > 4
    stop = free[2:4]
    cut = (await complete(client, prompt="Question: 12+7?", max_tokens=24, stop=[stop])).choices[0]
    assert cut.finish_reason == "stop" and free.startswith(cut.text) and stop not in cut.text


# ---- chat (vLLM test_chat.py) ------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


async def chat(client, **kw):
    return await client.chat.completions.create(model=MODEL, messages=MESSAGES, **{"max_completion_tokens": 5, "temperature": 0.0, **kw})


async def test_chat_logprobs_and_top_logprobs(client):
    # test_no_logprobs_chat / test_zero_logprobs_chat / test_some_logprobs_chat
    assert (await chat(client, logprobs=False)).choices[0].logprobs is None
    zero = (await chat(client, logprobs=True, top_logprobs=0)).choices[0].logprobs
    assert zero.content is not None and len(zero.content[0].top_logprobs) == 0
    some = await chat(client, logprobs=True, top_logprobs=5)
    content = some.choices[0].logprobs.content
    assert len(content) == some.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 5 and bytes(item.bytes).decode("utf-8", "replace") == item.token
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and item.logprob == pytest.approx(values[0], abs=1e-5)


async def test_chat_too_many_logprobs_and_top_logprobs_without_logprobs(client):
    # test_too_many_chat_logprobs: top_logprobs=21 refused (plain and streamed); the server still works
    for kw in ({}, {"stream": True}):
        with pytest.raises(openai.BadRequestError) as err:
            stream = await chat(client, logprobs=True, top_logprobs=21, **kw)
            async for _ in stream:
                pass
        assert err.value.param == "top_logprobs" and "20" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        await chat(client, top_logprobs=2)
    assert err.value.param == "top_logprobs"
    assert (await chat(client, logprobs=True, top_logprobs=20)).choices[0].logprobs.content


async def test_chat_streaming_with_usage_and_logprobs(client):
    # test_chat_streaming + test_chat_completion_stream_options: role first, deltas, finish once, usage chunk last
    full = await chat(client, max_completion_tokens=10, logprobs=True, top_logprobs=2)
    stream = await chat(client, max_completion_tokens=10, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    body = chunks[:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert sum(c.choices[0].finish_reason is not None for c in body) == 1
    streamed = [item.token for c in body for item in (c.choices[0].logprobs.content or [])]
    assert streamed == [item.token for item in full.choices[0].logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


async def test_chat_n3_seeded_and_streamed(client):
    plain = await chat(client, n=3, temperature=1.0, seed=11, max_completion_tokens=8)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    texts = [""] * 3
    async for chunk in await chat(client, n=3, temperature=1.0, seed=11, max_completion_tokens=8, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in plain.choices]


# ---- bad values: always a 4xx in OpenAI's shape, never a 5xx -------------------------------------

BAD_COMPLETIONS = [
    pytest.param({"temperature": "hot"}, "temperature", id="temperature-string"),
    pytest.param({"n": 0}, "n", id="n-zero"),
    pytest.param({"n": 1000}, "n", id="n-too-many"),
    pytest.param({"logprobs": -1}, "logprobs", id="logprobs-negative"),
    pytest.param({"max_tokens": -5}, "max_tokens", id="max-tokens-negative"),
    pytest.param({"prompt": []}, "prompt", id="prompt-empty-list"),
    pytest.param({"prompt": [[]]}, "prompt", id="prompt-empty-ids"),
    pytest.param({"prompt": ["ok", ""]}, "prompt", id="batch-with-empty-prompt"),
    pytest.param({"stop": 5}, "stop", id="stop-number"),
    pytest.param({"seed": "x"}, "seed", id="seed-string"),
    pytest.param({"presence_penalty": 1.0}, "presence_penalty", id="penalty"),
    pytest.param({"best_of": 5}, "best_of", id="best-of"),
    pytest.param({"logit_bias": {"5": 10}}, "logit_bias", id="logit-bias"),
    pytest.param({"echo": True}, "echo", id="echo"),
]


@pytest.mark.parametrize("override,param", BAD_COMPLETIONS)
async def test_bad_completion_values_are_bad_requests_naming_the_parameter(client, override, param):
    with pytest.raises(openai.BadRequestError) as err:  # the client sends values as given (its types are hints only)
        await complete(client, **{"prompt": "x", **override})
    assert err.value.status_code == 400 and err.value.param == param, err.value.message


async def test_bad_chat_values_are_bad_requests(client):
    for kw, param in (({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({"n": 0}, "n")):
        with pytest.raises(openai.BadRequestError) as err:
            await chat(client, **kw)
        assert err.value.param == param


# ---- HTTP limits (docs/http-api.md) ---------------------------------------------------------------


async def test_a_request_head_sent_slowly_is_cut_off_by_the_server(executor):
    """A client sending its headers at one byte a second (slowloris) is disconnected by the server
    within the head deadline; a client that sends its head in time then trickles the body is served."""
    from rose.shared.http_server import HEAD_READ_TIMEOUT_S

    url = urlsplit(executor[1])
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\nX-Padding: {'a' * 64}\r\n\r\n".encode()
    started, sent = time.monotonic(), 0
    try:
        while sent < len(head):
            writer.write(head[sent : sent + 1])
            await writer.drain()
            sent += 1
            if reader.at_eof():
                break
            await asyncio.sleep(1.0)
        leftover = await asyncio.wait_for(reader.read(), timeout=HEAD_READ_TIMEOUT_S + 5)
    except ConnectionError:
        leftover = b""
    took = time.monotonic() - started
    writer.close()
    assert leftover == b"" and sent < len(head)  # closed by the server, before the head was complete, with no answer
    assert took < HEAD_READ_TIMEOUT_S + 5

    body = b'{"model": "rose-serving", "prompt": "hi", "max_tokens": 2, "temperature": 0}'
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    for i in range(0, len(body), 16):  # the body trickles in over ~2 s: not under the head deadline
        writer.write(body[i : i + 16])
        await writer.drain()
        await asyncio.sleep(0.4)
    status = await asyncio.wait_for(reader.readline(), timeout=30)
    writer.close()
    assert status.startswith(b"HTTP/1.1 200")
