"""Requests to a real executor engine (`rose.services.executor.engine`), as the engine tests make them."""

from __future__ import annotations

from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass

PROMPT = "Question: what is 12+7? <tool>calc: 12+7</tool>"


def req(engine, rid, cls=WorkClass.ROLLOUT, prompt=PROMPT, **kw):
    """A request `rid` of work class `cls`: `prompt` is text (encoded with the engine's tokenizer for
    that class) or a tuple of token ids; `stream`, `stream_interval` and `trajectory_id` from `kw`, the rest is sampling."""
    stream = kw.pop("stream", True)
    traj = kw.pop("trajectory_id", None)
    interval = kw.pop("stream_interval", 1)
    ids = prompt if isinstance(prompt, tuple) else tuple(engine.tokenizer_for(cls).encode(prompt))
    return GenerationRequest(
        request_id=rid,
        work_class=cls,
        prompt_token_ids=ids,
        sampling=EngineSampling(**kw),
        trajectory_id=traj,
        stream=stream,
        stream_interval=interval,
    )


async def generate(engine, request):
    """Submit `request` and wait for its whole result."""
    return await engine.submit(request).result()
