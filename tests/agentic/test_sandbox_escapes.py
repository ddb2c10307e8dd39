"""The code sandbox holds each escape attempt, with a clear reason, and says which backend ran."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from rose.shared.agentic.sandbox import DockerBackend, Sandbox, SandboxLimits

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=1, memory_bytes=256 << 20, max_output_bytes=8 << 10, file_bytes=1 << 20)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox("subprocess", LIMITS)


def test_a_plain_program_runs_and_the_backend_is_recorded(sandbox):
    r = sandbox.run("print(sum(range(10)))")
    assert r.ok and r.stdout == "45\n" and r.backend == "subprocess"
    assert {"rlimit_cpu", "rlimit_as", "wall_time", "output_limit", "audit_hook", "own_tmp_dir"} <= set(r.enforced)
    if "uid_nobody" in r.enforced:  # as root: the kernel's permission checks back the hook
        r = sandbox.run("import os; print(os.getuid(), os.getgid())\ntry:\n    os.listdir('/root')\nexcept PermissionError:\n    print('denied')")
        assert r.ok and r.stdout.split() == ["65534", "65534", "denied"] and not r.blocked


def test_its_own_dir_is_writable_and_nothing_else(sandbox, tmp_path):
    outside = Path("/tmp") / f"rose-escape-{os.getpid()}.txt"
    r = sandbox.run("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())")
    assert r.ok and r.stdout == "x\n"
    for attempt in (
        f"open({str(outside)!r}, 'w').write('escaped')",
        f"import os; os.close(os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT))",
        "import os; os.symlink('/etc', 'etc_link'); open('etc_link/rose-escape', 'w')",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        f"import os; d = os.open('/tmp', os.O_RDONLY); os.open({outside.name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=d)",
    ):
        r = sandbox.run(attempt)
        assert not r.ok and r.blocked, attempt
        assert "outside the sandbox dir" in r.blocked[0], r.blocked
    assert not outside.exists() and tmp_path.exists()


def test_no_network_even_to_a_server_on_this_host(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    server.settimeout(5.0)

    def accept() -> None:
        try:
            accepted.append(server.accept()[0])
        except OSError:  # timed out, or closed by the test: nobody connected
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        r = sandbox.run(f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')")
        assert not r.ok and "connected" not in r.stdout
        assert r.blocked and "network socket" in r.blocked[0]
        r = sandbox.run("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)")
        assert not r.ok and r.blocked and "network" in r.blocked[0]
    finally:
        server.close()
        t.join(10)
    assert not accepted
    if "netns" in sandbox.run("pass").enforced:  # the kernel layer under the hook: only a loopback exists
        r = sandbox.run("import socket; print([n for _, n in socket.if_nameindex()])")
        assert r.ok and r.stdout.strip() == "['lo']"


def test_a_fork_bomb_and_subprocesses_are_refused(sandbox):
    r = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert not r.ok and r.blocked == ["process creation (os.fork)"]
    r = sandbox.run("import subprocess; subprocess.run(['sh', '-c', ':(){ :|:& };:'])")
    assert not r.ok and r.blocked == ["process creation (subprocess.Popen)"]
    r = sandbox.run("import os; os.system('echo hi')")
    assert not r.ok and r.blocked == ["process creation (os.system)"]
    r = sandbox.run("import ctypes")  # the easy way around the audit hook
    assert not r.ok and "native code loader" in r.blocked[0]


def test_endless_output_is_cut_at_the_limit(sandbox):
    r = sandbox.run("while True:\n    print('y' * 100)")
    assert r.killed == "output_limit" and len(r.stdout) <= LIMITS.max_output_bytes


def test_an_infinite_loop_hits_the_cpu_limit_and_a_sleeper_the_wall_clock(sandbox):
    r = sandbox.run("while True:\n    pass")
    assert r.killed == "cpu_time" and not r.ok
    r = sandbox.run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=1))
    assert r.killed == "wall_time" and r.duration_s < 30


def test_a_memory_bomb_fails_inside_its_limit(sandbox):
    r = sandbox.run("x = bytearray(2 << 30)\nprint(len(x))")
    assert r.killed == "memory" and "MemoryError" in r.stderr


def test_the_program_cannot_read_its_harness_back(sandbox):
    r = sandbox.run("import os; print(sorted(os.listdir('.')))")
    assert r.ok and r.stdout.strip() == "[]"


def test_docker_backend_when_an_engine_is_reachable():
    if not DockerBackend.available():
        pytest.skip("no Docker engine reachable (or the `docker` SDK is not installed): the docker backend cannot run here")
    sandbox = Sandbox("docker", LIMITS)
    r = sandbox.run("print(6 * 7)")
    assert r.backend == "docker" and r.ok and r.stdout.strip() == "42"
    r = sandbox.run("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert not r.ok
