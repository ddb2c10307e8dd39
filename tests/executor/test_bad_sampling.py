"""Sampling values that once killed the engine's lane thread (found by tests/executor_service/test_http_fuzz.py)."""

from __future__ import annotations

import pytest
import torch

from rose.services.executor.protocol import EngineSampling, InvalidRequest
from rose.services.executor.sampling import SamplerState, sample_batch


def _sample(logits: torch.Tensor, **params) -> list[int]:
    return sample_batch(logits, [SamplerState(EngineSampling(**params), seed=1) for _ in range(len(logits))])[0]


def test_a_temperature_that_rounds_to_zero_in_float32_samples_greedily():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1).tolist()
    for temperature in (1e-320, 1e-40, 1e-6):
        assert _sample(logits, temperature=temperature) == greedy


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert _sample(logits, temperature=1.0, top_p=1e-320) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params,needle",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(temperature=float("inf")), "finite"),
        (dict(temperature=float("nan")), "finite"),
    ],
)
def test_out_of_range_values_are_refused_before_the_engine(params, needle):
    with pytest.raises(InvalidRequest, match=needle):
        EngineSampling(**params).validate()
    EngineSampling(seed=2**64 - 1).validate()
    EngineSampling(seed=-(2**63)).validate()
