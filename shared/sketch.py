"""Mergeable latency sketches on the wire: DDSketch <-> `contracts.executor.LatencySketch` fields.

DDSketch buckets values logarithmically, so quantiles have a bounded *relative* error and two
sketches with the same accuracy merge exactly by adding bucket counts: executors publish one
per interval, and the SLO monitor merges them per executor, fleet-wide and over windows.
Serialised without protobuf: key -> count bins of the positive store (latencies are >= 0).
"""

from __future__ import annotations

from ddsketch import DDSketch

from rose.contracts.executor import LatencySketch

SKETCH_RELATIVE_ACCURACY = 0.01


def new_sketch() -> DDSketch:
    return DDSketch(relative_accuracy=SKETCH_RELATIVE_ACCURACY)


def sketch_to_dict(sketch: DDSketch) -> dict:
    """The sketch as plain fields (those of `LatencySketch`)."""
    store = sketch._store
    bins = {store.offset + i: c for i, c in enumerate(store.bins) if c}
    return {
        "relative_accuracy": sketch._relative_accuracy,
        "count": float(sketch.count),
        "zero_count": float(sketch._zero_count),
        "sum": float(sketch.sum),
        "min": float(sketch._min) if sketch.count else 0.0,
        "max": float(sketch._max) if sketch.count else 0.0,
        "bins": bins,
    }


def sketch_from_dict(data: dict) -> DDSketch:
    """Rebuild a DDSketch from `sketch_to_dict` output."""
    sketch = DDSketch(relative_accuracy=data["relative_accuracy"])
    for key, count in data["bins"].items():
        sketch._store.add(int(key), count)
    sketch._zero_count = data["zero_count"]
    sketch._count = data["count"]
    sketch._sum = data["sum"]
    if data["count"]:
        sketch._min, sketch._max = data["min"], data["max"]
    return sketch


def to_contract(sketch: DDSketch) -> LatencySketch:
    return LatencySketch(**sketch_to_dict(sketch))


def from_contract(sketch: LatencySketch) -> DDSketch:
    return sketch_from_dict({f: getattr(sketch, f) for f in sketch.__struct_fields__})
