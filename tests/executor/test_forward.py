"""Our paged forward must produce the Hugging Face model's logits."""

import torch

from rose.services.executor.forward_item import ForwardItem
from rose.services.executor.kv_pool import KVPool
from rose.services.executor.model_runner import PagedModelRunner, kv_shape_of

ATOL = 1e-4


def test_paged_forward_matches_hf_prefill_and_batched_decode(loaded):
    for name in ("serving", "policy"):
        model, _ = loaded[name]
        pool = KVPool(name, kv_shape_of(model), 4 << 20, 16, torch.device("cpu"))
        runner = PagedModelRunner(model, pool)
        gen = torch.Generator().manual_seed(1)
        seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (37, 20, 5)]
        refs = [model(s[None]).logits[0] for s in seqs]
        tables = [pool.allocate(pool.blocks_for(40)) for _ in seqs]
        prefill = [n - 4 for n in (37, 20, 5)]
        out = runner.forward([ForwardItem(t, 0, s[:p].tolist()) for t, s, p in zip(tables, seqs, prefill)], all_logits=True)
        for b, (ref, p) in enumerate(zip(refs, prefill)):
            torch.testing.assert_close(out[b, :p], ref[:p], atol=ATOL, rtol=0)
        for step in range(4):  # batched decode of sequences at different positions
            items = [ForwardItem(t, p + step, [s[p + step].item()]) for t, s, p in zip(tables, seqs, prefill)]
            out = runner.forward(items)
            for b, (ref, p) in enumerate(zip(refs, prefill)):
                torch.testing.assert_close(out[b], ref[p + step], atol=ATOL, rtol=0)


def test_one_packed_forward_prefills_and_decodes_side_by_side(loaded):
    """Prefill chunks of different lengths (one continuing a cached prefix) and decode steps of
    sequences at different positions, in one forward: each row as the HF model computes it."""
    model, _ = loaded["policy"]
    pool = KVPool("mixed", kv_shape_of(model), 4 << 20, 16, torch.device("cpu"))
    runner = PagedModelRunner(model, pool)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (30, 21, 9, 40)]
    refs = [model(s[None]).logits[0] for s in seqs]
    tables = [pool.allocate(pool.blocks_for(41)) for _ in seqs]
    # sequences 0 and 1 are decoding (their prompts cached by an earlier forward); 3 has 17 tokens cached
    assert (
        runner.forward(
            [
                ForwardItem(tables[0], 0, seqs[0][:29].tolist()),
                ForwardItem(tables[1], 0, seqs[1][:20].tolist()),
                ForwardItem(tables[3], 0, seqs[3][:17].tolist()),
            ]
        )
        is not None
    )
    items = [
        ForwardItem(tables[2], 0, seqs[2].tolist()),  # a whole prompt
        ForwardItem(tables[0], 29, [seqs[0][29].item()]),  # decode
        ForwardItem(tables[3], 17, seqs[3][17:40].tolist()),  # the next prefill chunk
        ForwardItem(tables[1], 20, [seqs[1][20].item()]),  # decode
    ]
    out = runner.forward(items, all_logits=True)
    torch.testing.assert_close(out[0, :9], refs[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, 0], refs[0][29], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2, :23], refs[3][17:40], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3, 0], refs[1][20], atol=ATOL, rtol=0)
    assert not out[1, 1:].any() and not out[0, 9:].any()  # padding rows are zeros
    last = runner.forward(items)  # K/V written again at the same slots: same values
    for row, logits in zip(last, (refs[2][8], refs[0][29], refs[3][39], refs[1][20])):
        torch.testing.assert_close(row, logits, atol=ATOL, rtol=0)
    # the engine's order, prefill first: each group's rows are a contiguous run of the packed batch
    ordered = runner.forward([items[2], items[1], items[3]])
    for row, logits in zip(ordered, (refs[3][39], refs[0][29], refs[1][20])):
        torch.testing.assert_close(row, logits, atol=ATOL, rtol=0)
