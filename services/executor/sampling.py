"""Token sampling and stop detection, per sequence.

Each sequence has its own ``torch.Generator`` (seeded from the request, or from the
engine's seed sequence when the request has none), so a seeded request samples the same
tokens whatever else shares its batch and however often it is preempted: preemption
never consumes randomness. Logprobs are of the sampled token under the *untempered*
distribution (log_softmax of raw logits), documented in ``GenerationResult``.
"""

from __future__ import annotations

import torch

from .protocol import EngineSampling

# Temperatures below this sample greedily (their limit), as vLLM does: dividing float32 logits by
# a smaller one overflows to inf, and the softmax of that is NaN, which torch.multinomial rejects.
GREEDY_BELOW = 1e-5


class SamplerState:
    """Per-sequence sampling state: generator and parameters.

    ``seed`` and ``draws`` let another process rebuild the exact generator (the rollout forward
    process samples there: ``rollout_process.py``): seed it, then skip ``draws`` uniforms.
    """

    def __init__(self, params: EngineSampling, seed: int) -> None:
        self.params = params
        self.seed = seed
        self.greedy = params.temperature < GREEDY_BELOW
        self.draws = 0  # uniforms drawn so far (one per sampled token, none when greedy)
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []  # per sampled token, when params.top_logprobs > 0
        self._generator: torch.Generator | None = None  # made on first use: rebuilt after ``skip``

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(self.seed)
            for _ in range(self.draws):
                torch.rand(1, generator=self._generator, dtype=torch.float64)
        return self._generator

    def draw(self) -> torch.Tensor:
        uniform = torch.rand(1, generator=self.generator, dtype=torch.float64)
        self.draws += 1
        return uniform

    def skip(self) -> None:
        """Another process drew this sequence's next uniform (from its copy of the stream): count it,
        and rebuild the local generator only if it is ever used (no torch op here)."""
        self.draws += 1
        self._generator = None


def sample_batch(logits: torch.Tensor, states: list[SamplerState]) -> tuple[list[int], list[float]]:
    """Sample one token per row of float32 ``logits`` [B, vocab]; return ids and their logprobs."""
    logits = logits.cpu()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1).tolist()
    # one batched softmax for every row (greedy rows get a harmless temperature of 1)
    temps = torch.tensor([1.0 if s.greedy else s.params.temperature for s in states], dtype=logits.dtype)
    probs_all = torch.softmax(logits / temps[:, None], dim=-1)
    tokens = greedy
    rows = [row for row, s in enumerate(states) if not s.greedy]
    if rows:
        probs = probs_all[rows] if len(rows) < len(states) else probs_all
        for i, row in enumerate(rows):
            p = states[row].params
            if 0 < p.top_k < probs.shape[1]:
                probs[i] = _top_k_filter(probs[i], p.top_k)
            if p.top_p < 1.0:
                probs[i] = _top_p_filter(probs[i].clone(), p.top_p)
        # Inverse-CDF sampling, one batched search: each row draws one uniform from its own
        # generator (so a seeded request samples the same tokens whatever shares its batch);
        # right=True never lands on a zero-probability token.
        uniforms = torch.cat([states[row].draw() for row in rows])
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        picked_rows = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1).tolist()
        for row, token in zip(rows, picked_rows):
            tokens[row] = token
    picked = logprobs_all[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    for row, state in enumerate(states):  # asked for by the OpenAI API's logprobs / top_logprobs only
        if state.params.top_logprobs:
            values, ids = logprobs_all[row].topk(state.params.top_logprobs)
            state.top_logprobs.append(tuple(zip(ids.tolist(), values.tolist())))
    return tokens, picked


def _top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k most likely tokens, renormalised."""
    kept, index = probs.topk(top_k)
    filtered = torch.zeros_like(probs).scatter_(0, index, kept)
    return filtered / filtered.sum()


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(0)
    drop = cumulative - sorted_probs >= top_p
    drop[0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 would drop all)
    sorted_probs[drop] = 0.0
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return filtered / filtered.sum()


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int:
    """Index of the earliest stop string starting at or after ``search_from`` (or -1)."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, search_from))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
