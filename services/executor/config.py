"""The executor's configuration: models, engine, HTTP, metrics, role. TOML + ROSE_* (see shared/config.py)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from rose.contracts.executor import ExecutorRole, RolloutMode
from rose.contracts.slo import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from rose.shared.bursts import BURST_BASELINE_S, BurstSettings
from rose.shared.config import BusConfig, DTypeName, PositiveSeconds, RuntimeConfig

from .policies import DEFAULT_QUANTUM_MS, PolicyName

MIB = 1 << 20
# How rollout shares a serving device (contracts/executor.py RolloutMode): two_model (rollout_loop.py) or co_batched
# (co_batched.py)
ROLLOUT_MODES: tuple[str, ...] = get_args(RolloutMode)
Positive = Annotated[float, msgspec.Meta(gt=0.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]


class ModelsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the two models live. Empty: `<state dir>/models`, built on the spot if missing."""

    dir: str = ""
    serving_dir: str = ""  # default <dir>/serving; any local HF Qwen2/Llama directory works
    policy_dir: str = ""  # default <dir>/policy
    serving_name: str = "rose-serving"  # the `model` name of the OpenAI API
    init_if_missing: bool = True
    seed: int = 0


class EngineSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[engine]`` table. Its defaults are also ``engine.EngineConfig``'s (which reads them from here)."""

    # rose: our engine runs both models here; sglang: two SGLang servers do (see `sglang_backend`)
    backend: Literal["rose", "sglang"] = "rose"
    device: str = "auto"  # auto | cpu | cuda | cuda:N | emulated:KIND (an emulated accelerator: [emulation])
    policy: PolicyName = "rose"
    # two_model | co_batched (RolloutMode above); co_batched needs a policy that is a LoRA adapter of the serving model
    rollout_mode: RolloutMode = "two_model"
    serving_kv_mib: Positive = 64.0
    rollout_kv_mib: Positive = 128.0
    # the rollout pool's host-memory tier (SGLang's --hicache-ratio, default 2): it holds copies of retained
    # trajectory prefixes, written when they are retained, so an evicted prefix or a released pool (a revoked
    # lease) is restored from host instead of prefilled again; its bytes = this x the rollout pool's; 0: off
    host_kv_ratio: NonNegative = 2.0
    serving_max_batch: PositiveInt = 32
    rollout_max_batch: PositiveInt = 32
    quantum_ms: Positive = DEFAULT_QUANTUM_MS
    # CPU, rose: the rollout lane widens over the serving lane's core while serving has no work
    # (false where several executors share a host's cores: two widened lanes wait on each other)
    lend_serving_core: bool = True
    # CPU: rollout forwards (and their sampling) run in a child process, so the two lanes no longer
    # take turns on one interpreter lock (see rollout_process.py); ignored on CUDA
    rollout_process: bool = True
    # CUDA: decode steps replay captured CUDA graphs (one call per step instead of ~1,000 kernel
    # launches from Python; see cuda_graphs.py); ignored on CPU
    cuda_graphs: bool = True
    slo_ttft_ms: Positive = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: Positive = DEFAULT_SLO_TPOT_MS
    seed: int = 0
    dtype: DTypeName = "float32"  # of both models on the device


class EmulationSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`engine.device = "emulated:KIND"` (A100, H100, H200): an emulated accelerator (emulated.py). The engine's
    host side runs for real; forwards take the time the simulator's step model gives for these models on
    `tp` such GPUs; KV pools are accounted in the emulated device's memory. The tiny local models stay
    the tokenizer and the policy's stand-in weights."""

    model: str = "7B"  # the serving model's shape: 7B, 14B, 32B, 70B (shared/devices.py MODELS)
    policy_model: str = ""  # the RL policy's shape (default: the serving model's)
    tp: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0  # GPUs per instance; 0: as the simulator sizes it (serving_tp / rollout_tp)
    # KV pools on the emulated device, GiB; 0: what the engine may use less the weights, split evenly (emulated.default_memory).
    # Launchers that know the serving trace size them as the simulator does (cli/emulate.py).
    serving_kv_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    rollout_kv_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class WeightsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Following the policy's published versions (weight manifests + shards on the bus)."""

    follow: bool = True
    model: str = "policy"  # the model name the trainer publishes under
    report_digest: bool = False  # put a SHA-256 of the live policy in every WeightApplied (costs a pass over the weights)
    # Apply only manifests signed by a trusted Ed25519 key (checked before anything is fetched).
    require_signed: bool = True
    # Trusted public keys: `.pub` files or directories of them, re-read for every manifest (a rotation
    # adds the new key here, then removes the old one). Empty: $ROSE_STATE_DIR/keys, where the
    # embedded default's publisher keeps its pair.
    trusted_keys: list[str] = msgspec.field(default_factory=list)


class HttpConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: a free port, announced in heartbeats
    max_body_bytes: PositiveInt = 4 * MIB
    # tokens per streamed chunk after the first (SGLang's --stream-interval): 1 streams every token; a larger one
    # costs the host less per token (an emulated fleet's many executors in one process) and keeps TTFT exact
    stream_interval: PositiveInt = 1
    public_host: str = ""  # how others reach it, if not `host`


class SGLangApiSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's RL admin API on this executor (see sglang_api.py), serving the *policy* model.

    Endpoints that change what runs (weights, pause, memory, cache, abort) are admin endpoints:
    they need `Authorization: Bearer <admin_api_key>` when a key is set, and are refused (403)
    when no key is set unless `allow_unauthenticated_admin` (an executor bound to localhost
    beside its trainer, as RL frameworks run SGLang).
    """

    enabled: bool = True
    admin_api_key: str = ""  # a secret: never logged
    allow_unauthenticated_admin: bool = False
    max_waiting_requests: PositiveInt = 4096  # rollout requests queued before /generate answers 503
    # how long /generate waits for a rollout lease before a 503 (a serving executor lends only while its SLO allows)
    lease_wait_s: PositiveSeconds = 120.0
    # co-batched mode (the policy a LoRA adapter of the serving model): what /generate runs for a request that names
    # no `lora_path`. "policy": the policy's live adapter, as rollout work under the lease (what slime, verl and AReaL
    # expect of an SGLang server that runs their policy); "base": the base model, the serving model, as serving work
    # (what SGLang itself runs; the sglang backend's LoRA mode sends its serving requests so). Either way a request
    # naming the policy (`lora_path` = weights.model) runs the policy. "base" in the two-model mode is refused at start.
    generate_without_lora: Literal["policy", "base"] = "policy"

    def __repr__(self) -> str:  # the key never reaches a log line through a config dump
        return (
            f"SGLangApiSettings(enabled={self.enabled}, admin_api_key={'***' if self.admin_api_key else ''!r}, "
            f"allow_unauthenticated_admin={self.allow_unauthenticated_admin})"
        )


class SGLangBackendSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`engine.backend = "sglang"`: the executor drives two SGLang servers (see sglang_backend.py).

    The serving server runs `models.serving_dir`'s model, the rollout server `models.policy_dir`'s
    (the executor loads that one on the CPU too, as the base of weight deltas); both share one GPU
    by `--mem-fraction-static`, and the rollout server needs `--enable-memory-saver` for lending.
    """

    serving_url: str = "http://127.0.0.1:30000"
    rollout_url: str = "http://127.0.0.1:30001"
    api_key: str = ""  # the servers' --api-key, if any (a secret: never logged)
    admin_api_key: str = ""  # for admin calls (pause, memory, weights, abort), if it differs from api_key
    # SGLang --enable-priority-scheduling: larger = sooner (unless --schedule-low-priority-values-first); None: not sent
    serving_priority: int | None = 10
    rollout_priority: int | None = 0
    # tensor: /update_weights_from_tensor with shared-memory tensors (executor and server on one host, same IPC namespace);
    # disk: a safetensors directory under staging_dir for /update_weights_from_disk (the server must see the same path)
    weight_sync: Literal["tensor", "disk"] = "tensor"
    staging_dir: str = ""  # default <state dir>/sglang-weights
    # cumulative: SGLang's default stream (every event has the whole output so far); incremental: text, output_ids
    # and logprobs are deltas (newer SGLang's --incremental-streaming-output; not checked against 0.5.3's --stream-output)
    stream_output: Literal["cumulative", "incremental"] = "cumulative"
    connect_timeout_s: PositiveSeconds = 5.0
    request_timeout_s: PositiveSeconds = 600.0  # a generation, and the longest silence inside its stream
    admin_timeout_s: PositiveSeconds = 300.0  # pause, memory, weight calls (a large weight load takes a while)
    abort_grace_s: PositiveSeconds = 5.0  # after /abort_request, how long the server may take to end the request
    scrape_interval_s: PositiveSeconds = 0.5  # /metrics of both servers
    scrape_timeout_s: PositiveSeconds = 2.0
    max_connections: PositiveInt = 1024  # concurrent HTTP connections to the servers (one per streaming request)

    def __repr__(self) -> str:  # the keys never reach a log line through a config dump
        return (
            f"SGLangBackendSettings(serving_url={self.serving_url!r}, rollout_url={self.rollout_url!r}, weight_sync={self.weight_sync!r}, "
            f"api_key={'***' if self.api_key else ''!r}, admin_api_key={'***' if self.admin_api_key else ''!r})"
        )


class ExecutorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    weights: WeightsSettings = msgspec.field(default_factory=WeightsSettings)
    sglang_api: SGLangApiSettings = msgspec.field(default_factory=SGLangApiSettings)
    sglang_backend: SGLangBackendSettings = msgspec.field(default_factory=SGLangBackendSettings)
    emulation: EmulationSettings = msgspec.field(default_factory=EmulationSettings)
    # serving: takes production traffic, rollout only under a scheduler's lease.
    # dedicated: a rollout executor (no serving SLO at stake) that holds a standing lease of its own.
    role: ExecutorRole = "serving"
    metrics_interval_s: PositiveSeconds = 1.0
    # the executor's own burst detector (shared/bursts.py): the SLO monitor's test on every arrival, against
    # the arrivals of the last `burst_baseline_s` (the monitor's long window)
    bursts: BurstSettings = msgspec.field(default_factory=BurstSettings)
    burst_baseline_s: PositiveSeconds = BURST_BASELINE_S
    max_lease_skew_s: PositiveSeconds = 2.0  # clock skew tolerated when turning lease expiry into local time
