"""What every part of the compose check uses: the repository's paths, the log line, a command run, a failed step.

deploy/compose/check.py and its parts beside it (check_engine.py, check_images.py, check_cluster.py)
run as scripts in the project's .venv (scripts/compose-check), not as a package: they import one
another by module name, with this folder on sys.path (check.py puts it there).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from rose.shared.errors import RoseError  # (the check runs in the project's .venv: scripts/compose-check)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "compose"


def log(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class CheckFailed(RoseError, RuntimeError):
    """A step of the compose check did not hold: what, and the logs that show why."""


def need(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def run(cmd: list[str], *, env: dict[str, str] | None = None, check: bool = True, capture: bool = True, timeout: float | None = None, **kw):
    out = subprocess.run(cmd, env=env, capture_output=capture, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        tail = ((out.stdout or "") + (out.stderr or ""))[-3000:] if capture else ""
        raise CheckFailed(f"{' '.join(cmd[:6])} ... exited {out.returncode}:\n{tail}")
    return out


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses (its sources), for debootstrap and Debian 13's engine packages."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if not path.is_file():
            continue
        text = path.read_text()
        for m in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if not m.group(1).rstrip("/").endswith("-security"):
                return m.group(1).rstrip("/")
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", text, re.M):
            if not m.group(1).rstrip("/").endswith("-security"):
                return m.group(1).rstrip("/")
    raise CheckFailed("no Debian mirror in /etc/apt/sources.list{,.d}: this check needs Debian's packages")
