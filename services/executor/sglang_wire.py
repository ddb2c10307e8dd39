"""SGLang's wire formats as the sglang backend reads them: server-sent events, error bodies, finish reasons, and the
Prometheus text of its /metrics turned into histograms and DDSketches.

A module of its own so the backend (sglang_backend.py) holds the lending, requests and weights, and these pure
functions, each tested against SGLang's own bytes, stand apart.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ddsketch import DDSketch
from prometheus_client.parser import text_string_to_metric_families

from rose.shared.errors import RoseError

from .kv_pool import PoolUsage
from .metrics import IntervalCounters
from .protocol import FinishReason

# labels that name one rank of a tensor/pipeline/expert-parallel group: every rank reports the same
# batch, so series that differ only in these are one value (max), not several to add
RANK_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
FINISH_TYPES: tuple[FinishReason, ...] = ("stop", "length", "abort")
TTFT_METRIC = "sglang:time_to_first_token_seconds"
ITL_METRIC = "sglang:inter_token_latency_seconds"
TPOT_METRIC = "sglang:time_per_output_token_seconds"  # older servers (0.4.x) export this instead of ITL
GEN_TOKENS = "sglang:generation_tokens_total"


class ServerError(RoseError, RuntimeError):
    """An SGLang server answered with an error status; ``message`` is what it said."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


# ---------------------------------------------------------------------------- wire formats


class SSEDecoder:
    """Server-sent events from arbitrary byte chunks: yields each event's data (lines joined by \\n).

    SGLang writes ``data: <json>\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end; a TCP read
    may split an event anywhere, so bytes are buffered until the blank line that ends it.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        if b"\r" in self._buf:
            keep_cr = self._buf.endswith(b"\r")  # may be half of a \r\n split across reads
            self._buf = self._buf[:-1] if keep_cr else self._buf
            self._buf = self._buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep_cr else b"")
        events: list[str] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return events
            block, self._buf = self._buf[:end], self._buf[end + 2 :]
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data).decode("utf-8", errors="replace"))


def error_message(text: str) -> str:
    """The human part of an SGLang error body (its several envelopes), else the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:1000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "error_message", "detail"):  # error_message: SGLang's LoRAUpdateOutput
            if body.get(key):
                return str(body[key])
    return text.strip()[:1000]


def finish_reason_of(raw: Any) -> FinishReason | None:
    """SGLang's ``{"type": "stop"|"length"|"abort", ...}`` (or a bare string) -> ours; None while running."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else raw
    return kind if kind in FINISH_TYPES else "abort"


# ---------------------------------------------------------------------------- Prometheus scrape


@dataclass
class Histogram:
    buckets: dict[float, float]  # upper bound -> cumulative count
    sum: float = 0.0
    count: float = 0.0


@dataclass
class Scrape:
    """One server's metrics, each name reduced to one value across label sets (see ``parse_metrics``)."""

    histograms: dict[str, Histogram] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)  # gauges and counters (counters by their `_total` name)


def _reduce(series: dict[tuple, dict[tuple, float]]) -> dict[tuple, float]:
    """{group -> {rank labels -> value}} -> {group -> value}: max over ranks (they repeat one batch)."""
    return {group: max(ranks.values()) for group, ranks in series.items()}


def parse_metrics(text: str) -> Scrape:
    """Parse Prometheus text; series of one name are added up (data-parallel ranks, label variants),
    except series that differ only in tensor/pipeline ranks, which report the same thing (max)."""
    hist: dict[str, dict[str, dict[tuple, dict[tuple, float]]]] = {}
    values: dict[str, dict[tuple, dict[tuple, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            ranks = tuple(sorted((k, v) for k, v in labels.items() if k in RANK_LABELS))
            group = tuple(sorted((k, v) for k, v in labels.items() if k not in RANK_LABELS and k != "le"))
            if family.type == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    if sample.name == family.name + suffix:
                        key = f"{suffix}:{labels['le']}" if suffix == "_bucket" else suffix
                        hist.setdefault(family.name, {}).setdefault(key, {}).setdefault(group, {})[ranks] = sample.value
            elif family.type == "counter":
                if sample.name.endswith("_created"):
                    continue
                name = sample.name if sample.name.endswith("_total") else sample.name + "_total"
                values.setdefault(name, {}).setdefault(group, {})[ranks] = sample.value
            elif family.type in ("gauge", "untyped", "unknown"):
                values.setdefault(sample.name, {}).setdefault(group, {})[ranks] = sample.value
    out = Scrape()
    for name, parts in hist.items():
        h = Histogram({})
        for key, series in parts.items():
            total = sum(_reduce(series).values())
            if key.startswith("_bucket:"):
                h.buckets[float(key[len("_bucket:") :])] = total
            elif key == "_sum":
                h.sum = total
            else:
                h.count = total
        out.histograms[name] = h
    for name, series in values.items():
        out.values[name] = sum(_reduce(series).values())
    return out


def histogram_delta(prev: Histogram | None, cur: Histogram) -> tuple[list[tuple[float, float, float]], float]:
    """Observations between two scrapes: ([(lower, upper, count) per bucket], sum of values).

    A server restart resets its counters: when anything went down, the current scrape is all new.
    """
    bounds = sorted(cur.buckets)
    reset = prev is None or cur.count < prev.count or any(cur.buckets[b] < prev.buckets.get(b, 0.0) for b in bounds)
    base = Histogram({}) if reset or prev is None else prev
    out = []
    lower, below = 0.0, 0.0
    for upper in bounds:
        cumulative = cur.buckets[upper] - base.buckets.get(upper, 0.0)
        count = cumulative - below
        if count > 0:
            out.append((lower, upper, count))
        lower, below = upper, cumulative
    return out, cur.sum - base.sum


def add_buckets(sketch: DDSketch, buckets: list[tuple[float, float, float]], total: float, scale: float = 1000.0) -> float:
    """Add bucketed observations to a DDSketch, each bucket's count at one representative value.

    Prometheus keeps only counts per bucket, so a value inside each bucket stands for them all:
    the mean (``total / count``) when every observation fell in one bucket (exact for that
    interval), else the geometric midpoint ``sqrt(lower * upper)`` (DDSketch's error is relative,
    and the geometric midpoint bounds it by ``sqrt(upper / lower)``), half the upper bound for
    the first bucket (lower bound 0), and for the overflow bucket (upper = +Inf) what the sum
    leaves over for it, never below its lower bound. ``scale`` converts units (s -> ms).
    Returns the number of observations added.
    """
    n = sum(c for _, _, c in buckets)
    if n <= 0:
        return 0.0
    if len(buckets) == 1:
        lower, upper, count = buckets[0]
        mean = total / count
        sketch.add((mean if lower <= mean <= upper else _midpoint(lower, upper)) * scale, count)
        return n
    finite = 0.0
    for lower, upper, count in buckets:
        if math.isfinite(upper):
            finite += _midpoint(lower, upper) * count
            sketch.add(_midpoint(lower, upper) * scale, count)
    for lower, upper, count in buckets:
        if not math.isfinite(upper):
            sketch.add(max(lower, (total - finite) / count) * scale, count)
    return n


def _midpoint(lower: float, upper: float) -> float:
    if not math.isfinite(upper):
        return lower
    return upper / 2 if lower <= 0 else math.sqrt(lower * upper)


def fold_scrape(interval: IntervalCounters, rollout: bool, prev: Scrape | None, cur: Scrape) -> None:
    """Add what happened between two scrapes of one server to ``interval`` (the caller holds its lock).

    The serving server's TTFT histogram fills the TTFT sketch; its inter-token latencies fill the
    TPOT sketch (per token, where our engine records one mean per request: the same quantity
    for an SLO on time per output token, weighted by tokens instead of requests).
    """
    if prev is None:
        return  # the first scrape only sets the baseline: its counts are from before we looked
    tokens = cur.values.get(GEN_TOKENS, 0.0) - prev.values.get(GEN_TOKENS, 0.0)
    if tokens < 0:  # the server restarted
        tokens = cur.values.get(GEN_TOKENS, 0.0)
    if rollout:
        interval.rollout_tokens += tokens
        return
    interval.serving_tokens += tokens
    ttft = cur.histograms.get(TTFT_METRIC)
    if ttft is not None:
        add_buckets(interval.ttft, *histogram_delta(prev.histograms.get(TTFT_METRIC), ttft))
    itl_name = ITL_METRIC if ITL_METRIC in cur.histograms else TPOT_METRIC
    itl = cur.histograms.get(itl_name)
    if itl is not None:
        add_buckets(interval.tpot, *histogram_delta(prev.histograms.get(itl_name), itl))


def pool_usage(scrape: Scrape, bytes_per_token: int, known_total: int) -> PoolUsage:
    """KV use in tokens (one block = one token, SGLang's page size 1); ``known_total``: the capacity
    `/get_server_info` reported, for a server whose metrics do not."""
    total = int(scrape.values.get("sglang:max_total_num_tokens", 0)) or known_total
    if "sglang:num_used_tokens" in scrape.values:
        used = int(scrape.values["sglang:num_used_tokens"])
    else:
        usage = scrape.values.get("sglang:token_usage", 0.0)
        used = int(round(usage * total)) if total else 0
    return PoolUsage(bytes_per_token, max(total, used), used)


def version_of(label: Any, default: int) -> int:
    """SGLang's weight_version string as our integer version, when it is one."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.isdigit():
        return int(label)
    return default
