"""The weight publisher's metrics: versions published, bytes on the wire per version, failures."""

from __future__ import annotations

from rose.contracts.weights import WeightManifest
from rose.shared.metrics import LATENCY_BUCKETS_S, meter, metric_name


class PublisherMetrics:
    """Instruments of the publisher; every measurement carries `model`."""

    def __init__(self) -> None:
        m = meter()
        self.versions = m.create_counter(
            metric_name("weight_publisher.versions"), unit="{version}", description="Weight versions published, per model and kind (keyframe, delta)."
        )
        self.failures = m.create_counter(
            metric_name("weight_publisher.failures"), unit="{version}", description="Accepted publish requests that failed, per model."
        )
        self.wire_total = m.create_counter(
            metric_name("weight_publisher.wire"), unit="By", description="Encoded bytes stored for followers to fetch (on the wire), per model."
        )
        self.version = m.create_gauge(metric_name("weight_publisher.version"), unit="{version}", description="The last version published, per model.")
        self.version_wire = m.create_gauge(
            metric_name("weight_publisher.version_wire"), unit="By", description="Bytes on the wire of the last version published, per model."
        )
        self.version_full = m.create_gauge(
            metric_name("weight_publisher.version_full"), unit="By", description="Dense bytes of the last version published, per model."
        )
        self.changed = m.create_gauge(
            metric_name("weight_publisher.changed_fraction"), description="Fraction of elements that changed in the last version, per model."
        )
        self.duration = m.create_histogram(
            metric_name("weight_publisher.publish_duration"),
            unit="s",
            description="Request taken off the queue to manifest announced (load, encode, store).",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )

    def serving(self, model: str) -> None:
        """A model this publisher now serves: its counters exported at 0 (a dashboard shows 0, not "No data")."""
        self.failures.add(0, {"model": model})

    def published(self, manifest: WeightManifest, seconds: float) -> None:
        model = {"model": manifest.model}
        self.versions.add(1, {**model, "kind": manifest.kind})
        self.wire_total.add(manifest.wire_bytes, model)
        self.version.set(manifest.version, model)
        self.version_wire.set(manifest.wire_bytes, model)
        self.version_full.set(manifest.full_bytes, model)
        self.changed.set(manifest.changed_fraction, model)
        self.duration.record(seconds, model)

    def failed(self, model: str) -> None:
        self.failures.add(1, {"model": model})
