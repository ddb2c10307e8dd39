"""Weight sync after each training step: full broadcast vs lossless delta, over link bandwidth.

The trainer and the dedicated rollout pool sit in one cluster (InfiniBand-class fabric); the
serving fleet sits in another, reached over ordinary Ethernet (mission.md). A new version
crosses the inter-cluster link once and is relayed inside the serving cluster (a relay tree,
as INTELLECT-2's Shardcast or our weight publisher over NATS), so the time to reach every
serving executor is

    encode + bytes / cross_link + bytes / intra_link      (pipelined shards: the max would be
                                                            the bound; we take the sum, which is
                                                            conservative)

Parameters and their sources:
- ``cross_link_gbps = 100``: one 100 GbE path between the clusters (assumption; the paper's
  setting is "ordinary Ethernet");
- ``intra_link_gbps = 400``: a 400 Gb/s NIC per node inside a cluster (NDR InfiniBand /
  400 GbE, the usual H100/H200 node fabric);
- ``delta_bytes_fraction = 0.02``: bytes of a lossless delta as a share of the bf16 weights.
  Public figures: verl ``delta_sharded`` changed ratio 2.1-2.6 % on a 72B model; slime
  "~3 % density"; our ``rose bench weights`` sent 1.15 % of the bytes on a 26 M model
  (anchors.md);
- ``encode_bytes_per_s = 20 GB/s``: delta encoding of the model bytes, ~1.3 GB/s per core
  (anchors.md: numpy encode 1.1-1.7 GB/s on one core) on 16 cores in parallel over shards.
A full broadcast needs no encoding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncSpec:
    cross_link_gbps: float = 100.0
    intra_link_gbps: float = 400.0
    delta_bytes_fraction: float = 0.02
    encode_bytes_per_s: float = 20e9


def sync_seconds(weight_bytes: float, mode: str, spec: SyncSpec, cross_cluster: bool) -> float:
    """Seconds until a new version of ``weight_bytes`` is usable on the targets.

    ``mode``: ``full`` or ``delta``; ``cross_cluster``: the targets are serving executors in
    the other cluster (else the dedicated pool beside the trainer).
    """
    if mode not in ("full", "delta"):
        raise ValueError(f"weight sync mode {mode!r}: full or delta")
    nbytes = weight_bytes * (spec.delta_bytes_fraction if mode == "delta" else 1.0)
    encode = weight_bytes / spec.encode_bytes_per_s if mode == "delta" else 0.0
    intra = nbytes * 8 / (spec.intra_link_gbps * 1e9)
    if not cross_cluster:
        return encode + intra
    return encode + nbytes * 8 / (spec.cross_link_gbps * 1e9) + intra


def bytes_sent(weight_bytes: float, mode: str, spec: SyncSpec) -> float:
    return weight_bytes * (spec.delta_bytes_fraction if mode == "delta" else 1.0)
