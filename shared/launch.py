"""Start ROSE services as real processes and wait for their 'ready' heartbeat (benches and tests).

`rose up` supervises its children itself (cli/up.py); this is the small piece that benches and
end-to-end tests share: spawn `rose run NAME` with an environment, find it on the bus, stop it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rose.contracts.registry import SERVICE_REGISTRY

from .bus import Bus

STOP_TIMEOUT_S = 20.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class ServiceProcess:
    service: str
    instance: str
    env: dict[str, str]
    log_path: Path
    nice: int = 0  # OS priority offset; benches use it to keep stand-in "other hardware" off the serving CPUs
    cpus: frozenset[int] | None = None  # CPU set it (and its children) may run on: one core stands in for one device; None floats
    args: tuple[str, ...] = ()  # after `rose run SERVICE` (an emulated executor group: `--emulate 8xH100:7B ...`)
    # the instances it runs when they are several (an emulated executor group, services/executor/group.py); empty: `instance`
    members: tuple[str, ...] = ()
    process: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "ROSE_RUNTIME__INSTANCE": self.instance}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rose.cli.main", "run", self.service, *self.args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._in_child,
            )
        return self

    def _in_child(self) -> None:
        """Runs in the child before exec: its CPU set, its OS priority, and death with its parent (Linux).

        The CPU set is applied before exec so that the interpreter, torch's thread pools (sized
        from the affinity mask) and every process it spawns (the executor's rollout forward
        child) see only those cores.

        Why: a bench or test killed mid-run (a timeout, Ctrl-C twice) must not leave a fleet of
        orphaned services eating the machine; the kernel sends SIGTERM when the parent exits.
        """
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)
        if self.nice:
            os.nice(self.nice)
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the chaos step (no drain, no goodbye)."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the process freezes (no heartbeats, no acks, sockets stay open), as behind a partition."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    async def wait_ready(self, bus: Bus, timeout: float) -> dict[str, str]:
        """Until this instance's heartbeat says 'ready'; returns its endpoints."""
        return (await self.wait_members_ready(bus, timeout, (self.instance,)))[self.instance]

    async def wait_members_ready(self, bus: Bus, timeout: float, members: tuple[str, ...] | None = None) -> dict[str, dict[str, str]]:
        """Until every instance this process runs (``members``, else its own) says 'ready'; their endpoints by instance."""
        deadline = time.monotonic() + timeout
        waiting = list(members or self.members or (self.instance,))
        ready: dict[str, dict[str, str]] = {}
        while waiting:
            beat = await bus.kv_get(SERVICE_REGISTRY, service=self.service, instance=waiting[0])
            if beat is not None and beat.state == "ready" and beat.pid == self.pid:
                ready[waiting.pop(0)] = dict(beat.endpoints)
                continue
            if not self.alive():
                raise RuntimeError(f"{self.service} {self.instance} exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.service} {waiting[0]} not ready in {timeout:.0f}s:\n{self.log_tail()}")
            await asyncio.sleep(0.2)
        return ready


async def start_all(bus: Bus, procs: list[ServiceProcess], timeout: float) -> None:
    """Start every process at once and wait until all are ready."""
    for p in procs:
        p.start()
    await asyncio.gather(*(p.wait_members_ready(bus, timeout) for p in procs))


def stop_all(procs: list[ServiceProcess]) -> None:
    for p in procs:
        if p.alive():
            assert p.process is not None
            p.process.terminate()
    for p in procs:
        p.stop()
