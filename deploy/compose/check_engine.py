"""The compose check's Docker daemon: a running one new enough, or one of its own (data under a temporary directory).

Debian 12's engine is too old for docker-compose.yml; Debian 13's packages are unpacked into the
cache (not installed) and run beside the host's containerd and runc. A daemon started here runs
without a bridge or iptables (every service is on the host's network: host-network.yml) and is
stopped with all its data at the end; `leftovers` says what, if anything, stayed behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from check_common import DEPLOY, REPO, CheckFailed, debian_mirror, log, need, run
from check_images import IMAGES

COMPOSE_FILES = [REPO / "docker-compose.yml", DEPLOY / "host-network.yml"]
ENGINE_SUITE = "trixie"  # Debian 13: docker.io 26 and docker-compose 2.26, what the compose file needs
MIN_ENGINE, MIN_COMPOSE = (26, 0), (2, 24)  # volume subpath (API 1.45); `!reset`/`!override` in host-network.yml
HOST_PACKAGES = ["containerd", "runc", "tini", "debootstrap", "prometheus"]  # prometheus: promtool on the host
# What the compose file reads from the environment here: the images, and `rose demo`'s models (its policy
# is 1/20 of the default's: GRPO steps and weight versions in seconds on 2 shared cores)
COMPOSE_VARS = {**IMAGES, "ROSE_MODELS_PRESET": "demo"}


def _version(text: str) -> tuple[int, int]:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def host_packages() -> None:
    absent = [p for p in HOST_PACKAGES if run(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout.strip() != "install ok installed"]
    if absent:
        log(f"apt-get install {' '.join(absent)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *absent], env=env)


def engine_tools(cache: Path) -> tuple[Path, Path, Path]:
    """dockerd, docker and compose: the host's when new enough, else Debian 13's packages unpacked into the cache.

    Debian 12's docker.io (20.10) and docker-compose (1.29) reject docker-compose.yml (`name`,
    volume `subpath`: Engine >= 26, Compose >= 2.24); Debian 13's run on Debian 12 (libc >= 2.34)
    beside its containerd and runc. Unpacked (dpkg -x), not installed: the host's packages stay.
    """
    host = {n: shutil.which(n) for n in ("dockerd", "docker")}
    if all(host.values()):
        dv = _version(run([host["dockerd"], "--version"], check=False).stdout)  # type: ignore[list-item]
        cv = _version(run([host["docker"], "compose", "version"], check=False).stdout)  # type: ignore[list-item]
        if dv >= MIN_ENGINE and cv >= MIN_COMPOSE:
            return Path(host["dockerd"]), Path(host["docker"]), Path(host["docker"])  # type: ignore[arg-type]
    root = cache / f"engine-{ENGINE_SUITE}"
    dockerd, docker, compose = root / "usr/sbin/dockerd", root / "usr/bin/docker", root / "usr/libexec/docker/cli-plugins/docker-compose"
    if not (dockerd.exists() and docker.exists() and compose.exists()):
        apt = cache / f"apt-{ENGINE_SUITE}"
        (apt / "lists/partial").mkdir(parents=True, exist_ok=True)
        (apt / "archives/partial").mkdir(parents=True, exist_ok=True)
        (apt / "sources.list").write_text(f"deb {debian_mirror()} {ENGINE_SUITE} main\n")
        opts = [
            f"-oDir::Etc::SourceList={apt / 'sources.list'}",
            "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State::Lists={apt / 'lists'}",
            f"-oDir::Cache::Archives={apt / 'archives'}",
            "-oAPT::Sandbox::User=root",
        ]
        run(["apt-get", *opts, "update", "-qq"])
        run(["apt-get", *opts, "download", "docker.io", "docker-cli", "docker-compose"], cwd=apt)
        for deb in apt.glob("*.deb"):
            run(["dpkg-deb", "-x", str(deb), str(root)])
            deb.unlink()
    need(_version(run([str(dockerd), "--version"]).stdout) >= MIN_ENGINE, f"{dockerd} is older than Engine {MIN_ENGINE}")
    return dockerd, docker, compose


@dataclass
class Engine:
    """A Docker daemon to talk to: one already running (left running) or one started here (stopped here)."""

    docker: Path
    compose_bin: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    root: Path | None = None

    @classmethod
    def start(cls, dockerd: Path, docker: Path, compose_bin: Path) -> Engine:
        env = dict(os.environ)
        probe = run([str(docker), "version", "--format", "{{.Server.Version}}"], env=env, check=False, timeout=20)
        if probe.returncode == 0 and _version(probe.stdout) >= MIN_ENGINE:
            log(f"using the running Docker Engine {probe.stdout.strip()}")
            return cls(docker, compose_bin, env)
        root = Path(tempfile.mkdtemp(prefix="rose-dockerd-"))
        sock = root / "docker.sock"
        path = os.pathsep.join([str(dockerd.parent), str(docker.parent), os.environ.get("PATH", "")])
        # docker-init: Debian's tini-static (dockerd looks for it on PATH)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        tini = shutil.which("tini-static") or shutil.which("tini")
        if tini:
            (bin_dir / "docker-init").symlink_to(tini)
        denv = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{path}")
        logf = open(root / "dockerd.log", "w")  # noqa: SIM115 - the daemon's, closed when it stops
        proc = subprocess.Popen(
            [
                str(dockerd),
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                "--data-root",
                str(root / "data"),
                "--exec-root",
                str(root / "exec"),
                "--pidfile",
                str(root / "dockerd.pid"),
                "-H",
                f"unix://{sock}",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=denv,
            start_new_session=True,
        )
        env = dict(os.environ, DOCKER_HOST=f"unix://{sock}", PATH=denv["PATH"])
        engine = cls(docker, compose_bin, env, proc, root)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise CheckFailed(f"dockerd exited {proc.returncode}:\n{(root / 'dockerd.log').read_text()[-2000:]}")
                probe = run([str(docker), "version", "--format", "{{.Server.Version}}"], env=env, check=False, timeout=10)
                if probe.returncode == 0 and probe.stdout.strip():
                    break
                if time.monotonic() > deadline:
                    raise CheckFailed("dockerd did not answer within 60 s")
                time.sleep(0.5)
            info = probe.stdout.strip()
            driver = run([str(docker), "info", "--format", "{{.Driver}}"], env=env).stdout.strip()
        except BaseException:
            engine.stop()
            raise
        log(f"started dockerd {info} ({driver}, --bridge=none --iptables=false, data under {root})")
        return engine

    def docker_cmd(self, *args: str, check: bool = True, timeout: float | None = None, capture: bool = True):
        return run([str(self.docker), *args], env=self.env, check=check, timeout=timeout, capture=capture)

    def compose(self, *args: str, extra: Iterable[Path] = (), check: bool = True, timeout: float | None = 600, capture: bool = True):
        files = [a for f in [*COMPOSE_FILES, *extra] for a in ("-f", str(f))]
        env = dict(self.env, **COMPOSE_VARS)
        # the host's `docker compose` plugin, or Debian 13's plugin binary run on its own (standalone mode)
        prefix = [str(self.docker), "compose"] if self.compose_bin == self.docker else [str(self.compose_bin)]
        return run(
            [*prefix, *files, "--project-directory", str(REPO), *args],
            env=env,
            check=check,
            timeout=timeout,
            capture=capture,
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.root is not None:
            for mnt in reversed(_mounts_under(self.root)):  # overlay and shm mounts a killed daemon leaves
                subprocess.run(["umount", "-l", mnt], capture_output=True)
            stopped = time.monotonic()
            shutil.rmtree(self.root, ignore_errors=True)
            log(f"dockerd stopped, its data removed ({time.monotonic() - stopped:.1f} s to remove)")


def _mounts_under(root: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4]
        if target.startswith(str(root)):
            out.append(target)
    return out


def leftovers(engine: Engine | None) -> list[str]:
    """What the check left behind: a bridge, its daemon, that daemon's data or mounts, another check's daemon."""
    out = []
    if Path("/sys/class/net/docker0").exists():
        out.append("docker0 bridge")
    if engine is not None and engine.proc is not None:
        if engine.proc.poll() is None:
            out.append(f"dockerd pid {engine.proc.pid}")
        if engine.root is not None and engine.root.exists():
            out.append(str(engine.root))
        if engine.root is not None and _mounts_under(engine.root):
            out.append(f"mounts under {engine.root}")
    ours = run(["pgrep", "-f", "rose-dockerd-"], check=False).stdout.split()
    out += [f"process {p} of a check's dockerd" for p in ours if int(p) != os.getpid()]
    return out
