"""Requests to a real executor engine (`rose.services.executor.engine`), as the engine tests make them, and the
test case every engine backend passes (`CoServingEngineTestcase`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rose.services.executor.backend import CoServingEngine
from rose.services.executor.emulated import EmulationSpec
from rose.services.executor.protocol import EngineSampling, GenerationRequest, RolloutRejected, WorkClass
from rose.testing.polling import until

PROMPT = "Question: what is 12+7? <tool>calc: 12+7</tool>"
FAR_S = 3600.0  # a lease that outlives the test
# a 7B serving model and policy on an emulated H100, as the emulated-device tests run them
EMULATED_7B_H100 = EmulationSpec(
    device="H100",
    serving_model="7B",
    policy_model="7B",
    tp=1,
    dedicated=False,
    serving_kv_bytes=4 << 30,
    rollout_kv_bytes=8 << 30,
    quantum_s=0.01,
)


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


class CoServingEngineTestcase:
    """What every engine behind the executor (``backend.CoServingEngine``) must do, written once and
    run against each (FastStream's shared broker test cases): the home engine on torch CPU
    (tests/executor/test_engine.py), the emulated accelerator (tests/executor/test_emulated.py) and
    the SGLang backend before its stand-in servers (tests/executor_service/test_sglang_backend.py).

    A subclass gives the ``engine`` fixture: a started engine, no lease held, stopped at teardown. It
    may set ``long_tokens`` (a rollout request that long is still running when the test acts on it) and
    ``lease_bytes`` (what a lease lends: enough KV for it).
    Only the engine surface is used; what each backend does underneath is its own module's test.
    """

    long_tokens = 400
    lease_bytes = 8 << 20  # the KV a test's lease lends

    @pytest.fixture
    def engine(self):
        raise NotImplementedError("a subclass gives a started engine without a lease")

    @staticmethod
    def request(work_class: WorkClass, max_tokens: int, *, stream: bool = True, **kw) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"{work_class.value}-{time.monotonic_ns()}",
            work_class=work_class,
            prompt_token_ids=(5, 6, 7, 8, 9),
            sampling=EngineSampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            stream=stream,
            **kw,
        )

    async def refusal(self, engine, detail: str | None = None) -> str:
        with pytest.raises(RolloutRejected, match=detail) as refused:
            engine.submit(self.request(WorkClass.ROLLOUT, 2))
        return refused.value.reason

    async def test_is_a_co_serving_engine(self, engine):
        assert isinstance(engine, CoServingEngine)

    async def test_serving_streams_deltas_that_make_up_the_result(self, engine):
        handle = engine.submit(self.request(WorkClass.SERVING, 8))
        deltas = [d async for d in handle]
        result = await handle.result()
        assert result.finish_reason == "length" and len(result.token_ids) == 8 and len(result.logprobs) == 8
        assert sum((d.token_ids for d in deltas), ()) == result.token_ids and "".join(d.text for d in deltas) == result.text
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert result.policy_version == 0 and 0 < result.timings.ttft_ms <= result.timings.total_ms

    async def test_rollout_runs_only_under_a_granted_lease(self, engine):
        assert await self.refusal(engine) == "no_lease"
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        turn = await engine.submit(self.request(WorkClass.ROLLOUT, 5, stream=False)).result()
        assert turn.finish_reason == "length" and len(turn.token_ids) == 5 == len(turn.logprobs)
        assert all(lp <= 0.0 for lp in turn.logprobs) and engine.stats().lease_id == "lease-1"

    async def test_revoke_and_expiry_each_say_why(self, engine):
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        engine.revoke_rollout()
        assert await self.refusal(engine) == "lease_revoked"
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + 0.3, "lease-2")
        await asyncio.sleep(0.4)
        assert await self.refusal(engine) == "lease_expired"

    async def test_a_parked_turn_waits_and_a_new_lease_finishes_it(self, engine):
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        parked = engine.submit(self.request(WorkClass.ROLLOUT, self.long_tokens, stream=False))
        await asyncio.sleep(0.2)
        engine.park_rollout(time.monotonic() + FAR_S)
        assert await self.refusal(engine, "parked") == "lease_revoked"
        await asyncio.sleep(0.3)
        assert not parked.done()  # parked, not finished nor aborted
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-2")
        done = await asyncio.wait_for(parked.result(), 120)
        assert done.finish_reason == "length" and len(done.token_ids) == self.long_tokens

    async def test_a_parked_lease_that_runs_out_ends_as_revoked_and_a_new_lease_resumes_its_turn(self, engine):
        """A burst parks the lease; the park runs out before a new lease comes. The lease ended because it was
        revoked (the engine and the SGLang backend once disagreed: one said revoked, the other expired); the turn
        it held is not lost: a new lease finishes it."""
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        turn = engine.submit(self.request(WorkClass.ROLLOUT, self.long_tokens, stream=False))
        await asyncio.sleep(0.2)
        engine.park_rollout(time.monotonic() + 0.3)
        await until(lambda: engine.lease.current is None or time.monotonic() >= engine.lease.current.expires_at, what="the park to run out")
        assert await self.refusal(engine) == "lease_revoked"
        assert not turn.done()
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-2")
        done = await asyncio.wait_for(turn.result(), 120)
        assert done.finish_reason == "length" and len(done.token_ids) == self.long_tokens
        assert engine.lease.ended == "lease_revoked" and engine.stats().lease_id == "lease-2"

    async def test_a_cancelled_request_finishes_with_abort(self, engine):
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        handle = engine.submit(self.request(WorkClass.ROLLOUT, self.long_tokens, stream=False))
        await asyncio.sleep(0.2)
        handle.cancel()
        result = await asyncio.wait_for(handle.result(), 30)
        assert result.finish_reason == "abort" and len(result.token_ids) < self.long_tokens

    async def test_a_weight_swap_labels_rollout_tokens_and_never_serving(self, engine):
        await asyncio.wrap_future(engine.apply_policy_weights(engine.policy_state_dict(), 1))
        engine.set_rollout_lease(self.lease_bytes, time.monotonic() + FAR_S, "lease-1")
        turn = await engine.submit(self.request(WorkClass.ROLLOUT, 3, stream=False)).result()
        assert turn.policy_version == 1 and set(turn.token_versions) == {1}
        served = await engine.submit(self.request(WorkClass.SERVING, 3)).result()
        assert served.policy_version == 0 and set(served.token_versions) == {0}
