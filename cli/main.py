"""The `rose` command: one argparse tree, each command explained by `--help`."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path

from rose import __version__
from rose.bench.options import MODEL_PRESET_NAMES, add_coserve_arguments, number_list
from rose.sim import POLICIES

from .service_table import EMULATED_EXECUTORS_MODULE, ON_DEMAND_SERVICES, SERVICE_MODULES

E2E_JSON = "bench-out/e2e.json"
EMULATED_DURATION_S = 120.0  # emulated seconds of a policy's window
EMULATED_DEMO_S = 60.0  # emulated seconds of `rose demo --emulate`


def _cmd_run(args: argparse.Namespace) -> int:
    name = SERVICE_MODULES[args.service]
    if args.service == "executor" and any(a == "--emulate" or a.startswith("--emulate=") for a in args.service_args):
        name = EMULATED_EXECUTORS_MODULE  # a group of emulated executors in this one process
    return importlib.import_module(name).main(args.service_args)


def _cmd_up(args: argparse.Namespace) -> int:
    from .up import up

    return up(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from .status import status

    return asyncio.run(status(args))


def _cmd_health(args: argparse.Namespace) -> int:
    from .health import health_command

    return health_command(args)


def _cmd_provision(args: argparse.Namespace) -> int:
    from .provision import provision_command

    return provision_command(args)


def _cmd_contracts_export(args: argparse.Namespace) -> int:
    from rose.contracts.export import export

    written = export(args.dir)
    print(f"wrote {len(written) - 1} JSON Schemas and asyncapi.json under {Path(args.dir).resolve()}")
    return 0


def _cmd_contracts_docs(args: argparse.Namespace) -> int:
    from rose.contracts.export import events_markdown

    path = Path(args.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events_markdown())
    print(f"wrote {path.resolve()}")
    return 0


def _cmd_events_forward(args: argparse.Namespace) -> int:
    from .events_forward import forward

    return forward(args)


def _cmd_models_init(args: argparse.Namespace) -> int:
    from rose.shared.models import init_models

    paths = init_models(args.dir, seed=args.seed, preset=args.preset)
    print(f"serving model: {paths.serving}\npolicy model:  {paths.policy}")
    return 0


def _cmd_bench_bus(args: argparse.Namespace) -> int:
    from rose.bench.bus import run_bus_bench

    result = asyncio.run(run_bus_bench(out_json=args.json, requests=args.requests, rounds=args.rounds))
    return 0 if result["meets_target"] else 1


def _cmd_bench_security(args: argparse.Namespace) -> int:
    from rose.bench.security import print_summary, run_security_bench

    result = run_security_bench(args.json, quick=args.quick, include_sandbox=not args.no_sandbox)
    print_summary(result, args.json)
    return 0 if result["attacks_blocked"] == result["attacks_tried"] else 1


def _cmd_bench_coserve(args: argparse.Namespace) -> int:
    from rose.bench.coserve import command

    return command(args)


def _cmd_bench_elastic(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.bench.elastic import run_elastic_bench

    result = run_elastic_bench(
        out_json=args.json,
        seed=args.seed,
        executors=args.executors,
        dedicated=args.dedicated,
        burst_factor=args.burst_factor,
        duration_s=args.duration,
        model_dir=args.models,
        console=Console(),
        burst_factors=args.burst_factors,
        min_bursts=args.min_bursts,
    )
    return 0 if result["tasks_lost"] == 0 else 1


def _cmd_bench_e2e(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.emulate:
        return _bench_e2e_emulated(args)
    from rose.bench.e2e import run_e2e_bench

    result = run_e2e_bench(
        out_json=args.json,
        seed=args.seed,
        duration_s=args.duration,
        policies=args.policies,
        model_dir=args.models,
        serving=args.serving,
        dedicated=args.dedicated,
        console=Console(),
        warm_start_steps=args.warm_start_steps,
        pin="none" if args.unpinned else args.pin,
        rollout_demand=args.rollout_demand,
    )
    return 0 if all(p["trajectories_lost"] == 0 for p in result["policies"].values()) else 1


def _bench_e2e_emulated(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.bench.e2e_emulated import run_emulated_e2e
    from rose.bench.emulated import BENCH_WORKLOAD, EmulatedJob
    from rose.shared.devices import parse_fleet

    gpus, device = parse_fleet(args.emulate)
    job = EmulatedJob(
        gpus=gpus,
        device=device.name,
        model=args.model,
        policy_model=args.policy_model or "",
        dedicated_ratio=args.dedicated_ratio,
        demand=args.demand,
        mode=args.mode,
        seed=args.seed,
        load=args.load,
        time_scale=args.time_scale,
        rollout_max_batch=args.rollout_max_batch,
        workload={**BENCH_WORKLOAD, **(args.workload or {})},
        trace=args.trace or "",
    )
    result = run_emulated_e2e(
        out_json=args.json if args.json != E2E_JSON else "bench-out/e2e-emulated.json",
        job=job,
        policies=args.policies,
        duration_s=args.duration or EMULATED_DURATION_S,
        until_steps=args.until_steps,
        model_dir=args.models,
        console=Console(),
    )
    return 0 if all(p["trajectories_lost"] == 0 for p in result["policies"].values()) else 1


def _cmd_bench_faults(args: argparse.Namespace) -> int:
    from rose.bench.faults import run_faults_bench

    result = run_faults_bench(out_json=args.json, seed=args.seed, quick=args.quick, models=args.models)
    ok = result["faults_survived"] == result["faults_injected"] and result["trajectories_lost"] == 0 and result["weight_versions_lost"] == 0
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.emulate:
        return _demo_emulated(args)
    from rose.bench.demo import run_demo

    summary = run_demo(
        out=args.out,
        duration=args.duration,
        seed=args.seed,
        models=args.models,
        serving=args.serving,
        dedicated=args.dedicated,
        warm_start_steps=args.warm_start_steps,
        until_steps=args.until_steps,
        agent=args.agent,
    )
    return 0 if summary["trajectories"]["lost"] == 0 else 1


def _demo_emulated(args: argparse.Namespace) -> int:
    """`rose demo --emulate 8xH100:7B [--trace CSV]`: a dry run of ROSE on emulated GPUs, rose only, the simulator beside."""
    from pathlib import Path

    from rich.console import Console

    from rose.bench.e2e_emulated import run_emulated_e2e
    from rose.bench.emulated import EmulatedJob
    from rose.services.executor.group import EmulatedFleet

    fleet = EmulatedFleet.parse(args.emulate)
    job = EmulatedJob(
        gpus=fleet.gpus,
        device=fleet.device,
        model=fleet.serving_model,
        policy_model=fleet.policy_model,
        dedicated_ratio=args.dedicated_ratio,
        seed=args.seed,
        time_scale=args.time_scale,
        trace=args.trace or "",
    )
    result = run_emulated_e2e(
        out_json=str(Path(args.out) / "summary.json"),
        job=job,
        policies=["rose"],
        duration_s=args.duration or EMULATED_DEMO_S,
        until_steps=args.until_steps,
        model_dir=args.models,
        console=Console(),
    )
    return 0 if result["policies"]["rose"]["trajectories_lost"] == 0 else 1


def _cmd_bench_weights(args: argparse.Namespace) -> int:
    from rose.bench.weights import run_weights_bench

    out = asyncio.run(run_weights_bench(out_json=args.json, params=args.params, steps=args.steps, lr=args.lr, seed=args.seed))
    return 0 if all(out["meets_target"].values()) else 1


def _cmd_bench_gateway(args: argparse.Namespace) -> int:
    from rose.bench.gateway import run_gateway_bench

    out = run_gateway_bench(out_json=args.json, pairs=args.pairs, turns=args.turns, models=args.models)
    return 0 if out["fidelity"]["tokens_differing"] == 0 and out["fidelity"]["segment_breaks_without_reason"] == 0 else 1


def _cmd_bench_control_plane(args: argparse.Namespace) -> int:
    from rose.bench.control_plane import Settings, run_control_plane_bench

    settings = Settings(
        executors=[int(n) for n in args.executors.split(",") if n.strip()],
        duration_s=args.duration,
        interval_s=args.interval,
        cluster=args.cluster,
        turns_per_s=args.turns_per_s,
        seed=args.seed,
        instances=args.instances,
        kill=args.kill,
    )
    out = asyncio.run(run_control_plane_bench(args.json, settings))
    return 0 if all(level["snapshots_lost"] == 0 for level in out["levels"]) else 1


def _cmd_bench_sim(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.bench import sim

    models = args.models or (sim.QUICK_MODELS if args.quick else sim.MODELS)
    fleets = args.gpus or (sim.QUICK_FLEETS if args.quick else sim.FLEETS)
    demands = args.demand or ([args.oversubscription] if args.oversubscription else (sim.QUICK_DEMANDS if args.quick else sim.DEMANDS))
    ratios = args.dedicated_ratio or (sim.QUICK_RATIOS if args.quick else sim.RATIOS)
    sim.run_sim_bench(
        out_json=args.json,
        seed=args.seed,
        seeds=tuple(args.seeds or ()),
        models=models,
        serving_models=tuple(args.serving_model or ()),
        policy_models=tuple(args.policy_model or ()),
        over_provision=tuple(args.over_provision or (0.0,)),
        fleets=fleets,
        demands=demands,
        ratios=ratios,
        modes=args.modes or sim.MODES,
        policies=args.policies or sim.POLICIES,
        steps=args.steps or (1 if args.quick else 2),
        jobs=args.jobs,
        device=args.device,
        load=args.load,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        quantum_ms=args.quantum_ms,
        what_if=tuple(args.what_if or ()),
        e2e=args.e2e,
        coserve=args.coserve,
        calibrate=args.calibrate,
        measure_steps=not args.no_measure,
        console=Console(),
    )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.sim.plan import run_plan
    from rose.sim.traces import TraceError

    try:
        run_plan(
            trace=args.trace,
            fleet=args.fleet,
            model=args.model,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            scale=args.scale,
            out_json=args.json,
            console=Console(),
            demands=tuple(args.demand),
            dedicated_ratio=args.dedicated_ratio,
        )
    except (TraceError, ValueError) as exc:
        print(f"rose plan: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rose",
        description="ROSE: agentic-RL rollouts on the spare capacity of a serving fleet, guarding its latency SLO.",
    )
    parser.add_argument("--version", action="version", version=f"rose {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="a real RL job on co-elastic capacity: the whole fleet, a live table, report/summary.json and plots (~5 min)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of the GRPO window after the warm start (default: the demo's own, 140; with start-up, warm start and "
        "drain the whole demo takes about 5 minutes)",
    )
    p.add_argument("--seed", type=int, default=0, help="serving trace and task seed")
    p.add_argument("--out", default="report", help="where summary.json, the plots, logs and the models go")
    p.add_argument("--models", default=None, help="a models directory to reuse (default: build them under --out)")
    p.add_argument("--serving", type=int, default=2, help="serving executors (each takes a replayed trace with bursts)")
    p.add_argument("--dedicated", type=int, default=1, help="dedicated rollout executors")
    p.add_argument(
        "--warm-start-steps", type=int, default=None, metavar="N", help="the trainer's SFT warm-start steps before GRPO (default: the demo's 200)"
    )
    p.add_argument(
        "--until-steps", type=int, default=None, metavar="N", help="end the run once the trainer has taken N GRPO steps (at most --duration)"
    )
    p.add_argument(
        "--agent",
        default=None,
        metavar="PATH",
        help="run the job's episodes with this agent script through the rollout gateway (e.g. examples/agents/openai_loop.py) "
        "instead of the built-in environment",
    )
    g = p.add_argument_group("a dry run on emulated GPUs (bench/emulated.py): the real services, the simulator beside")
    g.add_argument("--emulate", default=None, metavar="COUNTxKIND:MODEL[+POLICY]", help="e.g. 8xH100:7B (the demo's window: 60 emulated seconds)")
    g.add_argument("--trace", default=None, metavar="CSV", help="replay this Azure-format serving trace (as `rose plan` takes)")
    g.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU")
    g.add_argument("--time-scale", type=float, default=2.0, help="wall seconds per emulated second (shared/clock.py)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("up", help="start NATS (unless NATS_URL is set) and every service, supervised; Ctrl-C stops all")
    p.add_argument("--state-dir", default=None, help="where the NATS store, logs and models live (default: $ROSE_STATE_DIR or ./.rose)")
    p.add_argument(
        "--services", nargs="*", default=None, help=f"which services to start (default: {sorted(set(SERVICE_MODULES) - set(ON_DEMAND_SERVICES))})"
    )
    p.add_argument(
        "--emulate",
        default=None,
        metavar="COUNTxKIND:MODEL[+POLICY]",
        help="a dry run on emulated GPUs (services/executor/emulated.py): e.g. 8xH100:7B, serving executors and a dedicated pool beside them",
    )
    p.add_argument("--dedicated-ratio", type=float, default=0.25, help="with --emulate: dedicated rollout GPUs per serving GPU")
    p.add_argument("--time-scale", type=float, default=1.0, help="with --emulate: wall seconds per emulated second (shared/clock.py)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for every service to report ready")
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="NATS nodes to start: 1 (default) one embedded server; 3 the docker compose topology, a JetStream cluster whose streams and buckets "
        "get N replicas",
    )
    p.add_argument(
        "--no-auth", action="store_true", help="start the embedded NATS without authentication (default: per-service NKeys and permissions)"
    )
    p.add_argument("--tls", action="store_true", help="the embedded NATS requires TLS (a CA and server certificate made under the state dir)")
    p.add_argument(
        "--credentials",
        default=None,
        metavar="DIR",
        help="the credentials directory (`rose security init DIR`; default: STATE_DIR/security, made and reused); with NATS_URL, the server's",
    )
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("status", help="list live services from their heartbeats, with their endpoints")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--nats-url", default=None, help="NATS to ask (default: NATS_URL, else the one `rose up` started)")
    p.add_argument("--state-dir", default=None, help="state dir of the `rose up` to ask (default: $ROSE_STATE_DIR or ./.rose)")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("health", help="exit 0 when a service has a fresh 'ready' heartbeat (and --http answers 2xx): container healthchecks")
    p.add_argument("service", nargs="?", choices=sorted(SERVICE_MODULES), help="the service whose heartbeat must be fresh and ready")
    p.add_argument("--instance", default=None, help="only this instance id")
    p.add_argument("--local", action="store_true", help="only heartbeats from this host (in a container: this container)")
    p.add_argument("--http", default=None, metavar="URL", help="also require a 2xx from this URL (e.g. the executor's /health)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for connecting and for the HTTP check")
    p.add_argument("--nats-url", default=None, help="NATS to ask (default: NATS_URL, else the one `rose up` started)")
    p.add_argument("--state-dir", default=None, help="state dir of the `rose up` to ask (default: $ROSE_STATE_DIR or ./.rose)")
    p.set_defaults(func=_cmd_health)

    p = sub.add_parser("provision", help="create every stream, KV bucket and object store with N replicas (once, before services start)")
    p.add_argument("--replicas", type=int, default=None, help="replicas of each (default: ROSE_BUS__REPLICAS, else 1); 3 on a 3-node cluster")
    p.add_argument("--nats-url", default=None, help="NATS server(s), comma-separated (default: NATS_URL / ROSE_BUS__URL)")
    p.add_argument("--retry-for", type=float, default=60.0, help="seconds to retry while a JetStream cluster is still forming")
    p.set_defaults(func=_cmd_provision)

    p = sub.add_parser("run", help="run one service in the foreground (what `rose up` and docker compose start)")
    p.add_argument("service", choices=sorted(SERVICE_MODULES) or ["(none yet)"], help="the service to run")
    p.add_argument("service_args", nargs=argparse.REMAINDER, help="arguments for the service, e.g. --config FILE")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("contracts", help="the bus contracts")
    csub = p.add_subparsers(dest="contracts_command", required=True, metavar="ACTION")
    e = csub.add_parser("export", help="write a JSON Schema per message and an AsyncAPI 3.0 document into DIR")
    e.add_argument("dir", help="output directory")
    e.set_defaults(func=_cmd_contracts_export)
    e = csub.add_parser("docs", help="write the Markdown reference of every public event (docs/events.md) from the AsyncAPI document")
    e.add_argument("file", nargs="?", default="docs/events.md", help="output file (default: docs/events.md)")
    e.set_defaults(func=_cmd_contracts_docs)

    p = sub.add_parser("events", help="integrations with ROSE's public events")
    esub = p.add_subparsers(dest="events_command", required=True, metavar="ACTION")
    e = esub.add_parser(
        "forward",
        help="a webhook bridge: POST every event on --subjects to --to (durable, retries with backoff, dead-letter file)",
        description="POST every event on the given subjects to an HTTP URL as CloudEvents JSON. A JetStream durable consumer keeps the "
        "place across restarts; failures are retried with exponential backoff, and events the URL refuses are appended to a dead-letter file.",
    )
    from .events_forward_args import add_arguments as add_forward_arguments

    add_forward_arguments(e)
    e.set_defaults(func=_cmd_events_forward)

    p = sub.add_parser(
        "security",
        help="keys and credentials: `init` per-service NATS credentials and permissions, `weights-key` the pair that signs weight manifests",
    )
    ssub = p.add_subparsers(dest="security_command", required=True, metavar="ACTION")
    from .security import add_parser as add_bus_security_parser
    from .security_keys import add_parser as add_weights_key_parser

    add_bus_security_parser(ssub)
    add_weights_key_parser(ssub)

    p = sub.add_parser("models", help="local models in Hugging Face format")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    m = msub.add_parser("init", help="build a tiny serving model and a tiny policy model (Qwen2, real tokenizer) in DIR")
    m.add_argument("dir", help="output directory (gets serving/ and policy/)")
    m.add_argument("--seed", type=int, default=0, help="random seed of weights and tokenizer corpus")
    m.add_argument(
        "--preset",
        choices=MODEL_PRESET_NAMES,
        default="tiny",
        help="sizes: tiny (CPU, the default), demo (tiny's serving model, `rose demo`'s 0.4M-parameter policy: GRPO steps in "
        "seconds on a CPU) or qwen2.5 (Qwen2.5-0.5B / 1.5B layer shapes in bfloat16, for GPU nodes)",
    )
    m.set_defaults(func=_cmd_models_init)

    p = sub.add_parser("bench", help="benchmarks: each compares against a baseline in the same run and writes JSON")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    b = bsub.add_parser("bus", help="request/reply latency and publish throughput: our helpers vs raw nats-py (and FastStream)")
    b.add_argument("--json", default="bench-out/bus.json", help="where to write the JSON result")
    b.add_argument("--requests", type=int, default=2000, help="requests per measured round")
    b.add_argument("--rounds", type=int, default=3, help="alternating rounds per contender (median is reported)")
    b.set_defaults(func=_cmd_bench_bus)
    b = bsub.add_parser(
        "security", help="every known attack (confused deputy on the bus, unpickler payloads, HTTP, sandbox escapes) against real processes"
    )
    b.add_argument("--json", default="bench-out/security.json", help="where to write the JSON result (one row per attack)")
    b.add_argument("--quick", action="store_true", help="fewer bus combinations, the unpickler without the HTTP engine, a few sandbox escapes")
    b.add_argument("--no-sandbox", action="store_true", help="leave out the code sandbox's escapes")
    b.set_defaults(func=_cmd_bench_security)
    b = bsub.add_parser(
        "coserve",
        help="one executor, a replayed serving trace plus a rollout backlog, under serving_only / naive_share / static_partition / rose",
    )
    add_coserve_arguments(b)
    b.set_defaults(func=_cmd_bench_coserve)
    b = bsub.add_parser("weights", help="RL-like weight deltas published by the SDK and applied by a real executor, vs nats-py's object store")
    b.add_argument("--json", default="bench-out/weights.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--params", type=int, default=25_000_000, help="parameters of the Qwen2 policy")
    b.add_argument("--steps", type=int, default=10, help="AdamW steps, one published version each")
    b.add_argument("--lr", type=float, default=1e-6, help="learning rate of the fp32 master weights")
    b.add_argument("--seed", type=int, default=0, help="seed of the weights and the training batches")
    b.set_defaults(func=_cmd_bench_weights)
    b = bsub.add_parser(
        "gateway",
        help="an agent's turn through the rollout gateway vs the worker's own path (same executor, same run); the example agents' trajectories "
        "token for token against what was sampled",
    )
    b.add_argument("--json", default="bench-out/gateway.json", help="where to write the JSON result")
    b.add_argument("--pairs", type=int, default=200, help="3-turn conversations run on both paths (each gives 3 paired turns)")
    b.add_argument("--turns", type=int, default=1000, help="turns from the example agents for the token-for-token check")
    b.add_argument("--models", default=None, help="a models directory to build the warm-started policy in and keep (default: a temporary one)")
    b.set_defaults(func=_cmd_bench_gateway)
    b = bsub.add_parser(
        "control-plane",
        help="the real SLO monitor and scheduler against N executor stand-ins on real NATS: snapshots/s, route and alert-to-revoke latency, CPU",
    )
    b.add_argument("--json", default="bench-out/control-plane.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--executors", default="100,300,1000", help="comma-separated fleet sizes, one run each")
    b.add_argument("--duration", type=float, default=30.0, help="measured seconds per fleet size (after a warm-up for the first leases)")
    b.add_argument("--interval", type=float, default=1.0, help="executors' metrics snapshot interval in seconds")
    b.add_argument("--cluster", action="store_true", help="on the 3-node JetStream cluster (R3 storage) instead of one node")
    b.add_argument("--turns-per-s", type=float, default=0.5, help="turn route requests per second per leased executor")
    b.add_argument("--seed", type=int, default=0, help="seed of arrivals and bursts")
    b.add_argument("--instances", type=int, default=1, help="SLO monitor and scheduler instances each; several split the executors")
    b.add_argument(
        "--kill", action="store_true", help="kill -9 one monitor and one scheduler halfway (with --instances >= 2): takeover time, double grants"
    )
    b.set_defaults(func=_cmd_bench_control_plane)
    b = bsub.add_parser(
        "elastic",
        help="serving executors under a bursty trace, dedicated executors, monitor, scheduler and a rollout worker as real processes; kill -9 and "
        "NATS restart mid-run",
    )
    b.add_argument("--json", default="bench-out/elastic.json", help="where to write the JSON result (the timeline PNG goes beside it)")
    b.add_argument("--seed", type=int, default=0, help="seed of the serving trace and the task order")
    b.add_argument("--executors", type=int, default=2, help="serving (opportunistic) executors")
    b.add_argument("--dedicated", type=int, default=1, help="dedicated rollout executors")
    b.add_argument("--burst-factor", type=float, default=3.0, help="serving arrival rate during a burst, as a multiple of the base rate")
    b.add_argument("--burst-factors", type=number_list(float), default=None, help="one fleet run per factor, e.g. 3,5 (instead of --burst-factor)")
    b.add_argument(
        "--min-bursts", type=int, default=0, help="bursts every 12 s and a trace long enough for this many to find a lease held (e.g. 20 for a p99)"
    )
    b.add_argument("--duration", type=float, default=90.0, help="seconds of replayed serving trace")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: tiny models built on the spot)")
    b.set_defaults(func=_cmd_bench_elastic)
    b = bsub.add_parser(
        "faults",
        help="the demo's fleet under injected faults: kill -9 of NATS and of each service kind, a paused executor, a slow consumer, a stream byte "
        "limit",
    )
    b.add_argument("--json", default="bench-out/faults.json", help="where to write the JSON result (the timeline PNG beside it, logs in <name>-run/)")
    b.add_argument("--seed", type=int, default=0, help="seed of the serving trace and the RL job")
    b.add_argument("--quick", action="store_true", help="a subset of the faults (NATS restart, scheduler kill, partition, slow consumer, byte limit)")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: tiny models built on the spot)")
    b.set_defaults(func=_cmd_bench_faults)
    b = bsub.add_parser(
        "e2e",
        help="the demo's RL job on fresh fleets under static / naive_share / elastic_baseline / rose: RL steps per hour, rollout time, serving SLO",
    )
    b.add_argument("--json", default=E2E_JSON, help="where to write the JSON result (the PNG beside it, each run's report and logs in <name>-runs/)")
    b.add_argument("--seed", type=int, default=0, help="seed of the serving trace and the tasks (the same for every policy)")
    b.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of trace and training per policy (default: 120, about 12 minutes for all four; emulated: 120 emulated seconds)",
    )
    b.add_argument("--policies", nargs="+", default=None, metavar="POLICY", help="run only these (default: static naive_share elastic_baseline rose)")
    b.add_argument("--models", default=None, help="a models directory to reuse (default: built under <name>-runs/models)")
    b.add_argument(
        "--serving", type=int, default=None, help="serving executors (default: the demo's 2; pinned, at most the cores left after the dedicated ones)"
    )
    b.add_argument("--dedicated", type=int, default=1, help="dedicated rollout executors")
    b.add_argument(
        "--warm-start-steps", type=int, default=None, metavar="N", help="the trainer's SFT warm-start steps before GRPO (default: the demo's 200)"
    )
    b.add_argument(
        "--pin",
        choices=("auto", "none"),
        default="auto",
        help="auto: each executor on a core of its own (one core = one device; the trainer and light services float); none: unpinned",
    )
    b.add_argument("--unpinned", action="store_true", help="the same as --pin none")
    b.add_argument(
        "--rollout-demand",
        type=int,
        default=1,
        metavar="K",
        help="trajectories in flight as a multiple of what the dedicated executors run at once (default 1: they keep up; 2: a batch queued)",
    )
    g = b.add_argument_group("emulated accelerators (bench/e2e_emulated.py): the real services on 8-64 emulated GPUs, the simulator beside")
    g.add_argument("--emulate", default=None, metavar="COUNTxKIND", help="serving GPUs to emulate, e.g. 16xH100 (the dedicated pool beside them)")
    g.add_argument("--model", default="7B", help="the serving model's size: 7B, 14B, 32B, 70B")
    g.add_argument("--policy-model", default=None, help="the RL policy's size (default: the serving model's)")
    g.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU")
    g.add_argument("--demand", type=float, default=2.0, help="trajectories in flight, in multiples of what the dedicated executors run at once")
    g.add_argument("--mode", choices=("sync", "async"), default="async", help="sync: one step of tasks at a time; async: one step ahead")
    g.add_argument("--load", type=float, default=0.35, help="mean serving load, a fraction of the fleet's SLO capacity")
    g.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="wall seconds per emulated second (shared/clock.py): a fleet too large for real time runs slower",
    )
    g.add_argument("--rollout-max-batch", type=int, default=32, help="sequences a rollout lane runs at once (the simulator's max_rollout_batch)")
    g.add_argument(
        "--workload",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="the agentic workload's changes, e.g. '{\"gen_median\": 150}' (shared/workload.py RolloutSpec)",
    )
    g.add_argument(
        "--trace", default=None, metavar="CSV", help="replay this Azure-format serving trace (as `rose plan` takes) instead of the synthetic one"
    )
    g.add_argument("--until-steps", type=int, default=None, metavar="N", help="end a policy's window after N trainer steps (at most --duration)")
    b.set_defaults(func=_cmd_bench_e2e)
    b = bsub.add_parser(
        "sim",
        help="simulated fleets (SimPy): models 7B-70B x 8-64 GPUs x static / naive_share / elastic_baseline / rose, with the services' own decisions",
    )
    b.add_argument("--json", default="bench-out/sim.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--seed", type=int, default=0, help="seed of traces, batches and routing (the same for every policy)")
    b.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="run every configuration at each of these seeds; ratios are medians over seeds of paired per-seed ratios (instead of --seed)",
    )
    b.add_argument(
        "--quick", action="store_true", help="a small grid (7B on 8 GPUs, demand 1x and 4x, dedicated ratio 0.25, sync and async, one RL step each)"
    )
    b.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=["7B", "14B", "32B", "70B"],
        help="model sizes, each as serving model and policy (default: all four)",
    )
    b.add_argument(
        "--serving-model",
        nargs="+",
        default=None,
        choices=["7B", "14B", "32B", "70B"],
        help="the serving fleet's model sizes, each with every --policy-model (default: --models)",
    )
    b.add_argument(
        "--policy-model",
        nargs="+",
        default=None,
        choices=["7B", "14B", "32B", "70B"],
        help="the RL policy's sizes, each beside every --serving-model (default: --models)",
    )
    b.add_argument(
        "--over-provision",
        nargs="+",
        type=float,
        default=None,
        help="partial rollouts: hand a step's batch out with this share of its groups more, train on the first complete, carry the rest "
        "(grpo.over_provision; default: 0, none)",
    )
    b.add_argument("--gpus", nargs="+", type=int, default=None, help="serving fleet sizes in GPUs (default: 8 16 32 64)")
    b.add_argument("--steps", type=int, default=None, help="RL steps simulated per configuration (default: 2; --quick: 1)")
    b.add_argument("--jobs", type=int, default=None, help="worker processes (default: 2)")
    b.add_argument("--device", default="H100", choices=["A100", "H100", "H200"], help="GPU kind of every instance")
    b.add_argument("--load", type=float, default=0.35, help="mean serving load as a fraction of the fleet's SLO capacity")
    b.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="serving p99 TTFT SLO")
    b.add_argument("--slo-tpot-ms", type=float, default=100.0, help="serving p99 TPOT SLO")
    b.add_argument(
        "--demand",
        nargs="+",
        type=float,
        default=None,
        help="rollout demand: trajectories per step as multiples of what the dedicated pool runs at once (default: 1 2 4)",
    )
    b.add_argument("--dedicated-ratio", nargs="+", type=float, default=None, help="dedicated rollout GPUs per serving GPU (default: 0.125 0.25 0.5)")
    b.add_argument(
        "--modes", nargs="+", choices=["sync", "async"], default=None, help="synchronous RL and/or asynchronous (one step prefetched) (default: both)"
    )
    b.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=None,
        help="policies to run (default: all four)",
    )
    b.add_argument("--oversubscription", type=float, default=None, help="the same as one --demand value (kept for old scripts)")
    b.add_argument("--quantum-ms", type=float, default=10.0, help="the executor's rollout quantum on serving instances")
    b.add_argument(
        "--what-if",
        nargs="+",
        default=None,
        choices=["kv_slots", "sticky_throughput"],
        help="also run rose with these input changes (kv_slots: headroom slots capped by the lent KV; sticky_throughput: best tokens/s ever "
        "measured)",
    )
    b.add_argument(
        "--e2e",
        default=None,
        help="calibrate against this `rose bench e2e` JSON (per-policy rl_steps_per_hour error; default: bench-out/e2e.json if present)",
    )
    b.add_argument("--coserve", default=None, help="calibrate against this `rose bench coserve` JSON (per-policy rollout tokens/s error)")
    b.add_argument("--calibrate", action="store_true", help="run a short real `rose bench coserve` now and calibrate against it (about a minute)")
    b.add_argument("--no-measure", action="store_true", help="do not measure the tiny models' step times (no calibration at all)")
    b.set_defaults(func=_cmd_bench_sim)

    p = sub.add_parser("plan", help="how much rollout a serving fleet can lend, hour by hour, and at what SLO risk (from a trace)")
    p.add_argument("--trace", required=True, help="CSV in the Azure LLM inference trace format: TIMESTAMP,ContextTokens,GeneratedTokens")
    p.add_argument("--fleet", required=True, help="COUNTxKIND, e.g. 64xH100 (KIND: A100, H100, H200)")
    p.add_argument("--model", required=True, choices=["7B", "14B", "32B", "70B"], help="size of the serving model and of the RL policy")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="serving p99 TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="serving p99 TPOT SLO")
    p.add_argument("--scale", default="auto", help="multiply the trace's request rate (auto: its busiest hour at 45%% of the fleet's SLO capacity)")
    p.add_argument(
        "--demand",
        nargs="*",
        type=float,
        default=[1.0, 2.0, 4.0],
        help="rollout demand levels to simulate (static vs rose) for the expected speedup (none: skip the simulation)",
    )
    p.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU in that simulation")
    p.add_argument("--json", default="bench-out/plan.json", help="where to write the JSON result (the PNG goes beside it)")
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
