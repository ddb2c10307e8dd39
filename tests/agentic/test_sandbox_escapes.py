"""The code sandbox holds every known escape, judged from outside; without isolation the code env refuses.

The attacks live in rose.bench.sandbox_attacks (`rose bench security` runs the same
ones); each row's `blocked` comes from an observable effect (no marker file outside, no
connection at a listener, no secret in the output, no process left alive, a limit held).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from rose.bench.sandbox_attacks import ATTACKS, run_sandbox_attacks
from rose.services.rollout_worker.config import RolloutWorkerConfig
from rose.shared.agentic import sandbox as sandbox_module
from rose.shared.agentic.env_code import CodeEnv
from rose.shared.agentic.sandbox import DockerBackend, Sandbox, SandboxLimits, SandboxUnavailable
from rose.shared.agentic.tools import EnvironmentFailure, format_answer
from rose.shared.config import ConfigError, load_config

LIMITS = SandboxLimits(wall_s=8.0, cpu_s=1, memory_bytes=256 << 20, max_output_bytes=8 << 10, file_bytes=1 << 20, disk_bytes=4 << 20)
USERS = ("root", "nobody")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox("subprocess", LIMITS)


@pytest.fixture(scope="module")
def attack_rows() -> dict[str, list[dict]]:
    """Every attack as root and as nobody (the shipped container's case), both at once: they mostly wait.

    As a non-root caller, "nobody" runs as that caller's own uid and "root" cannot run."""
    users = USERS if os.geteuid() == 0 else ("nobody",)
    with ThreadPoolExecutor(len(users)) as pool:
        return dict(zip(users, pool.map(run_sandbox_attacks, users)))


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the tests do not run as root here: the attacks as root cannot run")


@pytest.mark.parametrize("as_user", [pytest.param(u, marks=AS_ROOT) if u == "root" else u for u in USERS])
def test_every_escape_is_blocked(attack_rows, as_user):
    rows = attack_rows[as_user]
    assert len(rows) == len(ATTACKS) >= 20 and {r["as_user"] for r in rows} == {as_user}
    assert {r["category"] for r in rows} == {"sandbox"}
    escaped = [f"{r['attack']}: {r['evidence']}" for r in rows if not r["blocked"]]
    assert not escaped, escaped


def test_the_attacks_do_escape_a_sandbox_without_isolation():
    # The same attacks against the audit-hook sandbox that was replaced: they must be able to fail.
    only = ["audit_hook_disabled", "fork_exec", "nkey_seeds", "parent_environ", "tcp_loopback", "signal_host_process"]
    rows = run_sandbox_attacks("nobody", backend="unsafe", only=only)
    assert [r["attack"] for r in rows if not r["blocked"]] == [
        "audit_hook_disabled_then_subprocess",
        "fork_exec_without_audit_event",
        "read_nkey_seeds_in_state_dir",
        "read_parent_environ",
        "tcp_to_host_loopback",
        "kill_a_host_process",
    ], rows


def test_a_program_sees_only_its_own_namespaces(sandbox):
    r = sandbox.run(
        "import os, socket\n"
        "open('mine.txt', 'w').write('x')\n"
        "print(open('mine.txt').read(), os.getcwd(), os.environ['HOME'], os.getuid())\n"
        "print(sorted(os.listdir('/')))\n"
        "print([n for _, n in socket.if_nameindex()], socket.gethostname())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) if os.path.exists('/proc/self') else 'no-proc')\n"
    )
    assert r.ok and r.backend == "subprocess", r.stderr
    mine, root, net, procs = r.stdout.splitlines()
    assert mine == "x /sandbox /sandbox 1000"
    assert set(eval(root)) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sandbox", "sbin", "usr"}  # noqa: S307 - our own print
    assert net == "['lo'] sandbox"
    assert procs == "no-proc" or eval(procs) == [1, 2]  # noqa: S307 - the launcher (PID 1) and the program, nothing of the host
    assert {"userns", "pidns", "netns", "mountns", "no_capabilities", "rlimit_nproc", "clean_env"} <= set(r.enforced)


def test_the_program_cannot_read_its_harness_back(sandbox):
    r = sandbox.run("import os; print(sorted(os.listdir('.')))")
    assert r.ok and r.stdout.strip() == "[]"


def test_endless_output_is_cut_at_the_limit(sandbox):
    r = sandbox.run("while True:\n    print('y' * 100)")
    assert r.killed == "output_limit" and len(r.stdout) <= LIMITS.max_output_bytes


def test_a_sleeper_is_stopped_at_the_wall_clock(sandbox):
    r = sandbox.run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=1))
    assert r.killed == "wall_time" and r.exit_code is None and r.duration_s < 30


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="disk_bytes must be positive"):
        SandboxLimits(disk_bytes=0)  # tmpfs size=0 would mean unbounded


def test_the_code_env_refuses_without_an_isolating_backend_unless_unsafe():
    # "No backend" through the sandbox's own configuration: auto may use none of docker / subprocess.
    with pytest.raises(SandboxUnavailable, match="no isolating sandbox backend"):
        Sandbox("auto", LIMITS, auto_order=())
    env = CodeEnv(auto_order=())
    task = env.task(3, task_id="c-3")
    with pytest.raises(EnvironmentFailure, match="user namespaces.*unsafe") as refused:
        env.reset(task)
    assert "docs/sandbox.md" in str(refused.value)
    assert "no isolating sandbox backend" in env.use_sandbox("auto")
    # Only when unsafe is asked for by name does it run, and the result says so.
    unsafe = CodeEnv(sandbox_backend="unsafe", auto_order=())
    assert unsafe.reset(task).endswith("assistant\n")
    assert unsafe.step(task, 1, format_answer(unsafe.problem(3).answer), "stop", ["stop"]).reward == 1.0
    assert unsafe.run_tests(unsafe.problem(3).answer, unsafe.problem(3).data).sandbox.backend == "unsafe"
    assert env.use_sandbox("unsafe") == "" and env.sandbox.name == "unsafe"
    # The default finds the kernel's isolation here.
    assert CodeEnv().use_sandbox("auto") == ""


def test_the_worker_config_names_the_backend():
    assert load_config(RolloutWorkerConfig, env={}).sandbox.backend == "auto"
    assert load_config(RolloutWorkerConfig, env={"ROSE_SANDBOX__BACKEND": "unsafe"}).sandbox.backend == "unsafe"
    with pytest.raises((ConfigError, msgspec.ValidationError), match="sandbox"):
        load_config(RolloutWorkerConfig, env={"ROSE_SANDBOX__BACKEND": "none"})


def test_docker_backend_when_an_engine_is_reachable():
    if not DockerBackend.available():
        pytest.skip("no Docker engine reachable (or the `docker` SDK is not installed): the docker backend cannot run here")
    sandbox = Sandbox("docker", LIMITS)
    r = sandbox.run("print(6 * 7)")
    assert r.backend == "docker" and r.ok and r.stdout.strip() == "42"
    r = sandbox.run("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert not r.ok


def test_a_kernel_that_refuses_namespaces_means_no_sandbox_not_a_weaker_one(sandbox):
    # Inside the sandbox the kernel refuses new user namespaces (max_user_namespaces = 0 there):
    # the sandbox module, run in it, must refuse to start rather than run the program unconfined.
    # the module alone, without the package (not importable in there): its one project import, the error base, inlined
    source = Path(sandbox_module.__file__).read_text()
    assert "from rose.shared.errors import RoseError\n" in source
    source = source.replace("from rose.shared.errors import RoseError\n", "class RoseError(Exception):\n    pass\n", 1)
    program = source + (
        "\ntry:\n"
        "    Sandbox('auto', auto_order=('subprocess',))\n"
        "    print('STARTED')\n"
        "except SandboxUnavailable as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    r = sandbox.run(program.replace("from __future__ import annotations\n", "", 1), SandboxLimits(wall_s=60.0, cpu_s=20, memory_bytes=512 << 20))
    assert "STARTED" not in r.stdout, r.stdout
    assert r.stdout.startswith("REFUSED no isolating sandbox backend") and "unshare" in r.stdout, (r.stdout, r.stderr[-500:])
