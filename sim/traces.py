"""Serving traces: a synthetic diurnal load with bursts, and CSV import of the Azure format.

A trace, for the simulator, is per-second serving demand: the arrival rate (requests/s) and
the mean prompt and output length of that second, plus the p99 prompt length (prefill time
of the slowest requests sets p99 TTFT).

Synthetic traces (``diurnal_bursty``) are a load *shape* with mean 1, scaled by the caller
to a fraction of the fleet's SLO capacity:

    load(t) = (1 + amplitude x cos(2 pi (hour(t) - peak_hour) / 24)) x burst(t)

where bursts start as a Poisson process (one per ``burst_every_s`` on average), last a
log-normal time (median ``burst_len_s``) and multiply the rate by ``burst_factor``. Request
sizes are log-normal. These are assumptions chosen to look like a chat service (prompts of
~1k tokens, outputs of ~100-250 tokens, a daily cycle, minute-scale surges); they are not
fitted to any provider's data.

CSV import reads the column layout of the Azure LLM inference traces (Azure/AzurePublicDataset,
``AzureLLMInferenceTrace_conv.csv`` / ``_code.csv``): a header ``TIMESTAMP,ContextTokens,
GeneratedTokens`` and one request per line; TIMESTAMP is a date-time
(``2023-11-16 18:15:46.6805900``) or plain seconds. ``data/azure_format_sample_synthetic.csv``
is a tiny file in that format that we *generated* (``write_sample_csv``, seed 0): synthetic,
not Azure data.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from rose.shared.errors import RoseError

SAMPLE_CSV = Path(__file__).parent / "data" / "azure_format_sample_synthetic.csv"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SIZE_SAMPLE = 20_000  # requests drawn from a synthetic trace's size distribution (Trace.request_sizes)


class TraceError(RoseError, ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class RequestSizes:
    """Log-normal serving request sizes (tokens): median and sigma of the underlying normal."""

    prompt_median: float = 1000.0
    prompt_sigma: float = 0.9
    prompt_max: int = 8192
    output_median: float = 150.0
    output_sigma: float = 0.9
    output_max: int = 2048

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = np.clip(rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, n), 1, self.prompt_max)
        o = np.clip(rng.lognormal(math.log(self.output_median), self.output_sigma, n), 1, self.output_max)
        return np.round(p).astype(np.int64), np.round(o).astype(np.int64)

    def means(self) -> tuple[float, float, float]:
        """(mean prompt, mean output, p99 prompt), from a large fixed sample."""
        p, o = self.sample(np.random.default_rng(12345), 200_000)
        return float(p.mean()), float(o.mean()), float(np.percentile(p, 99))


@dataclass
class Trace:
    """Per-second serving demand. ``rate`` is requests/s (or, for a load shape, a multiplier)."""

    rate: np.ndarray
    prompt_mean: np.ndarray
    output_mean: np.ndarray
    prompt_p99: float
    start_s: float = 0.0  # seconds since midnight of the first bin (for hour-of-day)
    source: str = "synthetic"
    # the requests' (prompt, output) tokens, or a sample of their distribution; None: every request has the mean sizes
    request_sizes: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def duration_s(self) -> int:
        return len(self.rate)

    def scaled(self, factor: float) -> Trace:
        return replace(self, rate=self.rate * factor)  # every other field kept, request_sizes among them

    def at(self, t: float) -> int:
        """Index of second ``t`` (the trace repeats past its end)."""
        return int(t) % len(self.rate)

    def hours(self) -> list[tuple[int, slice]]:
        """(hour of day, slice of bins) for every hour the trace covers, in order."""
        out = []
        first = int(self.start_s // 3600)
        n = len(self.rate)
        h = 0
        while True:
            lo = max(0, int((first + h) * 3600 - self.start_s))
            hi = min(n, int((first + h + 1) * 3600 - self.start_s))
            if lo >= n:
                break
            if hi > lo:
                out.append(((first + h) % 24, slice(lo, hi)))
            h += 1
        return out


@dataclass(frozen=True)
class DiurnalBursty:
    """Parameters of the synthetic load shape (see the module doc)."""

    amplitude: float = 0.3
    peak_hour: float = 14.0
    burst_every_s: float = 240.0
    burst_factor: float = 1.6
    burst_len_s: float = 45.0
    sizes: RequestSizes = RequestSizes()


def diurnal_bursty(duration_s: int, start_hour: float, spec: DiurnalBursty, seed: int) -> Trace:
    """A load shape (mean ~1 over a day) of ``duration_s`` seconds starting at ``start_hour``."""
    rng = np.random.default_rng(seed)
    t = np.arange(duration_s, dtype=float)
    hour = (start_hour + t / 3600.0) % 24.0
    shape = 1.0 + spec.amplitude * np.cos(2 * math.pi * (hour - spec.peak_hour) / 24.0)
    burst = np.ones(duration_s)
    if spec.burst_every_s > 0 and spec.burst_factor != 1.0:
        at = rng.exponential(spec.burst_every_s)
        while at < duration_s:
            length = float(np.clip(rng.lognormal(math.log(spec.burst_len_s), 0.5), 5.0, 600.0))
            burst[int(at) : int(at + length)] = spec.burst_factor
            at += length + rng.exponential(spec.burst_every_s)
    p, o, p99 = spec.sizes.means()
    sizes = spec.sizes.sample(np.random.default_rng(12345), SIZE_SAMPLE)
    return Trace(shape * burst, np.full(duration_s, p), np.full(duration_s, o), p99, start_hour * 3600.0, "synthetic diurnal + bursts", sizes)


# ---- the Azure LLM inference trace format -----------------------------------------------------
@dataclass
class Requests:
    """One row per request: arrival (seconds from the first), context and generated tokens."""

    times_s: np.ndarray
    context: np.ndarray
    generated: np.ndarray
    start_s: float  # seconds since midnight of the first arrival
    source: str


def _parse_time(text: str) -> tuple[float, float | None]:
    """(seconds, seconds since midnight or None) of a TIMESTAMP cell."""
    try:
        return float(text), None
    except ValueError:
        pass
    dt = datetime.fromisoformat(text.strip())
    midnight = dt.replace(hour=0, minute=0, second=0, microsecond=0)
    return dt.timestamp() if dt.tzinfo else (dt - datetime(1970, 1, 1)).total_seconds(), (dt - midnight).total_seconds()


def load_azure_csv(path: str | Path) -> Requests:
    """Read a trace in the Azure LLM inference format; a bad file raises TraceError naming the line."""
    path = Path(path)
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror or exc}") from None
    times: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    day_offset: float | None = None
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}: empty file; expected a header {','.join(AZURE_COLUMNS)}")
        names = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in names]
        if missing:
            raise TraceError(f"{path}, line 1: header {header!r} lacks {', '.join(missing)}; expected {','.join(AZURE_COLUMNS)}")
        ti, ci, gi = (names.index(c) for c in AZURE_COLUMNS)
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) < len(names):
                raise TraceError(f"{path}, line {line}: {len(row)} fields, expected {len(names)} ({','.join(names)})")
            try:
                t, of_day = _parse_time(row[ti])
            except ValueError:
                raise TraceError(
                    f"{path}, line {line}: TIMESTAMP {row[ti]!r} is neither seconds nor a date-time like 2023-11-16 18:15:46.6805900"
                ) from None
            try:
                c, g = int(row[ci]), int(row[gi])
            except ValueError:
                raise TraceError(f"{path}, line {line}: ContextTokens {row[ci]!r} / GeneratedTokens {row[gi]!r} must be integers") from None
            if c < 0 or g < 0:
                raise TraceError(f"{path}, line {line}: negative token count ({c}, {g})")
            if times and t < times[-1]:
                raise TraceError(f"{path}, line {line}: TIMESTAMP {row[ti]!r} goes back in time (rows must be in arrival order)")
            if day_offset is None:
                day_offset = of_day if of_day is not None else 0.0
            times.append(t)
            ctx.append(c)
            gen.append(g)
    if not times:
        raise TraceError(f"{path}: no requests after the header")
    tt = np.asarray(times, dtype=float)
    return Requests(tt - tt[0], np.asarray(ctx, dtype=np.int64), np.asarray(gen, dtype=np.int64), day_offset or 0.0, str(path))


def requests_to_trace(req: Requests, bin_s: float = 1.0) -> Trace:
    """Bin requests per second: rate, mean sizes (the trace's overall mean where a bin is empty)."""
    n = max(1, int(math.ceil((float(req.times_s[-1]) + 1e-9) / bin_s)))
    idx = np.minimum((req.times_s / bin_s).astype(np.int64), n - 1)
    count = np.bincount(idx, minlength=n).astype(float)
    ctx_sum = np.bincount(idx, weights=req.context.astype(float), minlength=n)
    gen_sum = np.bincount(idx, weights=req.generated.astype(float), minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        pm = np.where(count > 0, ctx_sum / np.maximum(count, 1), float(req.context.mean()))
        om = np.where(count > 0, gen_sum / np.maximum(count, 1), float(req.generated.mean()))
    sizes = (req.context, np.maximum(req.generated, 1))
    return Trace(count / bin_s, pm, np.maximum(om, 1.0), float(np.percentile(req.context, 99)), req.start_s, req.source, sizes)


def write_sample_csv(path: str | Path, hours: float = 24.0, mean_rps: float = 0.04, seed: int = 0, spec: DiurnalBursty | None = None) -> int:
    """Write a synthetic trace in the Azure format (Poisson arrivals of ``diurnal_bursty``); returns rows."""
    spec = spec or DiurnalBursty(burst_every_s=1800.0, burst_factor=2.0, burst_len_s=300.0)
    shape = diurnal_bursty(int(hours * 3600), 0.0, spec, seed)
    rng = np.random.default_rng(seed + 1)
    counts = rng.poisson(shape.rate * mean_rps)
    n = int(counts.sum())
    second = np.repeat(np.arange(len(counts)), counts)
    t = second + rng.random(n)
    t.sort()
    p, o = spec.sizes.sample(rng, n)
    day = datetime(2023, 11, 16)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(AZURE_COLUMNS)
        for ti, pi, oi in zip(t, p, o):
            stamp = day + timedelta(seconds=float(ti))
            w.writerow([stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond:06d}0", int(pi), int(oi)])
    return n
