"""Every message and every subject of ROSE, defined once.

`rose.contracts.registry.CHANNELS` lists each subject with its payload, storage, publishers
and consumers; the message types are msgspec Structs that carry a schema version.
"""

from .base import SCHEMA_VERSION, Message
from .executor import (
    DeviceTelemetry,
    GenerateReply,
    GenerateRequest,
    GenerateTimings,
    LatencySketch,
    MetricsSnapshot,
    PoolUsage,
    SamplingParams,
)
from .lease import Lease, LeaseEvent
from .rollout import PlacementEvent, RolloutTask, ToolCall, Trajectory, TurnCheckpoint, TurnRecord, TurnRoute, TurnRouteRequest
from .service import DeadLetter, Heartbeat, ServiceEvent
from .slo import Headroom, SloAlert
from .weights import (
    ShardInfo,
    TensorInfo,
    WeightApplied,
    WeightFailed,
    WeightManifest,
    WeightPublishAccepted,
    WeightPublishFailed,
    WeightPublishRequest,
)

__all__ = [
    "SCHEMA_VERSION",
    "DeadLetter",
    "DeviceTelemetry",
    "GenerateReply",
    "GenerateRequest",
    "GenerateTimings",
    "Headroom",
    "Heartbeat",
    "LatencySketch",
    "Lease",
    "LeaseEvent",
    "Message",
    "MetricsSnapshot",
    "PlacementEvent",
    "PoolUsage",
    "RolloutTask",
    "SamplingParams",
    "ServiceEvent",
    "ShardInfo",
    "SloAlert",
    "TensorInfo",
    "ToolCall",
    "Trajectory",
    "TurnCheckpoint",
    "TurnRecord",
    "TurnRoute",
    "TurnRouteRequest",
    "WeightApplied",
    "WeightFailed",
    "WeightManifest",
    "WeightPublishAccepted",
    "WeightPublishFailed",
    "WeightPublishRequest",
]
