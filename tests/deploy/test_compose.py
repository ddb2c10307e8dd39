"""docker-compose.yml without a Docker engine: what can be checked here is checked for real.

- the file validates against the Compose Specification's JSON Schema (vendored, see data/README.md);
- every command a ROSE container runs, and every healthcheck, is a real `rose` command (run with `--help`);
- services, dependencies, health checks, profiles, volumes and the observability configs fit together;
- auth: `security-init`'s real command writes every file another container mounts from the
  `credentials` volume, each ROSE container mounts exactly its own seed (an executor: its own
  instance's, `executor@<instance>.nk`), NATS nodes only the server includes, and everything that
  mounts one starts after it;
- every variable the file reads or sets is documented in deploy/compose/README.md.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from rose.cli.main import build_parser
from rose.cli.service_table import ON_DEMAND_SERVICES, SERVICE_MODULES
from rose.shared.nats_server import COMPOSE_AUTH_DIR, compose_route_addresses
from rose.shared.security import (
    CLUSTER_INCLUDE,
    OPERATOR,
    ROUTE_SECRET,
    SEED_SUFFIX,
    SERVER_INCLUDE,
    USERS,
    instance_user,
    parse_instances,
    permissions,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "compose"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
NATS_NODES = ["nats-1", "nats-2", "nats-3"]
ONE_SHOT = {"models-init", "provision", "weights-key", "security-init"}
CREDENTIALS = "credentials"  # the volume security-init writes
NODE_CONFIG = "/etc/nats/nats.conf"


def _schema_errors(doc: dict) -> list[str]:
    # The schema declares draft-07 (`$schema` without the trailing '#', which jsonschema does not map by itself).
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


def _runs_rose(service: dict) -> bool:
    return (service.get("command") or [None])[0] == "rose"


ROSE_SERVICES = {name: s for name, s in SERVICES.items() if _runs_rose(s)}
LONG_RUNNING = {name: s for name, s in ROSE_SERVICES.items() if name not in ONE_SHOT}


def _mounts(service: dict) -> list[dict]:
    """Every volume of a service in one form (short `source:target[:ro]` or long syntax)."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            out.append({"source": source, "target": target, "read_only": mode == ["ro"], "subpath": None, "nocopy": False})
        else:
            options = volume.get("volume") or {}
            out.append(
                {
                    "source": volume["source"],
                    "target": volume["target"],
                    "read_only": bool(volume.get("read_only")),
                    "subpath": options.get("subpath"),
                    "nocopy": bool(options.get("nocopy")),
                }
            )
    return out


def _credential_mounts(service: dict) -> list[dict]:
    return [m for m in _mounts(service) if m["source"] == CREDENTIALS]


# ---- the Compose Specification ---------------------------------------------------------------


def test_compose_file_validates_against_the_compose_specification():
    assert _schema_errors(COMPOSE) == []


def test_the_schema_check_is_not_vacuous():
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["scheduler"]["depends_on"]["provision"]["condition"] = "service_ready"
    broken["services"]["scheduler"]["helthcheck"] = {"test": ["CMD", "true"]}
    broken["servics"] = {}
    errors = " ".join(_schema_errors(broken))
    assert "servics" in errors and "helthcheck" in errors and "depends_on" in errors


# ---- commands are real `rose` commands -------------------------------------------------------


def _interpolated(argv: list[str]) -> list[str]:
    """`${VAR:-default}` as compose expands it with VAR unset (the file's defaults)."""
    return [re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", a) for a in argv]


def _rose_commands() -> list[list[str]]:
    """Every command and healthcheck in the file that runs `rose` (with the file's defaults), without duplicates."""
    found: list[list[str]] = []
    for service in SERVICES.values():
        argv = service.get("command")
        if argv and argv[0] == "rose":
            found.append(_interpolated(list(argv)))
        test = (service.get("healthcheck") or {}).get("test") or []
        if test[:2] == ["CMD", "rose"]:
            found.append(_interpolated(list(test[1:])))
    unique: list[list[str]] = []
    for argv in found:
        if argv not in unique:
            unique.append(argv)
    return unique


def test_commands_are_exec_form_lists():
    """Exec form: the service gets SIGTERM itself (drain, goodbye heartbeat) instead of a shell getting it."""
    for name, service in SERVICES.items():
        if "command" in service:
            assert isinstance(service["command"], list), name
        test = (service.get("healthcheck") or {}).get("test")
        if test is not None:
            assert isinstance(test, list) and test[0] == "CMD", name


def test_every_rose_command_parses():
    parser = build_parser()
    for argv in _rose_commands():
        args = parser.parse_args(argv[1:])  # exits (SystemExit) on anything argparse refuses
        assert callable(args.func), argv


# Runs each command's `--help` through the console script's function, `rose.cli.main:main`, all in one
# fresh interpreter: a process per command paid the imports (torch, transformers) 30 times over.
HELP_CHILD = """
import contextlib, io, json, sys
from rose.cli.main import main
answers = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv + ["--help"])
        except SystemExit as exc:
            code = exc.code
    answers.append([argv, code, out.getvalue()])
print(json.dumps(answers))
"""


def test_every_rose_command_answers_help():
    """`rose ... --help` exits 0, from the function the image's `rose` console script calls."""
    commands = _rose_commands()
    assert len(commands) >= 10
    done = subprocess.run(
        [sys.executable, "-c", HELP_CHILD, json.dumps([argv[1:] for argv in commands])], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout.splitlines()[-1])
    assert [a[0] for a in answers] == [argv[1:] for argv in commands]
    for argv, code, text in answers:
        assert code in (0, None) and "usage:" in text, f"{argv}: {text}"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'rose = "rose.cli.main:main"' in pyproject  # the `rose` the image puts on PATH


# ---- services, dependencies, health ----------------------------------------------------------


def test_every_rose_service_runs_and_the_trainer_is_a_profile():
    running = {}
    for name, service in ROSE_SERVICES.items():
        argv = service["command"]
        if argv[1] == "run":
            running.setdefault(argv[2], []).append(name)
    assert set(running) == set(SERVICE_MODULES)
    for module, names in running.items():
        for name in names:
            profiles = SERVICES[name].get("profiles", [])
            if module in ON_DEMAND_SERVICES:
                assert profiles == ["train"], name
            elif name != "executor-gpu":
                assert profiles == [], name
    roles = sorted(SERVICES[n]["environment"]["ROSE_ROLE"] for n in running["executor"] if not SERVICES[n].get("profiles"))
    assert roles == ["dedicated", "serving", "serving"]


def test_gpu_profile_reserves_an_nvidia_device_with_cuda_torch():
    gpu = SERVICES["executor-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"] == ["rose", "run", "executor"]
    assert gpu["environment"]["ROSE_ENGINE__DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]
    assert gpu["image"] != SERVICES["scheduler"]["image"]  # the CPU image keeps CPU torch


def test_long_running_rose_services_have_real_healthchecks():
    for name, service in LONG_RUNNING.items():
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "rose", "health"], name
        if service["command"][:2] == ["rose", "run"]:
            assert test[3] == service["command"][2] and "--local" in test, name  # this container's own heartbeat
        if service["command"] == ["rose", "run", "executor"]:
            port = service["environment"]["ROSE_HTTP__PORT"]
            assert f"http://127.0.0.1:{port}/health" in test, name
    for node in NATS_NODES:
        assert SERVICES[node]["healthcheck"]["test"] == ["CMD", "rose", "health", "--http", "http://127.0.0.1:8222/healthz"]


def test_dependencies_have_conditions_that_can_be_met():
    for name, service in SERVICES.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for target, spec in depends.items():
            assert target in SERVICES, f"{name} depends on unknown {target}"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[target], f"{name} waits for {target} to be healthy, but it has no healthcheck"
            if condition == "service_completed_successfully":
                assert SERVICES[target].get("restart") == "no", f"{target} must be a one-shot"
            if not service.get("profiles"):
                assert not SERVICES[target].get("profiles"), f"{name} (always on) depends on {target} (profile only)"
    for name in LONG_RUNNING:
        depends = SERVICES[name]["depends_on"]
        assert depends["provision"]["condition"] == "service_completed_successfully", name
        assert depends["models-init"]["condition"] == "service_completed_successfully", name
        assert depends["security-init"]["condition"] == "service_completed_successfully", name
    assert {n: SERVICES["provision"]["depends_on"][n]["condition"] for n in NATS_NODES} == dict.fromkeys(NATS_NODES, "service_healthy")


def test_rose_services_see_the_whole_cluster_with_r3_and_the_collector():
    for name, service in {**LONG_RUNNING, "provision": SERVICES["provision"]}.items():
        env = service["environment"]
        urls = env["NATS_URL"].split(",")
        assert urls == [f"nats://{node}:4222" for node in NATS_NODES], name
        assert env["ROSE_BUS__REPLICAS"] == "3", name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
    assert SERVICES["provision"]["command"] == ["rose", "provision", "--replicas", "3"]


def test_nats_nodes_mount_their_config_and_a_persistent_volume():
    store = re.search(r'store_dir: "([^"]+)"', (DEPLOY / "nats" / "nats-1.conf").read_text()).group(1)
    for node in NATS_NODES:
        service = SERVICES[node]
        assert service["command"] == ["nats-server", "-c", NODE_CONFIG]
        mounts = {m["source"]: m["target"] for m in _mounts(service) if m["source"] != CREDENTIALS}
        assert mounts[f"./deploy/compose/nats/{node}.conf"] == NODE_CONFIG
        assert (REPO / "deploy" / "compose" / "nats" / f"{node}.conf").exists()
        data = f"{node}-data"
        assert data in COMPOSE["volumes"] and mounts[data] == "/data" and store.startswith("/data/")


def test_models_are_built_once_into_a_shared_volume():
    init = SERVICES["models-init"]
    assert init["command"] == ["rose", "models", "init", "/models", "--preset", "${ROSE_MODELS_PRESET:-tiny}"] and "models:/models" in init["volumes"]
    for name, service in LONG_RUNNING.items():
        if service["command"][2] in ("executor", "rollout_worker", "trainer"):
            assert "models:/models:ro" in service["volumes"], name
            assert service["environment"]["ROSE_MODELS__DIR"] == "/models", name


# ---- auth: credentials from security-init, each container only its own ----------------------


def _security_init(directory: Path) -> subprocess.CompletedProcess[str]:
    """security-init's own command, with its volume (/creds) at `directory`."""
    argv = [directory.as_posix() if arg == "/creds" else arg for arg in SERVICES["security-init"]["command"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_") and k != "NATS_URL"}
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *argv[1:]], capture_output=True, text=True, timeout=120, env=env)


def test_security_init_is_a_one_shot_that_writes_the_credentials_volume_and_keeps_it(tmp_path):
    init = SERVICES["security-init"]
    argv = init["command"]
    assert argv[:4] == ["rose", "security", "init", "/creds"] and "--force" not in argv  # a re-run must not rotate
    routes = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--cluster-route"]
    assert routes == compose_route_addresses(len(NATS_NODES)) == [f"{node}:6222" for node in NATS_NODES]
    assert init["restart"] == "no" and not init.get("depends_on") and not init.get("profiles")
    assert _mounts(init) == [{"source": CREDENTIALS, "target": "/creds", "read_only": False, "subpath": None, "nocopy": False}]
    assert CREDENTIALS in COMPOSE["volumes"]
    assert re.search(
        r"^\s+&& mkdir -p .*/creds\b.*\n\s+&& chown rose:rose .*/creds\b", (DEPLOY / "Dockerfile").read_text(), re.M
    )  # the volume starts owned by `rose`

    creds = tmp_path / "creds"
    first = _security_init(creds)
    assert first.returncode == 0, first.stdout + first.stderr
    files = {p.name: p.read_bytes() for p in creds.iterdir()}
    assert set(files) >= {f"{u}{SEED_SUFFIX}" for u in USERS} | {SERVER_INCLUDE, CLUSTER_INCLUDE, ROUTE_SECRET}
    assert all(stat.S_IMODE(os.stat(creds / name).st_mode) == 0o600 for name in files)
    password = files[ROUTE_SECRET].decode().strip()
    cluster = files[CLUSTER_INCLUDE].decode()
    assert f'password: "{password}"' in cluster
    assert all(f'"nats-route://rose-route:{password}@{route}"' in cluster for route in routes)

    # `docker compose up` runs it again each time: seeds and the route password stay, the includes are rewritten.
    (creds / SERVER_INCLUDE).write_text("# stale\n")
    (creds / CLUSTER_INCLUDE).write_text("# stale\n")
    again = _security_init(creds)
    assert again.returncode == 0, again.stdout + again.stderr
    assert {p.name: p.read_bytes() for p in creds.iterdir()} == files


def _executors() -> dict[str, str]:
    """Every executor container (all profiles) and its instance name."""
    return {n: s["environment"]["ROSE_RUNTIME__INSTANCE"] for n, s in ROSE_SERVICES.items() if s["command"] == ["rose", "run", "executor"]}


def test_every_rose_container_mounts_exactly_its_own_seed():
    """`rose run X` gets X.nk and nothing else of the volume (an executor: its own instance's seed, not the
    shared `executor.nk`); its healthcheck runs on the same seed."""
    executors = _executors()
    for name, service in ROSE_SERVICES.items():
        if name == "security-init":
            continue
        argv = service["command"]
        mounts = _credential_mounts(service)
        if argv[:3] == ["rose", "run", "executor"]:
            user = instance_user("executor", executors[name])
        elif argv[:2] == ["rose", "run"]:
            user = argv[2]
        elif argv[:2] == ["rose", "provision"]:
            user = OPERATOR  # creates streams, buckets and stores: the operator's right
        else:
            assert mounts == [] and "ROSE_BUS__NKEY_SEED_FILE" not in (service.get("environment") or {}), name  # models-init, weights-key
            continue
        seed = f"{user}{SEED_SUFFIX}"
        assert mounts == [{"source": CREDENTIALS, "target": f"/creds/{seed}", "read_only": True, "subpath": seed, "nocopy": True}], name
        assert service["environment"]["ROSE_BUS__NKEY_SEED_FILE"] == f"/creds/{seed}", name
        test = (service.get("healthcheck") or {}).get("test") or []
        if "--local" in test:  # `rose health SERVICE --local` reads ROSE_BUS__NKEY_SEED_FILE: the service's own seed
            assert test[3] == user.split("@")[0], name
            if name in executors:  # on an instance seed it may only hear that instance's heartbeats: it names it
                assert test[test.index("--instance") + 1] == executors[name], name
    operators = [n for n, s in SERVICES.items() if any(m["subpath"] == f"{OPERATOR}{SEED_SUFFIX}" for m in _credential_mounts(s))]
    assert operators == ["provision"]
    assert len(executors) == 4 and len(set(executors.values())) == 4
    assert not any(m["subpath"] == f"executor{SEED_SUFFIX}" for s in SERVICES.values() for m in _credential_mounts(s))  # the shared one: nobody
    for name in executors:  # and the weights' trusted keys they already had
        assert {"source": "weights-trusted", "target": "/trusted", "read_only": True, "subpath": None, "nocopy": False} in _mounts(SERVICES[name]), (
            name
        )


def test_security_init_makes_a_user_for_every_executor_instance_pinned_to_it(tmp_path):
    """Its --instance list is exactly the compose executors' instance names (the gpu profile's too), and each
    user it writes may serve, report and heartbeat as that executor only."""
    argv = SERVICES["security-init"]["command"]
    declared = parse_instances(argv[i + 1] for i, arg in enumerate(argv) if arg == "--instance")
    assert set(declared) == {"executor"} and sorted(declared["executor"]) == sorted(_executors().values())
    creds = tmp_path / "creds"
    assert _security_init(creds).returncode == 0
    conf = (creds / SERVER_INCLUDE).read_text()
    for instance in declared["executor"]:
        seed = creds / f"{instance_user('executor', instance)}{SEED_SUFFIX}"
        assert stat.S_IMODE(os.stat(seed).st_mode) == 0o600, seed
        assert f"# {instance_user('executor', instance)}\n" in conf
        perms = permissions("executor", instance=instance)
        assert f"rose.executor.{instance}.generate" in perms.subscribe and "rose.executor.*.generate" not in perms.subscribe
        assert f"rose.svc.heartbeat.executor.{instance}" in perms.publish and f"rose.telemetry.executor.{instance}" in perms.publish


def test_nats_nodes_mount_only_the_server_includes_and_their_config_includes_them():
    wanted = {
        SERVER_INCLUDE: f"/etc/nats/{COMPOSE_AUTH_DIR}/{SERVER_INCLUDE}",
        CLUSTER_INCLUDE: f"/etc/nats/{COMPOSE_AUTH_DIR}/{CLUSTER_INCLUDE}",
    }
    for node in NATS_NODES:
        mounts = _credential_mounts(SERVICES[node])
        assert {m["subpath"]: m["target"] for m in mounts} == wanted and len(mounts) == 2, node  # no seed, no route secret
        assert all(m["read_only"] and m["nocopy"] for m in mounts), node
        assert SERVICES[node]["depends_on"] == {"security-init": {"condition": "service_completed_successfully"}}, node
        text = (DEPLOY / "nats" / f"{node}.conf").read_text()
        includes = re.findall(r'^\s*include "([^"]+)"', text, re.M)
        resolved = {os.path.normpath(os.path.join(os.path.dirname(NODE_CONFIG), inc)) for inc in includes}  # relative to the config
        assert resolved == set(wanted.values()), node
        cluster_block = text[text.index("cluster {") :]
        assert f'include "{COMPOSE_AUTH_DIR}/{CLUSTER_INCLUDE}"' in cluster_block.split("}")[0], node  # inside cluster {}
        assert "nats-route://" not in text, node  # routes carry the password: only in the generated include


def test_nothing_mounts_a_credential_file_security_init_does_not_write(tmp_path):
    creds = tmp_path / "creds"
    assert _security_init(creds).returncode == 0
    written = {p.name for p in creds.iterdir()}
    for name, service in SERVICES.items():
        for mount in _credential_mounts(service):
            if name == "security-init":
                continue
            assert mount["subpath"] in written, f"{name} mounts {mount['subpath']!r}, which security-init does not write"
            # a volume subpath must exist when the container starts: only after security-init has completed
            depends = service.get("depends_on") or {}
            assert depends.get("security-init", {}).get("condition") == "service_completed_successfully", name
            assert mount["read_only"] and mount["nocopy"], name
        for mount in _mounts(service):
            if mount["source"].startswith("./"):
                assert (REPO / mount["source"]).exists(), f"{name} mounts {mount['source']}, which does not exist"
        seed_file = (service.get("environment") or {}).get("ROSE_BUS__NKEY_SEED_FILE")
        if seed_file:
            assert seed_file in {m["target"] for m in _credential_mounts(service)}, name


def test_one_shots_run_in_order():
    """security-init, then the NATS nodes (healthy), then provision as the operator, then every service."""
    provision = SERVICES["provision"]["depends_on"]
    assert provision["security-init"]["condition"] == "service_completed_successfully"
    assert all(provision[n]["condition"] == "service_healthy" for n in NATS_NODES)
    for name in LONG_RUNNING:
        assert SERVICES[name]["depends_on"]["provision"]["condition"] == "service_completed_successfully", name

    # no cycle: every chain of depends_on ends
    def chain(name: str, seen: tuple[str, ...] = ()) -> None:
        assert name not in seen, f"dependency cycle: {' -> '.join((*seen, name))}"
        for target in SERVICES[name].get("depends_on") or {}:
            chain(target, (*seen, name))

    for name in SERVICES:
        chain(name)


def test_the_compose_readme_says_auth_is_on_and_what_subpath_needs():
    doc = (DEPLOY / "README.md").read_text()
    assert "security-init" in doc and "Docker Engine 26" in doc
    assert "no authorization block" not in doc
    readme = (REPO / "README.md").read_text()
    assert "without auth" not in readme and "does not yet run with auth" not in readme


# ---- observability ---------------------------------------------------------------------------


def test_collector_pipelines_are_wired():
    config = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"{component} is not defined under {kind}"
    pipes = config["service"]["pipelines"]
    assert pipes["traces"]["exporters"] == ["otlp/jaeger"] and config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert pipes["metrics"]["exporters"] == ["prometheus"] and config["exporters"]["prometheus"]["endpoint"] == "0.0.0.0:8889"
    mount = SERVICES["otel-collector"]["volumes"][0]
    assert mount.startswith("./deploy/compose/otel/collector.yaml:") and SERVICES["otel-collector"]["command"] == [f"--config={mount.split(':')[1]}"]


def test_prometheus_scrapes_executors_and_the_collector():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]] for job in config["scrape_configs"]}
    executors = [n for n, s in ROSE_SERVICES.items() if s["command"] == ["rose", "run", "executor"]]
    assert sorted(targets["rose-executor"]) == sorted(f"{n}:{SERVICES[n]['environment']['ROSE_HTTP__PORT']}" for n in executors)
    assert targets["otel-collector-exporter"] == ["otel-collector:8889"]
    assert targets["otel-collector"] == ["otel-collector:8888"]
    for target in (t for ts in targets.values() for t in ts):
        host = target.split(":")[0]
        assert host in SERVICES or host == "127.0.0.1", target


def test_grafana_is_provisioned_with_datasources_and_the_dashboards_folder():
    provisioning = DEPLOY / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and by_uid["prometheus"]["isDefault"]
    assert by_uid["jaeger"]["url"] == "http://jaeger:16686"
    provider = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())["providers"][0]
    mounts = dict(v.split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert mounts["./deploy/compose/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/compose/grafana/provisioning"] == "/etc/grafana/provisioning"


# ---- image and configuration -----------------------------------------------------------------


def test_dockerfile_installs_the_project_with_constraints_and_bakes_no_secret():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.\d+-slim$", dockerfile, re.M) and "FROM ${BASE}" in dockerfile
    assert 'pip install -c constraints.txt ".${ROSE_EXTRAS}"' in dockerfile  # the project (plus the gpu extras in the CUDA image)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    settings = re.findall(r"^(?:ENV|ARG)\s+(.+)$", dockerfile, re.M)
    assert not [s for s in settings if re.search(r"PASSWORD|SECRET|TOKEN|CREDS|NKEY|_KEY", s, re.I)]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", ".rose"} <= set(ignore)
    for service in SERVICES.values():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN", key):
                assert str(value).startswith("${"), f"{key} must come from the environment, not the file"


def test_every_variable_is_documented_in_one_place():
    doc = (DEPLOY / "README.md").read_text()
    text = (REPO / "docker-compose.yml").read_text()
    interpolated = set(re.findall(r"\$\{([A-Z0-9_]+)", text))
    assert interpolated and not [v for v in sorted(interpolated) if f"`{v}`" not in doc]
    set_here = {k for s in SERVICES.values() for k in (s.get("environment") or {}) if k.startswith(("ROSE_", "NATS_", "OTEL_"))}
    assert not [v for v in sorted(set_here) if f"`{v}`" not in doc]


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose/otel/collector.yaml", "deploy/compose/prometheus/prometheus.yml"])
def test_yaml_files_parse(path):
    assert yaml.safe_load((REPO / path).read_text())
