"""`rose bench <BENCH>`: each bench's arguments beside the code that runs it.

The bench's own module (torch, the services, the bus) loads only when it runs. Each bench takes one frozen options
dataclass defined beside its code (`BusOptions`, `CoserveOptions`, ...), built from the parsed arguments by
rose.bench.options `options_from_args`: an argument's ``dest`` is its option's name. `rose bench coserve`'s
arguments live in rose.bench.options, which `python -m rose.bench.coserve` reads too.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from rose.bench.options import add_coserve_arguments, number_list, options_from_args
from rose.sim import DEVICE_KINDS, MODEL_SIZES, POLICIES, ROLLOUT_MODES

E2E_JSON = "bench-out/e2e.json"
EMULATED_DURATION_S = 120.0  # emulated seconds of a policy's window


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose bench` and every bench to `rose`'s commands."""
    p = commands.add_parser("bench", help="benchmarks: each compares against a baseline in the same run and writes JSON")
    benches = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_bus(benches)
    _register_security(benches)
    _register_coserve(benches)
    _register_weights(benches)
    _register_gateway(benches)
    _register_openapi(benches)
    _register_control_plane(benches)
    _register_elastic(benches)
    _register_faults(benches)
    _register_e2e(benches)
    _register_trl(benches)
    _register_sim(benches)
    _register_pool(benches)
    _register_lora(benches)


def _register_bus(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser("bus", help="request/reply latency and publish throughput: our helpers vs raw nats-py (and FastStream)")
    b.add_argument("--json", default="bench-out/bus.json", help="where to write the JSON result")
    b.add_argument("--requests", type=int, default=2000, help="requests per measured round")
    b.add_argument("--rounds", type=int, default=3, help="alternating rounds per contender (median is reported)")
    b.set_defaults(func=_run_bus)


def _run_bus(args: argparse.Namespace) -> int:
    from rose.bench.bus import BusOptions, run_bus_bench

    result = asyncio.run(run_bus_bench(options_from_args(BusOptions, args), args.json))
    return 0 if result["meets_target"] else 1


def _register_security(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "security", help="every known attack (confused deputy on the bus, unpickler payloads, HTTP, sandbox escapes) against real processes"
    )
    b.add_argument("--json", default="bench-out/security.json", help="where to write the JSON result (one row per attack)")
    b.add_argument("--quick", action="store_true", help="fewer bus combinations, the unpickler without the HTTP engine, a few sandbox escapes")
    b.add_argument("--no-sandbox", dest="include_sandbox", action="store_false", help="leave out the code sandbox's escapes")
    b.set_defaults(func=_run_security)


def _run_security(args: argparse.Namespace) -> int:
    from rose.bench.security import SecurityOptions, print_summary, run_security_bench

    result = run_security_bench(options_from_args(SecurityOptions, args), args.json)
    print_summary(result, args.json)
    return 0 if result["attacks_blocked"] == result["attacks_tried"] else 1


def _register_coserve(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "coserve",
        help="one executor, a replayed serving trace plus a rollout backlog, under serving_only / naive_share / static_partition / rose",
    )
    add_coserve_arguments(b)
    b.set_defaults(func=_run_coserve)


def _run_coserve(args: argparse.Namespace) -> int:
    from rose.bench.coserve import command

    return command(args)


def _register_weights(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser("weights", help="RL-like weight deltas published by the SDK and applied by a real executor, vs nats-py's object store")
    b.add_argument("--json", default="bench-out/weights.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--params", type=int, default=25_000_000, help="parameters of the Qwen2 policy")
    b.add_argument("--steps", type=int, default=10, help="AdamW steps, one published version each")
    b.add_argument("--lr", type=float, default=1e-6, help="learning rate of the fp32 master weights")
    b.add_argument("--seed", type=int, default=0, help="seed of the weights and the training batches")
    b.set_defaults(func=_run_weights)


def _run_weights(args: argparse.Namespace) -> int:
    from rose.bench.weights import WeightsOptions, run_weights_bench

    out = asyncio.run(run_weights_bench(options_from_args(WeightsOptions, args), args.json))
    return 0 if all(out["meets_target"].values()) else 1


def _register_gateway(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "gateway",
        help="an agent's turn through the rollout gateway vs the worker's own path (same executor, same run); the example agents' trajectories "
        "token for token against what was sampled",
    )
    b.add_argument("--json", default="bench-out/gateway.json", help="where to write the JSON result")
    b.add_argument("--pairs", type=int, default=200, help="3-turn conversations run on both paths (each gives 3 paired turns)")
    b.add_argument("--turns", type=int, default=1000, help="turns from the example agents for the token-for-token check")
    b.add_argument("--models", default=None, help="a models directory to build the warm-started policy in and keep (default: a temporary one)")
    b.set_defaults(func=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> int:
    from rose.bench.gateway import GatewayOptions, run_gateway_bench

    out = run_gateway_bench(options_from_args(GatewayOptions, args), args.json, args.models)
    return 0 if out["fidelity"]["tokens_differing"] == 0 and out["fidelity"]["segment_breaks_without_reason"] == 0 else 1


def _register_openapi(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "openapi", help="OpenAI's published OpenAPI description fuzzed against the executor's and the gateway's OpenAI APIs (schema violations: 0)"
    )
    b.add_argument("--json", default="bench-out/openapi.json", help="where to write the JSON result")
    b.add_argument("--requests", type=int, default=3000, help="generated requests per target (executor, gateway)")
    b.add_argument("--seed", type=int, default=0, help="hypothesis seed: the same requests for the same seed")
    b.set_defaults(func=_run_openapi)


def _run_openapi(args: argparse.Namespace) -> int:
    from rose.bench.openapi_fuzz import OpenApiOptions, run_openapi_bench

    out = run_openapi_bench(options_from_args(OpenApiOptions, args), args.json)
    clean = [r["schema_violations"] == 0 and r["dropped_connections"] == 0 and r["still_serving"] for r in (out["executor"], out["gateway"])]
    return 0 if all(clean) and not any(int(s) >= 500 for r in (out["executor"], out["gateway"]) for s in r["statuses"]) else 1


def _register_control_plane(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "control-plane",
        help="the real SLO monitor and scheduler against N executor stand-ins on real NATS: snapshots/s, route and alert-to-revoke latency, CPU",
    )
    b.add_argument("--json", default="bench-out/control-plane.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--executors", type=number_list(int), default=[100, 300, 1000], help="comma-separated fleet sizes, one run each")
    b.add_argument(
        "--duration",
        dest="duration_s",
        metavar="DURATION",
        type=float,
        default=30.0,
        help="measured seconds per fleet size (after a warm-up for the first leases)",
    )
    b.add_argument(
        "--interval", dest="interval_s", metavar="INTERVAL", type=float, default=1.0, help="executors' metrics snapshot interval in seconds"
    )
    b.add_argument("--cluster", action="store_true", help="on the 3-node JetStream cluster (R3 storage) instead of one node")
    b.add_argument("--turns-per-s", type=float, default=0.5, help="turn route requests per second per leased executor")
    b.add_argument("--seed", type=int, default=0, help="seed of arrivals and bursts")
    b.add_argument("--instances", type=int, default=1, help="SLO monitor and scheduler instances each; several split the executors")
    b.add_argument(
        "--kill", action="store_true", help="kill -9 one monitor and one scheduler halfway (with --instances >= 2): takeover time, double grants"
    )
    b.set_defaults(func=_run_control_plane)


def _run_control_plane(args: argparse.Namespace) -> int:
    from rose.bench.control_plane import ControlPlaneOptions, run_control_plane_bench

    out = asyncio.run(run_control_plane_bench(options_from_args(ControlPlaneOptions, args), args.json))
    return 0 if all(level["snapshots_lost"] == 0 for level in out["levels"]) else 1


def _register_elastic(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
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
    b.add_argument("--duration", dest="duration_s", metavar="DURATION", type=float, default=90.0, help="seconds of replayed serving trace")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: tiny models built on the spot)")
    b.set_defaults(func=_run_elastic)


def _run_elastic(args: argparse.Namespace) -> int:
    from rose.bench.elastic import ElasticOptions, run_elastic_bench

    result = run_elastic_bench(options_from_args(ElasticOptions, args), args.json, args.models)
    return 0 if result["tasks_lost"] == 0 else 1


def _register_faults(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "faults",
        help="the demo's fleet under injected faults: kill -9 of NATS and of each service kind, a paused executor, a slow consumer, a stream byte "
        "limit",
    )
    b.add_argument("--json", default="bench-out/faults.json", help="where to write the JSON result (the timeline PNG beside it, logs in <name>-run/)")
    b.add_argument("--seed", type=int, default=0, help="seed of the serving trace and the RL job")
    b.add_argument("--quick", action="store_true", help="a subset of the faults (NATS restart, scheduler kill, partition, slow consumer, byte limit)")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: tiny models built on the spot)")
    b.set_defaults(func=_run_faults)


def _run_faults(args: argparse.Namespace) -> int:
    from rose.bench.faults import FaultsOptions, run_faults_bench

    result = run_faults_bench(options_from_args(FaultsOptions, args), args.json, args.models)
    ok = result["faults_survived"] == result["faults_injected"] and result["trajectories_lost"] == 0 and result["weight_versions_lost"] == 0
    return 0 if ok else 1


def _register_e2e(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "e2e",
        help="the demo's RL job on fresh fleets under static / naive_share / elastic_baseline / rose: RL steps per hour, rollout time, serving SLO",
    )
    b.add_argument("--json", default=E2E_JSON, help="where to write the JSON result (the PNG beside it, each run's report and logs in <name>-runs/)")
    b.add_argument("--seed", type=int, default=0, help="seed of the serving trace and the tasks (the same for every policy)")
    b.add_argument(
        "--duration",
        dest="duration_s",
        metavar="DURATION",
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
    b.add_argument("--unpinned", dest="pin", action="store_const", const="none", help="the same as --pin none")
    b.add_argument(
        "--rollout-demand",
        type=int,
        default=1,
        metavar="K",
        help="trajectories in flight as a multiple of what the dedicated executors run at once (default 1: they keep up; 2: a batch queued)",
    )
    g = b.add_argument_group("emulated accelerators (bench/e2e_emulated.py): the real services on 8-64 emulated GPUs, the simulator beside")
    g.add_argument("--emulate", default=None, metavar="COUNTxKIND", help="serving GPUs to emulate, e.g. 16xH100 (the dedicated pool beside them)")
    g.add_argument("--model", default="7B", choices=MODEL_SIZES, help="the serving model's size")
    g.add_argument("--policy-model", default=None, choices=MODEL_SIZES, help="the RL policy's size (default: the serving model's)")
    g.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU")
    g.add_argument("--demand", type=float, default=2.0, help="trajectories in flight, in multiples of what the dedicated executors run at once")
    g.add_argument("--mode", choices=("sync", "async"), default="async", help="sync: one step of tasks at a time; async: one step ahead")
    g.add_argument("--load", type=float, default=0.35, help="mean serving load, a fraction of the fleet's SLO capacity")
    g.add_argument(
        "--rollout-mode",
        choices=ROLLOUT_MODES,
        default="two_model",
        help="two_model: the policy a model of its own beside the serving one; co_batched: a LoRA adapter of the serving model, "
        "its rows in serving's own batches (the simulator prices the same)",
    )
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
    g.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the policies one after another (default: side by side, each its own NATS and fleet, sharing the box's CPU)",
    )
    g.add_argument(
        "--over-provision",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="partial rollouts: a step's batch goes out with this share of its groups more, the rest carried (grpo.over_provision; default 0)",
    )
    b.set_defaults(func=_run_e2e)


def _run_e2e(args: argparse.Namespace) -> int:
    if args.emulate:
        return _run_e2e_emulated(args)
    from rose.bench.e2e import E2eOptions, run_e2e_bench

    result = run_e2e_bench(options_from_args(E2eOptions, args), args.json, args.models)
    return 0 if all(p["trajectories_lost"] == 0 for p in result["policies"].values()) else 1


def _run_e2e_emulated(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.bench.e2e_emulated import run_emulated_e2e
    from rose.bench.emulated import BENCH_WORKLOAD, EmulatedJob
    from rose.shared.devices import parse_fleet

    gpus, device = parse_fleet(args.emulate)
    job = options_from_args(EmulatedJob, args, gpus=gpus, device=device.name, workload={**BENCH_WORKLOAD, **(args.workload or {})})
    result = run_emulated_e2e(
        out_json=args.json if args.json != E2E_JSON else "bench-out/e2e-emulated.json",
        job=job,
        policies=args.policies,
        duration_s=args.duration_s or EMULATED_DURATION_S,
        until_steps=args.until_steps,
        model_dir=args.models,
        console=Console(),
        side_by_side=not args.one_at_a_time,
    )
    return 0 if all(p["trajectories_lost"] == 0 for p in result["policies"].values()) else 1


def _register_sim(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
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
    _add_sim_grid_arguments(b)
    b.add_argument(
        "--e2e",
        default=None,
        help="calibrate against this `rose bench e2e` JSON (per-policy rl_steps_per_hour error; default: bench-out/e2e.json if present)",
    )
    b.add_argument("--coserve", default=None, help="calibrate against this `rose bench coserve` JSON (per-policy rollout tokens/s error)")
    b.add_argument("--calibrate", action="store_true", help="run a short real `rose bench coserve` now and calibrate against it (about a minute)")
    b.add_argument(
        "--no-measure", dest="measure_steps", action="store_false", help="do not measure the tiny models' step times (no calibration at all)"
    )
    b.add_argument(
        "--no-fleet-ceiling",
        dest="fleet_ceilings",
        action="store_false",
        help="skip the fleet ceiling's runs (static on its dedicated pool grown by the lanes' capacity; 10-40 %% of the grid's time)",
    )
    b.add_argument(
        "--lane-pool",
        action="store_true",
        help="also run the lane pool: static with every serving instance's rollout lane in its pool, at the lane's SLO-safe "
        "share and lent KV (what the lent capacity buys as lanes, beside the fleet ceiling's whole GPUs; one static run more "
        "per configuration)",
    )
    b.add_argument(
        "--rollout-modes",
        nargs="+",
        choices=ROLLOUT_MODES,
        default=None,
        help="how rollout shares a serving instance: two_model (a policy copy on a lane of its own) and/or co_batched (the policy "
        "a LoRA adapter of the serving model, its sequences rows in serving's own iterations); both run the same grid and seeds, "
        "each row says which (default: two_model)",
    )
    b.set_defaults(func=_run_sim)


def _add_sim_grid_arguments(b: argparse.ArgumentParser) -> None:
    """`rose bench sim`'s grid: its axes and each configuration's settings."""
    b.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=MODEL_SIZES,
        help="model sizes, each as serving model and policy (default: all four)",
    )
    b.add_argument(
        "--serving-model",
        dest="serving_models",
        nargs="+",
        default=None,
        choices=MODEL_SIZES,
        help="the serving fleet's model sizes, each with every --policy-model (default: --models)",
    )
    b.add_argument(
        "--policy-model",
        dest="policy_models",
        nargs="+",
        default=None,
        choices=MODEL_SIZES,
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
    b.add_argument(
        "--host-kv-ratio",
        type=float,
        default=None,
        help="the executors' host tier for retained prefixes, x each instance's rollout KV (engine.host_kv_ratio; 0: none; default: the executor's)",
    )
    b.add_argument(
        "--gpus", dest="fleets", metavar="GPUS", nargs="+", type=int, default=None, help="serving fleet sizes in GPUs (default: 8 16 32 64)"
    )
    b.add_argument("--steps", type=int, default=None, help="RL steps simulated per configuration (default: 2; --quick: 1)")
    b.add_argument("--jobs", type=int, default=None, help="worker processes (default: 2)")
    b.add_argument("--device", default="H100", choices=DEVICE_KINDS, help="GPU kind of every instance")
    b.add_argument("--load", type=float, default=0.35, help="mean serving load as a fraction of the fleet's SLO capacity")
    b.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="serving p99 TTFT SLO")
    b.add_argument("--slo-tpot-ms", type=float, default=100.0, help="serving p99 TPOT SLO")
    b.add_argument(
        "--demand",
        dest="demands",
        metavar="DEMAND",
        nargs="+",
        type=float,
        default=None,
        help="rollout demand: trajectories per step as multiples of what the dedicated pool runs at once (default: 1 2 4)",
    )
    b.add_argument(
        "--dedicated-ratio",
        dest="ratios",
        metavar="DEDICATED_RATIO",
        nargs="+",
        type=float,
        default=None,
        help="dedicated rollout GPUs per serving GPU (default: 0.125 0.25 0.5)",
    )
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


def _run_sim(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.bench.sim import SimOptions, run_sim_bench

    run_sim_bench(options_from_args(SimOptions, args), args.json, Console())
    return 0


def _register_pool(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "pool",
        help="a co-hosting serving instance's KV pool as `rose plan` sizes it, against scaled and unbounded pools, on emulated GPUs",
    )
    b.add_argument("--json", default="bench-out/pool.json", help="where to write the JSON result (the TTFT plot goes beside it)")
    b.add_argument("--device", choices=DEVICE_KINDS, default="H100", help="GPU kind of the instance")
    b.add_argument("--serving-model", choices=MODEL_SIZES, default="70B", help="the serving model")
    b.add_argument("--policy-model", choices=MODEL_SIZES, default="7B", help="the RL policy beside it")
    b.add_argument("--loads", type=number_list(float), default=[0.3, 0.6], help="arrival rates as fractions of the instance's SLO capacity")
    b.add_argument("--pool-scales", type=number_list(float), default=[0.5, 1.0], help="pools run, x the derived one (an unbounded one always runs)")
    b.add_argument("--duration", dest="duration_s", metavar="DURATION", type=float, default=120.0, help="emulated seconds of arrivals per load")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrivals and their sizes")
    b.add_argument("--trace", default="", help="an Azure-format CSV whose request sizes to replay (default: the simulator's synthetic sizes)")
    b.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per emulated second (raise it if the forward lag is high)")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: tiny models built on the spot)")
    b.set_defaults(func=_run_pool)


def _run_pool(args: argparse.Namespace) -> int:
    from rose.bench.pool import PoolCheck, exit_code, run_pool_bench

    return exit_code(run_pool_bench(options_from_args(PoolCheck, args), args.json, models_dir=args.models or ""))


def _register_trl(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser(
        "trl",
        help="Hugging Face TRL's GRPOTrainer through ROSE vs ROSE's own trainer and vs TRL generating by itself, on the demo's job: "
        "steps per hour, where a step's time goes, reward per step",
    )
    b.add_argument("--json", default="bench-out/trl.json", help="where to write the JSON result")
    b.add_argument("--seeds", type=int, nargs="+", default=[0], help="task and trace seeds; each runs both trainers on fresh fleets")
    b.add_argument("--until-steps", type=int, default=20, help="steps each run takes (its window ends there)")
    b.add_argument(
        "--duration",
        dest="duration_s",
        metavar="DURATION",
        type=float,
        default=None,
        help="at most this many seconds per run (default: 3x the demo's window)",
    )
    b.add_argument("--serving", type=int, default=2, help="serving executors")
    b.add_argument("--dedicated", type=int, default=1, help="dedicated rollout executors")
    b.add_argument("--warm-start-steps", type=int, default=None, help="supervised steps of the shared warm start (default: the demo's 200)")
    b.add_argument("--models", default=None, help="a models directory to reuse (its policy is warm-started in place, once)")
    b.set_defaults(func=_run_trl)


def _run_trl(args: argparse.Namespace) -> int:
    from rose.bench.trl import TrlOptions, run_trl_bench

    out = run_trl_bench(options_from_args(TrlOptions, args), args.json, args.models)
    return 0 if out["trajectories_lost"] == 0 else 1


def _register_lora(benches: argparse._SubParsersAction) -> None:
    b = benches.add_parser("lora", help="LoRA GRPO vs full-parameter GRPO on the demo's job from one warm base: reward gained, bytes per version")
    b.add_argument("--json", default="bench-out/lora.json", help="where to write the JSON result")
    b.add_argument("--seeds", type=lambda s: tuple(int(x) for x in s.split(",")), help="comma-separated task and sampling seeds (default 0,1,2)")
    b.add_argument("--steps", type=int, help="GRPO steps per arm (default 20)")
    b.add_argument("--lora-rank", type=int, help="the adapter's rank (default: the bench's, rose.bench.lora_learning LORA_RANK)")
    b.add_argument("--lora-alpha", type=float, help="the adapter's alpha (default: LORA_ALPHA)")
    b.add_argument("--lora-lr", type=float, help="the LoRA arm's GRPO lr (default: LORA_LR)")
    b.add_argument("--full-lr", type=float, help="the full-parameter arm's GRPO lr (default: the demo job's)")
    b.add_argument("--warm-start-steps", type=int, help="SFT steps of the base's warm start (default: the demo job's)")
    b.set_defaults(func=_run_lora)


def _run_lora(args: argparse.Namespace) -> int:
    from rose.bench.lora_learning import LoraOptions, run_lora_bench

    result = run_lora_bench(options_from_args(LoraOptions, args), args.json)
    return 0 if result["meets_target"] else 1
