"""The engine with real models: preemption, prefix retention, sampling, weights, leases, policies."""

import asyncio
import time

import pytest
import torch

from rose.services.executor.engine import EngineConfig
from rose.services.executor.policies import POLICY_NAMES
from rose.services.executor.protocol import InvalidRequest, RolloutRejected, WorkClass
from rose.services.executor.weights import WeightUpdateError
from rose.testing.engine import CoServingEngineTestcase, generate, req
from rose.testing.polling import until

MIB = 1 << 20
TEST_CONFIG = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0)  # as in conftest


async def test_preempted_rollout_resumes_to_the_uninterrupted_tokens(make_engine):
    engine = make_engine()
    params = dict(temperature=0, max_tokens=48, ignore_eos=True)
    reference = await generate(engine, req(engine, "ref", **params))
    handle = engine.submit(req(engine, "pre", **params))
    seen = []
    async for delta in handle:
        seen.extend(delta.token_ids)
        if len(seen) >= 3 and engine.stats().rollout_running:
            before = engine.stats().preemptions
            engine.set_rollout_budget(0)  # memory pressure: the sequence loses its KV (at the engine's next iteration)
            await until(lambda before=before: engine.stats().preemptions > before, 30, "the preemption under a zero budget", step=0.005)
            engine.set_rollout_budget(TEST_CONFIG.rollout_kv_bytes)
            break
    result = await handle.result()
    assert result.timings.preemptions >= 1
    assert result.token_ids == reference.token_ids  # nothing lost, nothing duplicated
    assert len(result.token_ids) == 48 and result.finish_reason == "length"
    assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-3)


async def test_seeded_sampling_survives_revoke_and_new_lease(make_engine):
    engine = make_engine()
    params = dict(temperature=1.0, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    reference = await generate(engine, req(engine, "ref", **params))
    handle = engine.submit(req(engine, "rev", **params))
    async for _delta in handle:
        engine.revoke_rollout()  # rollout yields within a quantum and frees its KV
        await until(lambda: engine.stats().rollout_pool.used_blocks == 0, 30, "the revoked rollout's KV freed", step=0.005)
        engine.set_rollout_lease(TEST_CONFIG.rollout_kv_bytes, time.monotonic() + 60)
        break
    result = await handle.result()
    assert result.token_ids == reference.token_ids
    assert engine.stats().preemptions >= 1


async def test_prefix_cache_hit_on_second_turn(make_engine):
    engine = make_engine()
    tok = engine.tokenizer_for(WorkClass.ROLLOUT)
    turn1 = req(engine, "t1", temperature=0, max_tokens=8, ignore_eos=True, trajectory_id="traj", stream=False)
    r1 = await generate(engine, turn1)
    assert r1.prefix_cached_tokens == 0
    assert engine.stats().rollout_pool.cached_blocks > 0
    prompt2 = turn1.prompt_token_ids + r1.token_ids + tuple(tok.encode(" <result>19</result>"))
    r2 = await generate(engine, req(engine, "t2", prompt=prompt2, temperature=0, max_tokens=4, trajectory_id="traj"))
    assert r2.prefix_cached_tokens == len(turn1.prompt_token_ids) + len(r1.token_ids) - 1
    plain = await generate(engine, req(engine, "t2b", prompt=prompt2, temperature=0, max_tokens=4))
    assert r2.token_ids == plain.token_ids  # reused KV gives the same continuation
    stats = engine.stats()
    assert stats.prefix_hits == 1 and stats.prefix_misses == 1


async def test_budget_shrink_evicts_lru_prefix_then_preempts(make_engine):
    engine = make_engine()
    for i in range(3):
        await generate(engine, req(engine, f"c{i}", temperature=0, max_tokens=4, trajectory_id=f"traj{i}"))
    pool = engine.stats().rollout_pool
    assert pool.cached_blocks == pool.used_blocks > 0
    per_entry = pool.cached_blocks // 3
    engine.set_rollout_budget((pool.used_blocks - per_entry) * pool.block_bytes)  # applied within one quantum
    await until(lambda: len(list(engine.prefix_cache.entries())) < 3, 10, "an entry evicted")
    assert list(engine.prefix_cache.entries()) == ["traj1", "traj2"]  # the oldest went first
    serving_before = engine.stats().serving_pool
    assert serving_before.used_blocks == 0 and serving_before.total_blocks == TEST_CONFIG.serving_kv_bytes // serving_before.block_bytes


async def test_sampling_params(make_engine):
    engine = make_engine("rose")
    cls = WorkClass.SERVING
    a = await generate(engine, req(engine, "g1", cls, temperature=0, max_tokens=12, ignore_eos=True))
    b = await generate(engine, req(engine, "g2", cls, temperature=0, max_tokens=12, ignore_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12 and a.finish_reason == "length"
    s1 = await generate(engine, req(engine, "s1", cls, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True))
    s2 = await generate(engine, req(engine, "s2", cls, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True))
    s3 = await generate(engine, req(engine, "s3", cls, temperature=1.0, seed=4, max_tokens=24, ignore_eos=True))
    assert s1.token_ids == s2.token_ids != s3.token_ids
    assert all(lp <= 0 for lp in s1.logprobs)
    text = s1.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.find(stop)
    h = engine.submit(req(engine, "stop", cls, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, stop=(stop,)))
    streamed = "".join([d.text async for d in h])
    stopped = await h.result()
    assert stopped.finish_reason == "stop" and stopped.text == text[:cut] == streamed
    eos = engine.tokenizer_for(cls).eos_token_id
    first = a.token_ids[0]
    r = await generate(engine, req(engine, "stopid", cls, temperature=0, max_tokens=12, stop_token_ids=(first,)))
    assert r.token_ids == (first,) and r.finish_reason == "stop"
    assert eos is not None


async def test_a_stream_interval_sends_fewer_deltas_with_the_same_tokens_and_text(make_engine):
    """SGLang's --stream-interval: the first token goes out alone (TTFT is exact), then deltas of `stream_interval`
    tokens; what they add up to is the unstreamed result, token for token and character for character."""
    engine = make_engine("rose")
    cls = WorkClass.SERVING
    whole = await generate(engine, req(engine, "w", cls, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, stream=False))
    h = engine.submit(req(engine, "i", cls, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, stream_interval=16))
    deltas = [d async for d in h]
    assert [len(d.token_ids) for d in deltas] == [1, 16, 16, 7]
    assert sum((d.token_ids for d in deltas), ()) == whole.token_ids and "".join(d.text for d in deltas) == whole.text
    with pytest.raises(InvalidRequest, match="stream_interval"):
        engine.submit(req(engine, "z", cls, max_tokens=4, stream_interval=0))


def test_the_fast_decoder_is_the_tokenizers_decode(loaded):
    """The engine decodes with the Rust tokenizer directly (batcher.text_decoder): the same text as transformers'
    decode with skip_special_tokens, over random ids including special ones and partial UTF-8."""
    import random

    from rose.services.executor.batcher import text_decoder

    tokenizer = loaded["serving"][1]
    decode = text_decoder(tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 7, 50, 300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(prompt=()), "empty"),
        (dict(prompt=(1,) * 2040, max_tokens=20), "positions"),
        (dict(prompt=(10**6,)), "token ids"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=("",)), "stop"),
    ],
)
async def test_invalid_requests_raise_before_queueing(make_engine, kw, words):
    engine = make_engine("serving_only")
    with pytest.raises(InvalidRequest, match=words):
        engine.submit(req(engine, "bad", WorkClass.SERVING, **kw))
    assert engine.stats().serving_queue == 0


async def test_weight_update_is_atomic_and_validated(make_engine):
    engine = make_engine(fresh_policy=True)
    model = engine.work_for(WorkClass.ROLLOUT).model
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    before = await generate(engine, req(engine, "b", **params))
    serving_before = await generate(engine, req(engine, "sb", WorkClass.SERVING, **params))
    good = {k: v.clone() for k, v in model.state_dict().items()}
    for bad in (
        {"nope.weight": torch.zeros(3)},
        {"lm_head.weight": torch.zeros(2, 2)},
        {"model.norm.weight": good["model.norm.weight"].to(torch.float64)},
    ):
        with pytest.raises(WeightUpdateError):
            engine.apply_policy_weights(bad, 1)
    still = await generate(engine, req(engine, "s", **params))
    assert still.token_ids == before.token_ids and still.policy_version == 0
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in good.items()}
    pause_ms = await asyncio.wrap_future(engine.apply_policy_weights(new, 1))
    assert pause_ms >= 0 and engine.stats().max_swap_pause_ms == pause_ms
    after = await generate(engine, req(engine, "a", **params))
    assert after.policy_version == 1 and set(after.token_versions) == {1}
    assert after.token_ids != before.token_ids
    serving_after = await generate(engine, req(engine, "sa", WorkClass.SERVING, **params))
    assert serving_after.token_ids == serving_before.token_ids  # the serving model is never touched


async def test_lease_expiry_is_enforced_by_the_engine(make_engine):
    engine = make_engine(lease=False)
    with pytest.raises(RolloutRejected) as no_lease:
        engine.submit(req(engine, "x"))
    assert no_lease.value.reason == "no_lease"
    engine.set_rollout_lease(TEST_CONFIG.rollout_kv_bytes, time.monotonic() + 0.3)
    handle = engine.submit(req(engine, "long", temperature=0, max_tokens=1500, ignore_eos=True, stream=False))
    await asyncio.sleep(0.6)  # past the lease's expiry; the engine then parks its turn at its next iteration

    def released():
        stats = engine.stats()
        return stats if stats.rollout_pool.total_blocks == 0 else None

    stats = await until(released, 10, "the expired lease's pool released")
    assert stats.rollout_pool.total_blocks == 0 and stats.rollout_pool.used_blocks == 0
    assert stats.rollout_queue == 1 and stats.rollout_running == 0  # parked, tokens kept
    with pytest.raises(RolloutRejected) as expired:
        engine.submit(req(engine, "y"))
    assert expired.value.reason == "lease_expired"
    handle.cancel()
    result = await handle.result()
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 1500


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_every_policy_serves_and_runs_rollout(make_engine, policy):
    engine = make_engine(policy, EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu"))
    rollouts = []
    if engine.policy.admits_rollout:
        rollouts = [engine.submit(req(engine, f"r{i}", temperature=1.0, seed=i, max_tokens=16, stream=False)) for i in range(4)]
    else:
        with pytest.raises(RolloutRejected):
            engine.submit(req(engine, "r"))
    serving = await generate(engine, req(engine, "s", WorkClass.SERVING, temperature=0, max_tokens=8, ignore_eos=True))
    assert len(serving.token_ids) == 8 and serving.timings.ttft_ms > 0
    for h in rollouts:
        assert len((await h.result()).token_ids) >= 1
    stats = engine.stats()
    assert stats.ttft_ms["count"] == 1 and stats.serving_completed == 1


async def test_public_read_outs(make_engine):
    """What the SGLang-compatible API and the benchmarks read, instead of the engine's private state."""
    engine = make_engine()
    assert engine.lanes_alive and not engine.stopping
    assert engine.rollout_lease is not None and engine.rollout_lease.budget_bytes == TEST_CONFIG.rollout_kv_bytes
    assert engine.work_for(WorkClass.ROLLOUT).max_batch == TEST_CONFIG.rollout_max_batch
    assert engine.work_for(WorkClass.ROLLOUT).pool.block_size == TEST_CONFIG.block_size
    assert engine.work_for(WorkClass.SERVING).queue_lengths() == (0, 0)
    assert engine.cuda_graph_stats() == {"serving": None, "rollout": None}  # CPU: no graphs
    handle = engine.submit(req(engine, "ro", max_tokens=4))
    assert sum(engine.work_for(WorkClass.ROLLOUT).queue_lengths()) == 1
    await handle.result()
    await engine.stop()
    assert engine.stopping and not engine.lanes_alive
    engine.revoke_rollout()
    assert engine.rollout_lease is None


def test_engine_config_defaults_are_the_services():
    """One definition of each default: EngineConfig's are config.EngineSettings', except the two it differs in on purpose."""
    from rose.services.executor.config import EngineSettings

    service = EngineConfig.from_settings(EngineSettings())
    differ = {name for name, value in vars(EngineConfig()).items() if getattr(service, name) != value}
    assert differ == {"slo_ttft_ms", "slo_tpot_ms", "rollout_process"}


class TestHomeEngine(CoServingEngineTestcase):
    """The shared engine test case (rose.testing.engine) on the home engine, torch on CPU."""

    @pytest.fixture
    def engine(self, make_engine):
        return make_engine(lease=False, fresh_policy=True)
