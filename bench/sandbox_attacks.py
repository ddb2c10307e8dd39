"""Every known escape from the code sandbox, tried as an attacker would, judged by what is seen outside.

`run_sandbox_attacks(as_user)` runs the attacks in a fresh child process (as root, or dropped
to `nobody` as the shipped non-root container runs) that plays the rollout worker: a secret
in its environment, NKey seed files in its state dir, a TCP and a unix-socket listener, a
sleeping process of its own. Each row says whether the attack was blocked, decided from an
observable effect only: no marker file appeared outside (checked again some time after the
call returned), no listener received a connection, the secret is not in the output, no
process of the program is alive afterwards, a limit held at its value.

Importing this module starts nothing. `rose bench security` imports the function; the test
suite (tests/agentic/test_sandbox_escapes.py) runs the same attacks.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rose.bench.options import BenchOptionsError
from rose.shared.agentic.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable

NOBODY = 65534
PR_SET_DUMPABLE = 4
ATTACK_LIMITS = SandboxLimits(
    wall_s=8.0, cpu_s=1, memory_bytes=256 << 20, max_output_bytes=32 << 10, file_bytes=1 << 20, disk_bytes=4 << 20, max_processes=16
)
CPU_LOOP_WALL_S = 30.0  # the CPU limit must fire long before this, even on a busy machine
SURVIVOR_WAIT_S = 1.0  # after a run returned: how long a left-behind process has to show itself
CHILD_TIMEOUT_S = 300.0


@dataclasses.dataclass
class Harness:
    """The attacker's targets, set up by the process that plays the worker."""

    sandbox: Sandbox
    as_user: str
    scratch: Path  # the worker's own dir (owned by it): its cwd, its state dir, its unix socket
    home: Path
    secret: str  # in the worker's environment
    seeds: list[str]  # NKey seeds in the state dir
    token: str  # in the argv of every process an attack starts, to find survivors on the host
    rows: list[dict] = dataclasses.field(default_factory=list)

    def marker(self, where: Path, name: str) -> Path:
        return where / f"rose-attack-{self.token}-{name}"

    def record(self, attack: str, blocked: bool, evidence: str) -> None:
        self.rows.append({"attack": attack, "category": "sandbox", "as_user": self.as_user, "blocked": bool(blocked), "evidence": evidence[:500]})


def _summary(r: SandboxResult) -> str:
    tail = (r.stderr.strip().splitlines() or [""])[-1][:160]
    return f"{r.backend} {r.summary()}" + (f" ({tail})" if tail and not r.ok else "")


def _survivors(token: str) -> list[int]:
    """Host processes whose command line carries `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry))
    return found


class Listener:
    """A server socket that counts the connections it accepts (TCP or unix)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.accepted = sock, 0
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> int:
        time.sleep(0.3)  # a connection made just before the run returned is still counted
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return self.accepted


def _marker_attack(h: Harness, attack: str, where: Path, program: Callable[[Path], str]) -> None:
    marker = h.marker(where, attack)
    r = h.sandbox.run(program(marker))
    time.sleep(0.2)
    appeared = marker.exists()
    if appeared:
        marker.unlink()
    h.record(attack, not appeared, f"marker {marker} {'APPEARED' if appeared else 'absent'}; program: {_summary(r)}")


def attack_audit_hook_disabled(h: Harness) -> None:
    _marker_attack(
        h,
        "audit_hook_disabled_then_subprocess",
        h.scratch,
        lambda m: (
            "import sys, subprocess\n"
            "main = sys.modules['__main__']\n"
            "main._block = lambda what: None\n"  # the old sandbox's hook called this global
            f"subprocess.run(['/bin/sh', '-c', 'echo escaped > {m}'])\n"
        ),
    )


def attack_fork_exec(h: Harness) -> None:
    _marker_attack(
        h,
        "fork_exec_without_audit_event",
        h.scratch,
        lambda m: (
            "import _posixsubprocess, os\n"
            "r, w = os.pipe()\n"
            f"args = [b'/bin/sh', b'-c', b'echo escaped > {m}']\n"
            "common = (args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None)\n"
            "try:\n"
            "    pid = _posixsubprocess.fork_exec(*common, False)\n"
            "except TypeError:\n"
            "    pid = _posixsubprocess.fork_exec(*common)\n"
            "os.waitpid(pid, 0)\n"
        ),
    )


def attack_dir_fd(h: Harness) -> None:
    _marker_attack(
        h,
        "dir_fd_write_after_chdir",
        h.scratch,
        lambda m: (
            "import os\n"
            f"d = os.open({str(m.parent)!r}, os.O_RDONLY)\n"
            "os.chdir('/')\n"
            f"fd = os.open({m.name!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)\n"
            "os.write(fd, b'escaped')\n"
        ),
    )


def attack_write_tmp(h: Harness) -> None:
    _marker_attack(h, "write_host_tmp", Path(tempfile.gettempdir()), lambda m: f"open({str(m)!r}, 'w').write('escaped')\n")


def attack_write_home(h: Harness) -> None:
    _marker_attack(h, "write_host_home", h.home, lambda m: f"open({str(m)!r}, 'w').write('escaped')\n")


def attack_symlink(h: Harness) -> None:
    _marker_attack(
        h,
        "symlink_out_of_workdir",
        h.scratch,
        lambda m: f"import os\nos.symlink({str(m.parent)!r}, 'out')\nopen(os.path.join('out', {m.name!r}), 'w').write('escaped')\n",
    )


def attack_ctypes(h: Harness) -> None:
    _marker_attack(
        h,
        "native_code_write_via_ctypes",
        h.scratch,
        lambda m: (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"fd = libc.open({str(m).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)\n"
            "libc.write(fd, b'escaped', 7)\n"
        ),
    )


def _daemon_program(h: Harness, marker: Path, port: int, then: str) -> str:
    daemon = (
        "import socket, sys, time\n"
        "end = time.time() + 20\n"
        "while time.time() < end:\n"
        "    try:\n"
        f"        open({str(marker)!r}, 'w').write('alive')\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=0.2).close()\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.2)\n"
    )
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {daemon!r}, {h.token!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        f"{then}"
    )


def _daemon_attack(h: Harness, attack: str, then: str, limits: SandboxLimits) -> None:
    listener = Listener(socket.create_server(("127.0.0.1", 0)))
    marker = h.marker(h.scratch, attack)
    try:
        r = h.sandbox.run(_daemon_program(h, marker, listener.sock.getsockname()[1], then), limits)
        returned = time.monotonic()
        time.sleep(SURVIVOR_WAIT_S)
        survivors = _survivors(h.token)
    finally:
        accepted = listener.close()
    appeared = marker.exists()
    for pid in survivors:  # do not leave them running on the host
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    if appeared:
        marker.unlink()
    blocked = not survivors and not appeared and accepted == 0
    h.record(
        attack,
        blocked,
        f"{len(survivors)} process(es) alive {SURVIVOR_WAIT_S:.1f}s after the call returned "
        f"({time.monotonic() - returned:.1f}s); marker {'APPEARED' if appeared else 'absent'}; listener accepted {accepted}; program: {_summary(r)}",
    )


def attack_double_fork_setsid(h: Harness) -> None:
    _daemon_attack(h, "double_fork_setsid_outlives_program", "print('parent exits, daemon stays')\n", h.sandbox.limits)


def attack_double_fork_wall(h: Harness) -> None:
    limits = dataclasses.replace(h.sandbox.limits, wall_s=3.0)
    _daemon_attack(h, "double_fork_setsid_outlives_wall_limit", "import time\ntime.sleep(60)\n", limits)


def attack_fork_bomb(h: Harness) -> None:
    limit = h.sandbox.limits.max_processes
    code = (
        "import os, sys\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 30; :', {h.token!r}])\n"
        "    n += 1\n"
        "print('forked', n, flush=True)\n"
    )
    r = h.sandbox.run(code)
    time.sleep(SURVIVOR_WAIT_S)
    survivors = _survivors(h.token)
    for pid in survivors:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    forked = next((int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("forked ")), None)
    capped = forked is not None and forked < limit or forked is None and r.exit_code != 0
    h.record(
        "fork_bomb", capped and not survivors, f"forked {forked} processes (limit {limit}); {len(survivors)} alive afterwards; program: {_summary(r)}"
    )


def attack_memory_bomb(h: Harness) -> None:
    r = h.sandbox.run("x = bytearray(2 << 30)\nx[::4096] = b'x' * len(x[::4096])\nprint('allocated', len(x))\n")
    allocated = "allocated" in r.stdout
    h.record(
        "memory_bomb",
        not allocated,
        f"2 GiB allocation {'SUCCEEDED' if allocated else 'refused'} (limit {h.sandbox.limits.memory_bytes >> 20} MiB); program: {_summary(r)}",
    )


def attack_huge_file(h: Harness) -> None:
    code = (
        "import os\n"
        "total = 0\n"
        "chunk = b'x' * (1 << 20)\n"
        "try:\n"
        "    with open('big', 'wb') as f:\n"
        "        for _ in range(200):\n"
        "            f.write(chunk); f.flush(); total += len(chunk)\n"
        "except OSError as exc:\n"
        "    print('stopped:', type(exc).__name__)\n"
        "print('size', os.path.getsize('big'))\n"
    )
    r = h.sandbox.run(code)
    size = next((int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("size ")), None)
    cap = h.sandbox.limits.file_bytes
    blocked = size is not None and size <= cap or size is None and r.exit_code != 0
    h.record("huge_file", blocked, f"file grew to {size} bytes (cap {cap}); program: {_summary(r)}")


def attack_disk_fill(h: Harness) -> None:
    cap = h.sandbox.limits.disk_bytes
    code = (
        "total = 0\n"
        f"chunk = b'x' * {h.sandbox.limits.file_bytes // 2}\n"
        "try:\n"
        "    for i in range(400):\n"
        "        with open('f%d' % i, 'wb') as f:\n"
        "            f.write(chunk)\n"
        "        total += len(chunk)\n"
        "except OSError as exc:\n"
        "    print('stopped:', type(exc).__name__)\n"
        "print('total', total)\n"
    )
    r = h.sandbox.run(code)
    total = next((int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("total ")), None)
    blocked = total is not None and total <= cap or total is None and r.exit_code != 0
    h.record("disk_fill_many_files", blocked, f"wrote {total} bytes in files under the size cap (work dir cap {cap}); program: {_summary(r)}")


def attack_cpu_loop(h: Harness) -> None:
    r = h.sandbox.run("while True:\n    pass\n", dataclasses.replace(h.sandbox.limits, wall_s=CPU_LOOP_WALL_S))
    h.record(
        "cpu_loop",
        r.killed == "cpu_time",
        f"killed: {r.killed or 'no'} after {r.duration_s:.1f}s wall (CPU limit {h.sandbox.limits.cpu_s}s, exit {r.exit_code})",
    )


def attack_other_run(h: Harness) -> None:
    other_secret = f"OTHER-RUN-{secrets.token_hex(8)}"
    holder: dict[str, SandboxResult] = {}
    victim = threading.Thread(
        target=lambda: holder.update(
            r=h.sandbox.run(
                f"import os, time\nopen('secret.txt', 'w').write({other_secret!r})\nprint('written in', os.getcwd(), flush=True)\ntime.sleep(4)\n",
                dataclasses.replace(h.sandbox.limits, wall_s=15.0),
            )
        )
    )
    victim.start()
    time.sleep(1.0)
    r = h.sandbox.run(
        "import glob, os, time\n"
        "end = time.time() + 2\n"
        "while time.time() < end:\n"
        "    paths = glob.glob('/tmp/**/secret.txt', recursive=True) + glob.glob('/proc/*/cwd/secret.txt') + "
        "glob.glob('/proc/*/root/sandbox/secret.txt')\n"
        "    paths += glob.glob('/sandbox/**/secret.txt', recursive=True) + glob.glob('/var/tmp/**/secret.txt', recursive=True)\n"
        "    for p in paths:\n"
        "        try:\n"
        "            print(p, open(p).read(), flush=True)\n"
        "        except OSError as exc:\n"
        "            pass\n"
        "    time.sleep(0.2)\n",
        dataclasses.replace(h.sandbox.limits, wall_s=15.0),
    )
    victim.join(30)
    wrote = "written" in holder.get("r", SandboxResult(backend="unsafe", exit_code=None, stdout="", stderr="", duration_s=0.0)).stdout
    leaked = other_secret in r.stdout + r.stderr
    h.record(
        "read_other_run_files",
        not leaked,
        f"the concurrent run {'wrote' if wrote else 'did NOT confirm writing'} its secret file; "
        f"the other run {'READ IT' if leaked else 'did not see it'}; program: {_summary(r)}",
    )


def attack_nkey_seeds(h: Harness) -> None:
    state = os.environ["ROSE_STATE_DIR"]
    code = (
        "import glob, os\n"
        f"roots = [{state!r}, {str(h.scratch)!r}, './.rose', os.environ.get('ROSE_STATE_DIR', ''), '/state', '/creds', '/keys']\n"
        "for root in roots:\n"
        "    for p in glob.glob(os.path.join(root, '**', '*'), recursive=True):\n"
        "        try:\n"
        "            print(p, open(p, 'rb').read(200))\n"
        "        except Exception:\n"
        "            pass\n"
    )
    r = h.sandbox.run(code)
    leaked = [s[:6] + "..." for s in h.seeds if s in r.stdout + r.stderr]
    h.record("read_nkey_seeds_in_state_dir", not leaked, f"{len(leaked)} of {len(h.seeds)} seeds in the output {leaked}; program: {_summary(r)}")


def attack_parent_environ(h: Harness) -> None:
    code = (
        "import glob, os\n"
        "print(dict(os.environ))\n"
        "for p in [f'/proc/{os.getppid()}/environ', '/proc/1/environ'] + glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(p, open(p, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(p, type(exc).__name__)\n"
    )
    r = h.sandbox.run(code)
    leaked = h.secret in r.stdout + r.stderr
    h.record("read_parent_environ", not leaked, f"the worker's secret {'IS' if leaked else 'is not'} in the output; program: {_summary(r)}")


def _connect_attack(h: Harness, attack: str, listener: Listener, program: str) -> None:
    try:
        r = h.sandbox.run(program)
    finally:
        accepted = listener.close()
    h.record(attack, accepted == 0, f"listener accepted {accepted} connection(s); program: {_summary(r)}")


def attack_tcp_loopback(h: Harness) -> None:
    listener = Listener(socket.create_server(("127.0.0.1", 0)))
    port = listener.sock.getsockname()[1]
    _connect_attack(
        h,
        "tcp_to_host_loopback",
        listener,
        (
            "import socket, sys\n"
            "sys.modules['__main__']._block = lambda what: None\n"  # what disabled the old sandbox's audit hook
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\nprint('connected')\n"
        ),
    )


def _host_address() -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        s.close()


def attack_tcp_host_address(h: Harness) -> None:
    listener = Listener(socket.create_server(("0.0.0.0", 0)))
    port = listener.sock.getsockname()[1]
    addr = _host_address()
    _connect_attack(
        h, "tcp_to_host_address", listener, f"import socket\nsocket.create_connection(({addr!r}, {port}), timeout=2).close()\nprint('connected')\n"
    )


def attack_unix_socket(h: Harness) -> None:
    path = h.scratch / "worker.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o777)
    sock.listen(8)
    _connect_attack(
        h, "unix_socket_of_host", Listener(sock), f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\nprint('connected')\n"
    )


def attack_abstract_socket(h: Harness) -> None:
    name = f"\0rose-attack-{h.token}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    sock.listen(8)
    _connect_attack(
        h,
        "abstract_unix_socket_of_host",
        Listener(sock),
        f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({name!r})\nprint('connected')\n",
    )


def attack_signal_host_process(h: Harness) -> None:
    sleeper = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        r = h.sandbox.run(f"import os, signal\nos.kill({sleeper.pid}, signal.SIGKILL)\nprint('sent')\n")
        time.sleep(0.2)
        alive = sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    h.record("kill_a_host_process", alive, f"the worker's process {sleeper.pid} {'survived' if alive else 'WAS KILLED'}; program: {_summary(r)}")


def attack_nested_userns(h: Harness) -> None:
    r = h.sandbox.run(
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.unshare(0x10000000 | 0x20000) == 0:\n"  # CLONE_NEWUSER | CLONE_NEWNS: root again, mounts of its own
        "    print('nested root: capabilities', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "else:\n"
        "    print('refused', os.strerror(ctypes.get_errno()))\n"
    )
    regained = "nested root" in r.stdout
    h.record(
        "nested_user_namespace_regains_capabilities",
        not regained and "refused" in r.stdout,
        f"a nested user namespace was {'CREATED' if regained else 'refused'}: {r.stdout.strip()[:120]}; program: {_summary(r)}",
    )


ATTACKS: tuple[Callable[[Harness], None], ...] = (
    attack_audit_hook_disabled,
    attack_fork_exec,
    attack_dir_fd,
    attack_write_tmp,
    attack_write_home,
    attack_symlink,
    attack_ctypes,
    attack_double_fork_setsid,
    attack_double_fork_wall,
    attack_fork_bomb,
    attack_memory_bomb,
    attack_huge_file,
    attack_disk_fill,
    attack_cpu_loop,
    attack_other_run,
    attack_nkey_seeds,
    attack_parent_environ,
    attack_tcp_loopback,
    attack_tcp_host_address,
    attack_unix_socket,
    attack_abstract_socket,
    attack_signal_host_process,
    attack_nested_userns,
)


def _fake_seed(prefix: str) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(56))


def _child(as_user: str, backend: str, names: list[str]) -> list[dict]:
    """In the child: become `as_user`, set up the worker's secrets, run the attacks."""
    if as_user == "nobody" and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as a worker started as a non-root user is (setuid cleared it)
    scratch = Path(tempfile.mkdtemp(prefix="rose-attack-"))
    os.chmod(scratch, 0o755)
    home = Path(os.path.expanduser("~")) if os.geteuid() == 0 else scratch / "home"
    home.mkdir(exist_ok=True)
    state = scratch / ".rose"
    seeds = {"operator": _fake_seed("SO"), "account": _fake_seed("SA"), "rollout_worker": _fake_seed("SU"), "scheduler": _fake_seed("SU")}
    (state / "keys").mkdir(parents=True)
    for name, seed in seeds.items():
        path = state / "keys" / f"{name}.nk"
        path.write_text(seed + "\n")
        path.chmod(0o600)
    secret = os.environ["ROSE_ATTACK_SECRET"]  # in this process's environment since its exec, as a worker's credentials are
    os.environ.update({"ROSE_STATE_DIR": str(state), "HOME": str(home)})
    os.chdir(scratch)
    try:
        sandbox = Sandbox(backend, ATTACK_LIMITS)  # type: ignore[arg-type]
        h = Harness(sandbox, as_user, scratch, home, secret, list(seeds.values()), secrets.token_hex(8))
        for attack in ATTACKS:
            if not names or attack.__name__.removeprefix("attack_") in names:
                attack(h)
        return h.rows
    finally:
        os.chdir("/")
        shutil.rmtree(scratch, ignore_errors=True)


def run_sandbox_attacks(as_user: str, *, backend: str = "auto", only: list[str] | None = None) -> list[dict]:
    """Run every sandbox attack as `as_user` ("root" or "nobody") against `backend`; one row per attack.

    Runs in a child process (its environment, uid and working dir are the child's own).
    Raises SandboxUnavailable when no isolating backend can run, PermissionError when
    "root" is asked for by a non-root caller.
    """
    if as_user not in ("root", "nobody"):
        raise BenchOptionsError(f"as_user must be 'root' or 'nobody', not {as_user!r}")
    if as_user == "root" and os.geteuid() != 0:
        raise PermissionError("the sandbox attacks as root need a root caller")
    unknown = set(only or ()) - {a.__name__.removeprefix("attack_") for a in ATTACKS}
    if unknown:
        raise BenchOptionsError(f"unknown sandbox attacks {sorted(unknown)}; known: {[a.__name__.removeprefix('attack_') for a in ATTACKS]}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), ROSE_ATTACK_SECRET=f"WORKER-SECRET-{secrets.token_hex(12)}")
    cmd = [sys.executable, "-m", "rose.bench.sandbox_attacks", "--as-user", as_user, "--backend", backend]
    for name in only or []:
        cmd += ["--only", name]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S, cwd=tempfile.gettempdir())
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the sandbox attack runner failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}") from None
    if "unavailable" in answer:
        raise SandboxUnavailable(answer["unavailable"])
    return answer["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Child of run_sandbox_attacks: run the attacks, print one JSON line.")
    parser.add_argument("--as-user", choices=("root", "nobody"), required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        rows = _child(args.as_user, args.backend, args.only)
    except SandboxUnavailable as exc:
        print(json.dumps({"unavailable": str(exc)}))
        return 3
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
