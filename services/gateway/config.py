"""The gateway's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.shared.config import BusConfig, PositiveSeconds, RuntimeConfig
from rose.shared.models import PolicyModelRef
from rose.shared.turns.settings import TurnSettings

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
MIB = 1 << 20


class HttpSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The agents' HTTP endpoint; the head and body deadlines are the executor's (shared/http_server.py)."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: a free port, announced in heartbeats
    max_body_bytes: PositiveInt = 4 * MIB  # an agent's whole conversation and tools, per request
    public_url: str = ""  # how agents reach it (e.g. http://gateway-1:8100), if not http://host:port


class AgentSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The agent run for each episode. `script`: a Python file, forked per episode from one interpreter that
    imported its modules once (an `import openai` alone costs ~2 s of CPU here); `command`: any program,
    spawned per episode. Each gets OPENAI_BASE_URL, OPENAI_API_KEY (valid for its episode only),
    ROSE_EPISODE_URL and ROSE_TASK (the task as JSON) in its environment and the task's prompt as its
    argument. Neither: episodes fail at once, saying so."""

    script: str = ""
    command: list[str] = msgspec.field(default_factory=list)
    logs_dir: str = ""  # one log per episode; default: $ROSE_STATE_DIR/gateway/agents
    exit_grace_s: PositiveSeconds = 5.0  # after a reward is posted, how long the agent may take to exit before it is killed


class EpisodeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    deadline_s: PositiveSeconds = 600.0  # an episode still open after this is ended: truncated
    max_turns: Annotated[int, msgspec.Meta(ge=0)] = 0  # turn limit; 0: the task's max_turns
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # per turn, the most an agent may ask; 0: the task's env_args, else turns.max_tokens


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    models: PolicyModelRef = msgspec.field(default_factory=PolicyModelRef)
    turns: TurnSettings = msgspec.field(default_factory=TurnSettings)
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    agent: AgentSettings = msgspec.field(default_factory=AgentSettings)
    episodes: EpisodeSettings = msgspec.field(default_factory=EpisodeSettings)
    model_name: str = "rose-policy"  # the `model` agents ask for
    concurrency: PositiveInt = 8  # episodes in flight per gateway process
    durable: str = "gateways"  # the shared work-queue consumer of agent tasks
    ack_wait_s: PositiveSeconds = 30.0  # an episode whose gateway stops saying it is alive for this long is redelivered
    max_deliver: Annotated[int, msgspec.Meta(ge=2)] = 5  # the last delivery publishes a failed trajectory

    def __post_init__(self) -> None:
        if self.agent.script and self.agent.command:
            raise ValueError("agent.script and agent.command are two ways to run the agent: set one")
