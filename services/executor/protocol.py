"""What callers hand the engine and what they get back: plain dataclasses, no transport.

The HTTP API and the bus handlers translate their own wire types (``contracts/``) into
these; the engine never sees JSON. Every validation problem is an ``InvalidRequest``
(a ``ValueError``) raised by ``Engine.submit`` before anything is queued, with a message
that says what to change.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, replace

from rose.contracts.executor import MAX_STOP_STRINGS, FinishReason, RejectReason, SamplingParams
from rose.shared.errors import RoseError

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI documents for chat (and vLLM's default max_logprobs)
TopLogprobs = tuple[tuple[int, float], ...]  # one token's most likely alternatives: (token id, logprob), most likely first
SERVING_MODEL_VERSION = 0  # the serving model is never updated; its outputs carry version 0


class WorkClass(enum.Enum):
    SERVING = "serving"  # production traffic, latency SLO, always first
    ROLLOUT = "rollout"  # RL rollout, best effort, only inside a lease


class InvalidRequest(RoseError, ValueError):
    """The request can never be served as given (bad prompt or sampling parameters); ``param`` names
    the sampling parameter at fault, when one is (the HTTP APIs report it in their 4xx)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RolloutRejected(RoseError, RuntimeError):
    """A rollout request arrived when rollout is not admitted; ``reason`` is machine-readable."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: RejectReason = reason  # no_lease, lease_expired, lease_revoked or draining here


@dataclass(frozen=True, kw_only=True)
class EngineSampling:
    """How to sample. temperature 0 means greedy; seed makes sampling reproducible per request.

    The engine's own type, wider than the bus's ``SamplingParams`` (contracts/executor.py), which a
    rollout turn carries: ``from_wire`` makes one of the other. The HTTP APIs build theirs from their
    request bodies; ``validate`` holds every check, whichever way it was made."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # do not stop at the tokenizer's eos (benchmarks with fixed lengths)
    top_logprobs: int = 0  # per output token, also return this many most likely alternatives (untempered logprobs)

    @classmethod
    def from_wire(cls, params: SamplingParams) -> EngineSampling:
        """A rollout turn's sampling (the bus contract, already bounds-checked on decode) as the engine's."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=tuple(params.stop),
            stop_token_ids=tuple(params.stop_token_ids),
            seed=params.seed,
        )

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not (self.top_k == -1 or self.top_k >= 1):
            raise InvalidRequest(f"top_k must be -1 (whole vocabulary) or an integer >= 1, got {self.top_k!r}", "top_k")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers", "stop_token_ids")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}", "top_logprobs")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be an integer in [-2**63, 2**64) or null, got {self.seed!r}", "seed")


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation: a serving completion, or one turn of a rollout trajectory.

    ``trajectory_id`` (rollout only) keys prefix-cache retention between turns: the next
    turn's prompt should extend this turn's prompt + output, and only the new tokens
    are prefilled. ``stream`` False delivers a single final delta (cheaper for rollout).
    """

    request_id: str
    work_class: WorkClass
    prompt_token_ids: tuple[int, ...]
    sampling: EngineSampling = field(default_factory=EngineSampling)
    trajectory_id: str | None = None
    stream: bool = True
    # tokens per streamed delta after the first (SGLang's --stream-interval): fewer, larger deltas cost the host less
    stream_interval: int = 1
    # rollout only: the named adapter (``Engine.load_adapter``, SGLang's ``lora_path``) its rows go through, resolved to
    # a slot at submit; None: the work class's own weights (rollout: the policy's live version)
    lora: str | None = None


@dataclass(frozen=True, kw_only=True)
class StreamDelta:
    """New output since the previous delta (for server-sent events)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per new token, when the request asked for them


@dataclass(frozen=True, kw_only=True)
class Timings:
    """Milliseconds, measured by the engine on the monotonic clock from submit()."""

    queue_ms: float  # submit -> first scheduled
    ttft_ms: float  # submit -> first output token
    tpot_ms: float  # mean time per output token after the first (0 with one token)
    total_ms: float  # submit -> finished
    token_times_ms: tuple[float, ...]  # each output token, relative to submit
    preemptions: int  # times a rollout sequence lost its KV and was recomputed


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """The final output.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the model's
    *untempered* distribution (log_softmax of the raw logits, no top-p), the quantity an
    RL trainer compares against. ``token_versions[i]`` is the policy version whose weights
    sampled token i: a rollout preempted across a weight update carries both versions;
    ``policy_version`` is the version of the last token. ``token_ids`` include the tokens
    that completed a stop string; ``text`` excludes the stop string.
    """

    request_id: str
    work_class: WorkClass
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason
    token_versions: tuple[int, ...]
    policy_version: int
    prefix_cached_tokens: int
    timings: Timings
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token (``sampling.top_logprobs`` alternatives each), else empty


@dataclass(frozen=True)
class EngineLease:
    """What the engine holds of the executor's rollout lease: a KV budget until a monotonic expiry.

    ``admits`` False: the lease was revoked on a burst (``contracts.lease.Lease.park_until``):
    no rollout request is taken or run; those accepted keep their KV until ``expires_at``.
    """

    budget_bytes: int
    expires_at: float  # monotonic seconds
    lease_id: str = ""
    admits: bool = True

    def parked(self, until_monotonic: float) -> EngineLease:
        """This lease parked: running and taking nothing, ending at ``until_monotonic`` at the latest."""
        return replace(self, expires_at=min(self.expires_at, until_monotonic), admits=False)

    def admits_now(self) -> bool:
        return self.admits and time.monotonic() < self.expires_at


def validate_request(request: GenerationRequest, vocab_size: int, max_positions: int) -> None:
    """Every check a generation must pass before it is queued, whichever backend runs it (raises InvalidRequest)."""
    request.sampling.validate()
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequest("prompt is empty: send at least one token")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:3]}")
    total = len(prompt) + request.sampling.max_tokens
    if total > max_positions:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.sampling.max_tokens}) = {total} exceeds "
            f"the model's {max_positions} positions: shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    if request.trajectory_id is not None and request.work_class is WorkClass.SERVING:
        raise InvalidRequest("trajectory_id is for rollout requests only")
    if request.stream_interval < 1:
        raise InvalidRequest(f"stream_interval must be at least 1, got {request.stream_interval}")
    if request.sampling.top_logprobs and request.work_class is WorkClass.ROLLOUT:
        raise InvalidRequest("top_logprobs is for serving requests only (rollout returns the sampled token's logprob)")
    if request.lora is not None:
        if request.work_class is not WorkClass.ROLLOUT:
            raise InvalidRequest("a named adapter (lora_path) is for rollout requests: serving runs the serving model", "lora_path")
        if request.trajectory_id is not None:  # retained prefixes are keyed by trajectory and policy version, not by adapter
            raise InvalidRequest("a request naming an adapter (lora_path) retains no prefix: leave trajectory_id out", "lora_path")


def next_delta(
    request: GenerationRequest,
    token_ids: list[int],
    logprobs: list[float],
    text: str,
    emitted_tokens: int,
    emitted_text: int,
    final: bool,
    finish_reason: FinishReason | None,
    top_logprobs: list[TopLogprobs] | tuple[TopLogprobs, ...] = (),
) -> tuple[StreamDelta | None, int]:
    """The output since the last delta (None: nothing new) and how much text is emitted after it.

    Text that may begin a stop string is held back, and so is an incomplete UTF-8 sequence at the
    end (a replacement character), until the next token settles it; the final delta takes all.
    """
    hold = 0 if final else max((len(s) for s in request.sampling.stop), default=1) - 1
    end = len(text) - hold
    while not final and end > emitted_text and text[end - 1] == "\ufffd":
        end -= 1
    end = max(end, emitted_text)
    if not final and emitted_tokens == len(token_ids) and end == emitted_text:
        return None, emitted_text
    delta = StreamDelta(
        request_id=request.request_id,
        token_ids=tuple(token_ids[emitted_tokens:]),
        logprobs=tuple(logprobs[emitted_tokens:]),
        text=text[emitted_text:end],
        finished=final,
        finish_reason=finish_reason if final else None,
        top_logprobs=tuple(top_logprobs[emitted_tokens:]),
    )
    return delta, end


def timings_since(arrival: float, token_times: list[float], scheduled_at: float | None, preemptions: int, now: float) -> Timings:
    """A finished generation's Timings from monotonic instants (arrival, each token, first scheduled)."""
    times = [(t - arrival) * 1000.0 for t in token_times]
    n = len(times)
    return Timings(
        queue_ms=((scheduled_at or now) - arrival) * 1000.0,
        ttft_ms=times[0] if times else 0.0,
        tpot_ms=(times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
        total_ms=(now - arrival) * 1000.0,
        token_times_ms=tuple(times),
        preemptions=preemptions,
    )
