"""Run untrusted, model-written Python for the code tool, contained.

Two backends; `SandboxResult.backend` records which one ran.

**docker** (chosen by `Sandbox("auto")` when the `docker` SDK is installed and an engine
answers a ping): a throwaway container from `DockerSettings.image`, no network, read-only
root with a small tmpfs as its working dir, memory and pids limits, one CPU, all
capabilities dropped, no new privileges, uid 65534, removed afterwards. It cannot be tested
on the development machine (no engine runs there); its test skips, saying so.

**subprocess** (everywhere else). What is enforced, and how:
- CPU time: `RLIMIT_CPU` (SIGXCPU, then SIGKILL one second later) -> reason `cpu_time`;
- memory: `RLIMIT_AS` (allocations fail with MemoryError) -> reason `memory`;
- wall time: the parent kills the whole process group at the deadline -> `wall_time`;
- output: stdout + stderr are read as they come and the group is killed past
  `max_output_bytes` -> `output_limit`; files written in its dir are capped by `RLIMIT_FSIZE`;
- network: when running as root and `unshare` exists, a fresh network namespace
  (`unshare --net`: no interface but a downed loopback); always, an audit hook (PEP 578)
  refusing every non-AF_UNIX socket, `connect`, `bind`, `sendto` and name lookups;
- processes: the audit hook refuses fork, exec, spawn, `os.system`, `subprocess` and
  signalling other processes; `RLIMIT_NPROC` backs it when the program runs as a non-root uid;
- files: its own fresh temp dir is the cwd and HOME; the audit hook refuses opening for
  writing, creating, removing, renaming, linking or chmod-ing anything outside it, and
  `os.open` of a directory outside it (a dir fd would let `dir_fd=` calls escape); as root,
  the program also drops to uid/gid 65534 (nobody) so the kernel refuses writes to
  root-owned places (needs an interpreter whose stdlib that uid can read: the system
  `/usr/bin/python3` when the running one lives under a private home);
- native code: importing `ctypes`/`_ctypes`/`cffi` is refused (the easy way around the hook);
- isolated interpreter (`-I`: no environment variables, no user site), a minimal environment,
  `nice` 10, stdin closed.
A refused action prints `[rose-sandbox] blocked: WHAT` on stderr and raises PermissionError in
the program; `SandboxResult.blocked` lists them.

What the subprocess backend does NOT enforce: reading world-readable files (e.g. /etc), a
disk quota for its dir beyond the per-file size, a CPU *share* (only nice), isolation from
side channels, and, when not root, a kernel-level barrier behind the audit hook (an audit
hook is a Python-level guard; a C extension already importable could bypass it). Use the
docker backend where untrusted code must be held at the kernel level.
"""

from __future__ import annotations

import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

NOBODY = 65534
BLOCK_MARK = "[rose-sandbox] blocked: "
READ_CHUNK = 65536
NICE = 10
SYSTEM_PYTHON = "/usr/bin/python3"

Backend = Literal["docker", "subprocess"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    max_output_bytes: int = 64 << 10
    file_bytes: int = 16 << 20
    max_processes: int = 32
    max_open_files: int = 64


@dataclass(frozen=True)
class DockerSettings:
    image: str = "python:3.11-slim"
    ping_timeout_s: float = 2.0


@dataclass
class SandboxResult:
    backend: Backend
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    killed: Literal["", "wall_time", "cpu_time", "memory", "output_limit"] = ""
    blocked: list[str] = field(default_factory=list)
    enforced: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed

    def summary(self) -> str:
        """One line for a tool result: what happened, without the program's output."""
        if self.killed:
            return f"killed: {self.killed}"
        if self.blocked:
            return f"blocked: {'; '.join(self.blocked)}"
        return f"exit code {self.exit_code}"


# The program's interpreter runs this first (as `-c`): drop privileges, install the audit
# hook, then run the program file. Arguments: sandbox dir, program file, uid to become (-1: stay).
_BOOTSTRAP = r'''
import os, sys
_dir, _prog, _uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
if _uid >= 0 and os.getuid() == 0:
    os.setgroups([]); os.setgid(_uid); os.setuid(_uid)
os.chdir(_dir)
_src = open(_prog, encoding="utf-8", errors="replace").read()
os.remove(_prog)  # the program cannot read its own harness (e.g. a test's marker) back
_MARK = %r
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROC = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "pty.spawn"}
_NET = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
_FS = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate", "os.chflags", "os.lchflags", "shutil.rmtree", "os.mkfifo", "os.mknod"}
_FS2 = {"os.rename", "os.link", "os.symlink"}
_NATIVE = {"ctypes", "_ctypes", "cffi", "_cffi_backend"}
_AF_UNIX = 1
_realpath, _sep, _fspath, _write, _isdir = os.path.realpath, os.sep, os.fsdecode, os.write, os.path.isdir
_root = _realpath(_dir)
def _inside(p):
    if isinstance(p, int):
        return True
    p = _realpath(_fspath(p))
    return p == _root or p.startswith(_root + _sep)
def _block(what):
    try:
        _write(2, (_MARK + what + "\n").encode())
    except Exception:
        pass
    raise PermissionError("sandbox: " + what)
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            _block("write outside the sandbox dir: %%s" %% (path,))
        if mode is None and not _inside(path) and _isdir(path):  # a dir fd would let dir_fd= writes slip past the path check
            _block("directory handle outside the sandbox dir: %%s" %% (path,))
    elif event in _FS:
        if args and not _inside(args[0]):
            _block("%%s outside the sandbox dir: %%s" %% (event, args[0]))
    elif event in _FS2:
        if not (_inside(args[0]) and _inside(args[1])):
            _block("%%s outside the sandbox dir: %%s -> %%s" %% (event, args[0], args[1]))
    elif event in _PROC:
        _block("process creation (%%s)" %% event)
    elif event in ("os.kill", "os.killpg"):
        if args[0] not in (0, os.getpid()):
            _block("signalling another process (%%s)" %% event)
    elif event == "socket.__new__":
        if args[1] != _AF_UNIX:
            _block("network socket (family %%s)" %% (args[1],))
    elif event in _NET:
        _block("network access (%%s)" %% event)
    elif event == "import" and args[0] in _NATIVE:
        _block("native code loader (%%s)" %% args[0])
sys.addaudithook(_hook)
_code = compile(_src, _prog, "exec")
_g = {"__name__": "__main__", "__file__": _prog, "__builtins__": __builtins__}
del _src
exec(_code, _g)
''' % BLOCK_MARK


def _readable_by_others(path: Path) -> bool:
    """Can an unprivileged uid read `path`: every parent searchable, the file readable?"""
    try:
        path = path.resolve()
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    except OSError:
        return False


def _interpreter_for_nobody() -> str | None:
    """An interpreter (with its stdlib) that uid nobody can run, or None."""
    for candidate in (sys.executable, SYSTEM_PYTHON):
        exe = Path(candidate)
        if not exe.exists():
            continue
        probe = subprocess.run([candidate, "-I", "-c", "import os; print(os.__file__)"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and _readable_by_others(exe) and _readable_by_others(Path(probe.stdout.strip())):
            return candidate
    return None


class SubprocessBackend:
    name: Backend = "subprocess"

    def __init__(self) -> None:
        self.is_root = os.geteuid() == 0
        self.unshare = shutil.which("unshare") if self.is_root else None
        if self.unshare and subprocess.run([self.unshare, "--net", "--", "true"], capture_output=True).returncode != 0:
            self.unshare = None  # no CAP_SYS_ADMIN here (an unprivileged container)
        nobody_python = _interpreter_for_nobody() if self.is_root else None
        self.drop_uid = nobody_python is not None
        self.interpreter = nobody_python or sys.executable

    def enforced(self) -> list[str]:
        out = ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "rlimit_nofile", "wall_time", "output_limit", "audit_hook", "own_tmp_dir", "isolated_interpreter"]
        if self.unshare:
            out.append("netns")
        if self.drop_uid:
            out += ["uid_nobody", "rlimit_nproc"]
        return out

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        workdir = Path(tempfile.mkdtemp(prefix="rose-sandbox-"))
        try:
            program = workdir / "main.py"
            program.write_text(code, encoding="utf-8")
            if self.drop_uid:
                os.chown(workdir, NOBODY, NOBODY)
                os.chown(program, NOBODY, NOBODY)
            cmd = [self.unshare, "--net", "--"] if self.unshare else []
            cmd += [self.interpreter, "-I", "-c", _BOOTSTRAP, str(workdir), str(program), str(NOBODY if self.drop_uid else -1)]
            env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
            return self._supervise(cmd, workdir, env, limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _supervise(self, cmd: list[str], workdir: Path, env: dict[str, str], limits: SandboxLimits) -> SandboxResult:
        def confine() -> None:  # in the child, before exec
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.nice(NICE)

        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=confine,
        )
        out, err, killed = bytearray(), bytearray(), ""
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        deadline = started + limits.wall_s
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    killed = "wall_time"
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    chunk = os.read(key.fd, READ_CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                if len(out) + len(err) > limits.max_output_bytes:
                    killed = "output_limit"
                    break
            if killed:
                _kill_group(proc)
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed = killed or "wall_time"
                _kill_group(proc)
                proc.wait()
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            _kill_group(proc)  # nothing it started outlives it
        stderr = bytes(err[: limits.max_output_bytes]).decode("utf-8", "replace")
        rc = proc.returncode
        if not killed and rc is not None and rc < 0 and -rc in (signal.SIGXCPU, signal.SIGKILL):
            killed = "cpu_time"
        if not killed and "MemoryError" in stderr[-2000:]:
            killed = "memory"
        blocked = [line[len(BLOCK_MARK) :] for line in stderr.splitlines() if line.startswith(BLOCK_MARK)]
        return SandboxResult(
            backend="subprocess", exit_code=rc, stdout=bytes(out[: limits.max_output_bytes]).decode("utf-8", "replace"), stderr=stderr,
            duration_s=time.monotonic() - started, killed=killed, blocked=blocked, enforced=self.enforced(),  # type: ignore[arg-type]
        )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_DOCKER_BOOT = "import os; exec(compile(os.environ.pop('ROSE_SANDBOX_CODE'), 'main.py', 'exec'), {'__name__': '__main__'})"


class DockerBackend:
    """A container per run through the `docker` SDK (imported lazily: an optional dependency)."""

    name: Backend = "docker"

    def __init__(self, settings: DockerSettings = DockerSettings()) -> None:
        import docker  # noqa: PLC0415 - optional, only when an engine is used

        self.settings = settings
        self.client = docker.from_env(timeout=int(max(1, settings.ping_timeout_s)))
        self.client.ping()

    @staticmethod
    def available(settings: DockerSettings = DockerSettings()) -> bool:
        try:
            DockerBackend(settings)
        except Exception:  # no SDK, no engine, no permission
            return False
        return True

    def enforced(self) -> list[str]:
        return ["container", "no_network", "mem_limit", "pids_limit", "one_cpu", "read_only_root", "tmpfs_workdir", "cap_drop_all", "no_new_privileges", "uid_nobody", "wall_time", "output_limit"]

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        from docker.types import LogConfig  # noqa: PLC0415

        started = time.monotonic()
        container = self.client.containers.run(
            self.settings.image, ["python", "-I", "-c", _DOCKER_BOOT], environment={"ROSE_SANDBOX_CODE": code}, detach=True,
            network_disabled=True, mem_limit=limits.memory_bytes, memswap_limit=limits.memory_bytes, nano_cpus=1_000_000_000,
            pids_limit=limits.max_processes, read_only=True, tmpfs={"/sandbox": f"size={limits.file_bytes}"}, working_dir="/sandbox",
            user=f"{NOBODY}:{NOBODY}", cap_drop=["ALL"], security_opt=["no-new-privileges"],
            log_config=LogConfig(type="json-file", config={"max-size": str(limits.max_output_bytes)}),
        )
        killed = ""
        try:
            try:
                status = container.wait(timeout=limits.wall_s)
                exit_code: int | None = int(status.get("StatusCode", -1))
            except Exception:  # the wait timed out
                killed, exit_code = "wall_time", None
                container.kill()
            container.reload()
            if container.attrs.get("State", {}).get("OOMKilled"):
                killed = "memory"
            stdout = container.logs(stdout=True, stderr=False)
            stderr = container.logs(stdout=False, stderr=True)
        finally:
            container.remove(force=True)
        if len(stdout) + len(stderr) > limits.max_output_bytes:
            killed = killed or "output_limit"
        return SandboxResult(
            backend="docker", exit_code=exit_code, stdout=stdout[: limits.max_output_bytes].decode("utf-8", "replace"),
            stderr=stderr[: limits.max_output_bytes].decode("utf-8", "replace"), duration_s=time.monotonic() - started,
            killed=killed, enforced=self.enforced(),  # type: ignore[arg-type]
        )


class Sandbox:
    """Pick a backend once (`auto`: docker when an engine answers, else subprocess) and run programs."""

    def __init__(self, backend: Literal["auto", "docker", "subprocess"] = "auto", limits: SandboxLimits = SandboxLimits(), docker: DockerSettings = DockerSettings()) -> None:
        self.limits = limits
        if backend == "docker" or (backend == "auto" and DockerBackend.available(docker)):
            self.backend: DockerBackend | SubprocessBackend = DockerBackend(docker)
        else:
            self.backend = SubprocessBackend()

    @property
    def name(self) -> Backend:
        return self.backend.name

    def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        return self.backend.run(code, limits or self.limits)
