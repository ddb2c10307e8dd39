"""Messages of the co-serving executor: rollout generation turns and metrics snapshots."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import Fraction, Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds

MAX_STOP_STRINGS = 16

FinishReason = Literal["stop", "length", "abort"]  # why a generation ended: a stop token or string, max_tokens, or aborted
ExecutorRole = Literal["serving", "dedicated"]
# How rollout shares a serving device: "two_model", the policy a model of its own, rollout in quanta between serving's
# iterations; "co_batched", the policy a LoRA adapter of the serving model, rollout rows inside serving's own iterations
RolloutMode = Literal["two_model", "co_batched"]  # a serving instance (rollout under a lease) or a dedicated rollout one


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one generation; validated on decode so a bad value never reaches the engine."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 64
    stop: Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = msgspec.field(default_factory=list)
    stop_token_ids: list[NonNegInt] = msgspec.field(default_factory=list)
    seed: int | None = None


class GenerateRequest(Message):
    """One turn of a rollout trajectory, sent to one executor, admitted only under a lease."""

    request_id: Identifier
    trajectory_id: Identifier
    turn_index: NonNegInt
    prompt_token_ids: Annotated[list[NonNegInt], msgspec.Meta(min_length=1)]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    task_id: str = ""
    lease_id: str = ""
    lease_epoch: NonNegInt = 0
    min_policy_version: NonNegInt = 0
    # Not a turn but an abort: stop the in-flight turn with this request id (of the same trajectory and turn;
    # a hedge's slower copy) so it frees its slot; nothing is generated, the reply says whether it was found.
    abort_request_id: str = ""


RejectReason = Literal["no_lease", "lease_expired", "lease_revoked", "stale_lease_epoch", "draining", "overloaded", "invalid"]


class GenerateTimings(msgspec.Struct, kw_only=True):
    queue_ms: NonNegFloat = 0.0
    ttft_ms: NonNegFloat = 0.0
    total_ms: NonNegFloat = 0.0
    preemptions: NonNegInt = 0


class GenerateReply(Message):
    """The result of one turn: tokens with logprobs and the policy version that produced them."""

    request_id: Identifier
    executor_id: Identifier
    status: Literal["ok", "rejected", "failed"]
    reject_reason: RejectReason | None = None
    error: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    policy_version: NonNegInt = 0  # the version of the last token
    token_versions: list[NonNegInt] = msgspec.field(default_factory=list)  # per token, when a swap fell inside the turn
    prefix_cached_tokens: NonNegInt = 0
    timings: GenerateTimings = msgspec.field(default_factory=GenerateTimings)


class LatencySketch(msgspec.Struct, kw_only=True):
    """A mergeable quantile sketch (DDSketch, log-bucketed) of latencies in milliseconds.

    Bins map a bucket key to a count; two sketches with the same relative accuracy merge
    by adding counts, so the SLO monitor can combine executors and time windows exactly.
    """

    relative_accuracy: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.01
    count: NonNegFloat = 0.0
    zero_count: NonNegFloat = 0.0
    sum: float = 0.0
    min: float = 0.0
    max: float = 0.0
    bins: dict[int, float] = msgspec.field(default_factory=dict)


class PoolUsage(msgspec.Struct, kw_only=True):
    """KV-cache memory of one class (serving or rollout), accounted in fixed-size blocks."""

    block_bytes: NonNegInt
    total_blocks: NonNegInt
    used_blocks: NonNegInt
    cached_blocks: NonNegInt = 0


class DeviceTelemetry(msgspec.Struct, kw_only=True):
    """What the device reports: NVML on a GPU, process and CPU figures on a CPU, the emulated device's
    timeline on an emulated accelerator (services/executor/emulated.py)."""

    kind: Literal["cuda", "cpu", "emulated"]
    name: str
    memory_total_bytes: NonNegInt = 0
    memory_used_bytes: NonNegInt = 0
    utilization: Fraction = 0.0
    process_rss_bytes: NonNegInt = 0
    # emulated only: how late its forwards ended against their planned end, in percent of each forward's
    # planned time, over the interval (a sketch of percentages, not milliseconds): the host keeping up
    forward_lag: LatencySketch | None = None


class MetricsSnapshot(Message):
    """What an executor measured over one interval; the SLO monitor merges these."""

    executor_id: Identifier
    at: UnixSeconds
    interval_s: NonNegFloat
    role: ExecutorRole = "serving"
    ttft_ms: LatencySketch = msgspec.field(default_factory=LatencySketch)
    tpot_ms: LatencySketch = msgspec.field(default_factory=LatencySketch)
    serving_arrivals: NonNegInt = 0
    serving_completed: NonNegInt = 0
    serving_queue: NonNegInt = 0
    # when the last of the queue is projected to get its first token (shared/bursts.py first_token_wait_ms);
    # None: the executor cannot tell (an SGLang backend), and the queue's length alone is judged
    serving_queue_wait_ms: NonNegFloat | None = None
    serving_running: NonNegInt = 0
    rollout_queue: NonNegInt = 0
    rollout_running: NonNegInt = 0
    serving_tokens_per_s: NonNegFloat = 0.0
    rollout_tokens_per_s: NonNegFloat = 0.0
    serving_pool: PoolUsage | None = None
    rollout_pool: PoolUsage | None = None
    prefix_hits: NonNegInt = 0
    prefix_misses: NonNegInt = 0
    preemptions: NonNegInt = 0
    # of prefix_misses (the device's), the turns whose prefix the host tier restored; and the bytes it holds now
    prefix_host_hits: NonNegInt = 0
    host_kv_bytes: NonNegInt = 0
    # prompt tokens/s of its recent rollout forwards that prefilled (0: none yet): what a moved turn's prefill costs here
    rollout_prefill_tokens_per_s: NonNegFloat = 0.0
    policy_version: NonNegInt = 0
    lease_id: str = ""
    device: DeviceTelemetry | None = None
    # a burst parked the lease (`Lease.park_until`): the rollout sequences counted above keep their KV and compute
    # nothing until a new lease resumes them or the park ends
    rollout_parked: bool = False
    # co_batched: rollout rows ride in serving's own iterations, so serving's TPOT runs up to the executor's guard setpoint
    # by design (contracts/slo.py GUARD_SETPOINT), and the monitor judges its headroom against that
    rollout_mode: RolloutMode = "two_model"
