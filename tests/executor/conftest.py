"""Shared fixtures: the tiny default models are built once per session into a tmp dir."""

from __future__ import annotations

import asyncio
import time

import pytest

from rose.services.executor.engine import Engine, EngineConfig
from rose.shared.models import init_models, load_model, load_tokenizer

MIB = 1 << 20
TEST_CONFIG = EngineConfig(serving_kv_bytes=8 * MIB, rollout_kv_bytes=16 * MIB, device="cpu", seed=0)
LONG_LEASE_S = 3600.0


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory):
    return init_models(tmp_path_factory.mktemp("models"), seed=0)


@pytest.fixture(scope="session")
def loaded(model_paths):
    return {
        "serving": (load_model(model_paths.serving), load_tokenizer(model_paths.serving)),
        "policy": (load_model(model_paths.policy), load_tokenizer(model_paths.policy)),
    }


@pytest.fixture
def make_engine(loaded, model_paths):
    """Build started engines; stopped at teardown. fresh_policy=True reloads the policy weights."""
    engines = []

    def build(policy: str = "rose", config: EngineConfig = TEST_CONFIG, lease: bool = True, fresh_policy: bool = False) -> Engine:
        s_model, s_tok = loaded["serving"]
        p_model, p_tok = loaded["policy"]
        if fresh_policy:
            p_model = load_model(model_paths.policy)
        engine = Engine(s_model, s_tok, p_model, p_tok, config, policy)
        engine.start()
        if lease and engine.policy.admits_rollout:
            engine.set_rollout_lease(config.rollout_kv_bytes, time.monotonic() + LONG_LEASE_S)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:  # stopped as a service stops it (a test may have stopped it already: stop is idempotent)
        asyncio.run(engine.stop())
