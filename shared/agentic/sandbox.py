"""Run untrusted, model-written Python for the code tool, held by the kernel; fail closed.

Backends; `SandboxResult.backend` records which one ran. See docs/sandbox.md.

**subprocess** (the default where the kernel allows it): the program runs in a child process
in its own user, PID, network, mount, IPC and UTS namespaces, set up by a small launcher that
calls `unshare(2)`, `mount(2)` and `pivot_root(2)` through ctypes (Python only: no package to
install). Inside:
- PID namespace: a launcher process is PID 1; when the program exits (or the parent kills the
  launcher at the wall limit) the kernel kills everything the program started, double-forked
  and `setsid` daemons included;
- network namespace: only its own loopback; the host's interfaces, 127.0.0.1 listeners and
  abstract unix sockets are not reachable;
- mount namespace: a fresh read-only root holding only the system's /usr (/bin, /lib...), the
  interpreter's own prefix, /dev/null-like devices and a /proc of its own PID namespace; its
  work dir `/sandbox` is a size-capped tmpfs, the only writable path. The state dir
  (`$ROSE_STATE_DIR`: keys, credentials), the repo, /tmp, $HOME, other runs' dirs and the host's
  /proc are not in it (and are covered by an empty mount should they lie under an exposed path);
- user namespace: the program runs as an unprivileged uid (the caller's own uid, or `nobody`
  when the caller is root), with every capability dropped, an empty bounding set,
  `no_new_privs`, no supplementary groups (when root), and no nested user namespaces;
- limits: `RLIMIT_CPU`, `RLIMIT_AS`, `RLIMIT_FSIZE`, `RLIMIT_NPROC` (counted per namespace),
  `RLIMIT_NOFILE`, no core files; the work dir's tmpfs `size=`; the parent enforces the wall
  clock and the output cap;
- a clean environment (PATH, HOME, TMPDIR, LANG only), stdin from /dev/null.
Nothing runs unless every step of this set-up succeeded: a failure is a `SandboxError`
naming the step (an environment failure, never a silently weaker sandbox).

**docker** (`backend="docker"`, or `auto` when the `docker` SDK is installed and an engine
answers): a throwaway container, no network, read-only root, tmpfs work dir, memory and pids
limits, all capabilities dropped, uid 65534.

**unsafe** (only when asked for by name): the program runs as a plain child process guarded
by a Python audit hook and rlimits. An audit hook is no boundary (the issue that replaced it
showed five ways around it); it is kept for development machines without user namespaces,
never chosen by `auto`.

`Sandbox("auto")` picks docker, then subprocess, and raises `SandboxUnavailable` (saying what
to install or enable) when neither can run: the code environment refuses to start rather
than run model-written code unconfined.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from rose.shared.errors import RoseError

NOBODY = 65534
SANDBOX_UID = 1000  # the program's uid inside its user namespace (mapped to an unprivileged host uid)
BLOCK_MARK = "[rose-sandbox] blocked: "
READ_CHUNK = 65536
NICE = 10
SYSTEM_PYTHONS = ("/usr/local/bin/python3", "/usr/bin/python3")
EXIT_GRACE_S = 2.0  # after a kill: how long to wait for the namespace to be torn down
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "amd64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

Backend = Literal["docker", "subprocess", "unsafe"]
BackendChoice = Literal["auto", "docker", "subprocess", "unsafe"]
ISOLATING_BACKENDS: tuple[Backend, ...] = ("docker", "subprocess")

NO_BACKEND_HELP = (
    "no isolating sandbox backend can run here, so the code environment refuses to run model-written code. "
    "Enable unprivileged user namespaces (Linux: sysctl user.max_user_namespaces > 0; Debian/Ubuntu: "
    "kernel.unprivileged_userns_clone=1; Ubuntu 24.04: kernel.apparmor_restrict_unprivileged_userns=0; in a Docker "
    "container: --security-opt seccomp=unconfined --security-opt apparmor=unconfined, or a seccomp profile that allows "
    "unshare, mount, umount2 and pivot_root), or install the `docker` Python SDK with a reachable Docker engine "
    '(backend "docker"). Development machines only: set the sandbox backend to "unsafe" '
    "(ROSE_SANDBOX__BACKEND=unsafe) to run without isolation. See docs/sandbox.md."
)


class SandboxError(RoseError, OSError):
    """The sandbox itself could not run a program (the environment's failure, not the program's)."""


class SandboxUnavailable(SandboxError):
    """No isolating backend works on this machine (and `unsafe` was not asked for)."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    max_output_bytes: int = 64 << 10
    file_bytes: int = 16 << 20  # one file
    disk_bytes: int = 32 << 20  # the whole work dir (subprocess: its tmpfs size)
    max_processes: int = 32
    max_open_files: int = 64

    def __post_init__(self) -> None:  # a zero would mean "no limit" to some of them (a tmpfs size=0 is unbounded)
        for name, value in dataclasses.asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, not {value!r}")


@dataclass(frozen=True)
class DockerSettings:
    image: str = "python:3.11-slim"
    ping_timeout_s: float = 2.0


@dataclass(kw_only=True)
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


@dataclass
class _Supervised:
    """What the parent saw of one child tree: its output, why it was stopped, its exit code."""

    stdout: bytes
    stderr: bytes
    killed: str
    returncode: int | None
    duration_s: float


def _supervise(
    cmd: list[str], env: dict[str, str], limits: SandboxLimits, *, cwd: str, stdin_data: bytes = b"", pass_fds: tuple[int, ...] = (), preexec_fn=None
) -> _Supervised:
    """Run `cmd` in a new session; read its output as it comes; kill the session at the wall or output limit."""
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin_data else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=pass_fds,
        preexec_fn=preexec_fn,
    )
    out, err, killed = bytearray(), bytearray(), ""
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    try:
        if stdin_data:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin_data)  # the launcher reads all of it before anything else
                proc.stdin.close()
            except BrokenPipeError:
                pass
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        deadline = started + limits.wall_s
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
        # the pipes close once every process holding them is gone: wait a moment for that
        grace = time.monotonic() + EXIT_GRACE_S
        while sel.get_map() and time.monotonic() < grace:
            for key, _ in sel.select(timeout=0.1):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif len(out) + len(err) <= limits.max_output_bytes:
                    key.data.extend(chunk)
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        _kill_group(proc)  # nothing left in its session outlives it
    return _Supervised(bytes(out), bytes(err), killed, proc.returncode, time.monotonic() - started)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(data: bytes, limit: int) -> str:
    return data[:limit].decode("utf-8", "replace")


# --- subprocess: kernel namespaces ------------------------------------------------------------

# The launcher, run as `python -I -S -c _LAUNCHER CONFIG_JSON` with the program's source on stdin.
# L (this process, the caller's uid) forks C, which unshares the namespaces; L writes C's uid/gid
# maps (as root: the program becomes `nobody`); C forks P, PID 1 of the new PID namespace, which
# builds the new root, pivots into it and forks Q, which drops everything and execs the program.
# P reports on the status fd: "started ...", then "exit N" / "signal N"; any failed step:
# "setup-error STEP: REASON" and nothing runs.
_LAUNCHER = r"""
import _socket, ctypes, fcntl, json, os, resource, signal, struct, sys
cfg = json.loads(sys.argv[1])
STATUS = cfg["status_fd"]
os.set_inheritable(STATUS, False)
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MNT_DETACH = 1024, 2048, 1 << 21, 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
UID = cfg["uid"]
def report(line):
    try:
        os.write(STATUS, (line + "\n").encode())
    except OSError:
        pass
def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
def step(what, fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:
        report("setup-error %s: %s" % (what, exc))
        os._exit(125)
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount %s on %s" % (src or fstype, dst))
def unescape(field):  # mountinfo writes space, tab, newline and backslash as \\ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
def mounts_under(path):
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = unescape(line.split()[4])
            if point == path or point.startswith(path.rstrip("/") + "/"):
                out.append(point)
    return out
def statvfs_flags(path):
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
        if f & st:
            out |= ms
    return out
def bind_readonly(src, dst):
    mount(src, dst, None, MS_BIND | MS_REC)
    for point in mounts_under(dst):  # every submount too, keeping the flags the kernel has locked
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | statvfs_flags(point))
def write_file(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
def build_root(base):
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    # Open what to expose while still the caller's uid (as root: a prefix under /root), then
    # create files as the sandbox uid: the new tmpfs only takes owners mapped in this namespace.
    sources = []
    for src in cfg["system_dirs"] + cfg["interpreter_dirs"]:
        if os.path.islink(src):
            sources.append((src, None, os.readlink(src)))
        elif os.path.isdir(src):
            sources.append((src, os.open(src, os.O_PATH | os.O_DIRECTORY), None))
    libc.setfsgid(UID)
    libc.setfsuid(UID)
    if libc.setfsuid(UID) != UID:
        raise OSError("could not create files as the sandbox uid")
    mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for src, fd, link in sources:
        if link is not None:
            os.symlink(link, base + src)
        else:
            os.makedirs(base + src, exist_ok=True)
            bind_readonly("/proc/self/fd/%d" % fd, base + src)
            os.close(fd)
    for hidden in cfg["hide"]:  # a secret dir below an exposed path: cover it
        if os.path.isdir(base + hidden):
            mount("tmpfs", base + hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
        elif os.path.exists(base + hidden):
            mount("/dev/null", base + hidden, None, MS_BIND)
    os.makedirs(base + "/dev")
    for dev in ("null", "zero", "full", "random", "urandom"):
        write_file(base + "/dev/" + dev, "")
        mount("/dev/" + dev, base + "/dev/" + dev, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, base + "/dev/" + name)
    os.makedirs(base + "/etc")
    write_file(base + "/etc/passwd", "sandbox:x:%d:%d:sandbox:/sandbox:/bin/sh\n" % (UID, UID))
    write_file(base + "/etc/group", "sandbox:x:%d:\n" % UID)
    write_file(base + "/etc/hosts", "127.0.0.1 localhost sandbox\n::1 localhost\n")
    os.makedirs(base + "/proc")
    have_proc = True
    try:  # a /proc of the new PID namespace only; refused in some containers (masked /proc): then none
        mount("proc", base + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        have_proc = False
    os.makedirs(base + "/sandbox")
    mount("tmpfs", base + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,uid=%d,gid=%d,size=%d" % (UID, UID, cfg["disk_bytes"]))
    write_file(base + "/sandbox/main.py", code.decode("utf-8", "replace"))
    os.chown(base + "/sandbox/main.py", UID, UID)
    return have_proc
def pivot(base):
    nr = cfg["pivot_root_syscall"]
    os.chdir(base)
    check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
def no_nested_userns():
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
def loopback_up():
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14x", b"lo", 0x1 | 0x8 | 0x40))  # SIOCSIFFLAGS: UP|LOOPBACK|RUNNING
    finally:
        s.close()
def drop_and_exec():
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, 65536)
    os.chdir("/sandbox")
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if cap < 30:
        raise OSError("could not empty the capability bounding set (stopped at %d)" % cap)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    lim = cfg["limits"]
    for res, soft, hard in (
        (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),
        (resource.RLIMIT_AS, lim["memory_bytes"], lim["memory_bytes"]),
        (resource.RLIMIT_FSIZE, lim["file_bytes"], lim["file_bytes"]),
        (resource.RLIMIT_NOFILE, lim["max_open_files"], lim["max_open_files"]),
        (resource.RLIMIT_NPROC, lim["max_processes"], lim["max_processes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))
    os.nice(cfg["nice"])
    exe = cfg["interpreter"]
    os.execve(exe, [exe, "-I", "-c", cfg["bootstrap"], "/sandbox/main.py"], cfg["env"])
def init():  # P: PID 1 of the new PID namespace
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:  # the limit is per user namespace (ours); the host's /proc is still reachable here
        no_nested_userns()
        nested = 0
    except OSError:  # a read-only /proc/sys (Docker): nested user namespaces stay possible
        nested = 1
    have_proc = step("build the sandbox root", build_root, cfg["base"])
    step("pivot into the sandbox root", pivot, cfg["base"])
    step("hostname", lambda: check(libc.sethostname(b"sandbox", 7), "sethostname"))
    step("bring up the namespace's loopback", loopback_up)
    report("started proc=%d nested_userns=%d" % (have_proc, nested))
    q = os.fork()
    if q == 0:
        step("drop privileges and exec the program", drop_and_exec)
    while True:  # reap everything; the program's end is the sandbox's end
        try:
            pid, st = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == q:
            report("signal %d" % os.WTERMSIG(st) if os.WIFSIGNALED(st) else "exit %d" % os.WEXITSTATUS(st))
            os._exit(0)  # PID 1 exits: the kernel kills whatever the program left behind
def child(r_go, w_ready):  # C: unshares, waits for its maps, forks PID 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    step("unshare user, mount, PID, network, IPC and UTS namespaces", lambda: check(libc.unshare(
        CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare"))
    os.write(w_ready, b"u")
    os.close(w_ready)
    if os.read(r_go, 1) != b"m":
        os._exit(125)
    os.close(r_go)
    p = os.fork()
    if p == 0:
        init()
    _, st = os.waitpid(p, 0)
    os._exit(0 if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else 125)
def write_maps(pid):
    if os.geteuid() == 0:
        outer_uid = outer_gid = cfg["nobody"]
    else:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
    write_file("/proc/%d/setgroups" % pid, "deny")
    write_file("/proc/%d/uid_map" % pid, "%d %d 1\n" % (UID, outer_uid))
    write_file("/proc/%d/gid_map" % pid, "%d %d 1\n" % (UID, outer_gid))
if os.geteuid() == 0:
    step("drop supplementary groups", os.setgroups, [])
r_ready, w_ready = os.pipe()
r_go, w_go = os.pipe()
c = os.fork()
if c == 0:
    os.close(r_ready); os.close(w_go)
    child(r_go, w_ready)
os.close(w_ready); os.close(r_go)
if os.read(r_ready, 1) == b"u":
    try:
        write_maps(c)
    except OSError as exc:
        report("setup-error write the user namespace's uid/gid maps: %s" % exc)
        os.kill(c, signal.SIGKILL)
        os._exit(125)
    os.write(w_go, b"m")
os.close(w_go)
_, st = os.waitpid(c, 0)
os._exit(0 if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else 125)
"""

# The program's interpreter runs this (as `-c`): read the program, delete the file (it cannot read
# its harness back), run it as __main__.
_NS_BOOTSTRAP = r"""
import os, sys
_prog = sys.argv[1]
with open(_prog, encoding="utf-8", errors="replace") as _f:
    _src = _f.read()
os.remove(_prog)
_code = compile(_src, "main.py", "exec")
del _src, _f, _prog
exec(_code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
"""

PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8", "USER": "sandbox"}


@dataclass(frozen=True)
class Interpreter:
    """A Python this uid can run, and the host dirs it needs besides the system's (its prefix)."""

    path: str
    dirs: tuple[str, ...]


def _covered(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@lru_cache(maxsize=4)
def find_interpreter(euid: int) -> Interpreter | None:
    """The first of this interpreter's base, the running one and the system's that `euid` can run with ctypes."""
    candidates = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), os.path.realpath(sys.executable)]
    candidates += [os.path.realpath(p) for p in SYSTEM_PYTHONS]
    probe = "import ctypes, fcntl, json, resource, sys; print(json.dumps([sys.base_prefix, sys.base_exec_prefix]))"
    for exe in dict.fromkeys(candidates):
        if not os.path.exists(exe):
            continue
        try:
            out = subprocess.run([exe, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30, cwd="/", env=dict(PROGRAM_ENV))
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode != 0:
            continue
        real_system = tuple(os.path.realpath(d) for d in SYSTEM_DIRS if os.path.exists(d))
        dirs: list[str] = []
        for d in [*json.loads(out.stdout), os.path.dirname(exe)]:
            d = os.path.realpath(d)
            if d != "/" and not _covered(d, real_system) and not _covered(d, tuple(dirs)):
                dirs.append(d)
        return Interpreter(exe, tuple(dirs))
    return None


def _hidden_paths(exposed: tuple[str, ...]) -> list[str]:
    """Secrets to cover should they lie under an exposed dir: the state dir and the caller's home."""
    out = []
    for p in (os.environ.get("ROSE_STATE_DIR", ".rose"), os.path.expanduser("~")):
        real = os.path.realpath(p)
        if _covered(real, exposed) and real not in exposed:
            out.append(real)
    return out


class NamespaceBackend:
    """A child process in its own user/PID/network/mount/IPC/UTS namespaces (see the module doc)."""

    name: Backend = "subprocess"

    def __init__(self) -> None:
        interpreter = find_interpreter(os.geteuid())
        if interpreter is None:
            raise SandboxUnavailable(
                f"no Python interpreter that uid {os.geteuid()} can run was found (tried the running one and {', '.join(SYSTEM_PYTHONS)})"
            )
        if platform.machine() not in PIVOT_ROOT_SYSCALL:
            raise SandboxUnavailable(f"the namespace sandbox does not know pivot_root's syscall number on {platform.machine()}")
        self.interpreter = interpreter
        self.have_proc = False
        self.nested_userns = True
        probe = self.run("print('rose-sandbox-ok')", SandboxLimits(wall_s=30.0, cpu_s=10))
        if probe.stdout.strip() != "rose-sandbox-ok" or not probe.ok:
            raise SandboxUnavailable(f"the namespace sandbox's probe program did not run: {probe.summary()}: {probe.stderr.strip()[-300:]}")

    def enforced(self) -> list[str]:
        out = [
            "userns",
            "pidns",
            "netns",
            "mountns",
            "ipcns",
            "utsns",
            "read_only_root",
            "tmpfs_workdir",
            "no_capabilities",
            "no_new_privs",
            "uid_unprivileged",
            "clean_env",
            "rlimit_cpu",
            "rlimit_as",
            "rlimit_fsize",
            "rlimit_nproc",
            "rlimit_nofile",
            "wall_time",
            "output_limit",
        ]
        if self.have_proc:
            out.append("own_proc")
        if not self.nested_userns:
            out.append("no_nested_userns")
        return out

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        status_r, status_w = os.pipe()
        try:
            cfg = {
                "status_fd": status_w,
                "uid": SANDBOX_UID,
                "nobody": NOBODY,
                "base": tempfile.gettempdir(),
                "system_dirs": [d for d in SYSTEM_DIRS if os.path.lexists(d)],
                "interpreter_dirs": list(self.interpreter.dirs),
                "hide": _hidden_paths(tuple(os.path.realpath(d) for d in SYSTEM_DIRS if os.path.exists(d)) + self.interpreter.dirs),
                "disk_bytes": limits.disk_bytes,
                "interpreter": self.interpreter.path,
                "pivot_root_syscall": PIVOT_ROOT_SYSCALL[platform.machine()],
                "bootstrap": _NS_BOOTSTRAP,
                "env": PROGRAM_ENV,
                "nice": NICE,
                "limits": {
                    "cpu_s": limits.cpu_s,
                    "memory_bytes": limits.memory_bytes,
                    "file_bytes": limits.file_bytes,
                    "max_open_files": limits.max_open_files,
                    "max_processes": limits.max_processes,
                },
            }
            cmd = [self.interpreter.path, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)]
            seen = _supervise(
                cmd,
                {"PATH": PROGRAM_ENV["PATH"], "LANG": "C.UTF-8"},
                limits,
                cwd="/",
                stdin_data=code.encode("utf-8", "replace") or b"\n",
                pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
            status = _read_all(status_r)
        lines = status.splitlines()
        errors = [line[len("setup-error ") :] for line in lines if line.startswith("setup-error ")]
        started = next((line for line in lines if line.startswith("started")), "")
        if errors or (not started and not seen.killed):
            raise SandboxError(f"the sandbox could not start the program: {'; '.join(errors) or 'the launcher exited with ' + str(seen.returncode)}")
        self.have_proc = "proc=1" in started
        self.nested_userns = "nested_userns=1" in started
        exit_code: int | None = None
        for line in lines:
            if line.startswith("exit "):
                exit_code = int(line.split()[1])
            elif line.startswith("signal "):
                exit_code = -int(line.split()[1])
        stderr = _text(seen.stderr, limits.max_output_bytes)
        killed = seen.killed
        if not killed and exit_code is not None and -exit_code in (signal.SIGXCPU, signal.SIGKILL):
            killed = "cpu_time"
        if not killed and "MemoryError" in stderr[-2000:]:
            killed = "memory"
        return SandboxResult(
            backend=self.name,
            exit_code=exit_code,
            stdout=_text(seen.stdout, limits.max_output_bytes),
            stderr=stderr,
            duration_s=seen.duration_s,
            killed=killed,  # type: ignore[arg-type]
            enforced=self.enforced(),
        )


def _read_all(fd: int) -> str:
    """The status pipe, once every writer has exited (or a moment after a kill)."""
    out = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + EXIT_GRACE_S
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.1):
                continue
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                break
            out.extend(chunk)
    finally:
        sel.close()
        os.close(fd)
    return out.decode("utf-8", "replace")


# --- unsafe: an audit hook and rlimits, no boundary ------------------------------------------

# The program's interpreter runs this first (as `-c`): install the audit hook, then run the
# program file. Arguments: sandbox dir, program file. A diagnostic that reports the obvious
# attempts; it is NOT a boundary (see the module doc).
_UNSAFE_BOOTSTRAP = r"""
import os, sys
_dir, _prog = sys.argv[1], sys.argv[2]
os.chdir(_dir)
_src = open(_prog, encoding="utf-8", errors="replace").read()
os.remove(_prog)
_MARK = __BLOCK_MARK__
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROC = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "pty.spawn"}
_NET = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
_realpath, _sep, _fspath, _write = os.path.realpath, os.sep, os.fsdecode, os.write
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
            _block("write outside the sandbox dir: %s" % (path,))
    elif event in _PROC:
        _block("process creation (%s)" % event)
    elif event == "socket.__new__" and args[1] != 1:
        _block("network socket (family %s)" % (args[1],))
    elif event in _NET:
        _block("network access (%s)" % event)
sys.addaudithook(_hook)
_code = compile(_src, _prog, "exec")
del _src
exec(_code, {"__name__": "__main__", "__file__": _prog, "__builtins__": __builtins__})
""".replace("__BLOCK_MARK__", repr(BLOCK_MARK))


class UnsafeBackend:
    """A plain child process under rlimits and a diagnostic audit hook: for machines without namespaces, by explicit choice only."""

    name: Backend = "unsafe"

    def __init__(self) -> None:
        interpreter = find_interpreter(os.geteuid())
        self.interpreter = interpreter.path if interpreter else sys.executable

    def enforced(self) -> list[str]:
        return ["rlimit_cpu", "rlimit_as", "rlimit_fsize", "rlimit_nofile", "wall_time", "output_limit", "audit_hook_diagnostic", "own_tmp_dir"]

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        workdir = Path(tempfile.mkdtemp(prefix="rose-sandbox-unsafe-"))
        try:
            program = workdir / "main.py"
            program.write_text(code, encoding="utf-8")

            def confine() -> None:  # in the child, before exec
                resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
                resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
                resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                os.nice(NICE)

            env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8"}
            cmd = [self.interpreter, "-I", "-c", _UNSAFE_BOOTSTRAP, str(workdir), str(program)]
            seen = _supervise(cmd, env, limits, cwd=str(workdir), preexec_fn=confine)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        stderr = _text(seen.stderr, limits.max_output_bytes)
        rc, killed = seen.returncode, seen.killed
        if not killed and rc is not None and rc < 0 and -rc in (signal.SIGXCPU, signal.SIGKILL):
            killed = "cpu_time"
        if not killed and "MemoryError" in stderr[-2000:]:
            killed = "memory"
        blocked = [line[len(BLOCK_MARK) :] for line in stderr.splitlines() if line.startswith(BLOCK_MARK)]
        return SandboxResult(
            backend="unsafe",
            exit_code=rc,
            stdout=_text(seen.stdout, limits.max_output_bytes),
            stderr=stderr,
            duration_s=seen.duration_s,
            killed=killed,  # type: ignore[arg-type]
            blocked=blocked,
            enforced=self.enforced(),
        )


# --- docker ---------------------------------------------------------------------------------

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
        return [
            "container",
            "no_network",
            "mem_limit",
            "pids_limit",
            "one_cpu",
            "read_only_root",
            "tmpfs_workdir",
            "cap_drop_all",
            "no_new_privileges",
            "uid_nobody",
            "wall_time",
            "output_limit",
        ]

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        from docker.types import LogConfig  # noqa: PLC0415

        started = time.monotonic()
        container = self.client.containers.run(
            self.settings.image,
            ["python", "-I", "-c", _DOCKER_BOOT],
            environment={"ROSE_SANDBOX_CODE": code},
            detach=True,
            network_disabled=True,
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            nano_cpus=1_000_000_000,
            pids_limit=limits.max_processes,
            read_only=True,
            tmpfs={"/sandbox": f"size={limits.disk_bytes}"},
            working_dir="/sandbox",
            user=f"{NOBODY}:{NOBODY}",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
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
            backend="docker",
            exit_code=exit_code,
            stdout=stdout[: limits.max_output_bytes].decode("utf-8", "replace"),
            stderr=stderr[: limits.max_output_bytes].decode("utf-8", "replace"),
            duration_s=time.monotonic() - started,
            killed=killed,  # type: ignore[arg-type]
            enforced=self.enforced(),
        )


class Sandbox:
    """Pick a backend once and run programs; refuse (`SandboxUnavailable`) rather than run unconfined.

    `backend`: "auto" tries `auto_order` (docker, then subprocess) and takes the first that
    works; "docker" / "subprocess" insist on that one; "unsafe" runs without isolation and
    must be asked for by name. `auto_order` is what "auto" may consider (an empty tuple: no
    isolating backend, e.g. a machine where neither exists).
    """

    def __init__(
        self,
        backend: BackendChoice = "auto",
        limits: SandboxLimits = SandboxLimits(),
        docker: DockerSettings = DockerSettings(),
        *,
        auto_order: tuple[Backend, ...] = ISOLATING_BACKENDS,
    ) -> None:
        self.limits = limits
        self.backend: DockerBackend | NamespaceBackend | UnsafeBackend
        if backend == "unsafe":
            self.backend = UnsafeBackend()
            return
        if backend not in ("auto", *ISOLATING_BACKENDS):
            raise ValueError(f"unknown sandbox backend {backend!r}; choose auto, docker, subprocess or unsafe")
        order = auto_order if backend == "auto" else (backend,)
        reasons = []
        for name in order:
            try:
                self.backend = DockerBackend(docker) if name == "docker" else NamespaceBackend()
                return
            except SandboxError as exc:
                reasons.append(f"{name}: {exc}")
            except Exception as exc:  # docker: no SDK, no engine, no permission
                reasons.append(f"{name}: {type(exc).__name__}: {exc}")
        tried = f" (tried {'; '.join(reasons)})" if reasons else " (none was allowed)"
        raise SandboxUnavailable(NO_BACKEND_HELP + tried)

    @property
    def name(self) -> Backend:
        return self.backend.name

    def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        return self.backend.run(code, limits or self.limits)
