"""A pushed or published state is checked against the live policy before anything is converted
(issue 22): a bf16 tensor of the wrong shape used to be upcast to fp32 first, allocating its full
fp32 size, and only then refused."""

from __future__ import annotations

import resource

import pytest
import torch

from rose.services.executor.policy_updates import PolicyUpdates
from rose.services.executor.weights import WeightUpdateError

CLAIMED_ELEMENTS = 1 << 31  # 8 GiB once converted to fp32; an expanded bf16 scalar holds 2 bytes


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("problem", ["wrong shape", "unknown name"])
async def test_refused_before_any_conversion(make_engine, problem):
    engine = make_engine(fresh_policy=True)
    live = engine.policy_state_dict()
    name, target = max(live.items(), key=lambda kv: kv[1].numel())
    assert target.dtype == torch.float32  # so bf16 would be upcast (the conversion the check must precede)
    huge = torch.zeros((), dtype=torch.bfloat16).expand(CLAIMED_ELEMENTS // 1024, 1024)
    state = {name: huge} if problem == "wrong shape" else {name: target.to(torch.bfloat16), "model.backdoor": huge}
    before, version = _peak_rss(), engine.policy_version
    with pytest.raises(WeightUpdateError, match="shape" if problem == "wrong shape" else "unknown parameter"):
        await PolicyUpdates(engine).apply(state, version + 1)
    assert _peak_rss() - before < (CLAIMED_ELEMENTS * 4) // 8  # nothing of the fp32 size was allocated
    assert engine.policy_version == version and torch.equal(engine.policy_state_dict()[name], target)


async def test_lossless_upcast_still_applies(make_engine):
    engine = make_engine(fresh_policy=True)
    name, target = next(iter(engine.policy_state_dict().items()))
    new = (target + 1).to(torch.bfloat16)
    await PolicyUpdates(engine).apply({name: new}, engine.policy_version + 1)
    assert torch.equal(engine.policy_state_dict()[name], new.to(torch.float32))
