"""Argument vocabulary shared by `rose` (cli/bench.py, cli/models.py) and the stand-alone bench entry points, and
the one way a bench's parsed arguments become its options (``options_from_args``).

Kept free of heavy imports (torch, the bus): `rose --help` builds every parser, and
``python -m rose.bench.coserve`` must run on a bare GPU image.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from rose.shared.errors import RoseError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Options = TypeVar("Options", bound="DataclassInstance")


class BenchOptionsError(RoseError, ValueError):
    """A bench's options that cannot run (an unknown word, a value out of range): the CLI says so in one line."""


SLO_BASES = ("cell", "run")  # how `rose bench coserve` sets its SLO (bench/coserve.py CoserveOptions)
MODEL_PRESET_NAMES = ("tiny", "demo", "qwen2.5")  # rose.shared.models.MODEL_PRESETS' keys (that module imports torch: not at CLI start)


def number_list(kind):
    """An argparse type: a comma-separated list of ``kind`` (`0.2,0.35,0.5`)."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None

    return parse


def options_from_args(cls: type[Options], args: argparse.Namespace, **derived: Any) -> Options:
    """A bench's frozen options dataclass from its parsed arguments: each field from the argument its parser stores
    under the field's name (``dest``), a list as a tuple; an argument left None keeps the field's default (the bench's
    own, defined once beside its code); ``derived``: fields the parser does not hold as they are (a value it parsed
    into another form), over both."""
    values = dict(derived)
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if f.name not in values and value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def add_coserve_arguments(b: argparse.ArgumentParser) -> None:
    """`rose bench coserve`'s options (also `python -m rose.bench.coserve`'s)."""
    b.add_argument("--json", default="bench-out/coserve.json", help="where to write the JSON result (the PNG goes beside it)")
    b.add_argument("--seed", type=int, default=0, help="seed of the trace, prompts and sampling")
    b.add_argument("--serving-load", type=float, default=0.3, help="serving arrival rate as a fraction of the measured serving capacity")
    b.add_argument("--duration", dest="duration_s", metavar="DURATION", type=float, default=20.0, help="seconds of replayed trace per policy")
    b.add_argument("--models", default=None, help="model directory with serving/ and policy/ (default: models of --preset built on the spot)")
    b.add_argument("--preset", choices=MODEL_PRESET_NAMES, default="tiny", help="sizes of the models built on the spot (see `rose models init`)")
    b.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    b.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="of both models (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    b.add_argument(
        "--loads", type=number_list(float), default=None, help="a grid: comma-separated serving loads (instead of --serving-load), e.g. 0.2,0.35,0.5"
    )
    b.add_argument("--seeds", type=number_list(int), default=None, help="a grid: comma-separated seeds (instead of --seed), e.g. 3,4,5")
    b.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="lengthen each cell's trace (beyond --duration) to at least this many serving requests: 200 makes the 0.005 SLO tolerance one request",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each cell's policies this many rounds in turn on the same trace and pool each policy's requests: "
        "one run of a cell moves by more than the 0.005 SLO tolerance between runs on a noisy host",
    )
    b.add_argument(
        "--slo-basis",
        choices=SLO_BASES,
        default="cell",
        help="cell: each cell's SLO from its own serving_only (2 x its p99); run: one for every cell, from serving_only at the "
        "highest load, first seed, without noise",
    )
    b.add_argument(
        "--reclaim-probes",
        type=int,
        default=None,
        help="serving requests sent into lulls after each rose run: the reclaim samples (default: 20; a smoke run needs few)",
    )
    b.add_argument(
        "--dedicated-s",
        type=float,
        default=None,
        help="seconds of each dedicated-baseline run (before and after the policies; default: half of --duration, at least 5)",
    )
    b.add_argument("--slo-ms", type=number_list(float), default=None, help="the SLO given as TTFT,TPOT in ms (instead of calibrating it)")
    b.add_argument(
        "--lora",
        action="store_true",
        help="the policy a LoRA adapter of the serving model (rose models init --lora's shape): the four policies run it in the two-model "
        "mode, and rose also in the co-batched mode (its rollout rows in serving's own batches); each row says its mode",
    )
    b.add_argument(
        "--noise",
        dest="noises",
        metavar="NOISE",
        type=number_list(float),
        default=None,
        help="a co-runner burning this fraction of one core through every policy; comma-separated for a grid, e.g. 0,0.3 (default: none)",
    )
