"""Each `rose bench X` (and `rose demo`) hands its bench one frozen options object built from the parsed arguments
(rose.bench.options `options_from_args`): every argument its parser stores lands in a field of that object (or is one
of the few that say where, not what: the JSON path, a models directory), and a flag stored under another name, a
switch that turns an option off, a list and an argument left at None arrive as the bench reads them.

The parsers are `rose`'s own (rose.cli.main `build_parser`); nothing runs. About 5 s (importing the benches).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rose.bench.bus import BusOptions
from rose.bench.control_plane import ControlPlaneOptions
from rose.bench.coserve import RECLAIM_PROBES, CoserveOptions
from rose.bench.demo import DEFAULT_DURATION_S, JobOptions
from rose.bench.e2e import E2eOptions
from rose.bench.elastic import ElasticOptions
from rose.bench.emulated import EmulatedJob
from rose.bench.faults import FaultsOptions
from rose.bench.gateway import GatewayOptions
from rose.bench.lora_learning import LORA_RANK, LoraOptions
from rose.bench.openapi_fuzz import OpenApiOptions
from rose.bench.options import BenchOptionsError, options_from_args
from rose.bench.pool import PoolCheck
from rose.bench.security import SecurityOptions
from rose.bench.sim import QUICK_FLEETS, QUICK_MODELS, SimOptions
from rose.bench.trl import TrlOptions
from rose.bench.weights import WeightsOptions
from rose.cli.main import build_parser, main

WHERE = {"json", "models"}  # arguments that say where a bench reads and writes, beside its options
DISPATCH = {"func", "command", "bench_command"}  # argparse's own: which command runs

# bench -> (its options, the arguments it takes beside them)
BENCHES: dict[str, tuple[type, set[str]]] = {
    "bus": (BusOptions, {"json"}),
    "security": (SecurityOptions, {"json"}),
    "coserve": (CoserveOptions, WHERE),
    "weights": (WeightsOptions, {"json"}),
    "gateway": (GatewayOptions, WHERE),
    "openapi": (OpenApiOptions, {"json"}),
    "control-plane": (ControlPlaneOptions, {"json"}),
    "elastic": (ElasticOptions, WHERE),
    "faults": (FaultsOptions, WHERE),
    # --emulate runs the same command on emulated accelerators: its group is bench/emulated.py's EmulatedJob
    "e2e": (E2eOptions, WHERE | {"emulate", "one_at_a_time", *(f.name for f in dataclasses.fields(EmulatedJob))}),
    "trl": (TrlOptions, WHERE),
    "sim": (SimOptions, {"json"}),
    "pool": (PoolCheck, WHERE),
    "lora": (LoraOptions, {"json"}),
}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_every_argument_of_a_bench_is_one_of_its_options(bench):
    cls, beside = BENCHES[bench]
    args = parse("bench", bench)
    stray = set(vars(args)) - DISPATCH - beside - names(cls)
    assert not stray, f"`rose bench {bench}` parses {sorted(stray)}, which {cls.__name__} has no field for: the bench would never see them"
    options = options_from_args(cls, args)  # the defaults the command line gives pass the options' own checks
    assert dataclasses.is_dataclass(options) and type(options).__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_the_demo_hands_its_job_one_options_object():
    args = parse("demo", "--duration", "30", "--models", "m", "--agent", "a.py", "--trainer", "trl", "--serving", "1")
    stray = set(vars(args)) - DISPATCH - names(JobOptions) - {"out", "trainer", "emulate", "trace", "dedicated_ratio", "time_scale"}
    assert not stray
    job = options_from_args(JobOptions, args, trl=args.trainer == "trl")
    assert (job.duration_s, job.serving, job.trl, str(job.models_dir), job.agent is not None and job.agent.name) == (30.0, 1, True, "m", "a.py")
    assert options_from_args(JobOptions, parse("demo"), trl=False).duration_s == DEFAULT_DURATION_S  # None: the demo's own window


def test_renamed_switched_and_listed_arguments_arrive_as_the_bench_reads_them():
    coserve = options_from_args(CoserveOptions, parse("bench", "coserve", "--duration", "3", "--noise", "0,0.3", "--loads", "0.2,0.5"))
    assert (coserve.duration_s, coserve.noises, coserve.loads, coserve.reclaim_probes) == (3.0, (0.0, 0.3), (0.2, 0.5), RECLAIM_PROBES)
    assert len(coserve.grid()) == 4 and coserve.grid()[0] == (0.0, 0.2, 0)
    assert not options_from_args(SecurityOptions, parse("bench", "security", "--no-sandbox")).include_sandbox
    assert options_from_args(E2eOptions, parse("bench", "e2e", "--unpinned")).pin == "none"
    assert options_from_args(E2eOptions, parse("bench", "e2e", "--policies", "rose", "static")).chosen() == ["static", "rose"]
    cp = options_from_args(ControlPlaneOptions, parse("bench", "control-plane", "--executors", "20,40", "--interval", "0.5"))
    assert (cp.executors, cp.interval_s) == ((20, 40), 0.5)
    sim = options_from_args(SimOptions, parse("bench", "sim", "--quick", "--no-fleet-ceiling", "--gpus", "16", "--demand", "2"))
    assert (sim.grid_models, sim.grid_fleets, sim.grid_demands, sim.grid_steps, sim.fleet_ceilings) == (QUICK_MODELS, (16,), (2.0,), 1, False)
    lora = options_from_args(LoraOptions, parse("bench", "lora", "--seeds", "3,4", "--lora-alpha", "4"))
    assert (lora.seeds, lora.lora.rank, lora.lora.alpha) == ((3, 4), LORA_RANK, 4.0)
    assert options_from_args(SimOptions, parse("bench", "sim", "--quick")).grid_fleets == QUICK_FLEETS
    emulated = parse("bench", "e2e", "--emulate", "16xH100", "--mode", "sync", "--serving", "1")  # `--serving`: the real fleet's
    job = options_from_args(EmulatedJob, emulated, gpus=16, device="H100")
    assert job == EmulatedJob(gpus=16, device="H100", mode="sync")  # --policy-model and --trace left None: the job's own defaults


def test_bad_options_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="slo_basis"):
        CoserveOptions(slo_basis="week")
    with pytest.raises(ValueError, match="unknown policies"):
        options_from_args(E2eOptions, parse("bench", "e2e", "--policies", "greedy"))
    with pytest.raises(BenchOptionsError, match="loads must be"):
        options_from_args(PoolCheck, parse("bench", "pool", "--loads", "2"))


def test_the_cli_says_what_is_wrong_with_an_option_in_one_line(tmp_path, capsys):
    """A bench's refused option is a RoseError: `rose` prints one line naming it and exits 1, and runs nothing."""
    out = tmp_path / "pool.json"
    assert main(["bench", "pool", "--loads", "2", "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rose bench: BenchOptionsError: loads must be in (0, 1.5]") and "\n" not in err and "Traceback" not in err
    assert not out.exists()
