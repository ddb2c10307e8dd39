"""docker-compose.yml started for real and checked end to end, on a host without an image registry.

    scripts/compose-check                        # the whole check (root; see deploy/compose/README.md)
    python deploy/compose/check.py manifest      # the pins the image installs (from this venv)
    python deploy/compose/check.py wheelhouse D  # build or refresh the wheelhouse in D

Phases (each timed): the engine (Debian's docker.io and docker-compose; a daemon of our own, data
under a temporary directory, when none runs), a bookworm base from Debian's packages (debootstrap,
`docker import`), the wheelhouse (the host's venv versions), the images, the core of the compose
file up and healthy on host networking (host-network.yml), `rose status` and an `openai` completion
from the host, the `train` profile's GRPO steps with every executor applying every version, three
`docker kill`s (a serving executor, a NATS node, the scheduler) with the `rose bench faults`
accounting from the bus, the rollout worker's sandbox in its container, Prometheus (every dashboard
query against the live cluster, promtool), then `down` and `up` again: JetStream state kept, the
trainer resumes. Everything it started is stopped, also when a step fails.

The check is this file (the phases and what each one checks, `main`) and its parts beside it:
check_engine.py (the Docker daemon), check_images.py (the wheelhouse, the base and the images),
check_cluster.py (the cluster seen from the host), check_common.py (what they all use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # its parts, beside it: deploy/compose is no package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_cluster import (  # noqa: E402
    EXECUTORS,
    LISTEN_PORTS,
    NATS_URL,
    PROMETHEUS,
    Seen,
    ServingLoad,
    dashboard_queries,
    http_json,
    listening,
    observe,
    stream_counts,
)
from check_common import DEPLOY, CheckFailed, log, need, run  # noqa: E402
from check_engine import Engine, engine_tools, host_packages, leftovers  # noqa: E402
from check_images import (  # noqa: E402
    BASE_IMAGE,
    IMAGE_INPUTS,  # noqa: F401 - tests/deploy/test_compose_host.py reads it from this script
    IMAGES,
    SUITE,
    base_tarball,
    build_context,
    build_images,
    build_wheelhouse,
    images_key,
    manifest,
    missing_wheels,  # noqa: F401 - tests/deploy/test_compose_host.py reads it from this script
)

DEFAULT_CACHE = Path(os.environ.get("ROSE_COMPOSE_CACHE", "/var/cache/rose-compose"))
CORE = [
    "nats-1",
    "nats-2",
    "nats-3",
    "security-init",
    "models-init",
    "weights-key",
    "provision",
    "executor-1",
    "executor-2",
    "executor-dedicated",
    "slo_monitor",
    "scheduler",
    "weight_publisher",
    "rollout_worker",
    "prometheus",
]
TRAIN = ["trainer", "gateway"]
ONE_SHOT = {"security-init", "models-init", "weights-key", "provision"}
# The check's RL job: `rose demo`'s (rose.shared.workload.TRAINER: synchronous steps, one torch thread, a
# fixed set of problems), in smaller steps, so that steps come in seconds on 2 cores. Only the trainer's
# settings; the cluster is the compose file's (with ROSE_MODELS_PRESET=demo: COMPOSE_VARS).
JOB_CHANGES = {
    # `rose bench faults`'s warm start (the demo's: 200 steps): enough that groups have reward variance; from an
    # untrained policy every reward is 0, every step is skipped and no weight version is published
    "ROSE_SFT__STEPS": "80",
    # the demo: 8 groups of 8 a step. 2 of 8: a round whose every group has equal rewards (all 0) is skipped, and
    # 8 such rounds in a row end the job (trainer.DEGENERATE_STEPS_LIMIT); with 2 groups of 4 at this policy's
    # reward of ~0.1 that happened (run 3 of the evening, 4 December); with groups of 8 a round is all-zero ~1 time in 5
    "ROSE_GRPO__GROUPS_PER_STEP": "2",
}
KILLS = ["executor-1", "nats-2", "scheduler"]
HEALTHY_TIMEOUT_S = 420.0
STEP_TIMEOUT_S = 420.0
DRAIN_TIMEOUT_S = 120.0
SANDBOX_ATTACKS = ["fork_exec", "write_tmp", "nkey_seeds", "parent_environ", "tcp_loopback", "unix_socket", "signal_host_process", "nested_userns"]
# Run in the rollout worker's container under its code sandbox (sandbox_phase): a result, then four
# escapes whose success would show outside the sandbox. One `name=outcome` line each.
SANDBOX_PROGRAM = """
import os, socket
print("result=" + str(sum(i * i for i in range(10))))
def attempt(name, fn):
    try:
        print(name + "=got " + repr(fn())[:200])
    except Exception as exc:
        print(name + "=refused " + type(exc).__name__)
def connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        return s.recv(64) if port != {port} else "connected"
attempt("host_listener", lambda: connect({port}))
attempt("nats", lambda: connect({nats_port}))
attempt("nkey_seed", lambda: open("/creds/rollout_worker.nk").read())
def write():
    for d in ("/tmp", "/home/rose"):
        open(os.path.join(d, "{token}"), "w").write("x")
    return "written"
attempt("write_file", write)
"""


async def until(what: str, ok, timeout: float, every: float = 1.0) -> float:
    t0 = time.monotonic()
    while True:
        if await ok() if asyncio.iscoroutinefunction(ok) else ok():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(every)


@contextmanager
def phase(timings: dict[str, float], name: str) -> Iterator[None]:
    log(f"--- {name}")
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - t0, 1)
        log(f"--- {name}: {timings[name]:.1f} s")


class Check:
    def __init__(self, cache: Path, keep_cache: bool) -> None:
        self.cache, self.keep_cache = cache, keep_cache
        self.timings: dict[str, float] = {}
        self.results: dict[str, object] = {}
        self.engine: Engine | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="rose-compose-check-"))
        self.job = self.tmp / "job.yml"
        self.cli_seed = self.tmp / "cli.nk"
        self.failures: list[str] = []
        self.base_tar = cache / f"base-{SUITE}.tar"

    def expect(self, ok: bool, what: str) -> bool:
        """A failed check that does not stop the run: the later phases still report (the run fails)."""
        if not ok:
            self.failures.append(what)
            log(f"CHECK FAILED: {what}")
        return ok

    # -- helpers --
    @property
    def e(self) -> Engine:
        assert self.engine is not None
        return self.engine

    def compose(self, *args: str, **kw):
        return self.e.compose(*args, extra=[self.job], **kw)

    def states(self) -> dict[str, dict]:
        out = self.compose("ps", "--all", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 0 and out.strip().startswith("["):
            rows = json.loads(out)
        return {r["Service"]: r for r in rows}

    def healthy(self, services: Iterable[str]) -> list[str]:
        """Those of `services` not yet healthy (one-shots: not yet exited 0). Raises on a one-shot that failed."""
        states = self.states()
        waiting = []
        for s in services:
            r = states.get(s)
            if r is None:
                waiting.append(s)
            elif s in ONE_SHOT:
                if r["State"] == "exited":
                    need(r.get("ExitCode") == 0, f"{s} exited {r.get('ExitCode')}:\n{self.logs(s)}")
                else:
                    waiting.append(s)
            elif r.get("Health") not in ("healthy", "") or r["State"] != "running":
                waiting.append(s)
        return waiting

    def logs(self, service: str, tail: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    async def wait_healthy(self, services: list[str], timeout: float = HEALTHY_TIMEOUT_S) -> float:
        async def ok() -> bool:
            return not await asyncio.to_thread(self.healthy, services)

        try:
            return await until(f"{services} healthy", ok, timeout, every=2.0)
        except CheckFailed:
            waiting = self.healthy(services)
            raise CheckFailed(f"not healthy after {timeout:.0f} s: {waiting}\n" + "\n".join(self.logs(s) for s in waiting[:3])) from None

    def up(self, services: list[str], profile: bool = False) -> None:
        """`up -d` of `services`; with `profile` (train) on a core already healthy: its one-shots not run again."""
        args = (["--profile", "train", "up", "--no-deps"] if profile else ["up"]) + ["-d", "--no-build", "--pull", "never", *services]
        self.compose(*args)

    # -- phases --
    def engine_phase(self) -> None:
        host_packages()
        dockerd, docker, compose_bin = engine_tools(self.cache)
        self.engine = Engine.start(dockerd, docker, compose_bin)
        self.results["compose_version"] = self.e.compose("version", "--short").stdout.strip()
        self.results["engine_version"] = self.e.docker_cmd("version", "--format", "{{.Server.Version}}").stdout.strip()

    def base_phase(self) -> None:
        """The base tarball (imported only when the images are built: images_phase)."""
        self.base_tar = base_tarball(self.cache)
        self.results["base_tar_mb"] = round(self.base_tar.stat().st_size / 2**20)

    def wheelhouse_phase(self) -> None:
        self.results["wheelhouse"] = build_wheelhouse(self.cache / "wheelhouse")

    def images_phase(self) -> None:
        """The three images: loaded from the cache's `docker save` when their inputs are unchanged, else built (and saved)."""
        ctx = build_context(self.cache / "wheelhouse")
        try:
            key = images_key(ctx, self.base_tar)
            saved = self.cache / f"images-{key}.tar"
            self.results["images_from_cache"] = saved.exists()
            if saved.exists():
                self.e.docker_cmd("load", "-q", "-i", str(saved), timeout=600)
                log(f"images loaded from {saved.name} (their inputs are unchanged)")
            else:
                build_images(self.e, ctx, self.base_tar)
                for old in self.cache.glob("images-*.tar*"):
                    old.unlink()
                partial = saved.with_suffix(".tar.partial")
                self.e.docker_cmd("save", "-o", str(partial), *IMAGES.values(), timeout=600)
                partial.rename(saved)
        finally:
            shutil.rmtree(ctx, ignore_errors=True)
        size = self.e.docker_cmd("image", "inspect", "--format", "{{.Size}}", IMAGES["ROSE_IMAGE"]).stdout.strip()
        self.results["image_mb"] = round(int(size) / 2**20)

    def job_file(self) -> None:
        from rose.shared.workload import TRAINER

        job = {**TRAINER, **JOB_CHANGES}
        self.results["job"] = job
        env = "\n".join(f"      {k}: '{v}'" for k, v in job.items())
        self.job.write_text(f"# the check's RL job (deploy/compose/check.py JOB_CHANGES)\nservices:\n  trainer:\n    environment:\n{env}\n")

    async def up_phase(self) -> None:
        busy = [p for p in LISTEN_PORTS if listening(p)]
        need(not busy, f"ports already in use on 127.0.0.1: {busy} (host-network.yml needs them)")
        await asyncio.to_thread(self.up, CORE)
        took = await self.wait_healthy([s for s in CORE])
        self.results["core_healthy_s"] = round(took, 1)
        shutil.copy(self.credentials_dir() / "cli.nk", self.cli_seed)
        self.cli_seed.chmod(0o600)

    def rose(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, NATS_URL=NATS_URL, ROSE_BUS__NKEY_SEED_FILE=str(self.cli_seed))
        return run([str(Path(sys.executable).parent / "rose"), *args], env=env, timeout=60)

    def status_phase(self, expect: Iterable[str]) -> None:
        rows = json.loads(self.rose("status", "--json").stdout)["services"]
        listed = sorted({r["service"] for r in rows})
        missing = sorted(set(expect) - set(listed))
        self.expect(not missing, f"rose status does not list {missing} (it lists {listed})")
        self.results["rose_status_services"] = len(rows)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{EXECUTORS['executor-1']}/v1", api_key="unused", timeout=60)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="1 + 2 =", max_tokens=8)
        need(bool(done.choices) and done.usage is not None and done.usage.completion_tokens > 0, f"no completion: {done}")
        self.results["openai_completion"] = {"model": model, "tokens": done.usage.completion_tokens}
        log(f"rose status lists {len(rows)} services ({', '.join(listed)}); openai: {done.usage.completion_tokens} tokens from {model}")

    async def train_phase(self, seen: Seen) -> None:
        await asyncio.to_thread(self.up, TRAIN, True)
        await self.wait_healthy(TRAIN)
        await until("3 GRPO steps", self.stepping(seen, lambda: seen.last_step() >= 3), STEP_TIMEOUT_S)
        version = max(seen.manifests)
        await until(f"every executor applying versions 1..{version}", lambda: not seen.versions_lost(EXECUTORS, version), 90)
        self.results["steps_before_kills"] = seen.last_step()
        log(f"GRPO steps {seen.last_step()}, versions {sorted(seen.manifests)}, every executor applied each")

    def stepping(self, seen: Seen, done):
        """`done()`, failing at once when the trainer container has exited (its job ended: the log says why)."""
        last = [time.monotonic()]

        def check() -> bool:
            if done():
                return True
            if time.monotonic() - last[0] >= 10.0:
                last[0] = time.monotonic()
                state = self.states().get("trainer", {}).get("State")
                need(state == "running", f"the trainer is {state} at step {seen.last_step()}:\n{self.logs('trainer', 8)}")
            return False

        return check

    async def kill_phase(self, seen: Seen) -> None:
        kills = []
        for target in KILLS:
            step = seen.last_step()
            t0 = time.monotonic()
            self.compose("kill", "-s", "SIGKILL", target)
            await asyncio.sleep(2.0)
            state = self.states()[target]["State"]
            need(state != "running", f"{target} still running after docker kill")
            await asyncio.to_thread(self.compose, "start", target)  # what an operator (or an orchestrator) does after a kill
            healthy = await self.wait_healthy([target], 240)
            await until(f"a GRPO step after killing {target}", self.stepping(seen, lambda s=step: seen.last_step() > s), STEP_TIMEOUT_S)
            kills.append({"target": target, "healthy_s": round(time.monotonic() - t0, 1), "step_before": step, "step_after": seen.last_step()})
            log(f"killed {target}: healthy again after {healthy:.0f} s, trainer at step {seen.last_step()} (was {step})")
        self.results["kills"] = kills

    async def drain(self, seen: Seen) -> None:
        """Stop the trainer (no new tasks), wait until every task handed out came back as a trajectory and
        every executor runs the last version, then count what was lost across the kills."""
        await asyncio.to_thread(self.compose, "stop", "trainer")
        cut = set(seen.published)
        try:
            await until(
                "every task's trajectory, every version applied",
                lambda: cut <= seen.trajectories and not seen.versions_never_applied() and not seen.executors_behind(EXECUTORS),
                DRAIN_TIMEOUT_S,
            )
        except CheckFailed:
            pass  # counted below
        await asyncio.sleep(3.0)
        lost = sorted(cut - seen.trajectories)
        vlost = seen.versions_never_applied()
        behind = seen.executors_behind(EXECUTORS)
        # versions an executor neither applied nor folded into a chain it applied: those it joined past at a keyframe after its kill
        per_executor = {ex: seen.folded_into_keyframes(ex) for ex in EXECUTORS}
        folded = {ex: f for ex, (f, _) in per_executor.items() if f}
        skipped = {ex: m for ex, (_, m) in per_executor.items() if m}
        self.results.update(
            trajectories_published=len(cut),
            trajectories_lost=len(lost),
            trajectories_redelivered=seen.duplicates,
            weight_versions_published=len(seen.manifests),
            weight_versions_lost=len(vlost),
            executors_behind_last_version=behind,
            versions_folded_into_a_keyframe=folded,
            versions_skipped_by_an_executor=skipped,
        )
        log(
            f"accounting: {len(cut)} tasks handed out, {len(lost)} trajectories lost; {len(seen.manifests)} versions, {len(vlost)} lost {vlost}; "
            f"executors behind the last version: {behind or 'none'}; joined past at a keyframe: {folded or 'none'}"
        )
        self.expect(
            not lost and not vlost and not behind and not skipped,
            f"lost: trajectories {lost[:10]}, weight versions {vlost}; executors behind: {behind}; versions skipped, not at a keyframe: {skipped}",
        )

    def sandbox_phase(self) -> None:
        """Model code runs under the code sandbox in the worker's container; its escapes are refused, as seen from outside.

        The worker itself configured its sandbox (no refusal in its log). A program run through
        `Sandbox("subprocess")` inside the container (as the worker's user, under the container's
        seccomp/AppArmor/capabilities) computes a result and tries: a TCP connection to a listener
        the check holds on the host's 127.0.0.1 (the container has the host's network), one to a
        NATS node, reading the worker's NKey seed, writing a file where the container can see it.
        From outside: the listener counts the connections it accepted, the seed (read from the
        credentials volume on the host) must not be in the output, the file must not exist in the
        container. Then `rose bench security`'s sandbox attacks, run in the same container."""
        log_text = self.logs("rollout_worker", 400)
        refused = [line for line in log_text.splitlines() if "will refuse its episodes" in line]
        self.expect(not refused, f"rollout_worker's code sandbox refused to configure: {refused[:1]}")
        seed = self.credentials_dir() / "rollout_worker.nk"
        secret = seed.read_text().strip()
        token = f"escape-{os.getpid()}-{int(time.time())}"
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.settimeout(0.2)
            port = listener.getsockname()[1]
            accepted: list[str] = []
            stop = threading.Event()

            def accept() -> None:
                while not stop.is_set():
                    try:
                        conn, peer = listener.accept()
                    except OSError:
                        continue
                    accepted.append(f"{peer[0]}:{peer[1]}")
                    conn.close()

            acceptor = threading.Thread(target=accept, daemon=True)
            acceptor.start()
            program = SANDBOX_PROGRAM.format(port=port, nats_port=NATS_URL.split(":")[-1], token=token)
            code = (
                "import json; from rose.shared.agentic.sandbox import Sandbox; "
                f"r = Sandbox('subprocess').run({program!r}); "
                "print(json.dumps({'backend': r.backend, 'exit': r.exit_code, 'stdout': r.stdout, 'stderr': r.stderr[-500:], 'blocked': r.blocked}))"
            )
            ran = self.compose("exec", "-T", "rollout_worker", "python", "-c", code, check=False, timeout=120)
            time.sleep(1.0)
            stop.set()
            acceptor.join(5)
        try:
            out = json.loads(ran.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            self.expect(False, f"the sandbox did not run in rollout_worker (exit {ran.returncode}): {(ran.stdout + ran.stderr)[-1500:]}")
            return
        lines = dict(line.split("=", 1) for line in out["stdout"].splitlines() if "=" in line)
        left = self.compose("exec", "-T", "rollout_worker", "sh", "-c", f"ls /tmp/{token} /home/rose/{token} 2>/dev/null", check=False)
        outside = {
            "backend": out["backend"],
            "model_code_result": lines.get("result"),
            "attempts": {k: v for k, v in lines.items() if k != "result"},
            "host_listener_connections": len(accepted),
            "seed_in_output": secret in ran.stdout,
            "files_left_in_container": left.stdout.split(),
        }
        self.results["sandbox_outside"] = outside
        log(f"sandbox in rollout_worker, seen from outside: {outside}")
        self.expect(out["backend"] == "subprocess" and lines.get("result") == "285", f"model code did not run in rollout_worker's sandbox: {out}")
        self.expect(len(lines) == 5, f"the sandboxed program did not get through its attempts: {out}")
        self.expect(not accepted, f"the sandboxed program connected to the host's listener: {accepted}")
        got = [k for k in ("host_listener", "nats", "nkey_seed") if not lines.get(k, "").startswith("refused")]
        self.expect(not got, f"the sandboxed program was not refused: {got} ({out['stdout'][-800:]})")
        self.expect(secret not in ran.stdout, "the sandboxed program read rollout_worker's NKey seed")
        self.expect(not left.stdout.split(), f"the sandboxed program left files in the container: {left.stdout.split()}")
        # as the worker's own user (uid 10001 of the image; "nobody" keeps a non-root caller's uid)
        attacks = (
            "import json; from rose.bench.sandbox_attacks import run_sandbox_attacks as r; "
            f"print(json.dumps({{'rows': r('nobody', backend='subprocess', only={SANDBOX_ATTACKS!r})}}))"
        )
        res = self.compose("exec", "-T", "rollout_worker", "python", "-c", attacks, check=False, timeout=300)
        try:
            rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
        except (IndexError, ValueError, KeyError):
            self.expect(False, f"sandbox attacks in rollout_worker did not run (exit {res.returncode}): {(res.stdout + res.stderr)[-1500:]}")
            return
        escaped = [r["attack"] for r in rows if not r["blocked"]]
        self.results["sandbox_attacks"] = {"attacks": len(rows), "blocked": len(rows) - len(escaped), "escaped": escaped}
        log(f"sandbox attacks in rollout_worker: {len(rows) - len(escaped)} of {len(rows)} blocked")
        self.expect(not escaped, f"sandbox escapes in rollout_worker: {escaped}")

    def credentials_dir(self) -> Path:
        return Path(json.loads(self.e.docker_cmd("volume", "inspect", "rose_credentials").stdout)[0]["Mountpoint"])

    async def metrics_phase(self) -> None:
        targets_ok = lambda: all(t["health"] == "up" for t in http_json(f"{PROMETHEUS}/api/v1/targets")["data"]["activeTargets"])  # noqa: E731
        await until("every scrape target up", targets_ok, 60)
        targets = http_json(f"{PROMETHEUS}/api/v1/targets")["data"]["activeTargets"]
        queries = dashboard_queries()
        empty = []
        found = 0
        for dash, expr in queries:
            q = expr.replace("$__rate_interval", "1m").replace('=~"$executor"', '=~".+"')
            data = http_json(f"{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
            n = len(data["data"]["result"]) if data["data"]["resultType"] == "vector" else 1
            found += n
            if n == 0:
                empty.append(f"{dash}: {expr}")
        rules = http_json(f"{PROMETHEUS}/api/v1/rules")["data"]["groups"]
        bad_rules = [r["name"] for g in rules for r in g["rules"] if r.get("health") != "ok"]
        # the trainer's own count of lost trajectories (members of a group released on its timeout without
        # them; the RoseTrajectoriesLost alert's series), beside the check's count from the bus (drain)
        missing = http_json(f"{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": "rose_trainer_trajectories_missing_total"}))
        missing_values = [float(r["value"][1]) for r in missing["data"]["result"]]
        firing = sorted({a["labels"]["alertname"] for a in http_json(f"{PROMETHEUS}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"})
        self.results["prometheus"] = {
            "targets_up": len(targets),
            "dashboard_queries": len(queries),
            "series_found": found,
            "queries_without_series": empty,
            "rules": sum(len(g["rules"]) for g in rules),
            "rules_unhealthy": bad_rules,
            "trainer_trajectories_missing": missing_values,
            "alerts_firing": firing,
        }
        for line in empty:
            log(f"no series: {line}")
        log(
            f"prometheus: {len(targets)} targets up, {len(queries) - len(empty)} of {len(queries)} dashboard queries return series ({found} series); "
            f"trainer's missing trajectories {missing_values}; alerts firing {firing}"
        )
        prom = DEPLOY / "prometheus"
        run(["promtool", "check", "rules", str(prom / "rules.yml")])
        test = run(["promtool", "test", "rules", str(prom / "rules.test.yml")])
        self.results["promtool_test_rules"] = test.stdout.strip().splitlines()[-1].strip()
        self.expect(not bad_rules, f"rules not healthy in the live Prometheus: {bad_rules}")
        self.expect(missing_values == [0.0], f"the trainer counts trajectories missing: {missing_values}")
        self.expect("RoseTrajectoriesLost" not in firing, f"alerts firing: {firing}")
        self.expect(not empty, f"{len(empty)} dashboard queries return no series")

    async def restart_phase(self, seen: Seen, bus) -> None:
        before_step, before_run = seen.last_step(), (seen.steps[-1][1] if seen.steps else "")
        streams = await stream_counts(bus)
        await asyncio.to_thread(self.compose, "--profile", "train", "down", "--timeout", "20")
        await asyncio.to_thread(self.up, CORE)
        await self.wait_healthy(CORE)
        after = await stream_counts(bus)
        # the services' heartbeats are liveness, not state: a key lives SERVICES_KV.ttl_s after its last beat
        from rose.contracts.registry import SERVICES_KV

        liveness = f"KV_{SERVICES_KV.bucket}"
        kept = {s: (streams[s], after.get(s)) for s in streams if s != liveness and after.get(s, 0) < streams[s]}
        self.expect(not kept, f"JetStream lost messages across down/up: {kept}")
        await asyncio.to_thread(self.up, TRAIN, True)
        await until(
            "the trainer's first step after down/up", lambda: seen.last_step() > before_step and seen.steps[-1][1] == before_run, STEP_TIMEOUT_S
        )
        first = next(s for s in seen.steps if s[0] and s[2] > before_step)
        self.results["restart"] = {
            "streams": len(streams),
            "messages_before": sum(n for s, n in streams.items() if s != liveness),
            "messages_after": sum(n for s, n in after.items() if s != liveness),
            "step_before": before_step,
            "resumed_at_step": first[2],
            "same_run": first[1] == before_run,
        }
        self.expect(first[2] == before_step + 1, f"the trainer did not resume: step {first[2]} after {before_step}")
        log(f"down/up: {len(streams)} streams kept ({sum(after.values())} messages), trainer resumed run {before_run} at step {first[2]}")

    async def main(self) -> int:
        from rose.shared.bus import Bus
        from rose.shared.config import BusConfig

        with phase(self.timings, "engine"):
            await asyncio.to_thread(self.engine_phase)
        with phase(self.timings, "base"):
            await asyncio.to_thread(self.base_phase)
        with phase(self.timings, "wheelhouse"):
            await asyncio.to_thread(self.wheelhouse_phase)
        with phase(self.timings, "images"):
            await asyncio.to_thread(self.images_phase)
        self.job_file()
        with phase(self.timings, "up"):
            await self.up_phase()
        with phase(self.timings, "status"):
            await asyncio.to_thread(self.status_phase, ["executor", "slo_monitor", "scheduler", "weight_publisher", "rollout_worker"])
        load = ServingLoad(str(self.results.get("openai_completion", {}).get("model", "rose-serving")))  # type: ignore[union-attr]
        load.start()
        seen = Seen()
        bus = Bus(BusConfig(url=NATS_URL, nkey_seed_file=str(self.cli_seed), initial_connect_deadline_s=20), service="cli", instance="compose-check")
        await bus.connect()
        try:
            await observe(bus, seen, str(int(time.time())))
            with phase(self.timings, "train"):
                await self.train_phase(seen)
            with phase(self.timings, "kills"):
                await self.kill_phase(seen)
            with phase(self.timings, "sandbox"):
                await asyncio.to_thread(self.sandbox_phase)
            with phase(self.timings, "metrics"):
                await self.metrics_phase()
            self.results["serving_load"] = load.stop()
            log(f"serving load: {self.results['serving_load']}")
            with phase(self.timings, "drain"):
                await self.drain(seen)
            with phase(self.timings, "restart"):
                await self.restart_phase(seen, bus)
        finally:
            load.stop()
            await bus.close()
        return 0

    def diagnose(self) -> None:
        """What each container was doing when the check failed (before everything is removed)."""
        if self.engine is None:
            return
        try:
            for name, row in sorted(self.states().items()):
                print(f"--- {name}: {row.get('State')} {row.get('Health', '')} {row.get('Status', '')}", flush=True)
                if name not in ONE_SHOT:
                    print(self.logs(name, 15), flush=True)
        except Exception as exc:  # diagnosis only
            log(f"no diagnosis: {exc!r}")

    def cleanup(self) -> None:
        t0 = time.monotonic()
        if self.engine is not None:
            if self.engine.proc is None:  # a daemon we did not start: remove only what we made
                self.compose("--profile", "train", "down", "--volumes", "--timeout", "10", check=False)
                for image in [*IMAGES.values(), BASE_IMAGE]:
                    self.e.docker_cmd("image", "rm", "-f", image, check=False)
            else:  # our own daemon: its containers killed, then it and all its data (images, volumes) go
                self.compose("--profile", "train", "kill", check=False, timeout=60)
                log(f"containers killed after {time.monotonic() - t0:.1f} s")
                self.engine.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if not self.keep_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
        self.timings["cleanup"] = round(time.monotonic() - t0, 1)
        left = leftovers(self.engine)
        self.results["left_behind"] = left
        log(f"cleanup {self.timings['cleanup']:.1f} s; left behind: {left or 'nothing'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("run", help="the whole check (root)")
    c.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="base tarball, wheelhouse and engine packages, kept across runs")
    c.add_argument("--no-cache", action="store_true", help="start from an empty cache and remove it at the end (a fresh box)")
    c.add_argument("--json", type=Path, default=None, help="also write the figures here")
    sub.add_parser("manifest", help="print the pins the image installs")
    w = sub.add_parser("wheelhouse", help="build or refresh a wheelhouse")
    w.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "manifest":
        print("\n".join(manifest()))
        return 0
    if args.cmd == "wheelhouse":
        print(json.dumps(build_wheelhouse(args.dir)))
        return 0
    if os.geteuid() != 0:
        print("compose-check: run as root (it starts a Docker daemon and debootstraps a base)", file=sys.stderr)
        return 2
    cache = Path(tempfile.mkdtemp(prefix="rose-compose-cache-")) if args.no_cache else args.cache
    cache.mkdir(parents=True, exist_ok=True)
    check = Check(cache, keep_cache=not args.no_cache)
    t0 = time.monotonic()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    rc = 1
    try:
        rc = asyncio.run(check.main())
    except (CheckFailed, KeyboardInterrupt, subprocess.TimeoutExpired) as exc:
        log(f"FAILED: {exc}")
        check.diagnose()
    finally:
        check.cleanup()
    check.timings["total"] = round(time.monotonic() - t0, 1)
    check.results["timings_s"] = check.timings
    check.results["failures"] = check.failures
    check.results["ok"] = rc == 0 and not check.failures and not check.results.get("left_behind")
    print(json.dumps(check.results, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(check.results, indent=2, default=str))
    log("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in check.timings.items()))
    log("PASSED" if check.results["ok"] else "FAILED")
    return 0 if check.results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
