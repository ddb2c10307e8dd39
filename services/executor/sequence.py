"""One generation in flight: its tokens, KV blocks, sampling state and timings."""

from __future__ import annotations

import time

from .protocol import FinishReason, GenerationRequest
from .sampling import SamplerState
from .scheduling import SeqView


class Sequence:
    def __init__(self, seq_id: int, request: GenerationRequest, handle, sampler: SamplerState, adapter: tuple[int, int] | None = None) -> None:
        self.seq_id = seq_id
        # a named adapter's (slot, version label) that this sequence's rows take (``request.lora``, resolved at submit);
        # None: its work class's own weights and version
        self.adapter = adapter
        self.request = request
        self.handle = handle
        self.sampler = sampler
        self.tokens: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(self.tokens)
        self.num_cached = 0
        self.blocks: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.token_times: list[float] = []
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.preemptions = 0
        self.prefix_cached_tokens = 0
        self.emitted_tokens = 0
        self.emitted_text = 0
        self.text = ""
        self.text_final = False  # text was cut at a stop string; do not re-decode
        self.finish_reason: FinishReason | None = None
        self.aborted = False

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def reserve_tokens(self) -> int:
        """Serving reserves its whole length at admission (never preempted); rollout grows."""
        if self.request.work_class.value == "serving":
            return self.prompt_len + self.request.sampling.max_tokens
        return len(self.tokens)

    def view(self) -> SeqView:
        return SeqView(self.seq_id, len(self.tokens), self.num_cached, len(self.blocks), self.reserve_tokens)

    def drop_kv(self) -> list[int]:
        """Forget the KV (preemption for memory); tokens and logprobs are kept for recompute."""
        blocks, self.blocks, self.num_cached = self.blocks, [], 0
        self.preemptions += 1
        return blocks
