"""Runs an agent script once per episode, each in a child forked from one warm interpreter.

    python -m rose.services.gateway.zygote SCRIPT

Why: an agent is an ordinary program (`python agent.py "What is 3+4?"`), but starting one costs the
interpreter and its imports every time (`import openai` alone is ~2 s of CPU on a 2-core machine),
which at dozens of episodes a step would take the machine from the serving executors. This process
imports what the script imports once (its top-level imports, read from its source) and then forks a
child per episode that runs the script as `__main__` with the episode's environment and arguments:
starting an agent costs a fork.

Protocol (JSON lines): stdin `{"op": "launch", "id", "env": {...}, "argv": [...], "log": PATH}` and
`{"op": "kill", "id"}`; stdout `{"event": "started", "id", "pid"}` and `{"event": "exited", "id",
"code"}` (a signal: minus its number). EOF on stdin (the gateway went away) kills every child; so does
this process's death (each child asks the kernel for SIGKILL when its parent dies), and this process
dies with the gateway the same way.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import sys
import traceback
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
REAP_INTERVAL_S = 0.05


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def imported_modules(script: Path) -> list[str]:
    """The modules a script imports at its top level (and inside its top-level `if`/`try`), in order."""
    tree = ast.parse(script.read_text(), filename=str(script))
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                for extra in (getattr(node, "orelse", []), *(h.body for h in getattr(node, "handlers", []))):
                    visit(extra)

    visit(tree.body)
    return list(dict.fromkeys(names))


def preload(script: Path) -> None:
    sys.path.insert(0, str(script.parent))
    for name in imported_modules(script):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the script itself will say what is missing, in its episode's log
            print(f"zygote: cannot preload {name}: {exc!r}", file=sys.stderr, flush=True)


def run_child(script: Path, env: dict[str, str], argv: list[str], log: str) -> None:
    """In the forked child: its own process group, its log as stdout/stderr, the episode's environment; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        die_with_parent()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.update(env)
        sys.argv = [str(script), *argv]
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rose.services.gateway.zygote SCRIPT", file=sys.stderr)
        return 2
    script = Path(argv[0]).resolve()
    die_with_parent()
    out = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout; anything printed while importing goes to stderr
    os.dup2(2, 1)
    preload(script)
    children: dict[int, str] = {}

    def say(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    say({"event": "ready", "pid": os.getpid()})
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    pending = b""
    while True:
        ready = selector.select(timeout=REAP_INTERVAL_S)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                for pid in children:
                    _kill(pid)
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                order = json.loads(line)
                if order["op"] == "launch":
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        run_child(script, order["env"], order["argv"], order["log"])
                    _own_group(pid)  # as the child does: whichever runs first, a kill finds the group
                    children[pid] = order["id"]
                    say({"event": "started", "id": order["id"], "pid": pid})
                elif order["op"] == "kill":
                    for pid, eid in children.items():
                        if eid == order["id"]:
                            _kill(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                eid = children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                say({"event": "exited", "id": eid, "code": code})


def _own_group(pid: int) -> None:
    try:
        os.setpgid(pid, pid)
    except (ProcessLookupError, PermissionError):  # it already ran exec-free to its end, or set it itself
        pass


def _kill(pid: int) -> None:
    """The child and whatever it started (its process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
