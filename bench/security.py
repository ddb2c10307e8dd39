"""`rose bench security`: every known attack on ROSE's boundaries, tried against real processes.

Each row is one attack, judged "blocked" from what can be observed afterwards, never from an
exception alone:

* **bus** (a real nats-server with the per-service NKey users `rose security init` writes): for
  each request channel x each of its requesters' credentials, a request whose reply subject
  points at `$JS.API.STREAM.DELETE.KV_rose_leases`, `$JS.API.STREAM.PURGE.ROSE_EVENTS`, a forged
  lease key (`$KV.rose_leases.*`), another service's subject (a core event and a stream subject)
  and the inbox of a service that may not ask on that channel; garbage payloads (the error answer)
  and valid ones (the handler's answer); `$SRV.PING` with such a reply; and the same against a
  server without permissions, where only the bus's own reply check stands. Blocked: the bucket
  still exists and holds no forged key, the stream was not purged and holds nothing on the forged
  subject, the listener on the other subject or inbox received nothing;
* **unpickler** (`update_weights_from_tensor` payloads): file descriptors (`DupFd`,
  `rebuild_storage_fd`) dialing a TCP listener, a shm-manager socket of the payload's choosing, a
  file name outside torch's segments or a link to a secret, an oversized storage, a wrong shape, a
  wrong dtype, a direct allocation, a classic `os.system`. Blocked: the listener got no
  connection, no marker file, the secret is not in the answer, the peak RSS did not grow, the live
  weights did not change (full run: through the executor's real HTTP server);
* **http**: request heads at 1 byte/s and a silent connection (closed by the server within the
  head deadline + 3 s), admin key missing or wrong (401 and the weights unchanged);
* **sandbox**: the code sandbox's escapes (bench/sandbox_attacks.py), as root and as nobody;
* **gateway** (the rollout gateway's agent API, its real runner and HTTP server before a canned
  executor): another episode's key, no key, `Bearer None`, a key one character off, its prefix, a key in
  the wrong header, the key of an episode that has ended (401 or 403, and nothing sampled in any
  episode), an oversized body (413, nothing sampled), request heads at 1 byte/s and a silent connection
  (closed within the head deadline + 3 s), and an agent looking for the gateway's bus credentials in its
  environment, forked and spawned (none of them there).

`--quick` (the test suite's): fewer bus combinations, the unpickler without the HTTP engine, a
short head deadline, a few sandbox escapes (``SecurityOptions``).

The bus attacks are bench/security_bus.py's; the sandbox escapes bench/sandbox_attacks.py's.
"""

from __future__ import annotations

import asyncio
import base64
import getpass
import hashlib
import json
import os
import pickle
import resource
import secrets
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .security_bus import bus_part

LISTEN_WAIT_S = 1.0  # after a payload was refused: time for a dial-back to reach the listener
HEAD_GRACE_S = 3.0  # the server must close a slow head within its deadline plus this
QUICK_HEAD_TIMEOUT_S = 1.0
QUICK_SANDBOX_ATTACKS = ("audit_hook_disabled", "fork_exec", "nkey_seeds", "parent_environ", "tcp_loopback", "dir_fd")


@dataclass(frozen=True, kw_only=True)
class SecurityOptions:
    """What a `rose bench security` run tries: ``quick``, the test suite's subset (module docstring); without
    ``include_sandbox`` the code sandbox's escapes are left out."""

    quick: bool = False
    include_sandbox: bool = True


@dataclass
class Rows:
    rows: list[dict] = field(default_factory=list)

    def add(self, attack: str, category: str, as_user: str, blocked: bool, evidence: str) -> None:
        self.rows.append({"attack": attack, "category": category, "as_user": as_user, "blocked": bool(blocked), "evidence": evidence[:600]})


# ---- listeners: did anything dial back? ----------------------------------------------------


class Listener:
    """A TCP or unix-socket listener that counts the connections it accepted."""

    def __init__(self, unix_path: str | None = None) -> None:
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(unix_path)
            self.address: Any = unix_path
        else:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.address = self.sock.getsockname()
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()


# ---- unpickler payloads ------------------------------------------------------------------------


class _Reduce:
    """Pickles as `fn(*args)` (plus `state`): how an attacker writes a payload by hand."""

    def __init__(self, fn: Any, args: tuple, state: Any = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self) -> tuple:
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _b64(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode("ascii")


def _tensor_on(storage: Any, shape: tuple[int, ...]) -> Any:
    import torch
    import torch.multiprocessing.reductions as r

    stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) if i + 1 < len(shape) else 1 for i in range(len(shape)))
    typed = _Reduce(r.rebuild_typed_storage, (storage, torch.float32))
    return _Reduce(r.rebuild_tensor, (torch.Tensor, typed, (0, torch.Size(shape), stride, False)))


def payload_dupfd(address: Any, name: str, shape: tuple[int, ...]) -> str:
    """A storage behind a file descriptor the receiver fetches from `address` (multiprocessing's resource sharer)."""
    import torch
    import torch.multiprocessing.reductions as r

    dup = _dupfd(address)
    nbytes = 4 * int(torch.Size(shape).numel())
    return _b64([(name, _tensor_on(_Reduce(r.rebuild_storage_fd, (torch.UntypedStorage, dup, nbytes)), shape))])


def payload_bare_dupfd(address: Any) -> str:
    """Only a DupFd (unpickled, then detached by whoever reads it)."""
    return _b64([("w", _dupfd(address))])


def _dupfd(address: Any) -> Any:
    """A genuine DupFd (pickled as multiprocessing does) whose fd is to be fetched from `address`."""
    from multiprocessing.resource_sharer import DupFd

    dup = DupFd.__new__(DupFd)
    dup.__dict__["_id"] = (address, 1)  # the private field its unpickling dials
    return dup


def payload_filename(manager: bytes, handle: bytes, nbytes: int, name: str, shape: tuple[int, ...]) -> str:
    """torch's file_system format: the receiver connects to `manager` (a socket path) and maps `handle`."""
    import torch
    import torch.multiprocessing.reductions as r

    return _b64([(name, _tensor_on(_Reduce(r.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, nbytes)), shape))])


def payload_call(fn: Any, *args: Any) -> str:
    return _b64([("w", _Reduce(fn, args))])


def payload_tensors(named: list) -> str:
    from rose.services.executor.sglang_tensors import serialize_named_tensors

    return serialize_named_tensors(named)


@dataclass
class UnpicklerTarget:
    """Where payloads go: `push(b64) -> (refused, answer text)`, and the live weights' digest."""

    push: Callable[[str], Awaitable[tuple[bool, str]]]
    digest: Callable[[], Awaitable[str]]
    params: dict[str, Any]  # name -> live tensor
    via: str


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def unpickler_attacks(rows: Rows, target: UnpicklerTarget, scratch: Path, as_user: str) -> None:
    """Every unpickler payload against `target`; each judged by the listener, the marker, RSS, the secret, the weights."""
    import torch

    name, live = max(target.params.items(), key=lambda kv: kv[1].numel())
    shape = tuple(live.shape)
    small = next(((n, t) for n, t in target.params.items() if t.dim() == 1), (name, live))
    alive: list = []  # real tensors behind a payload stay alive until it was answered (their /dev/shm segments with them)

    def tensors(named: list) -> str:
        alive.append(named)
        return payload_tensors(named)

    async def attempt(attack: str, payload: str, extra: Callable[[str], tuple[bool, str]] | None = None, listener: Listener | None = None) -> None:
        before, rss = await target.digest(), _peak_rss_bytes()
        refused, answer = await target.push(payload)
        await asyncio.sleep(LISTEN_WAIT_S if listener is not None else 0)
        after, grown = await target.digest(), _peak_rss_bytes() - rss
        ok, notes = (
            refused and before == after,
            [
                f"{'refused' if refused else 'ACCEPTED'} via {target.via}: {answer[:160]!r}",
                f"weights {'unchanged' if before == after else 'CHANGED'}",
            ],
        )
        if listener is not None:
            ok &= listener.connections == 0
            notes.append(f"listener connections: {listener.connections}")
        if extra is not None:
            good, note = extra(answer)
            ok &= good
            notes.append(note)
        notes.append(f"peak RSS +{grown >> 20} MiB")
        rows.add(attack, "unpickler", as_user, ok, "; ".join(notes))

    tcp = Listener()
    sock_path = str(scratch / f"mgr-{secrets.token_hex(4)}.sock")
    unix = Listener(unix_path=sock_path)
    try:
        await attempt("DupFd storage dialing a TCP listener (rebuild_storage_fd)", payload_dupfd(tcp.address, name, shape), listener=tcp)
        await attempt("bare DupFd dialing a TCP listener", payload_bare_dupfd(tcp.address), listener=tcp)
        await attempt("DupFd dialing a unix socket", payload_dupfd(sock_path, name, shape), listener=unix)
        pid = os.getpid()
        await attempt(
            "shm storage naming a manager socket of the payload's choice (rebuild_storage_filename)",
            payload_filename(sock_path.encode(), f"/torch_{pid}_1_0".encode(), live.numel() * 4, name, shape),
            listener=unix,
        )
        secret = f"ROSE-SECRET-{secrets.token_hex(16)}"
        secret_file = Path("/dev/shm") / f"rose-secret-{secrets.token_hex(6)}"
        secret_file.write_bytes((secret * 64).encode())
        link = Path("/dev/shm") / f"torch_{pid}_{secrets.randbelow(10**9)}_7"
        link.symlink_to(secret_file)
        no_secret = lambda answer: (secret not in answer, "secret not in the answer" if secret not in answer else "SECRET LEAKED")  # noqa: E731
        try:
            n = len(secret) * 64 // 4 * 4
            await attempt(
                "file name outside torch's segments (/dev/shm/<secret>)",
                payload_filename(b"", f"/{secret_file.name}".encode(), n, small[0], (n // 4,)),
                no_secret,
            )
            await attempt(
                "path traversal in the segment name", payload_filename(b"", f"/../../{secret_file}".encode(), n, small[0], (n // 4,)), no_secret
            )
            await attempt(
                "torch-named segment that is a link to a secret", payload_filename(b"", f"/{link.name}".encode(), n, small[0], (n // 4,)), no_secret
            )
        finally:
            link.unlink(missing_ok=True)
            secret_file.unlink(missing_ok=True)
        huge = 16 << 30
        rss0 = _peak_rss_bytes()
        no_alloc = lambda answer: (_peak_rss_bytes() - rss0 < huge // 4, "no allocation of the claimed size")  # noqa: E731
        await attempt("oversized storage (16 GiB claimed)", payload_filename(b"", f"/torch_{pid}_2_0".encode(), huge, name, shape), no_alloc)
        rss0 = _peak_rss_bytes()
        await attempt("direct allocation torch.UntypedStorage(16 GiB) in the pickle", payload_call(torch.UntypedStorage, huge), no_alloc)
        rss0 = _peak_rss_bytes()
        await attempt("direct allocation torch.Tensor(4G elements) in the pickle", payload_call(torch.Tensor, huge // 4), no_alloc)
        wrong = (shape[0] + 1, *shape[1:])
        await attempt("wrong shape for a real parameter", tensors([(name, torch.zeros(wrong, dtype=live.dtype))]))
        await attempt("a tensor bigger than any parameter", tensors([(name, torch.zeros(live.numel() * 4, dtype=live.dtype))]))
        await attempt("wrong dtype (int32, same width) for a float parameter", tensors([(name, torch.zeros(shape, dtype=torch.int32))]))
        await attempt("wrong dtype (float64, wider) for a float parameter", tensors([(name, torch.zeros(shape, dtype=torch.float64))]))
        await attempt("unknown parameter name", tensors([("model.backdoor.weight", torch.zeros(shape, dtype=live.dtype))]))
        marker = scratch / f"pwned-{secrets.token_hex(4)}"
        no_marker = lambda answer: (not marker.exists(), f"marker {'absent' if not marker.exists() else 'CREATED'}")  # noqa: E731
        await attempt("os.system in the pickle", payload_call(os.system, f"touch {marker}"), no_marker)
        await attempt("builtins.exec in the pickle", payload_call(exec, f"open({str(marker)!r}, 'w').close()"), no_marker)
    finally:
        tcp.close()
        unix.close()


def direct_target(params: dict[str, Any]) -> UnpicklerTarget:
    """The unpickler in this process, against `params` (the quick run's target, and the tests')."""
    from rose.services.executor.sglang_tensors import UnsafePayload, deserialize_named_tensors

    async def push(payload: str) -> tuple[bool, str]:
        try:
            out = await asyncio.to_thread(deserialize_named_tensors, payload, params=params)
        except UnsafePayload as exc:
            return True, str(exc)
        for n, t in out:  # what an accepted payload would do: become the live weights
            params[n].copy_(t)
        return False, f"loaded {[n for n, _ in out]}"

    async def digest() -> str:
        h = hashlib.sha256()
        for n in sorted(params):
            h.update(params[n].detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    return UnpicklerTarget(push, digest, params, "deserialize_named_tensors")


# ---- HTTP --------------------------------------------------------------------------------------


async def slow_head_attacks(rows: Rows, host: str, port: int, deadline_s: float, as_user: str, category: str = "http") -> None:
    """Request heads at 1 byte/s, and a connection that sends nothing: the server must close both within the deadline + grace."""

    async def hold(attack: str, trickle: bool) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        started, closed_at = time.monotonic(), None
        head = b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        sent = 0
        try:
            while time.monotonic() - started < deadline_s + HEAD_GRACE_S + 2:
                if trickle and sent < len(head):
                    try:
                        writer.write(head[sent : sent + 1])
                        await writer.drain()
                        sent += 1
                    except (ConnectionError, OSError):
                        closed_at = time.monotonic()
                        break
                try:
                    data = await asyncio.wait_for(reader.read(1024), timeout=1.0)
                except TimeoutError:
                    continue
                except (ConnectionError, OSError):
                    closed_at = time.monotonic()
                    break
                if not data:
                    closed_at = time.monotonic()
                    break
        finally:
            writer.close()
        held = (closed_at or time.monotonic()) - started
        blocked = closed_at is not None and held <= deadline_s + HEAD_GRACE_S
        evidence = (
            f"connection closed by the server after {held:.1f} s (head deadline {deadline_s:g} s, {sent} bytes sent)"
            if closed_at
            else f"STILL OPEN after {held:.1f} s"
        )
        rows.add(attack if category == "http" else f"{category}: {attack}", category, as_user, blocked, evidence)

    await asyncio.gather(hold("request head at 1 byte/s (slowloris)", True), hold("connection that never sends a head", False))


async def admin_key_attacks(rows: Rows, base: str, digest: Callable[[], Awaitable[str]], good_key: str, payload: str, as_user: str) -> None:
    """Weight pushes with no key, a wrong key (right length, right prefix) and a key in the wrong header: 401 and the weights unchanged."""
    import aiohttp

    wrong = good_key[:-1] + ("x" if good_key[-1] != "x" else "y")
    cases = [
        ("admin endpoint without a key", {}),
        ("admin endpoint with a wrong key (one character off)", {"Authorization": f"Bearer {wrong}"}),
        ("admin endpoint with `Bearer None` (unset client key)", {"Authorization": "Bearer None"}),
        ("admin endpoint with the key's prefix only", {"Authorization": f"Bearer {good_key[: len(good_key) // 2]}"}),
    ]
    async with aiohttp.ClientSession() as session:
        for attack, headers in cases:
            before = await digest()
            async with session.post(f"{base}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}, headers=headers) as r:
                status, text = r.status, await r.text()
            after = await digest()
            blocked = status in (401, 403) and before == after
            rows.add(
                attack,
                "http",
                as_user,
                blocked,
                f"HTTP {status}; weights {'unchanged' if before == after else 'CHANGED'}; key not echoed: {good_key not in text}",
            )


async def http_engine_attacks(rows: Rows, scratch: Path, as_user: str) -> None:
    """The executor's real HTTP server (the runner services/executor/main.py uses) over a real engine: heads, keys, payloads."""
    import aiohttp
    from aiohttp import web

    from rose.services.executor.config import SGLangApiSettings
    from rose.services.executor.engine import Engine
    from rose.services.executor.http_api import OpenAIApi
    from rose.services.executor.sglang_api import SGLangApi
    from rose.services.executor.telemetry import Telemetry
    from rose.shared.http_server import HEAD_READ_TIMEOUT_S, HardenedAppRunner
    from rose.shared.models import init_models
    from rose.shared.weight_layout import state_digest

    paths = init_models(scratch / "models", seed=0)
    engine = Engine.from_dirs(str(paths.serving), str(paths.policy))
    engine.start()
    key = secrets.token_urlsafe(24)
    openai = OpenAIApi(engine, Telemetry(engine, "ex-bench-security", "dedicated", 1.0), "rose-serving", 64 << 20)
    SGLangApi(engine, SGLangApiSettings(admin_api_key=key), model_dir=str(paths.policy), served_name="policy", follows_bus_weights=False).mount(
        openai.app
    )
    runner = HardenedAppRunner(openai.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"

    async def digest() -> str:
        return await asyncio.to_thread(state_digest, engine.policy_state_dict())

    session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"})

    async def push(payload: str) -> tuple[bool, str]:
        async with session.post(f"{base}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}) as r:
            text = await r.text()
            return r.status >= 400, f"HTTP {r.status} {text}"

    try:
        params = engine.policy_state_dict()
        await slow_head_attacks(rows, "127.0.0.1", port, HEAD_READ_TIMEOUT_S, as_user)
        import torch

        name, live = next(iter(params.items()))
        pushed = [(name, torch.zeros_like(live))]  # alive while the pushes are answered
        await admin_key_attacks(rows, base, digest, key, payload_tensors(pushed), as_user)
        await unpickler_attacks(rows, UnpicklerTarget(push, digest, params, "POST /update_weights_from_tensor"), scratch, as_user)
    finally:
        await session.close()
        await runner.cleanup()
        await engine.stop()


async def quick_http_attacks(rows: Rows, as_user: str) -> None:
    """The quick run's head deadline check: the executor's runner class with a short deadline, serving a health route."""
    from aiohttp import web

    from rose.shared.http_server import HardenedAppRunner

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = HardenedAppRunner(app, head_timeout_s=QUICK_HEAD_TIMEOUT_S, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        await slow_head_attacks(rows, "127.0.0.1", site._server.sockets[0].getsockname()[1], QUICK_HEAD_TIMEOUT_S, as_user)  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


# ---- the gateway --------------------------------------------------------------------------------

GATEWAY_SECRETS = {  # set in the bench's own environment while the gateway launches agents: none may reach them
    "ROSE_BUS__NKEY_SEED_FILE": "/secret/gateway.nk",
    "ROSE_BUS__PASSWORD": "hunter2-gateway",
    "NATS_URL": "nats://gateway-secret@127.0.0.1:4222",
}
ENV_DUMP = "import json, os; print(json.dumps(dict(os.environ)))"


async def gateway_attacks(rows: Rows, tmp: Path, quick: bool, as_user: str) -> None:
    """The gateway's runner, chat format and HTTP API (services/gateway) on a real bus, before a canned scheduler
    and executor that count what they are asked to sample: the attacks must not make them sample anything."""
    import aiohttp
    from aiohttp import web

    from rose.contracts.executor import GenerateReply, GenerateRequest
    from rose.contracts.registry import GENERATE, ROUTE_TURN
    from rose.contracts.rollout import TurnRoute, TurnRouteRequest
    from rose.services.gateway.agents import ForkedAgents, SpawnedAgents
    from rose.services.gateway.chat import ChatFormat
    from rose.services.gateway.config import GatewayConfig
    from rose.services.gateway.http_api import GatewayApi
    from rose.services.gateway.runner import Episodes
    from rose.shared.agentic.env_arithmetic import ArithmeticEnv
    from rose.shared.bus import Bus
    from rose.shared.config import BusConfig
    from rose.shared.http_server import HEAD_READ_TIMEOUT_S, HardenedAppRunner
    from rose.shared.models import train_tokenizer
    from rose.shared.nats_server import NatsServer
    from rose.shared.provisioning import provision
    from rose.shared.turns.runner import TurnRunner

    fmt = ChatFormat(train_tokenizer(0))
    sampled: list[str] = []

    async def route(req: TurnRouteRequest, _d) -> TurnRoute:
        return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id="ex-bench-gw", role="dedicated")

    async def generate(req: GenerateRequest, _d) -> GenerateReply:
        sampled.append(req.task_id)
        ids = fmt.encode("ok") + fmt.stop_token_ids[-1:]
        return GenerateReply(
            request_id=req.request_id, executor_id="ex-bench-gw", status="ok", token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop"
        )

    deadline = QUICK_HEAD_TIMEOUT_S if quick else HEAD_READ_TIMEOUT_S
    with NatsServer(tmp / "nats-gateway") as server:
        bus = Bus(BusConfig(url=server.url, initial_connect_deadline_s=10.0), service="cli", instance="bench-security-gateway")
        await bus.connect()
        runner: web.AppRunner | None = None
        try:
            await provision(bus.js)
            await bus.serve(ROUTE_TURN, route)
            await bus.serve(GENERATE, generate, executor_id="ex-bench-gw")
            config = GatewayConfig()
            episodes = Episodes(bus, TurnRunner(bus, config.turns), fmt, None, config, "gw-bench")
            api = GatewayApi(episodes, fmt, config.model_name, 1 << 20, config.turns.temperature, body_timeout_s=deadline)
            runner = HardenedAppRunner(api.app, head_timeout_s=deadline, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            episodes.base_url = f"http://127.0.0.1:{port}"
            env = ArithmeticEnv(9)
            mine, other, ended = [await episodes.open(env.task(i, task_id=f"bench-gw-{i}")) for i in range(3)]
            await episodes.post_reward(ended, 1.0)
            await episodes.publish(ended)
            body = {"model": config.model_name, "messages": [{"role": "user", "content": "What is 1+1?"}]}
            wrong = mine.key[:-1] + ("x" if mine.key[-1] != "x" else "y")
            cases = [
                ("gateway: another episode's key", {"Authorization": f"Bearer {other.key}"}, body),
                ("gateway: no key", {}, body),
                ("gateway: `Bearer None` (unset client key)", {"Authorization": "Bearer None"}, body),
                ("gateway: the key one character off", {"Authorization": f"Bearer {wrong}"}, body),
                ("gateway: the key's prefix only", {"Authorization": f"Bearer {mine.key[: len(mine.key) // 2]}"}, body),
                ("gateway: the key in another header (X-Api-Key)", {"X-Api-Key": mine.key}, body),
            ]
            async with aiohttp.ClientSession() as session:
                url = f"{episodes.base_url}/episodes/{mine.episode_id}/v1/chat/completions"
                for attack, headers, payload in cases:
                    async with session.post(url, json=payload, headers=headers) as r:
                        status, text = r.status, await r.text()
                    blocked = status == 401 and not sampled and not mine.turns and not other.turns
                    rows.add(attack, "gateway", as_user, blocked, f"HTTP {status}; sampled {len(sampled)}; key not echoed: {mine.key not in text}")
                ended_url = f"{episodes.base_url}/episodes/{ended.episode_id}/v1/chat/completions"
                async with session.post(ended_url, json=body, headers={"Authorization": f"Bearer {ended.key}"}) as r:
                    status, text = r.status, await r.text()
                rows.add("gateway: a key past its episode's end", "gateway", as_user, status == 403 and not sampled, f"HTTP {status} {text[:160]}")
                huge = {**body, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
                async with session.post(url, json=huge, headers={"Authorization": f"Bearer {mine.key}"}) as r:
                    status = r.status
                rows.add(
                    "gateway: a body over the size limit", "gateway", as_user, status == 413 and not sampled, f"HTTP {status}; sampled {len(sampled)}"
                )
            await slow_head_attacks(rows, "127.0.0.1", port, deadline, as_user, category="gateway")
            await _slow_body_attack(rows, port, mine, deadline, as_user, sampled)
            await _agent_env_attacks(rows, episodes, env, tmp, as_user, ForkedAgents(str(tmp / "dump_env.py"), tmp / "agents"), "forked")
            await _agent_env_attacks(rows, episodes, env, tmp, as_user, SpawnedAgents([sys.executable, "-c", ENV_DUMP], tmp / "agents"), "spawned")
        finally:
            if runner is not None:
                await runner.cleanup()
            await bus.close()


async def _slow_body_attack(rows: Rows, port: int, episode: Any, deadline_s: float, as_user: str, sampled: list[str]) -> None:
    """A whole head, then a body at 1 byte/s: 408 within the body deadline (+ grace), nothing sampled."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /episodes/{episode.episode_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {episode.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
    )
    writer.write(head.encode())
    started, answer = time.monotonic(), b""
    try:
        while time.monotonic() - started < deadline_s + HEAD_GRACE_S + 2 and not answer:
            writer.write(b" ")
            await writer.drain()
            try:
                answer = await asyncio.wait_for(reader.read(1024), timeout=1.0)
            except TimeoutError:
                continue
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    held = time.monotonic() - started
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
    blocked = status == "408" and held <= deadline_s + HEAD_GRACE_S and not episode.turns and not sampled
    rows.add("gateway: a request body at 1 byte/s", "gateway", as_user, blocked, f"HTTP {status} after {held:.1f} s (body deadline {deadline_s:g} s)")


async def _agent_env_attacks(rows: Rows, episodes: Any, env: Any, tmp: Path, as_user: str, launcher: Any, how: str) -> None:
    """An agent that prints its whole environment: the gateway's credentials and bus settings must not be in it."""
    (tmp / "dump_env.py").write_text(ENV_DUMP + "\n")
    saved = {k: os.environ.get(k) for k in GATEWAY_SECRETS}
    os.environ.update(GATEWAY_SECRETS)
    try:
        await launcher.start()
        episode = await episodes.open(env.task(10 + len(how), task_id=f"bench-gw-env-{how}"))
        run = await launcher.launch(episode.episode_id, episodes.agent_env(episode), ["q"], tmp / f"env-{how}.log")
        code = await asyncio.wait_for(run.exited, 60.0)
        seen = json.loads((tmp / f"env-{how}.log").read_text().strip().splitlines()[-1])
    finally:
        await launcher.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    leaked = sorted(
        k for k, v in seen.items() if k in GATEWAY_SECRETS or any(secret in v for secret in GATEWAY_SECRETS.values()) or k.startswith("ROSE_BUS")
    )
    own = seen.get("OPENAI_API_KEY") == episode.key
    rows.add(
        f"gateway: an agent ({how}) reads the gateway's bus credentials from its environment",
        "gateway",
        as_user,
        code == 0 and not leaked and own,
        f"agent exited {code}; gateway secrets in its environment: {leaked or 'none'}; it has its own episode key: {own}",
    )


# ---- the run -----------------------------------------------------------------------------------


def _sandbox_part(rows: Rows, quick: bool) -> list[str]:
    """The sandbox escapes as root and as nobody; notes say what could not run (never a made-up row)."""
    notes: list[str] = []
    try:
        from rose.bench import sandbox_attacks as sandbox_attacks
    except ImportError as exc:
        return [f"sandbox attacks not run: {exc}"]
    names = [a.__name__.removeprefix("attack_") for a in getattr(sandbox_attacks, "ATTACKS", ())]
    only = [n for n in QUICK_SANDBOX_ATTACKS if n in names] if quick else None
    for user in ("root", "nobody"):
        try:
            rows.rows.extend(sandbox_attacks.run_sandbox_attacks(user, only=only))
        except Exception as exc:  # no isolating backend, not root, a runner failure: said, not hidden
            notes.append(f"sandbox attacks as {user} not run: {type(exc).__name__}: {exc}")
    return notes


async def _run(quick: bool, include_sandbox: bool) -> tuple[Rows, list[str]]:
    import torch

    rows, notes = Rows(), []
    me = getpass.getuser()
    with tempfile.TemporaryDirectory(prefix="rose-bench-security-") as tmp_name:
        tmp = Path(tmp_name)
        await bus_part(rows, tmp, quick)
        if quick:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
            params = {n: p.detach() for n, p in model.state_dict().items()}
            await unpickler_attacks(rows, direct_target(params), tmp, me)
            await quick_http_attacks(rows, me)
        else:
            await http_engine_attacks(rows, tmp, me)
        await gateway_attacks(rows, tmp, quick, me)
    if include_sandbox:
        notes += await asyncio.to_thread(_sandbox_part, rows, quick)
    return rows, notes


def run_security_bench(options: SecurityOptions, out_json: str | Path) -> dict[str, Any]:
    """Every attack the options name, one row each; the result (also written to ``out_json``)."""
    started = time.monotonic()
    rows, notes = asyncio.run(_run(options.quick, options.include_sandbox))
    by_category: dict[str, dict[str, int]] = {}
    for r in rows.rows:
        c = by_category.setdefault(r["category"], {"tried": 0, "blocked": 0})
        c["tried"] += 1
        c["blocked"] += int(r["blocked"])
    result = {
        "attacks_tried": len(rows.rows),
        "attacks_blocked": sum(r["blocked"] for r in rows.rows),
        "by_category": by_category,
        "quick": options.quick,
        "seconds": round(time.monotonic() - started, 1),
        "notes": notes,
        "rows": rows.rows,
    }
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_summary(result: dict[str, Any], out_json: str | Path) -> None:
    for r in result["rows"]:
        if not r["blocked"]:
            print(f"NOT BLOCKED [{r['category']}/{r['as_user']}] {r['attack']}: {r['evidence']}")
    for cat, c in result["by_category"].items():
        print(f"{cat:10s} {c['blocked']}/{c['tried']} blocked")
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"attacks blocked: {result['attacks_blocked']}/{result['attacks_tried']} ({result['seconds']} s); wrote {out_json}")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "bench-out/security.json"
    res = run_security_bench(SecurityOptions(quick="--quick" in sys.argv), out)
    print_summary(res, out)
    sys.exit(0 if res["attacks_blocked"] == res["attacks_tried"] else 1)
