"""Every subject on the bus, and every stream, KV bucket and object store behind them.

This is the only place a subject string is written. Code asks a `Channel` for its subject
(`GENERATE.subject(executor_id="ex-1")`) or its subscription pattern (`GENERATE.pattern()`,
where a missing token becomes `*`). `rose contracts export` turns this table into an AsyncAPI
document, and `rose.shared.provisioning` creates the storage it declares.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from enum import Enum

from .base import Message
from .executor import GenerateReply, GenerateRequest, MetricsSnapshot
from .gateway import EpisodeEvent, EpisodeTurn
from .lease import Lease, LeaseEvent
from .rollout import PlacementEvent, RolloutTask, Trajectory, TurnCheckpoint, TurnRoute, TurnRouteRequest
from .service import DeadLetter, Heartbeat, ServiceEvent
from .slo import Headroom, SloAlert
from .training import TrainingStep
from .weights import WeightApplied, WeightFailed, WeightManifest, WeightPublishAccepted, WeightPublishFailed, WeightPublishRequest

SUBJECT_PREFIX = "rose"
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# Defaults kept as named constants: the biggest message a control subject accepts, and the
# biggest a bulk (object store chunk) subject carries, matching the embedded server's max_payload.
CONTROL_MAX_BYTES = 1 << 20
BULK_CHUNK_MAX_BYTES = 8 << 20


class Kind(str, Enum):
    EVENT = "event"  # core pub/sub, fire and forget
    REQUEST = "request"  # request/reply
    STREAM = "stream"  # JetStream, persisted, consumed with acks
    KV = "kv"  # a key in a JetStream KV bucket
    OBJECTS = "objects"  # a JetStream object store bucket


class Encoding(str, Enum):
    JSON = "json"  # control messages and events: any language can read them
    MSGPACK = "msgpack"  # bulk structured payloads
    BYTES = "bytes"  # raw bulk bytes (object store chunks)


class Retention(str, Enum):
    LIMITS = "limits"
    WORK_QUEUE = "workqueue"


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    retention: Retention = Retention.LIMITS
    max_age_s: float = 7 * 24 * 3600.0
    max_msg_size: int = CONTROL_MAX_BYTES
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0


@dataclass(frozen=True)
class KeyValueSpec:
    bucket: str
    description: str
    ttl_s: float = 0.0  # 0: keys live until deleted
    history: int = 1


@dataclass(frozen=True)
class ObjectStoreSpec:
    bucket: str
    description: str
    ttl_s: float = 0.0


@dataclass(frozen=True)
class Channel:
    """One subject (or subject pattern) with its payload, storage and who uses it."""

    name: str
    template: str  # e.g. "rose.executor.{executor_id}.generate"
    kind: Kind
    payload: type[Message] | None
    description: str
    publishers: tuple[str, ...]
    consumers: tuple[str, ...]
    encoding: Encoding = Encoding.JSON
    reply: type[Message] | None = None
    stream: StreamSpec | None = None
    kv: KeyValueSpec | None = None
    objects: ObjectStoreSpec | None = None
    max_bytes: int = CONTROL_MAX_BYTES
    tokens: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)
        object.__setattr__(self, "tokens", names)

    def subject(self, **tokens: str) -> str:
        """The concrete subject; every token must be given and be subject-safe."""
        missing = [t for t in self.tokens if t not in tokens]
        if missing:
            raise ValueError(f"channel {self.name!r} needs {missing} to form a subject")
        extra = set(tokens) - set(self.tokens)
        if extra:
            raise ValueError(f"channel {self.name!r} has no tokens {sorted(extra)}")
        for key, value in tokens.items():
            if not TOKEN_RE.match(str(value)):
                raise ValueError(f"{key}={value!r} is not a valid subject token for {self.name!r}: use 1-128 letters, digits, '_' or '-'")
        return self.template.format(**tokens)

    def pattern(self, **tokens: str) -> str:
        """A subscription pattern: given tokens are filled in, the others become `*`."""
        filled = {t: "*" for t in self.tokens}
        for key, value in tokens.items():
            if key not in filled:
                raise ValueError(f"channel {self.name!r} has no token {key!r}")
            if not TOKEN_RE.match(str(value)):
                raise ValueError(f"{key}={value!r} is not a valid subject token")
            filled[key] = value
        return self.template.format(**filled)

    def parse(self, subject: str) -> dict[str, str]:
        """The tokens of a concrete subject of this channel."""
        parts, pattern = subject.split("."), self.template.split(".")
        if len(parts) != len(pattern):
            raise ValueError(f"{subject!r} is not a subject of channel {self.name!r}")
        out: dict[str, str] = {}
        for have, want in zip(parts, pattern, strict=True):
            if want.startswith("{"):
                out[want[1:-1]] = have
            elif have != want:
                raise ValueError(f"{subject!r} is not a subject of channel {self.name!r}")
        return out


# ---- storage -------------------------------------------------------------------------

EVENTS_STREAM = StreamSpec(
    "ROSE_EVENTS",
    ("rose.events.>",),
    "Public events (leases, SLO alerts, weights, services) kept for replay by integrators.",
)
DLQ_STREAM = StreamSpec(
    "ROSE_DLQ",
    ("rose.dlq.>",),
    "Dead letters: messages a service refused, with the reason and the original bytes.",
    max_msg_size=2 * CONTROL_MAX_BYTES,
)
TELEMETRY_STREAM = StreamSpec(
    "ROSE_TELEMETRY",
    ("rose.telemetry.>",),
    "Executor metrics snapshots, kept one hour so a restarted monitor can catch up.",
    max_age_s=3600.0,
)
TASKS_STREAM = StreamSpec(
    "ROSE_TASKS",
    ("rose.rollout.tasks",),
    "Rollout tasks, a work queue: each task is removed once a worker acks it.",
    retention=Retention.WORK_QUEUE,
    max_age_s=0.0,
)
TRAJECTORIES_STREAM = StreamSpec(
    "ROSE_TRAJECTORIES",
    ("rose.rollout.trajectories.*",),
    "Finished and failed trajectories, durable, for the trainer.",
    max_age_s=0.0,
    max_msg_size=8 * CONTROL_MAX_BYTES,
)
AGENT_TASKS_STREAM = StreamSpec(
    "ROSE_AGENT_TASKS",
    ("rose.rollout.agent_tasks",),
    "Rollout tasks for external agents, a work queue: each is run by a gateway, which acks it once its trajectory is out.",
    retention=Retention.WORK_QUEUE,
    max_age_s=0.0,
)
MANIFESTS_STREAM = StreamSpec(
    "ROSE_WEIGHT_MANIFESTS",
    ("rose.weights.manifest.*.*.*",),
    "One manifest per published weight version, one subject per version, so a joining executor "
    "finds the latest keyframe (last message on the model's keyframe subjects) and the deltas after it.",
    max_age_s=0.0,
)

SERVICES_KV = KeyValueSpec("rose_services", "Latest heartbeat of every live service instance.", ttl_s=60.0)
LEASES_KV = KeyValueSpec("rose_leases", "The current rollout lease of each executor.", history=5)
TURNS_KV = KeyValueSpec("rose_rollout_turns", "Finished turns by (task id, turn index), so a redelivered task resumes.", ttl_s=24 * 3600.0)
EPISODE_TURNS_KV = KeyValueSpec(
    "rose_gateway_turns", "Agents' turns at the gateway by (episode id, turn index), so a restarted gateway loses none.", ttl_s=24 * 3600.0
)
WEIGHTS_OBJECTS = ObjectStoreSpec("rose_weights", "Weight shards (keyframes and deltas), chunked.")
WEIGHTS_STAGING_OBJECTS = ObjectStoreSpec(
    "rose_weights_staging",
    "Dense safetensors a trainer uploads for the publisher when they share no filesystem; expire after a day.",
    ttl_s=24 * 3600.0,
)

STREAMS = (EVENTS_STREAM, DLQ_STREAM, TELEMETRY_STREAM, TASKS_STREAM, TRAJECTORIES_STREAM, MANIFESTS_STREAM, AGENT_TASKS_STREAM)
KV_BUCKETS = (SERVICES_KV, LEASES_KV, TURNS_KV, EPISODE_TURNS_KV)
OBJECT_STORES = (WEIGHTS_OBJECTS, WEIGHTS_STAGING_OBJECTS)

ALL_SERVICES = ("executor", "slo_monitor", "scheduler", "weight_publisher", "rollout_worker", "trainer", "gateway")

# ---- channels ------------------------------------------------------------------------

HEARTBEAT = Channel(
    "service.heartbeat",
    "rose.svc.heartbeat.{service}.{instance}",
    Kind.EVENT,
    Heartbeat,
    "Proof of life every few seconds, with identity, version, load and endpoints.",
    publishers=ALL_SERVICES,
    consumers=("cli", "slo_monitor", "scheduler"),  # the monitor hears its peers' (they split the executors)
)
SERVICE_REGISTRY = Channel(
    "service.registry",
    "{service}.{instance}",
    Kind.KV,
    Heartbeat,
    "The latest heartbeat of each live instance, read by `rose status`.",
    publishers=ALL_SERVICES,
    consumers=("cli",),
    kv=SERVICES_KV,
)
SERVICE_EVENT = Channel(
    "service.lifecycle",
    "rose.events.service.{kind}.{service}.{instance}",
    Kind.STREAM,
    ServiceEvent,
    "A service instance came up or went down (an instance's own credentials publish only its own).",
    publishers=ALL_SERVICES,
    consumers=("integrations",),
    stream=EVENTS_STREAM,
)
DEAD_LETTER = Channel(
    "service.dead_letter",
    "rose.dlq.{service}.{instance}",
    Kind.STREAM,
    DeadLetter,
    "A message the service refused (undecodable, wrong schema version, invalid, oversized, a reply subject it may not answer).",
    publishers=ALL_SERVICES,
    consumers=("operators",),
    stream=DLQ_STREAM,
    max_bytes=DLQ_STREAM.max_msg_size,
)
GENERATE = Channel(
    "executor.generate",
    "rose.executor.{executor_id}.generate",
    Kind.REQUEST,
    GenerateRequest,
    "One rollout turn for one executor; admitted only under a valid lease.",
    publishers=("rollout_worker", "scheduler", "gateway"),
    consumers=("executor",),
    reply=GenerateReply,
)
EXECUTOR_METRICS = Channel(
    "executor.metrics",
    "rose.telemetry.executor.{executor_id}",
    Kind.STREAM,
    MetricsSnapshot,
    "Latency sketches, queues, KV pools, rollout throughput and device telemetry, per interval.",
    publishers=("executor",),
    consumers=("slo_monitor",),
    stream=TELEMETRY_STREAM,
)
HEADROOM = Channel(
    "slo.headroom",
    "rose.slo.headroom.{executor_id}",
    Kind.EVENT,
    Headroom,
    "How much rollout an executor can take now, below its SLO with a margin.",
    publishers=("slo_monitor",),
    consumers=("scheduler", "trainer"),  # the trainer: its rollout queues, for grpo.early_hand_out
)
SLO_ALERT = Channel(
    "slo.alert",
    "rose.events.slo.{executor_id}",
    Kind.STREAM,
    SloAlert,
    "Serving latency at risk (burst detected early, or violation): reclaim rollout now.",
    publishers=("slo_monitor",),
    consumers=("scheduler", "executor", "integrations"),
    stream=EVENTS_STREAM,
)
EXECUTOR_BURST = Channel(
    "executor.burst",
    "rose.executor.{executor_id}.burst",
    Kind.EVENT,
    SloAlert,
    "An executor's own burst detector tripped on its serving arrivals: it has yielded; stop routing turns there and revoke its lease.",
    publishers=("executor",),
    consumers=("scheduler", "cli"),
)
LEASE = Channel(
    "lease.current",
    "{executor_id}",
    Kind.KV,
    Lease,
    "The current lease of an executor; executors watch their key.",
    publishers=("scheduler",),
    consumers=("executor",),
    kv=LEASES_KV,
)
LEASE_EVENT = Channel(
    "lease.event",
    "rose.events.lease.{kind}.{executor_id}",
    Kind.STREAM,
    LeaseEvent,
    "A lease was granted, renewed, revoked or expired.",
    publishers=("scheduler",),
    consumers=("scheduler", "integrations"),  # scheduler instances follow each other's leases
    stream=EVENTS_STREAM,
)
ROUTE_TURN = Channel(
    "scheduler.route",
    "rose.scheduler.route",
    Kind.REQUEST,
    TurnRouteRequest,
    "Where should this turn run? Turn-wise routing with prefix-cache affinity.",
    publishers=("rollout_worker", "gateway"),
    consumers=("scheduler",),
    reply=TurnRoute,
)
PLACEMENT = Channel(
    "scheduler.placement",
    "rose.events.placement.{executor_id}",
    Kind.STREAM,
    PlacementEvent,
    "A placement decision, for audit and tracing.",
    publishers=("scheduler",),
    consumers=("integrations",),
    stream=EVENTS_STREAM,
)
ROLLOUT_TASK = Channel(
    "rollout.task",
    "rose.rollout.tasks",
    Kind.STREAM,
    RolloutTask,
    "Rollout tasks; at-least-once to one worker, de-duplicated by (task id, turn index).",
    publishers=("trainer", "scheduler"),
    consumers=("rollout_worker",),
    stream=TASKS_STREAM,
)
TRAJECTORY = Channel(
    "rollout.trajectory",
    "rose.rollout.trajectories.{status}",
    Kind.STREAM,
    Trajectory,
    "Completed, failed or truncated trajectories, durable, for the trainer (de-duplicated by trajectory id).",
    publishers=("rollout_worker", "gateway"),
    consumers=("trainer", "scheduler", "integrations"),
    stream=TRAJECTORIES_STREAM,
    max_bytes=TRAJECTORIES_STREAM.max_msg_size,
)
TURN_CHECKPOINT = Channel(
    "rollout.turn_checkpoint",
    "{task_id}.{turn_index}",
    Kind.KV,
    TurnCheckpoint,
    "A finished turn of a task: the idempotence key of at-least-once rollout.",
    publishers=("rollout_worker",),
    consumers=("rollout_worker",),
    kv=TURNS_KV,
)
AGENT_TASK = Channel(
    "rollout.agent_task",
    "rose.rollout.agent_tasks",
    Kind.STREAM,
    RolloutTask,
    "Rollout tasks for external agents: a gateway opens an episode, hands its agent a base URL and key, publishes the trajectory.",
    publishers=("trainer",),
    consumers=("gateway",),
    stream=AGENT_TASKS_STREAM,
)
EPISODE_TURN = Channel(
    "gateway.episode_turn",
    "{episode_id}.{turn_index}",
    Kind.KV,
    EpisodeTurn,
    "A turn of an agent's episode, checkpointed before it is answered: retries and a restarted gateway answer from it.",
    publishers=("gateway",),
    consumers=("gateway",),
    kv=EPISODE_TURNS_KV,
)
EPISODE_EVENT = Channel(
    "gateway.episode",
    "rose.events.episode.{kind}.{episode_id}",
    Kind.STREAM,
    EpisodeEvent,
    "An agent's episode opened at a gateway, or ended (completed, failed or truncated, with the reason).",
    publishers=("gateway",),
    consumers=("cli", "integrations"),
    stream=EVENTS_STREAM,
)
WEIGHT_MANIFEST = Channel(
    "weights.manifest",
    "rose.weights.manifest.{model}.{kind}.{version}",
    Kind.STREAM,
    WeightManifest,
    "A new weight version: its shards, encodings and digests; kind is `keyframe` or `delta`.",
    publishers=("weight_publisher",),
    consumers=("executor", "trainer", "integrations"),  # the trainer's SDK waits for its versions
    stream=MANIFESTS_STREAM,
)
WEIGHT_SHARDS = Channel(
    "weights.shards",
    "{object_name}",
    Kind.OBJECTS,
    None,
    "Shard objects in the standard object store layout (any nats client can read them).",
    publishers=("weight_publisher",),
    consumers=("executor",),
    encoding=Encoding.BYTES,
    objects=WEIGHTS_OBJECTS,
    max_bytes=BULK_CHUNK_MAX_BYTES,
)
WEIGHT_STAGING = Channel(
    "weights.staging",
    "{object_name}",
    Kind.OBJECTS,
    None,
    "Dense safetensors staged by a trainer's SDK for the publisher (when they share no path).",
    publishers=("trainer",),
    consumers=("weight_publisher",),
    encoding=Encoding.BYTES,
    objects=WEIGHTS_STAGING_OBJECTS,
    max_bytes=BULK_CHUNK_MAX_BYTES,
)
WEIGHT_PUBLISH = Channel(
    "weights.publish",
    "rose.weights.publish.{model}",
    Kind.REQUEST,
    WeightPublishRequest,
    "Publish a new version of a model; answered when the request is queued, not when it is published.",
    publishers=("trainer",),
    consumers=("weight_publisher",),
    reply=WeightPublishAccepted,
)
WEIGHT_PUBLISH_FAILED = Channel(
    "weights.publish_failed",
    "rose.events.weights.publish_failed.{model}",
    Kind.STREAM,
    WeightPublishFailed,
    "An accepted publish request failed; the version was not published.",
    publishers=("weight_publisher",),
    consumers=("trainer", "integrations"),
    stream=EVENTS_STREAM,
)
WEIGHT_APPLIED = Channel(
    "weights.applied",
    "rose.events.weights.applied.{executor_id}",
    Kind.STREAM,
    WeightApplied,
    "An executor verified and swapped in a weight version.",
    publishers=("executor",),
    consumers=("cli", "integrations", "trainer"),  # the trainer: TRL's rollout function waits until every executor runs its version
    stream=EVENTS_STREAM,
)
WEIGHT_FAILED = Channel(
    "weights.failed",
    "rose.events.weights.failed.{executor_id}",
    Kind.STREAM,
    WeightFailed,
    "An executor refused a weight version; it keeps serving the previous one.",
    publishers=("executor",),
    consumers=("cli", "integrations"),
    stream=EVENTS_STREAM,
)
TRAINING_STEP = Channel(
    "training.step",
    "rose.events.training.{run_id}",
    Kind.STREAM,
    TrainingStep,
    "A trainer took an optimizer step: reward of its groups, the version it published, loss statistics.",
    publishers=("trainer",),
    consumers=("cli", "integrations"),
    stream=EVENTS_STREAM,
)

CHANNELS: tuple[Channel, ...] = (
    HEARTBEAT,
    SERVICE_REGISTRY,
    SERVICE_EVENT,
    DEAD_LETTER,
    GENERATE,
    EXECUTOR_METRICS,
    HEADROOM,
    SLO_ALERT,
    EXECUTOR_BURST,
    LEASE,
    LEASE_EVENT,
    ROUTE_TURN,
    PLACEMENT,
    ROLLOUT_TASK,
    TRAJECTORY,
    TURN_CHECKPOINT,
    AGENT_TASK,
    EPISODE_TURN,
    EPISODE_EVENT,
    WEIGHT_MANIFEST,
    WEIGHT_SHARDS,
    WEIGHT_STAGING,
    WEIGHT_PUBLISH,
    WEIGHT_PUBLISH_FAILED,
    WEIGHT_APPLIED,
    WEIGHT_FAILED,
    TRAINING_STEP,
)


def message_types() -> list[type[Message]]:
    """Every top-level message type that crosses the bus, once each, in registry order."""
    seen: list[type[Message]] = []
    for channel in CHANNELS:
        for t in (channel.payload, channel.reply):
            if t is not None and t not in seen:
                seen.append(t)
    return seen


def channel_by_name(name: str) -> Channel:
    for channel in CHANNELS:
        if channel.name == name:
            return channel
    raise KeyError(f"no channel named {name!r}")


def stream_subject_owner(subject: str) -> StreamSpec | None:
    """The stream that captures a concrete subject, if any (NATS wildcard rules)."""
    for stream in STREAMS:
        for pattern in stream.subjects:
            if _matches(pattern, subject):
                return stream
    return None


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)
