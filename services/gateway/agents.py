"""Starting the agent of each episode, and knowing when it exits.

`ForkedAgents` runs a Python script through one warm interpreter that forks a child per episode
(zygote.py); `SpawnedAgents` spawns any command per episode. Either way the agent gets a clean
environment: the allowed basics (PATH, HOME, locale, PYTHONPATH, ...) and its episode's variables, never
the gateway's own (bus credentials, NATS_URL, ROSE_* settings); its stdout and stderr go to the
episode's log; it dies with the gateway (and so its episode is run again from its checkpoints when the
task is redelivered).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

PASSED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")
AGENT_ENV = {"OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONUNBUFFERED": "1"}  # the Agents SDK would export traces to OpenAI with the episode key
READY_TIMEOUT_S = 120.0  # the zygote imports the script's modules first
PR_SET_PDEATHSIG = 1


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What an agent process sees: the basics, the agent defaults, and `extra`."""
    return {**{k: os.environ[k] for k in PASSED_ENV if k in os.environ}, **AGENT_ENV, **(extra or {})}


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class AgentRun:
    """One agent process: `exited` resolves to its exit code (minus the signal's number if killed)."""

    episode_id: str
    log_path: Path
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pid: int = 0


class AgentLauncher(Protocol):
    async def start(self) -> None: ...

    async def launch(self, episode_id: str, env: dict[str, str], argv: list[str], log_path: Path) -> AgentRun: ...

    async def kill(self, run: AgentRun) -> None: ...

    async def close(self) -> None: ...


class ForkedAgents:
    """A Python agent script, forked per episode from a warm interpreter (zygote.py)."""

    def __init__(self, script: str, logs_dir: Path) -> None:
        self.script = str(Path(script).resolve())
        self.logs_dir = logs_dir
        self.process: asyncio.subprocess.Process | None = None
        self.runs: dict[str, AgentRun] = {}
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._closing = False

    async def start(self) -> None:
        if not Path(self.script).is_file():
            raise FileNotFoundError(f"agent.script {self.script} does not exist")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        stderr = open(self.logs_dir / "zygote.log", "ab")  # noqa: SIM115 - the child holds it; closed with it
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rose.services.gateway.zygote",
                self.script,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=clean_env(),
                preexec_fn=_die_with_parent,
            )
        finally:
            stderr.close()
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), READY_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"the agent zygote for {self.script} exited at start: see {self.logs_dir / 'zygote.log'}")
        self._reader = asyncio.create_task(self._read(), name="agent-zygote")

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while line := await self.process.stdout.readline():
            event = json.loads(line)
            run = self.runs.get(event.get("id", ""))
            if run is None:
                continue
            if event["event"] == "started":
                run.pid = event["pid"]
            elif event["event"] == "exited":
                self.runs.pop(run.episode_id, None)
                if not run.exited.done():
                    run.exited.set_result(int(event["code"]))
        code = await self.process.wait()
        if not self._closing:
            log.error("the agent zygote exited (code %s): its agents are gone; the next launch starts another", code)
        for run in self.runs.values():
            if not run.exited.done():
                run.exited.set_result(-int(signal.SIGKILL))
        self.runs.clear()

    async def _send(self, order: dict) -> None:
        async with self._lock:
            if self.process is None or self.process.returncode is not None:
                await self.start()
            assert self.process is not None and self.process.stdin is not None
            self.process.stdin.write((json.dumps(order) + "\n").encode())
            await self.process.stdin.drain()

    async def launch(self, episode_id: str, env: dict[str, str], argv: list[str], log_path: Path) -> AgentRun:
        run = AgentRun(episode_id, log_path)
        self.runs[episode_id] = run
        await self._send({"op": "launch", "id": episode_id, "env": {**AGENT_ENV, **env}, "argv": argv, "log": str(log_path)})
        return run

    async def kill(self, run: AgentRun) -> None:
        if not run.exited.done():
            await self._send({"op": "kill", "id": run.episode_id})

    async def close(self) -> None:
        self._closing = True
        if self.process is not None and self.process.returncode is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # EOF: the zygote kills its children and exits
            try:
                await asyncio.wait_for(self.process.wait(), 5.0)
            except TimeoutError:
                self.process.kill()
        if self._reader is not None:
            self._reader.cancel()


class SpawnedAgents:
    """Any agent command, spawned per episode (its own process group, killed with it)."""

    def __init__(self, command: list[str], logs_dir: Path) -> None:
        self.command, self.logs_dir = command, logs_dir
        self._waits: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)

    async def launch(self, episode_id: str, env: dict[str, str], argv: list[str], log_path: Path) -> AgentRun:
        run = AgentRun(episode_id, log_path)
        with open(log_path, "ab") as out:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=clean_env(env),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        run.pid = process.pid

        async def wait() -> None:
            code = await process.wait()
            if not run.exited.done():
                run.exited.set_result(code)

        task = asyncio.create_task(wait())
        self._waits.add(task)
        task.add_done_callback(self._waits.discard)
        return run

    async def kill(self, run: AgentRun) -> None:
        if run.pid and not run.exited.done():
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def close(self) -> None:
        for task in list(self._waits):
            task.cancel()


def launcher_for(script: str, command: list[str], logs_dir: Path) -> AgentLauncher | None:
    if script:
        return ForkedAgents(script, logs_dir)
    if command:
        return SpawnedAgents(command, logs_dir)
    return None
