"""A LoRA policy inside the paged forward: rows through an adapter must be what peft computes, rows without one
what the base computes, in one packed forward over two KV pools (the co-batched lane's batch)."""

import copy

import pytest
import torch

from rose.services.executor.adapters import AdapterBank
from rose.services.executor.forward_item import ForwardItem
from rose.services.executor.kv_pool import KVPool
from rose.services.executor.model_runner import PagedModelRunner, kv_shape_of
from rose.services.executor.weights import FullPolicyWeights, MergedAdapterWeights, WeightUpdateError, fold_in
from rose.shared.lora import Adapter, AdapterError, LoraShape, lora_config, merged_weights, model_fingerprint, new_adapter

ATOL = 1e-4
SHAPE = LoraShape(rank=4, alpha=8.0)


def _trained_adapter(model, seed: int) -> dict[str, torch.Tensor]:
    """An adapter whose B is not zero (version 0's is): a stand-in for one trained for a few steps."""
    tensors = new_adapter(model, SHAPE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=gen)) if ".lora_B." in n else t for n, t in tensors.items()}


def _peft_model(base, tensors):
    """peft's own model of ``base`` + ``tensors``: the reference the trainer computes logprobs with."""
    from peft import get_peft_model, set_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(base), lora_config(SHAPE))
    set_peft_model_state_dict(model, tensors)
    return model.eval()


@pytest.fixture
def base(loaded):
    return loaded["serving"][0]


def test_one_forward_serves_base_rows_and_adapted_rows_over_two_pools(base):
    tensors = _trained_adapter(base, seed=1)
    reference = _peft_model(base, tensors)
    adapter = Adapter(shape=SHAPE, tensors=tensors, base="", base_fingerprint=model_fingerprint(base.state_dict()))
    bank = AdapterBank.for_adapter(adapter, slots=2, device=torch.device("cpu"), dtype=torch.float32)
    bank.load(1, tensors, version=3)
    serving_pool = KVPool("serving", kv_shape_of(base), 4 << 20, 16, torch.device("cpu"))
    rollout_pool = KVPool("rollout", kv_shape_of(base), 4 << 20, 16, torch.device("cpu"))
    runner = PagedModelRunner(base, [serving_pool, rollout_pool], adapters=bank)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, base.config.vocab_size, (n,), generator=gen) for n in (23, 17, 30)]
    with torch.no_grad():
        base_refs = [base(s[None]).logits[0] for s in seqs]
        lora_refs = [reference(s[None]).logits[0] for s in seqs]
    assert (base_refs[0] - lora_refs[0]).abs().max() > 100 * ATOL  # the adapter changes the logits: the test can tell
    s_tables = [serving_pool.allocate(2) for _ in seqs]
    r_tables = [rollout_pool.allocate(2) for _ in seqs]
    # prefill: sequence 0 as serving (pool 0, base) and as rollout (pool 1, slot 1); sequence 1 rollout only; 2 serving only
    items = [
        ForwardItem(s_tables[0], 0, seqs[0][:22].tolist()),
        ForwardItem(r_tables[0], 0, seqs[0][:22].tolist(), pool=1, adapter=1),
        ForwardItem(r_tables[1], 0, seqs[1][:16].tolist(), pool=1, adapter=1),
        ForwardItem(s_tables[2], 0, seqs[2][:29].tolist()),
    ]
    out = runner.forward(items, all_logits=True)
    torch.testing.assert_close(out[0, :22], base_refs[0][:22], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, :22], lora_refs[0][:22], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2, :16], lora_refs[1][:16], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3, :29], base_refs[2][:29], atol=ATOL, rtol=0)
    # decode steps of all four side by side: each reads its own pool's K/V
    step = [
        ForwardItem(s_tables[0], 22, [seqs[0][22].item()]),
        ForwardItem(r_tables[0], 22, [seqs[0][22].item()], pool=1, adapter=1),
        ForwardItem(r_tables[1], 16, [seqs[1][16].item()], pool=1, adapter=1),
        ForwardItem(s_tables[2], 29, [seqs[2][29].item()]),
    ]
    out = runner.forward(step)
    for row, ref in zip(out, (base_refs[0][22], lora_refs[0][22], lora_refs[1][16], base_refs[2][29])):
        torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
    assert serving_pool.used_blocks == 6 and rollout_pool.used_blocks == 6


def test_a_two_model_lora_policy_folded_into_its_base_computes_what_peft_does(base):
    """The two-model mode's LoRA policy: the adapter folded into its own copy of the base (W + scale * B @ A), then a
    plain forward with no adapter product, equal to peft's adapted model; the pristine weights are kept aside."""
    tensors = _trained_adapter(base, seed=2)
    adapter = Adapter(shape=SHAPE, tensors=tensors, base="", base_fingerprint=None)
    policy = copy.deepcopy(base)
    pristine = fold_in(policy, adapter)
    assert len(pristine) == len(tensors) // 2 and all(torch.equal(w, base.state_dict()[n]) for n, w in pristine.items())
    pool = KVPool("rollout", kv_shape_of(policy), 4 << 20, 16, torch.device("cpu"))
    runner = PagedModelRunner(policy, pool)
    seq = torch.randint(0, base.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _peft_model(base, tensors)(seq[None]).logits[0]
    torch.testing.assert_close(runner.forward([ForwardItem(pool.allocate(1), 0, seq.tolist())], all_logits=True)[0], ref, atol=ATOL, rtol=0)


def test_a_folded_version_is_folded_over_the_pristine_weights_and_checked_first(base):
    """Each version is folded over the base's pristine weights, never over the last fold (which would add the product
    twice); a delta names only what changed; a tensor the adapter lacks is refused before anything changes."""
    v0 = _trained_adapter(base, seed=4)
    adapter = Adapter(shape=SHAPE, tensors=v0, base="", base_fingerprint=None)
    policy = copy.deepcopy(base)
    pristine = fold_in(policy, adapter)
    weights = MergedAdapterWeights(
        adapter, pristine, FullPolicyWeights(policy, PagedModelRunner(policy, KVPool("r", kv_shape_of(policy), 1 << 20, 16, torch.device("cpu"))))
    )
    name = next(n for n in v0 if ".lora_B." in n)
    for version in (1, 2):  # the same delta twice: the second fold must equal the first
        weights.prepare({name: v0[name] * 3}, version)()
        expected = merged_weights(pristine, v0 | {name: v0[name] * 3}, SHAPE.scale)
        assert all(torch.equal(policy.state_dict()[n], w) for n, w in expected.items())
    assert torch.equal(weights.state_dict()[name], v0[name] * 3)
    before = {n: t.clone() for n, t in policy.state_dict().items()}
    with pytest.raises(WeightUpdateError, match="not one of its tensors"):
        weights.prepare({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 4)}, 3)
    with pytest.raises(WeightUpdateError, match="is \\(3, 3\\)"):
        weights.prepare({name: torch.ones(3, 3)}, 3)
    assert all(torch.equal(policy.state_dict()[n], t) for n, t in before.items())


def test_a_version_is_written_into_a_spare_slot_and_checked_first(base):
    v0 = new_adapter(base, SHAPE, seed=0)
    adapter = Adapter(shape=SHAPE, tensors=v0, base="", base_fingerprint=None)
    bank = AdapterBank.for_adapter(adapter, slots=2, device=torch.device("cpu"), dtype=torch.float32)
    bank.load(0, v0, version=0)
    name = next(n for n in v0 if ".lora_B." in n)
    bank.load(1, {name: torch.ones_like(v0[name])}, version=1, base_slot=0)  # a delta over the live slot
    assert torch.equal(bank.state_dict(1)[name], torch.ones_like(v0[name]))
    assert all(torch.equal(bank.state_dict(1)[n], v0[n]) for n in v0 if n != name)
    assert bank.version == [0, 1] and torch.equal(bank.state_dict(0)[name], v0[name])  # slot 0 untouched: still live
    with pytest.raises(AdapterError, match="live adapter"):
        bank.load(1, {name: torch.ones(3, 3)}, version=2, base_slot=0)
    with pytest.raises(AdapterError, match="not a tensor"):
        bank.load(1, {"base_model.model.lm_head.lora_A.weight": torch.ones(4, 4)}, version=2, base_slot=0)
    assert bank.version == [0, 1]  # a refused version changes nothing
    with pytest.raises(AdapterError, match="whole adapter version"):
        bank.load(1, {name: v0[name]}, version=2)
