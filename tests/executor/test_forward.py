"""Our paged forward must produce the Hugging Face model's logits."""

import torch

from rose.services.executor.kv_pool import KVPool
from rose.services.executor.model_runner import ForwardItem, PagedModelRunner, kv_shape_of

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
