"""CPU only: the rollout lane's forward passes, and its sampling, run in a child process.

Why: both lanes are threads of one Python process, and on a CPU with models this small a
forward is hundreds of small torch ops, each handing the interpreter lock (GIL) to the other
lane and back. Measured on the 2-core development VM: the policy model alone ran 2,389
tokens/s; beside the serving lane in another process 2,179 (serving unharmed); beside it in
the same process 1,130-1,500, and serving's burst tails grew. So the op-heavy part runs
here, in its own interpreter: the forward, then sampling from the last-token logits (only
token ids and logprobs come back, no logits). The engine's rollout thread keeps everything
else (planning, block accounting, stop checks, streaming), which needs almost no torch op.

What is shared, not copied: the policy's parameters (``model.share_memory()``) and the
rollout KV pool's K/V tensors live in shared memory, so the child writes the KV the engine
accounts for, and the engine's block scrubs reach the child. A released and restored KV pool
is handed over again before the next forward.

Weight swaps are double-buffered (``_WeightBanks``): two copies of the parameters sit in
shared memory, the live one the forwards read and a standby. A new version is copied into the
standby on the caller's thread (``prepare_weights``) while forwards go on reading the live
one; the swap, between forwards, re-points the parameters here and sets the live bank's index
in the shared control array, where the child reads it as its next forward begins and re-points
its own. The rollout lane's pause is a pointer move per tensor, with no message to the child,
whatever the model's size or the number of tensors changed (it was a copy of every changed
tensor into fresh shared memory: 52-72 ms at 30M parameters). The price: the policy's weights
twice in shared memory. A failed update (a copy into the standby cut short) flips nothing.
Sampling stays exactly reproducible: the engine sends each row's seed and how many uniforms
it has drawn, and the child keeps (or rebuilds) the generator at that point (``_Samplers``).

How the engine still steers a forward in flight: a small shared array. The child reads it
at each layer safepoint (as ``PagedModelRunner.forward``'s ``should_stop``): ``abandon``
(the engine's own safepoint said stop: lease gone, paused, stopping, a serving arrival
while the lanes overlap), ``hold`` (a serving burst: wait at the safepoint, keeping the
layers done, until it clears; ``model_runner.holding``) and ``want_width`` (core lending:
torch threads to use; the child acknowledges in ``width``, and the engine waits for that
before serving takes its core back). While a forward runs, the engine's rollout thread
polls its safepoint and hold condition every ``POLL_S``.

If the child dies, the next forward starts a new one (the KV and weights are the engine's)
and runs again; nothing the rollout produced is lost.

CPU priority (``idle_priority``, rose on a serving executor): the child runs at the OS's idle
policy (Linux ``SCHED_IDLE``; elsewhere nice 19), it and every torch thread it starts. The OS then
gives it only CPU time nothing else on the host wants: serving's threads, the engine's event loop and
any other process (a noisy neighbour) preempt it at once. It is the CPU analogue of serving's
higher CUDA stream priority: without it, a co-runner had to share a core with serving while the
rollout child held the other. Eight paired runs at load 0.35 beside a co-runner burning 0.3 of a
core: rose's SLO misses 84 -> 50 in all (serving_only's 37), its rollout tokens 20-50 % fewer (the
co-runner now takes them from rollout, not from serving); without a co-runner no change in either
(docs/benchmarks.md, "2026-12-02 (late morning)").
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # registers the shared-memory tensor reductions

from .core_lending import RETURN_TIMEOUT_S
from .device import process_rss_bytes
from .forward_item import ForwardItem
from .kv_pool import KVPool
from .model_runner import ModelWeights, PagedModelRunner, holding
from .protocol import EngineSampling
from .sampling import SamplerState
from .weights import StagedWeights

POLL_S = 0.001  # how often the engine's rollout thread asks its safepoint while the child computes
START_TIMEOUT_S = 120.0  # the first child waits for the fork server to import torch (seconds on a busy machine)
ACK_POLL_S = 0.0002  # while waiting for the child to narrow
SHM_DIR = "/dev/shm"  # where torch's shared tensors live (POSIX shared memory)
SHM_HEADROOM_BYTES = 64 << 20  # staged weight versions, the resource tracker's own
ALIVE_EVERY_POLLS = 50  # a dead child is noticed within this many polls (a system call each: not every poll)

# fields of the shared control array
ABANDON, WANT_WIDTH, WIDTH, BUSY, HOLD, HELD, BANK = range(7)  # HELD: safepoint polls the child has spent holding; BANK: the live weight bank


class _PoolView:
    """What ``PagedModelRunner`` needs of a pool, in the child: the shared K/V and the block size."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
        self.k, self.v, self.block_size = k, v, block_size


class _WeightBanks:
    """The policy's parameters twice in shared memory: the live bank the forwards read, and the
    standby the next version is written into meanwhile. ``dirty`` names the tensors where the
    standby may differ from the live bank (the last version's), brought in line at the next fill.
    ``lock`` keeps a fill (caller's thread) and a flip (rollout thread) apart; the live bank's
    index is also in the control array (``BANK``), for the child."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        copies: dict[int, torch.Tensor] = {}  # tied parameters (one Parameter under two names) share one copy
        for p in params.values():
            if id(p) not in copies:
                copy = torch.empty_like(p.data)
                copy.share_memory_()
                copies[id(p)] = copy.copy_(p.data)
        self.banks = ({n: p.data for n, p in params.items()}, {n: copies[id(p)] for n, p in params.items()})
        self.live = 0
        self.dirty: set[str] = set()
        self.filled_for: StagedWeights | None = None  # the version the standby holds, ready to flip to
        self.lock = threading.Lock()

    @torch.no_grad()
    def fill(self, staged: StagedWeights) -> None:
        """The standby := the live bank with ``staged``'s tensors (copies only the changed and the dirty ones)."""
        live, standby = self.banks[self.live], self.banks[1 - self.live]
        names = {n for n in staged.tensors if n in standby}
        self.filled_for = None
        self.dirty |= names  # a copy cut short leaves these differing too: the next fill restores them
        for name in self.dirty - names:
            standby[name].copy_(live[name])
        for name in names:
            standby[name].copy_(staged.tensors[name])
        self.dirty, self.filled_for = names, staged


def _point_at(params: dict[str, torch.nn.Parameter], bank: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        p.data = bank[name]


def forward_context():
    """Children fork from a fork server that has imported torch and this module once per process.

    A spawned child is a fresh interpreter importing torch: 3-5 s of CPU on a busy 2-core box,
    paid again for every replacement of a dead child and every engine the process builds (a bench's
    runs, a test module's engines). Forked from the server, a child is ready in a fraction of a
    second. The server is a clean process of its own (started by spawning), not a fork of this
    threaded one, so nothing the engine's threads hold is copied; it starts no torch threads
    (torch creates its pools on first use, in the child, after the child lowers its priority).
    """
    ctx = torch_mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", __name__])  # read when the server starts: the first child
    return ctx


def _child_main(
    conn,
    weights: ModelWeights,
    banks: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    ctl,
    threads: int,
    idle_priority: bool = False,
) -> None:
    """The child's loop: one message in, one reply out, until "close" or the engine goes away."""
    if idle_priority:
        lower_to_idle_priority()  # before torch starts its threads: they inherit it
    torch.set_num_threads(threads)
    ctl[WIDTH] = threads
    runner = PagedModelRunner(weights, _PoolView(k, v, block_size))
    params = weights.params
    bank = ctl[BANK]  # the engine sent its parameters pointing at the live bank
    width = threads
    samplers = _Samplers()

    def fit_width() -> None:
        nonlocal width
        want = ctl[WANT_WIDTH]
        if want != width:
            torch.set_num_threads(want)
            width = want
            ctl[WIDTH] = want

    def abandoned() -> bool:
        fit_width()
        return ctl[ABANDON] != 0

    def held() -> bool:
        if ctl[HOLD]:
            ctl[HELD] += 1
            return True
        return False

    safepoint = holding(abandoned, held)

    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, *body = conn.recv()
        except (EOFError, OSError):  # the engine's process is gone
            return
        if kind == "close":
            return
        try:
            if kind in ("forward", "sample"):
                items, arg = body
                if ctl[BANK] != bank:  # a swap since the last forward (set before this message was sent): read the other bank whole
                    bank = ctl[BANK]
                    _point_at(params, banks[bank])
                ctl[BUSY] = 1
                fit_width()
                reply: object
                if kind == "forward":
                    logits = runner.forward(items, arg, should_stop=safepoint)
                    reply = None if logits is None else logits.numpy()
                else:
                    reply = runner.forward_sample(items, samplers.states(arg), should_stop=safepoint)
                ctl[BUSY] = 0
                conn.send(("done", reply))
            elif kind == "kv":
                runner.pool = _PoolView(body[0], body[1], block_size)
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown message {kind!r}"))
        except (BrokenPipeError, ConnectionResetError):  # the engine's process is gone
            return
        except Exception as exc:  # reported to the engine, which raises it on its rollout thread
            ctl[BUSY] = 0
            try:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            except OSError:
                return


def lower_to_idle_priority() -> None:
    """Put every thread of this process (those started while it was unpickling its arguments too)
    and the threads they start from now on at the OS's idle priority. Lowering one's own priority
    needs no privilege."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
            for tid in threads:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:  # a kernel or sandbox without it: the lowest nice is the next best
            pass
    os.nice(19 - os.nice(0))


class _Samplers:
    """The child's copies of the engine's per-sequence generators, rebuilt exactly when missing.

    The engine sends each sampling row's seed and how many uniforms it has drawn; a cached
    generator at that count is used as is, any other is rebuilt (seed, then skip the draws):
    so a restarted child, or an evicted entry, samples what the engine's own generator would.
    """

    KEEP_FOR = 256  # forwards an unused generator is kept (finished sequences are never announced)

    def __init__(self) -> None:
        self._by_seq: dict[int, tuple[SamplerState, int]] = {}
        self._forwards = 0

    def states(self, specs: list[tuple[int, int, EngineSampling, int, int]]) -> list[tuple[int, SamplerState]]:
        self._forwards += 1
        out = []
        for row, seq_id, params, seed, draws in specs:
            cached = self._by_seq.get(seq_id)
            state = cached[0] if cached is not None else None
            if state is None or (state.seed, state.draws, state.params) != (seed, draws, params):
                state = SamplerState(params, seed)
                state.draws = draws  # its generator is rebuilt at that point of the stream on first use
            self._by_seq[seq_id] = (state, self._forwards)
            out.append((row, state))
        if self._forwards % self.KEEP_FOR == 0:
            self._by_seq = {k: v for k, v in self._by_seq.items() if self._forwards - v[1] < self.KEEP_FOR}
        return out


class ProcessRunner(PagedModelRunner):
    """A ``PagedModelRunner`` whose ``forward`` runs in a child process (CPU only).

    Everything else (shapes, vocabulary, positions) is answered locally from the same model.
    ``start`` launches the child and waits until it is ready (``forward_context``: the first
    waits for the fork server to import torch, seconds, later ones a fraction of a second; it
    is sent the model's ``ModelWeights``, which need no transformers); ``close`` at the end.
    """

    model: torch.nn.Module  # always built from a module (the base class also takes bare ModelWeights)
    pool: KVPool  # the engine's own pool (the child holds a view of its tensors)

    def __init__(self, model: torch.nn.Module, pool: KVPool, threads: int, *, idle_priority: bool = False) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("the rollout forward process is for CPU devices (a GPU's lanes are streams)")
        super().__init__(model, pool)
        self.threads = threads
        self.idle_priority = idle_priority  # the child runs only on CPU time nothing else wants (see the module docstring)
        self._ctx = forward_context()
        self._ctl = self._ctx.RawArray("i", 7)
        self._ctl[WANT_WIDTH] = self._ctl[WIDTH] = threads
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._sent_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._banks: _WeightBanks | None = None  # made at the first start (the parameters then in shared memory)
        self.restarts = 0
        # while a forward is held, how often to ask again (the engine: one serving iteration); None: POLL_S
        self.held_poll_s: Callable[[], float] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self.model.share_memory()
        if self._banks is None:
            self._banks = _WeightBanks(self.weights.params)
        k, v = self.pool.k, self.pool.v
        if not self.pool.released:
            k.share_memory_(), v.share_memory_()
        ours, theirs = self._ctx.Pipe()
        self._ctl[ABANDON], self._ctl[BUSY], self._ctl[WIDTH] = 0, 0, self._ctl[WANT_WIDTH]
        self._process = self._ctx.Process(
            target=_child_main,
            args=(
                theirs,
                self.weights,
                self._banks.banks,
                k,
                v,
                self.pool.block_size,
                self._ctl,
                self._ctl[WANT_WIDTH],
                self.idle_priority,
            ),
            name="rose-rollout-forward",
            daemon=True,
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        self._sent_kv = (k, v)
        self._ready = False
        self._await_ready()

    def close(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None or conn is None:  # never started (the two are set together)
            return
        try:
            conn.send(("close",))
        except (OSError, ValueError):
            pass
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
        conn.close()

    @property
    def child_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def child_rss_bytes(self) -> int:
        pid = self.child_pid
        return process_rss_bytes(pid) if pid is not None else 0

    @property
    def held_polls(self) -> int:
        """Safepoint polls the child has spent holding a forward, all-time: how a caller sees a hold take effect."""
        return self._ctl[HELD]

    @property
    def width(self) -> int:
        """The torch threads the child's forwards run on now (``set_width`` asks; the child applies it at its next safepoint)."""
        return self._ctl[WIDTH]

    # ------------------------------------------------------------------ the runner's interface
    def forward(self, items: list[ForwardItem], all_logits: bool = False, should_stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        logits = self._in_child("forward", items, all_logits, should_stop, None)
        return None if logits is None else torch.from_numpy(logits)

    def forward_sample(
        self,
        items: list[ForwardItem],
        samples: list[tuple[int, SamplerState]],
        should_stop: Callable[[], bool] | None = None,
        should_hold: Callable[[], bool] | None = None,
    ) -> tuple[list[int], list[float]] | None:
        """Forward and sample in the child: only ids and logprobs cross the pipe, and none of the
        sampling ops run here (each would hand this interpreter's lock to the serving lane and back)."""
        specs = [(row, id(state), state.params, state.seed, 0 if state.greedy else state.draws) for row, state in samples]
        sampled = self._in_child("sample", items, specs, should_stop, should_hold)
        if sampled is not None:
            for _, state in samples:  # count the child's draws (no torch op: each would hand this interpreter's lock over)
                if not state.greedy:
                    state.skip()
        return sampled

    def _in_child(self, kind: str, items: list[ForwardItem], arg, should_stop, should_hold) -> Any:
        for attempt in range(2):
            try:
                return self._forward_once(kind, items, arg, should_stop, should_hold)
            except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
                if attempt:
                    raise RuntimeError(f"the rollout forward process died twice in a row (exit code {self._exitcode()})") from exc
                self._restart()
        raise AssertionError("unreachable")

    def prepare_weights(self, staged: StagedWeights) -> None:
        """Copy ``staged`` into the standby bank (the caller's thread; forwards go on reading the live one)."""
        banks = self._banks
        if banks is not None:
            with banks.lock:
                banks.fill(staged)

    def apply_weights(self, staged: StagedWeights) -> float:
        """Flip to the standby bank holding ``staged`` (between forwards, on the rollout thread): here at
        once, in the child as its next forward begins; returns the pause in ms. A copy into the standby
        that fails raises before anything is flipped."""
        start = time.perf_counter()
        banks = self._banks
        if banks is None:  # never started: no child to tell, the parameters are this process's own
            staged.apply(self.model)
            return (time.perf_counter() - start) * 1000.0
        with banks.lock:
            if banks.filled_for is not staged:  # not prepared (or another update took the standby since): copied in the pause
                banks.fill(staged)
            target = 1 - banks.live
            _point_at(self.weights.params, banks.banks[target])
            banks.live, banks.filled_for = target, None
            self._ctl[BANK] = target  # read by the child before its next forward (sent after this, on this thread)
        live = dict(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in staged.tensors.items():
                if name not in self.weights.params and name in live:  # buffers (none in the paged forward): in place, as before
                    live[name].copy_(tensor)
        return (time.perf_counter() - start) * 1000.0

    def set_width(self, threads: int) -> None:
        """Core lending's width for the child. Narrowing waits (bounded) until the child has
        narrowed at a safepoint, or is between forwards, so serving gets its core back whole."""
        ctl = self._ctl
        ctl[WANT_WIDTH] = threads
        deadline = time.monotonic() + RETURN_TIMEOUT_S
        while ctl[BUSY] and ctl[WIDTH] > threads and time.monotonic() < deadline:
            time.sleep(ACK_POLL_S)

    # ------------------------------------------------------------------ internals
    def _forward_once(self, kind: str, items, arg, should_stop, should_hold) -> Any:
        if self._process is None:
            self.start()
        self._await_ready()
        if (self._sent_kv is None or self.pool.k is not self._sent_kv[0]) and not self.pool.released:
            k, v = self.pool.k, self.pool.v
            k.share_memory_(), v.share_memory_()
            self._call("kv", k, v)
            self._sent_kv = (k, v)
        ctl = self._ctl
        ctl[ABANDON] = ctl[HOLD] = 0
        conn = self._pipe()
        conn.send((kind, items, arg))
        reply = select.poll()  # not select.select: that fails on a descriptor >= 1024, which a busy executor reaches
        reply.register(conn.fileno(), select.POLLIN)  # (Connection.poll builds a selector per call)
        polls, wait_s = 0, POLL_S
        try:
            while not reply.poll(wait_s * 1000.0):
                if should_stop is not None and not ctl[ABANDON] and should_stop():
                    ctl[ABANDON] = 1
                if should_hold is not None:
                    ctl[HOLD] = held = int(should_hold())
                    # held: what holds it changes at serving's pace; asking every POLL_S only takes this
                    # interpreter's lock from the serving lane. Running: POLL_S, to hold at once on a backlog.
                    wait_s = max(POLL_S, self.held_poll_s()) if held and self.held_poll_s is not None else POLL_S
                polls += 1
                if polls % ALIVE_EVERY_POLLS == 0 and (self._process is None or not self._process.is_alive()) and not conn.poll():
                    raise EOFError("rollout forward process exited")
        finally:
            ctl[HOLD] = 0
        return self._reply()

    def _call(self, kind: str, *body):
        self._await_ready()
        self._pipe().send((kind, *body))
        return self._reply()

    def _pipe(self) -> Connection:
        if self._conn is None:
            raise EOFError("the rollout forward process is not running")
        return self._conn

    def _reply(self):
        reply, detail = self._pipe().recv()
        if reply == "error":
            raise RuntimeError(f"rollout forward process: {detail}")
        return detail

    def _await_ready(self) -> None:
        if self._ready:
            return
        conn = self._pipe()
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the rollout forward process did not start within {START_TIMEOUT_S:.0f} s")
        kind, _pid = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"rollout forward process: unexpected first message {kind!r}")
        self._ready = True

    def _restart(self) -> None:
        self.restarts += 1
        process = self._process
        self._process = None
        if process is not None and process.is_alive():
            process.kill()
        if process is not None:
            process.join()
        self.start()

    def _exitcode(self):
        return self._process.exitcode if self._process is not None else None


def shared_memory_shortfall(model: torch.nn.Module, pool: KVPool) -> int:
    """Bytes missing from ``SHM_DIR`` (a tmpfs) for the policy's weights and the rollout KV pool; 0 when
    they fit (the weights twice: the live and the standby bank). A container's /dev/shm is 64 MB unless
    raised: a mapping past it would kill the executor with SIGBUS at first touch, so the engine checks
    first and stays in one process."""
    need = 2 * sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 * pool.k.numel() * pool.k.element_size()
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return need
    return max(0, need + SHM_HEADROOM_BYTES - st.f_bavail * st.f_frsize)


def child_pid(runner: object) -> int | None:
    """The pid of a runner's forward process (None for a runner in this process)."""
    return runner.child_pid if isinstance(runner, ProcessRunner) else None


def child_rss_bytes(runner: object) -> int:
    """Resident memory of a runner's forward process (0 for a runner in this process)."""
    return runner.child_rss_bytes() if isinstance(runner, ProcessRunner) else 0
