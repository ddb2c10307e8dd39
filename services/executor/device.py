"""Where the engine computes: CUDA with prioritised streams, or CPU with two threads.

Chosen once at start. On CUDA, serving work runs on a high-priority stream and rollout on
a low-priority one (``torch.cuda.Stream(priority=...)``; lower number = higher priority).
A priority is only a hint to the block scheduler — it never preempts a running kernel —
which is why the engine also bounds each rollout quantum. On CPU the analogue is two
threads, one per lane, each with ``torch.set_num_threads(1)``: torch releases the GIL
inside ops, so the two lanes run in parallel on two cores as two streams share SMs (the
rollout lane also spans the serving core while serving has no work: ``core_lending.py``).
They still take turns on the GIL between ops: with models this small, where much of a step
is op dispatch, that cost the rollout lane about 40 % of its speed beside serving, which is
why executors run the rollout forwards in a child process (``rollout_process.py``).

A *lane* is one of these execution contexts plus a FIFO lock. Policies that share one
lane between serving and rollout (``naive_share``) get strict alternation in arrival
order; separate lanes never contend on the lock.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from rose.shared.devices import DEVICES, HOST_ROLLOUT_PREFILL_TOKENS, fold_seconds, sync_seconds
from rose.shared.sketch import sketch_to_dict

from .adapters import AdapterBank
from .emulated import EMULATED_PREFIX, EmulatedAccelerator, EmulatedRunner, EmulationSpec
from .kv_pool import KVPool, KVShape
from .model_runner import PagedModelRunner, kv_shape_of
from .protocol import WorkClass

SERVING_PRIORITY = -1  # CUDA: higher priority (more negative)
ROLLOUT_PRIORITY = 0
CPU_THREADS_PER_LANE = 1


class FifoLock:
    """A ticket lock: waiters acquire in arrival order (threading.Lock is not fair)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self) -> FifoLock:
        with self._cv:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cv.wait()
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


class Lane:
    """An execution context (a CUDA stream, or the calling CPU thread) guarded by a FIFO lock."""

    def __init__(self, name: str, stream: torch.cuda.Stream | None = None) -> None:
        self.name = name
        self.stream = stream
        self._lock = FifoLock()

    @contextlib.contextmanager
    def run(self):
        with self._lock:
            if self.stream is None:
                yield
            else:
                with torch.cuda.stream(self.stream):
                    yield
                self.stream.synchronize()


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    """Same fields as contracts.executor.DeviceTelemetry."""

    kind: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float
    process_rss_bytes: int
    forward_lag: dict | None = None  # emulated only: a LatencySketch's fields, lateness in percent of a forward's planned time


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's cpuset, taskset), not the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
    except (OSError, IndexError, ValueError):
        return 0.0


def process_rss_bytes(pid: int | None = None) -> int:
    """Resident memory of this process, or of process ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0 if pid else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RealHardware:
    """What the engine builds on a device that really computes (CPU, CUDA): real KV tensors, the real
    runner, weights that arrive by the follower's own fetch. EmulatedDevice answers these differently."""

    rollout_prefill_tokens = HOST_ROLLOUT_PREFILL_TOKENS  # per rollout iteration (not yet measured on a GPU)

    def kv_shape(self, model: torch.nn.Module, work_class: WorkClass) -> KVShape:
        return kv_shape_of(model)

    def kv_bytes(self, work_class: WorkClass, configured: int) -> int:
        return configured

    def runner(
        self, model: torch.nn.Module, pool: KVPool | list[KVPool], work_class: WorkClass, tokenizer: Any, adapters: AdapterBank | None = None
    ) -> PagedModelRunner:
        return PagedModelRunner(model, pool, adapters=adapters)

    def weight_transfer_s(self) -> float:
        """A new policy version's transfer beyond what the weight follower really fetched: none."""
        return 0.0

    emulates: str | None = None  # real hardware stands for itself


class CpuDevice(RealHardware):
    kind = "cpu"
    priority_streams = False  # serving and rollout threads are scheduled alike by the OS

    # ---- what the engine builds on this device (the emulated one answers differently: emulated.py)
    backs_kv = True  # KV pools hold real tensors
    host_is_device = True  # forwards compute on host cores: the interpreter lock is part of the device

    def __init__(self, threads_per_lane: int = CPU_THREADS_PER_LANE) -> None:
        self.torch_device = torch.device("cpu")
        self.threads_per_lane = threads_per_lane
        self._last_cpu = (time.monotonic(), time.process_time(), 0.0)

    def lane(self, name: str, priority: int) -> Lane:
        return Lane(name)

    def init_thread(self, threads: int | None = None) -> None:
        torch.set_num_threads(threads or self.threads_per_lane)

    def max_lane_width(self, narrow: int) -> int:
        """Torch threads of the rollout lane while the serving lane lends its core (``core_lending.py``):
        every core, the CPU analogue of best-effort kernels filling idle SMs."""
        return max(narrow, usable_cores())

    def set_thread_width(self, threads: int) -> None:
        torch.set_num_threads(threads)  # per calling thread (OpenMP ICV); the serving lane keeps its own

    def lanes_overlap(self, rollout_threads: int) -> bool:
        """Whether a rollout lane this wide shares cores with the serving lane (else they run side by side)."""
        return rollout_threads + self.threads_per_lane > usable_cores()

    def offload(self, model: torch.nn.Module) -> int:
        """Weights already live in host memory: nothing to move (bytes freed on the device: 0)."""
        return 0

    def reload(self, model: torch.nn.Module) -> int:
        return 0

    def telemetry(self, child_pid: int | None = None) -> Telemetry:
        """``utilization``: CPU time of this process and its forward child ``child_pid`` (the rollout
        lane's process is part of the device) over the cores it may run on (its affinity: pinned to
        one core, one core is the whole device), since the previous call."""
        now, own = time.monotonic(), time.process_time()
        child = process_cpu_s(child_pid) if child_pid else 0.0
        last_now, last_own, last_child = self._last_cpu
        self._last_cpu = (now, own, child)
        cores = usable_cores()
        used = (own - last_own) + max(0.0, child - last_child)  # a restarted child starts again from 0
        util = min(1.0, used / max(1e-9, (now - last_now) * cores))
        total = used = 0
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            total, used = info["MemTotal"], info["MemTotal"] - info["MemAvailable"]
        except (OSError, KeyError):
            pass
        return Telemetry(
            kind="cpu",
            name=f"cpu x{cores}",
            memory_total_bytes=total,
            memory_used_bytes=used,
            utilization=util,
            process_rss_bytes=process_rss_bytes(),
        )


class CudaDevice(RealHardware):
    """Exercised on GPU nodes (``scripts/gpu-check``: tests/executor/test_device_paths.py and
    ``rose bench coserve`` there); the development machines have no GPU."""

    kind = "cuda"
    priority_streams = True  # serving's stream outranks rollout's

    # ---- what the engine builds on this device (the emulated one answers differently: emulated.py)
    backs_kv = True  # KV pools hold real tensors
    host_is_device = True  # forwards compute on the GPU, launched from the interpreter: the interpreter lock is part of the device

    def __init__(self, index: int = 0) -> None:
        self.torch_device = torch.device("cuda", index)
        self.index = index
        self._nvml: tuple[Any, Any] | None = None  # (the pynvml module, this device's handle), on first use

    def lane(self, name: str, priority: int) -> Lane:
        return Lane(name, torch.cuda.Stream(device=self.torch_device, priority=priority))

    threads_per_lane = 1  # host threads: one per lane drives its stream

    def max_lane_width(self, narrow: int) -> int:
        return narrow  # the GPU shares its SMs between streams by itself: no core lending

    def set_thread_width(self, threads: int) -> None:
        pass

    def lanes_overlap(self, rollout_threads: int) -> bool:
        return True  # two streams share the SMs: a rollout kernel delays serving ones

    def init_thread(self, threads: int | None = None) -> None:
        torch.cuda.set_device(self.torch_device)

    def offload(self, model: torch.nn.Module) -> int:
        """Move the model's parameters and buffers to pinned host memory; returns the device bytes freed."""
        return _move(model, lambda t: t.to("cpu").pin_memory(), self.torch_device)

    def reload(self, model: torch.nn.Module) -> int:
        return _move(model, lambda t: t.to(self.torch_device, non_blocking=True), self.torch_device)

    def telemetry(self, child_pid: int | None = None) -> Telemetry:
        """NVML's view of the whole GPU (``child_pid``: unused, every process on the device counts)."""
        if self._nvml is None:
            import pynvml  # nvidia-ml-py, imported only on GPU nodes

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.index))
        pynvml, handle = self._nvml
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except pynvml.NVMLError:  # not supported on some virtualised or MIG devices: report 0, keep the rest
            util = 0.0
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        return Telemetry(
            kind="cuda",
            name=name,
            memory_total_bytes=int(mem.total),
            memory_used_bytes=int(mem.used),
            utilization=util,
            process_rss_bytes=process_rss_bytes(),
        )


class EmulatedDevice:
    """An emulated accelerator (emulated.py): the forwards hold an ``EmulatedAccelerator``'s timeline for
    the time the step model gives; the models' shapes and memory are the emulated ones."""

    kind = "emulated"
    threads_per_lane = 1
    priority_streams = True  # as a GPU: serving's work goes first (EmulatedAccelerator)
    backs_kv = False  # pools are accounted, not allocated
    host_is_device = False  # forwards do not run on the host: the interpreter lock is not the device

    def __init__(self, spec: EmulationSpec) -> None:
        self.spec = spec
        self.torch_device = torch.device("cpu")  # the stand-in policy's weights live in host memory
        self.accelerator = EmulatedAccelerator(max(spec.serving.layers, spec.policy.layers), spec.quantum_s)
        self._offloaded = False
        self._last = (time.monotonic(), 0.0)

    @property
    def emulates(self) -> str | None:
        """What this device stands for (the executor's ``emulated`` label)."""
        return self.spec.label()

    def lane(self, name: str, priority: int) -> Lane:
        return Lane(name)

    def init_thread(self, threads: int | None = None) -> None:
        pass

    def max_lane_width(self, narrow: int) -> int:
        return narrow

    def set_thread_width(self, threads: int) -> None:
        pass

    def lanes_overlap(self, rollout_threads: int) -> bool:
        return True  # one device: a rollout forward delays serving's

    @property
    def rollout_prefill_tokens(self) -> int:
        """The policy's roofline ridge: the largest chunk that costs no more than a decode step's weight read (a
        smaller one wastes the read, as a 64-token chunk does at 7B on an H100, ~4x; a larger one only lengthens
        the forward a serving arrival abandons). The simulator prices rollout prefill at full efficiency."""
        return self.spec.roofline(WorkClass.ROLLOUT).rollout_prefill_tokens

    def kv_shape(self, model: torch.nn.Module, work_class: WorkClass) -> KVShape:
        m = self.spec.serving if work_class is WorkClass.SERVING else self.spec.policy
        return KVShape(m.layers, m.kv_heads, m.head_dim, torch.bfloat16)  # the roofline's bf16 KV

    def kv_bytes(self, work_class: WorkClass, configured: int) -> int:
        """The pool a lane gets: the emulated device's split (``configured`` sizes are the host's, for real models)."""
        return self.spec.serving_kv_bytes if work_class is WorkClass.SERVING else self.spec.rollout_kv_bytes

    def runner(
        self, model: torch.nn.Module, pool: KVPool | list[KVPool], work_class: WorkClass, tokenizer: Any, adapters: AdapterBank | None = None
    ) -> EmulatedRunner:
        """A lane's emulated forward: priced on its work class's roofline, with the adapter's kernels where its rows
        take one (the LoRA policy's shape: ``adapters``)."""
        pools = pool if isinstance(pool, list) else [pool]
        lora = adapters.shape if adapters is not None else None
        return EmulatedRunner(
            self.accelerator, self.spec.roofline(work_class), work_class, model, tokenizer, pools[0], self.spec.time_scale, lora=lora
        )

    def offload(self, model: torch.nn.Module) -> int:
        """The policy's weights leave the emulated device (the stand-in stays in host memory)."""
        if self._offloaded:
            return 0
        self._offloaded = True
        return int(self.spec.policy.weight_bytes)

    def reload(self, model: torch.nn.Module) -> int:
        if not self._offloaded:
            return 0
        self._offloaded = False
        return int(self.spec.policy.weight_bytes)

    def weight_transfer_s(self) -> float:
        """How long a new policy version takes to reach this instance, priced as the simulator prices it:
        the real model's bytes as a delta over the inter-cluster link (a serving instance) or the training
        cluster's fabric (a dedicated one, beside the trainer): shared.devices.sync_seconds."""
        # a LoRA version is priced whole: an adapter's elements nearly all move each step (unlike a full model's 2-4 %)
        lora = self.spec.lora
        priced = sync_seconds(self.spec.version_bytes, "full" if lora is not None else "delta", self.spec.sync, cross_cluster=not self.spec.dedicated)
        if lora is not None and not self.spec.co_batched:  # the two-model mode folds each version into its base copy
            priced += fold_seconds(self.spec.policy.adapted_weight_bytes(lora) / self.spec.tp, self.spec.sync)
        return priced * self.spec.time_scale

    def telemetry(self, child_pid: int | None = None) -> Telemetry:
        """``utilization``: the device timeline's busy share since the previous call; memory: the
        weights and both KV pools, preallocated as an engine does."""
        now, busy = time.monotonic(), self.accelerator.busy_s
        last_now, last_busy = self._last
        self._last = (now, busy)
        total = int(self.spec.tp * DEVICES[self.spec.device].hbm_bytes)
        weights = self.spec.weight_bytes() - (self.spec.policy.weight_bytes if self._offloaded else 0.0)
        used = int(weights + self.spec.serving_kv_bytes + self.spec.rollout_kv_bytes)
        return Telemetry(
            kind="emulated",
            name=self.spec.label(),
            memory_total_bytes=total,
            memory_used_bytes=min(total, used),
            utilization=min(1.0, (busy - last_busy) / max(1e-9, now - last_now)),
            process_rss_bytes=process_rss_bytes(),
            forward_lag=sketch_to_dict(self.accelerator.lag.take()),
        )


@torch.no_grad()
def _move(model: torch.nn.Module, to, device: torch.device) -> int:
    moved = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        moved += tensor.numel() * tensor.element_size()
        tensor.data = to(tensor.data)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return moved


def select_device(name: str = "auto", emulation: EmulationSpec | None = None) -> CpuDevice | CudaDevice | EmulatedDevice:
    """``auto`` picks CUDA when available; ``cpu`` / ``cuda`` / ``cuda:N`` force one; ``emulated:KIND``
    (with its ``emulation``: the models' shapes and the memory split) is an emulated accelerator."""
    if name.startswith(EMULATED_PREFIX):
        if emulation is None:
            raise ValueError(f"device {name!r} needs an emulation spec (the executor builds it from its [emulation] settings)")
        return EmulatedDevice(emulation)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return CpuDevice()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        return CudaDevice(int(name.split(":")[1]) if ":" in name else 0)
    raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or emulated:KIND")
