"""The files behind scripts/compose-check, without Docker: what the check itself takes ~10 minutes to run.

- deploy/compose/host-network.yml over docker-compose.yml (merged as Compose merges, `!reset` and
  `!override` included) is a valid Compose file: every service it names exists, every one that
  runs has the host's network, nothing is published, every listener is on 127.0.0.1 on a port of
  its own and none is a default port (a NATS of the host's may hold 4222);
- the host-network NATS configs are the renderer's, and the routes, client URLs and health probes
  in the override are those configs' ports; Prometheus scrapes exactly the ports the override gives;
- the alert rules and the dashboards query only metrics that the code defines;
- the wheelhouse manifest is this venv's versions of what `rose-rl[agents]` needs (torch at the
  constraints' pin, the openai client, no test tool), and a wheel pip builds from this tree is found
  for its pin; the Dockerfile copies every package folder of pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.utils import canonicalize_name

from rose.shared.nats_server import compose_host_addresses, compose_node_configs

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "compose"
SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
DEFAULT_PORTS = {4222, 4223, 4224, 6222, 8222, 8000, 8001, 8002, 8003, 8004, 9090, 3000, 4317, 4318, 16686}
NOT_STARTED = {"otel-collector", "jaeger", "grafana", "sglang-serving", "sglang-rollout", "executor-gpu"}  # no image here; profile gpu


def _load_check():
    spec = importlib.util.spec_from_file_location("compose_check", DEPLOY / "check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check = _load_check()


class _Tagged:
    def __init__(self, tag: str, value):
        self.tag, self.value = tag, value


class _Loader(yaml.SafeLoader):
    pass


for _tag in ("!reset", "!override"):
    _Loader.add_constructor(
        _tag,
        lambda loader, node, t=_tag: _Tagged(
            t,
            loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_mapping(node, deep=True)
            if isinstance(node, yaml.MappingNode)
            else None,
        ),
    )


def _merge_service(base: dict, over: dict) -> dict:
    """Compose's merge for the keys the override uses: mappings merged, volumes by target, command and
    healthcheck.test replaced, `!reset` clears, `!override` replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, _Tagged):
            if value.tag == "!reset":
                out.pop(key, None)
            else:
                out[key] = value.value
        elif key == "volumes":
            by_target = {_target(v): v for v in out.get("volumes", [])}
            by_target.update({_target(v): v for v in value})
            out["volumes"] = list(by_target.values())
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _target(volume) -> str:
    return volume["target"] if isinstance(volume, dict) else volume.split(":")[1]


BASE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
OVERRIDE = yaml.load((DEPLOY / "host-network.yml").read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader with two tags
MERGED = {**BASE, "services": {n: _merge_service(s, OVERRIDE["services"].get(n, {})) for n, s in BASE["services"].items()}}
STARTED = {n: s for n, s in MERGED["services"].items() if n not in NOT_STARTED}
PROM = yaml.safe_load((DEPLOY / "prometheus" / "host-network.yml").read_text())


def _env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (MERGED["services"][service].get("environment") or {}).items()}


def test_the_merged_file_is_valid_compose_and_names_only_existing_services():
    assert not set(OVERRIDE["services"]) - set(BASE["services"])
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(MERGED)]
    assert not errors, errors
    # the schema check is not vacuous: an unknown key in a merged service is refused
    broken = json.loads(json.dumps(MERGED))
    broken["services"]["scheduler"]["network_mod"] = "host"
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(broken))


def test_every_started_service_is_on_the_host_network_or_none_and_publishes_nothing():
    assert set(STARTED) == set(check.CORE) | set(check.TRAIN)
    for name, service in STARTED.items():
        assert service.get("network_mode") in ("host", "none"), name
        assert "ports" not in service, name
        assert "otel-collector" not in (service.get("depends_on") or {}), name
        assert _env(name).get("OTEL_EXPORTER_OTLP_ENDPOINT", "") == "", name
    assert {n for n, s in STARTED.items() if s["network_mode"] == "none"} == {"security-init", "models-init", "weights-key"}


def _listeners() -> dict[str, list[str]]:
    """HOST:PORT of every listener the override sets, by service."""
    out: dict[str, list[str]] = {}
    nats = compose_host_addresses(3)
    for i in range(3):
        out[f"nats-{i + 1}"] = [nats[kind][i] for kind in ("client", "cluster", "monitor")]
    for name in STARTED:
        env = _env(name)
        if "ROSE_HTTP__PORT" in env:
            out.setdefault(name, []).append(f"{env['ROSE_HTTP__HOST']}:{env['ROSE_HTTP__PORT']}")
        if "ROSE_RUNTIME__METRICS_PORT" in env:
            out.setdefault(name, []).append(f"{env.get('ROSE_RUNTIME__METRICS_HOST', '127.0.0.1')}:{env['ROSE_RUNTIME__METRICS_PORT']}")
    prometheus = next(a for a in STARTED["prometheus"]["command"] if a.startswith("--web.listen-address="))
    out["prometheus"] = [prometheus.split("=", 1)[1]]
    return out


def test_listeners_are_on_loopback_each_on_a_port_of_its_own_and_none_a_default():
    addresses = [a for listed in _listeners().values() for a in listed]
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert len(ports) == len(set(ports)), sorted(ports)
    assert not set(ports) & DEFAULT_PORTS
    # the check waits for exactly these to be free before it starts
    assert set(ports) == set(check.LISTEN_PORTS)


def test_nats_nodes_routes_urls_and_probes_use_the_host_configs():
    on_disk = {p.name: p.read_text() for p in sorted((DEPLOY / "nats" / "host").glob("*.conf"))}
    assert on_disk == compose_node_configs(3, host_network=True), (
        "deploy/compose/nats/host drifted from the renderer; regenerate with\n"
        "  python -c 'from rose.shared.nats_server import write_compose_configs as w; w(\"deploy/compose/nats/host\", host_network=True)'"
    )
    nats = compose_host_addresses(3)
    for i in range(3):
        node = MERGED["services"][f"nats-{i + 1}"]
        mounted = {_target(v): v for v in node["volumes"]}["/etc/nats/nats.conf"]
        assert mounted.split(":")[0] == f"./deploy/compose/nats/host/nats-{i + 1}.conf"
        assert node["healthcheck"]["test"][-1] == f"http://{nats['monitor'][i]}/healthz"
    command = MERGED["services"]["security-init"]["command"]
    routes = [command[i + 1] for i, a in enumerate(command) if a == "--cluster-route"]
    assert routes == nats["cluster"]
    # the instances are still the base file's: only the routes differ
    assert [a for a in command if a.startswith("executor=")] == [a for a in BASE["services"]["security-init"]["command"] if a.startswith("executor=")]
    url = ",".join(f"nats://{a}" for a in nats["client"])
    assert url == check.NATS_URL
    for name, service in STARTED.items():
        if service["network_mode"] == "host" and (service.get("command") or [""])[0] == "rose":
            assert _env(name)["NATS_URL"] == url, name


def test_executor_health_probes_and_public_host_follow_their_ports():
    for name, port in check.EXECUTORS.items():
        env = _env(name)
        assert env["ROSE_HTTP__PORT"] == str(port) and env["ROSE_HTTP__PUBLIC_HOST"] == "127.0.0.1"
        assert MERGED["services"][name]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"


def test_prometheus_scrapes_every_service_on_the_port_the_override_gives_it():
    scraped = {(job["job_name"], t) for job in PROM["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    want = {("prometheus", _listeners()["prometheus"][0])}
    for name, service in STARTED.items():
        env = _env(name)
        job = f"rose-{(service['command'][2] if name.startswith('executor') else name).replace('_', '-')}"
        if "ROSE_HTTP__PORT" in env:  # an executor: its HTTP port serves /metrics
            want.add((job, f"127.0.0.1:{env['ROSE_HTTP__PORT']}"))
        elif "ROSE_RUNTIME__METRICS_PORT" in env:
            want.add((job, f"127.0.0.1:{env['ROSE_RUNTIME__METRICS_PORT']}"))
    assert scraped == want
    assert PROM["rule_files"] == yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["rule_files"] == ["rules.yml"]


def _defined_metrics() -> set[str]:
    """Prometheus names of the instruments the code creates (`metric_name("a.b")` + unit and counter suffixes)."""
    names = set()
    for path in [*REPO.glob("services/**/*.py"), *REPO.glob("shared/**/*.py")]:
        text = path.read_text()
        for m in re.finditer(r'create_(counter|histogram|gauge|up_down_counter)\(\s*metric_name\("([a-z_.]+)"\)(?:,\s*unit="([^"]*)")?', text):
            kind, name, unit = m.group(1), "rose_" + m.group(2).replace(".", "_"), m.group(3) or ""
            if unit == "s":
                name += "_seconds"
            elif unit == "By":
                name += "_bytes"
            elif unit == "{request}/s":
                name += "_per_second"
            if kind == "counter":
                names.add(name + "_total")
            elif kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
            else:
                names.add(name)
    return names


def _queried(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(rose_[a-z_]+)\b", expr)}


def test_rules_and_dashboards_query_only_metrics_the_code_defines():
    defined = _defined_metrics()
    assert "rose_trainer_trajectories_missing_total" in defined and "rose_executor_ttft_seconds_bucket" in defined
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]] + [q for _, q in check.dashboard_queries()]
    unknown = sorted({m for e in exprs for m in _queried(e)} - defined)
    assert not unknown, unknown
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"RoseServingTTFTSLOViolated", "RoseServingTPOTSLOViolated", "RoseServingBurst", "RoseTrajectoriesLost"} <= alerts
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules.test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])}
    assert {"RoseServingTTFTSLOViolated", "RoseServingTPOTSLOViolated", "RoseServingBurst", "RoseTrajectoriesLost"} <= tested


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version  # PEP 503, as the manifest names them
    return pins


def test_the_wheelhouse_manifest_is_this_venvs_versions_of_what_the_image_needs():
    pins = dict(p.split("==") for p in check.manifest())
    for name, version in _constraints().items():
        if name in pins:
            assert pins[name].split("+")[0] == version, (name, pins[name], version)
    assert pins["torch"].split("+")[0] == _constraints()["torch"]
    assert {"nats-py", "msgspec", "aiohttp", "openai", "nkeys", "transformers"} <= set(pins)
    assert not {"pytest", "ruff", "mypy", "hypothesis", "rose-rl"} & set(pins)
    without_agents = dict(p.split("==") for p in check.manifest(extras=()))
    assert "openai" in pins and "openai" not in without_agents and set(without_agents) < set(pins)


def test_a_wheel_built_from_this_tree_is_found_for_its_pin(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert check.missing_wheels(tmp_path, [f"rose-rl=={version}", "torch==0.0.1"]) == ["torch==0.0.1"]


def test_the_dockerfile_copies_every_package_folder_and_can_install_from_the_wheelhouse():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {p.split(".")[1] for p in packages if p.count(".") >= 1}
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", dockerfile, re.M))
    assert copied == folders
    assert "ARG BASE=python:3.11-slim" in dockerfile and "FROM ${BASE}" in dockerfile
    assert 'pip install --no-index --find-links /wheels -c /wheels/manifest.txt "rose-rl${ROSE_EXTRAS}"' in dockerfile
    assert (DEPLOY / "wheelhouse" / "README.md").exists()


def test_a_saved_image_is_keyed_by_every_file_the_dockerfile_copies(tmp_path):
    """scripts/compose-check loads saved images only while what they are made of is unchanged."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    sources = {src.rstrip("/") for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for src in line.split()[:-1]}
    assert sources - {"README.md"} == set(check.IMAGE_INPUTS) - {"deploy/compose/Dockerfile"}
    ctx = tmp_path / "ctx"
    for rel in check.IMAGE_INPUTS:
        path = ctx / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel == "deploy/compose/wheelhouse":
            path.mkdir()
            (path / "torch-2.0.0-cp311-none-any.whl").write_bytes(b"torch")
            (path / "rose_rl-0.1.0-py3-none-any.whl").write_bytes(b"built each run")
        elif rel.endswith(("Dockerfile", ".txt", ".toml", ".py")):
            path.write_text(rel)
        else:
            path.mkdir()
            (path / "m.py").write_text(rel)
    (ctx / "README.md").write_text("readme")
    base = tmp_path / "base.tar"
    base.write_bytes(b"base")
    key = check.images_key(ctx, base)
    assert len(key) == 16 and check.images_key(ctx, base) == key
    (ctx / "deploy/compose/wheelhouse/rose_rl-0.1.0-py3-none-any.whl").write_bytes(b"rebuilt, same tree")
    (ctx / "README.md").write_text("the long description only")
    assert check.images_key(ctx, base) == key
    for changed in ["services/m.py", "constraints.txt", "deploy/compose/wheelhouse/torch-2.0.0-cp311-none-any.whl", "deploy/compose/Dockerfile"]:
        old = (ctx / changed).read_bytes()
        (ctx / changed).write_bytes(old + b"x")
        assert check.images_key(ctx, base) != key, changed
        (ctx / changed).write_bytes(old)
    assert check.images_key(ctx, base) == key
    base.write_bytes(b"another base")
    assert check.images_key(ctx, base) != key


@pytest.mark.parametrize("path", ["deploy/compose/prometheus/host-network.yml", "deploy/compose/prometheus/rules.yml"])
def test_prometheus_files_parse(path):
    assert yaml.safe_load((REPO / path).read_text())
