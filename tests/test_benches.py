"""The benchmark commands run end to end at a tiny size and write every JSON field their issue names.

No figure is asserted here (speed belongs to the benchmarks themselves, on a quiet machine).
NATS auth is: the benches run on a server with per-service permissions, every client with its
own credentials, and `auth` in their JSON says a client without credentials was refused.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rose.bench.bus import refuses_anonymous
from rose.bench.elastic import connect_as, start_nats
from rose.contracts.registry import ROLLOUT_TASK, SLO_ALERT
from rose.contracts.rollout import RolloutTask
from rose.contracts.slo import SloAlert
from rose.shared.bus import PermissionDenied
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR


def _bench(*args: str, out: Path, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rose.cli.main", "bench", *args, "--json", str(out)], capture_output=True, text=True, timeout=timeout
    )
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_bus_fields(tmp_path):
    r = _bench("bus", "--requests", "200", "--rounds", "1", out=tmp_path / "bus.json")
    for name in ("raw_nats_py", "rose_helpers", "faststream"):
        assert r["request_reply"][name]["p50_ms"] > 0 and r["request_reply"][name]["p99_ms"] > 0
    assert r["publish"]["raw_msgs_per_s"] > 0 and r["publish"]["helpers_msgs_per_s"] > 0
    assert r["helper_overhead_p50"] > 0 and isinstance(r["meets_target"], bool)
    assert r["auth"] is True


def test_bench_weights_fields(tmp_path):
    r = _bench("weights", "--params", "3000000", "--steps", "2", out=tmp_path / "weights.json")
    for field in (
        "params",
        "full_bytes",
        "wire_bytes",
        "wire_ratio",
        "changed_fraction",
        "publish_s",
        "fetch_apply_s",
        "full_snapshot_speedup",
        "apply_pause_ms",
        "encode_mb_s",
        "decode_mb_s",
    ):
        assert field in r, field
    assert r["bit_exact"] is True  # exactness is a correctness property, not a speed
    assert set(r["objstore_baseline"]) >= {"put_s", "get_s"}
    assert (tmp_path / "weights.png").exists()
    assert r["auth"] is True  # and bit-exact above: the publisher and the executor worked with their own credentials


async def test_bench_elastic_nats_keeps_auth_across_its_restart(tmp_path):
    """`rose bench elastic`'s server, without the fleet (the whole bench runs for minutes): auth on, still on
    after the chaos step's restart, and the task feeder may do what the trainer may, nothing more."""
    creds, server = start_nats(tmp_path)
    try:
        assert await refuses_anonymous(server.url)
        server.restart()  # what the chaos step does
        assert await refuses_anonymous(server.url)
        async with connect_as(creds, server.url, OPERATOR, "t-observer") as observer:
            await provision(observer.js)
        async with connect_as(creds, server.url, "trainer", "t-feeder") as feeder:
            task = RolloutTask(task_id="t-1", env="conversation", prompt="hi", max_turns=1, group_id="g", group_size=1, created_at=time.time())
            await feeder.publish(ROLLOUT_TASK, task, msg_id=task.task_id)
            with pytest.raises(PermissionDenied):
                await feeder.publish(SLO_ALERT, SloAlert(executor_id="e", at=0.0, severity="burst", reason="r"), executor_id="e")
    finally:
        server.stop()


def test_bench_coserve_fields(tmp_path, models_dir):
    """Two cells, one SLO: serving_only at the highest load sets it once and is that cell's serving_only. With a LoRA
    policy of the serving model (``--lora``): the four policies in the two-model mode and rose co-batched beside them."""
    r = _bench(
        "coserve",
        "--lora",
        "--duration",
        "1",
        "--loads",
        "0.2,0.3",
        "--slo-basis",
        "run",
        "--reclaim-probes",
        "4",
        "--dedicated-s",
        "1",
        "--models",
        str(models_dir),
        out=tmp_path / "coserve.json",
        timeout=600,
    )
    assert r["slo"]["basis"] == "run" and r["slo"]["calibration"] == {"noise": 0.0, "load": 0.3, "seed": 0}
    assert [c["load"] for c in r["cells"]] == [0.2, 0.3] and r["serving_load"] == 0.2  # the top level is the first cell
    for c in r["cells"]:
        assert c["slo"] == {"ttft_ms": r["slo"]["ttft_ms"], "tpot_ms": r["slo"]["tpot_ms"]}
    # serving_only at the calibration cell ran once: its own p99 is the SLO's half (the multiplier is 2)
    assert r["cells"][1]["policies"]["serving_only"]["ttft_p99_ms"] * 2 == pytest.approx(r["slo"]["ttft_ms"])
    # each cell was also written as it finished (a grid stopped midway keeps them): same cells, same SLO figures
    partial = [json.loads(line) for line in (tmp_path / "coserve.cells.jsonl").read_text().splitlines()]
    assert [(c["load"], c["seed"], c["noise"]) for c in partial] == [(c["load"], c["seed"], c["noise"]) for c in r["cells"]]
    before = max(r["dedicated_runs"][0].values())  # the partial rows' baseline: the dedicated run before the policies
    for early, final in zip(partial, r["cells"]):
        assert early["policies"]["rose"]["slo_attainment"] == final["policies"]["rose"]["slo_attainment"]
        assert early["harvest_baseline"] == "dedicated_before" and before > 0
        # rose's own tokens may be 0 on a loaded host (its child runs at idle priority): check the ratio, not its size
        for p in early["policies"].values():
            assert p["harvest"] == pytest.approx(p["rollout_tokens_per_s"] / before)
        assert early["policies"]["static_partition"]["rollout_tokens_per_s"] > 0  # the backlog fed the rollout lanes
    for c in r["cells"]:  # two harvests: over the best dedicated baseline, and over its one-thread run
        rose, by_threads = c["policies"]["rose"], r["dedicated_by_threads"]
        assert rose["harvest_vs_one_thread"] * by_threads["1"] == pytest.approx(rose["harvest"] * max(by_threads.values()))
    assert r["repeats"] == 1 and all(c["repeats"] == 1 for c in r["cells"])  # one round per cell unless --repeats
    for c in r["cells"]:
        assert all(p["slo_attainment_runs"] == [p["slo_attainment"]] for p in c["policies"].values())
    assert set(r["policies"]) == {"serving_only", "naive_share", "static_partition", "rose", "rose+co_batched"}
    assert {name: p["mode"] for name, p in r["cells"][0]["policies"].items()}["rose+co_batched"] == "co_batched"
    assert r["lora"]["rank"] >= 1 and r["co_batched"]["cells"] == 2
    for c in r["cells"]:  # the co-batched row's ratios are its tokens over two-model rose's and static partition's
        co, rose, static = (c["policies"][n]["rollout_tokens_per_s"] for n in ("rose+co_batched", "rose", "static_partition"))
        assert c["co_batched"]["over_static_partition"] == pytest.approx(co / static) and co > 0
    for p in r["policies"].values():
        assert set(p) >= {"slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "serving_tokens_per_s", "rollout_tokens_per_s"}
    for field in ("dedicated_rollout_tokens_per_s", "harvest_ratio", "reclaim_latency_ms_p99", "executor_rss_mb"):
        assert field in r, field
    assert r["policies"]["serving_only"]["rollout_tokens_per_s"] == 0
    rounds = r["serving_capacity_rounds_rps"]  # the trace's rate is set by their median
    assert len(rounds) == 3 and r["serving_capacity_rps"] == sorted(rounds)[1]
    assert r["reclaim_samples"] >= 2  # half the 4 lull probes at least: serving arrivals that found rollout on serving's cores and took them back
    assert (tmp_path / "coserve.png").exists()


def test_bench_elastic_reclaim_splits_at_the_bursts_first_arrival():
    """Reclaim per burst = onset -> first revocation signal; the floor is onset -> the burst's first
    arrival (nothing can be detected before it), the rest is detection plus the bus."""
    from rose.bench.elastic import Record, poisson_first_arrival_p99_ms, reclaim

    rec = Record()
    rec.serving.bursts += [(100.0, 103.0, "ex-a"), (200.0, 203.0, "ex-a"), (300.0, 303.0, "ex-b")]
    rec.alerts += [(100.4, "ex-a", "burst", 100.39), (200.9, "ex-a", "recovered", 200.9)]
    rec.lease_events += [(200.3, "ex-a", "revoked", "l-2")]
    leases = {"ex-a": [(90.0, 100.5), (150.0, 200.3)]}  # ex-b held no lease at its burst: nothing to reclaim
    arrivals = {"ex-a": [99.9, 100.15, 100.2, 200.05], "ex-b": [300.01]}
    # what the executors' metrics showed after each signal: ex-a's first burst parked its turns (KV kept, no
    # compute) at 100.6, its second left a turn running until 201.5
    rec.snapshots += [(100.6, "ex-a", 80.0, 3, "l-1", True), (200.6, "ex-a", 80.0, 1, "l-2", False), (201.5, "ex-a", 80.0, 0, "", False)]
    r = reclaim(rec, leases, arrivals)
    assert r["samples"] == 2 and r["missed"] == 0
    assert r["confirmed_p99"] == pytest.approx(1490.0, abs=15.0)  # p99 of {600, 1500}
    assert r["all_ms"] == [400.0, 300.0]
    assert r["floor_p99"] == pytest.approx(150.0, abs=1.0)  # p99 of {150, 50}
    assert r["after_first_arrival_p99"] == pytest.approx(250.0, abs=1.0)  # p99 of {250, 250}
    assert poisson_first_arrival_p99_ms(24.0) == pytest.approx(191.9, abs=0.1)  # a x3 burst of 8 req/s


def test_bench_elastic_counts_own_burst_alerts_outside_bursts_as_false_alarms():
    from rose.bench.elastic import RECLAIM_GRACE_S, Record, false_alarms_per_hour

    rec = Record()
    rec.serving.bursts += [(100.0, 102.0, "ex-a"), (106.0, 108.0, "ex-b")]
    rec.own_bursts += [(100.3, "ex-a"), (102.0 + RECLAIM_GRACE_S - 0.1, "ex-a")]  # in the burst and in its grace
    rec.own_bursts += [(101.0, "ex-b"), (150.0, "ex-a")]  # ex-b had no burst then; ex-a none at 150
    assert false_alarms_per_hour(rec, ["ex-a", "ex-b"], window_s=1800.0) == pytest.approx(2.0)  # 2 in 1 executor-hour


def test_bench_elastic_says_whose_each_slo_miss_is():
    """Each failed or late serving request is placed by when it was sent: after a chaos step (first: a killed
    executor's traffic goes to the others), in a burst on its executor (onset to the grace after its end), beside
    a lease, or in calm; requests within the SLO are not listed."""
    from rose.bench.elastic import RECLAIM_GRACE_S, SLO_TPOT_MS, SLO_TTFT_MS, Record, slo_misses_in_context

    rec = Record()
    rec.serving.bursts += [(100.0, 102.0, "ex-a"), (201.0, 203.0, "ex-a")]
    rec.chaos += [(200.0, "kill -9 ex-b")]
    leases = {"ex-a": [(300.0, 320.0)]}

    def req(ex: str, sent: float, ttft: float = 10.0, tpot: float = 1.0, ok: bool = True, error: str | None = None) -> dict:
        return {"executor": ex, "sent_at": sent, "t": sent + 1.0, "ttft_ms": ttft, "tpot_ms": tpot, "ok": ok, "error": error}

    late = SLO_TTFT_MS + 1.0
    rec.serving.requests += [
        req("ex-a", 101.0, ttft=late),  # in the burst
        req("ex-a", 102.0 + RECLAIM_GRACE_S - 0.1, tpot=SLO_TPOT_MS + 1.0),  # in its grace
        req("ex-b", 101.0, ttft=late),  # ex-b had no burst: calm
        req("ex-b", 205.0, ok=False, ttft=float("inf"), error="ServerDisconnectedError: gone"),  # after the kill
        req("ex-a", 199.5, ok=False, ttft=float("inf"), error="ClientOSError: reset"),  # in flight at the kill
        req("ex-a", 202.0, ttft=late),  # a burst on ex-a while ex-b's traffic comes to it: the fault's
        req("ex-a", 310.0, ttft=late),  # beside a lease
        req("ex-a", 310.0),  # within the SLO: not a miss
    ]
    r = slo_misses_in_context(rec, leases, t0=100.0)
    assert r["by_context"] == {"burst": 2, "lease": 1, "chaos": 3, "calm": 1}
    assert [m["context"] for m in r["records"]] == ["burst", "burst", "calm", "chaos", "chaos", "chaos", "lease"]
    failed = r["records"][3]
    assert failed["error"].startswith("ServerDisconnectedError") and failed["ttft_ms"] is None and failed["sent_s"] == 105.0


def test_bench_elastic_says_why_later_turns_missed_their_prefix():
    """A later turn that moved executors, or whose first attempt was refused, ran without its cached prefix:
    the breakdown counts both per routing, beside the hit rate, and what every turn of a routing cost."""
    from rose.bench.elastic import Record, prefix_figures, turn_routing
    from rose.contracts.rollout import Trajectory, TurnRecord

    def turn(i: int, ex: str, cached: int, attempts: int = 1, at: float = 100.0) -> TurnRecord:
        seconds = 2.0 if ex == "s" else 1.0
        return TurnRecord(
            started_at=at,
            finished_at=at + seconds,
            turn_index=i,
            prompt_token_ids=[1],
            token_ids=[2],
            logprobs=[0.0],
            policy_version=0,
            executor_id=ex,
            prefix_cached_tokens=cached,
            attempts=attempts,
        )

    rec = Record()
    rec.trajectories["a"] = Trajectory(
        task_id="a", trajectory_id="a", env="e", status="completed", routing="affinity", turns=[turn(0, "d", 0), turn(1, "d", 9), turn(2, "s", 0)]
    )
    rec.trajectories["b"] = Trajectory(
        task_id="b", trajectory_id="b", env="e", status="completed", routing="affinity", turns=[turn(0, "d", 0), turn(1, "d", 0, attempts=2)]
    )
    rec.trajectories["c"] = Trajectory(
        task_id="c", trajectory_id="c", env="e", status="completed", routing="random", turns=[turn(0, "s", 0), turn(1, "d", 0, at=103.0)]
    )
    assert prefix_figures(rec)["prefix_hit_rate"] == {"affinity": pytest.approx(1 / 3), "random": 0.0}
    r = turn_routing(rec, serving=["s"])
    assert r["affinity"] == {
        "turns": 3,
        "stayed": pytest.approx(2 / 3),
        "retried": pytest.approx(1 / 3),
        "retried_outside_chaos": pytest.approx(1 / 3),  # no chaos step in this run
        "to_lease": pytest.approx(1 / 3),
        "to_dedicated": 0.0,
        "between_leases": 0.0,
        "left_lease_ended_before": 0.0,
        "left_lease_ended_during": 0.0,
        "on_leases": pytest.approx(1 / 5),  # every turn counts here, the first ones too
        "turn_s_mean": pytest.approx(6 / 5),
    }
    assert r["random"] == {
        **{"turns": 1, "stayed": 0.0, "retried": 0.0, "retried_outside_chaos": 0.0, "on_leases": 0.5, "turn_s_mean": 1.5},
        **{"to_lease": 0.0, "to_dedicated": 1.0, "between_leases": 0.0, "left_lease_ended_before": 0.0, "left_lease_ended_during": 0.0},
    }
    ended = lambda: {k: v for k, v in turn_routing(rec, serving=["s"])["random"].items() if k.startswith("left_")}  # noqa: E731
    rec.lease_events.append((110.0, "s", "revoked", "l3"))  # after c's second turn ended: not why it moved
    assert ended() == {"left_lease_ended_before": 0.0, "left_lease_ended_during": 0.0}
    rec.lease_events.append((103.5, "s", "expired", "l2"))  # while c's second turn ran (on d): its first attempt's lease
    assert ended() == {"left_lease_ended_before": 0.0, "left_lease_ended_during": 1.0}
    rec.lease_events.append((100.5, "s", "revoked", "l1"))  # while c's first turn ran there: gone when the second was placed
    assert ended() == {"left_lease_ended_before": 1.0, "left_lease_ended_during": 1.0}
    # a retry whose turn ran across a kill -9 is the fault's; one well after the restart window is not
    rec.chaos.append((100.5, "kill -9 s"))
    rec.trajectories["d"] = Trajectory(
        task_id="d", trajectory_id="d", env="e", status="completed", routing="random", turns=[turn(0, "d", 0), turn(1, "d", 0, attempts=2, at=200.0)]
    )
    r = turn_routing(rec, serving=["s"])
    assert r["affinity"]["retried"] == pytest.approx(1 / 3) and r["affinity"]["retried_outside_chaos"] == 0.0
    assert r["random"]["retried"] == pytest.approx(1 / 2) and r["random"]["retried_outside_chaos"] == pytest.approx(1 / 2)


def test_bench_elastic_detection_bound_follows_the_information_in_the_burst():
    """Lorden's bound for a Poisson rate step: 8 -> 24 req/s carries 24 ln 3 - 16 = 10.37 nats/s; one false
    alarm an hour needs ln(3600 x 10.37) = 10.5 nats: about a second. A larger step is found sooner,
    a stricter false-alarm budget later."""
    from rose.bench.elastic import detection_delay_bound_ms

    info = 24 * math.log(3) - 16
    assert detection_delay_bound_ms(8.0, 3.0) == pytest.approx(math.log(3600 * info) / info * 1e3, rel=1e-9)
    assert 950 < detection_delay_bound_ms(8.0, 3.0) < 1100
    assert detection_delay_bound_ms(8.0, 5.0) < detection_delay_bound_ms(8.0, 3.0) / 2
    assert detection_delay_bound_ms(8.0, 3.0, false_alarm_every_s=86400) > detection_delay_bound_ms(8.0, 3.0)


def test_bench_elastic_counts_reclaim_samples_as_the_run_goes():
    """With --min-bursts the run goes on until enough bursts that found a lease are over: a burst counts
    once it ended (and its grace for a late signal passed), and only if a lease was held at its onset."""
    from rose.bench.elastic import RECLAIM_GRACE_S, Record, samples_so_far

    rec = Record()
    rec.serving.bursts += [(100.0, 102.0, "ex-a"), (112.0, 114.0, "ex-a"), (124.0, 126.0, "ex-a")]
    rec.lease_events += [(90.0, "ex-a", "granted", "l-1"), (100.2, "ex-a", "revoked", "l-1")]  # held at the first onset only
    rec.lease_events += [(120.0, "ex-a", "granted", "l-2"), (124.3, "ex-a", "revoked", "l-2")]  # and at the third
    arrivals = {"ex-a": [100.1, 124.1]}
    assert samples_so_far(rec, arrivals, now=101.0) == 0  # the first burst is still on
    assert samples_so_far(rec, arrivals, now=102.0 + RECLAIM_GRACE_S + 0.1) == 1
    assert samples_so_far(rec, arrivals, now=120.0) == 1  # the second found nothing lent
    assert samples_so_far(rec, arrivals, now=126.0 + RECLAIM_GRACE_S + 0.1) == 2


def test_bench_coserve_cell_says_when_one_request_decides_it():
    """A cell's target tolerates 0.005 of its requests more missed by rose than by serving_only; with fewer
    than 200 requests that is less than one request, and the cell says so (+k of n) instead of a bare MISS."""
    from rose.bench.coserve import _cell, _resolution_note

    def run(n: int, missed: int) -> dict:
        ttft = [10.0] * (n - missed) + [500.0] * missed
        return {
            "ttft_ms": ttft, "tpot_ms": [5.0] * n, "aborted": [False] * n, "serving_tokens_per_s": 1.0,
            "rollout_tokens_per_s": 50.0, "lane_failures": 0, "cuda_graphs": None, "reclaim_ms": [5.0],
        }  # fmt: skip

    def cell(n: int, rose_missed: int) -> dict:
        runs = {"serving_only": run(n, 0), "static_partition": run(n, 0), "rose": run(n, rose_missed)}
        return _cell(runs, (100.0, 50.0), {1: 80.0, 2: 100.0}, 0.2, 3, 0.3, 15.0)

    small = cell(187, 1)
    assert not small["rose_meets_slo_target"] and small["rose_extra_misses"] == 1
    assert small["tolerated_extra_misses"] < 1 and _resolution_note(small) == " (+1 of 187)"
    large = cell(1000, 5)
    assert large["rose_meets_slo_target"] and large["tolerated_extra_misses"] == 5.0 and _resolution_note(large) == ""
    assert not cell(1000, 6)["rose_meets_slo_target"]
    assert large["policies"]["rose"]["harvest"] == 0.5 and large["policies"]["rose"]["slo_misses"] == 5
    assert large["policies"]["rose"]["harvest_vs_one_thread"] == 50.0 / 80.0  # over what the rollout lane has of its own
    from rose.bench.coserve import cell_duration_s

    assert cell_duration_s(12.0, 0, 15.6) == 12.0
    assert cell_duration_s(12.0, 1000, 15.6) == pytest.approx(64.1, abs=0.1)  # load 0.2 of 78 req/s: 64 s for 1,000 requests
    assert cell_duration_s(12.0, 100, 50.0) == 12.0


def test_bench_coserve_pools_a_cells_rounds(tmp_path):
    """--repeats: each policy's rounds on one trace pooled: attainment over all their requests, each round's
    own too, the tolerance over the pooled count, throughputs averaged, reclaim samples together."""
    from rose.bench.coserve import _cell, _pooled

    def run(n: int, missed: int, rollout: float) -> dict:
        return {
            "ttft_ms": [10.0] * (n - missed) + [500.0] * missed, "tpot_ms": [5.0] * n, "aborted": [False] * n,
            "serving_tokens_per_s": 1.0, "rollout_tokens_per_s": rollout, "lane_failures": 0, "cuda_graphs": None,
            "reclaim_ms": [5.0], "rss_bytes": 100, "guard_trace": [(0.0, 1.0, 0.1), (4.0, 0.5, 0.9)],
            "arrivals_s": [0.01 * i for i in range(n)],
        }  # fmt: skip

    rose = _pooled([run(400, 0, 40.0), run(400, 8, 60.0), run(400, 1, 50.0)])  # one bad round of three
    runs = {name: _pooled([run(400, 1, 0.0)] * 3) for name in ("serving_only", "static_partition")} | {"rose": rose}
    cell = _cell(runs, (100.0, 50.0), {1: 50.0}, 0.35, 3, 0.3, 27.0)
    r = cell["policies"]["rose"]
    assert cell["repeats"] == 3 and cell["serving_requests"] == 1200 and cell["tolerated_extra_misses"] == pytest.approx(6.0)
    assert r["slo_attainment_runs"] == [1.0, 0.98, 0.9975] and r["slo_attainment"] == pytest.approx(1 - 9 / 1200)
    assert cell["rose_extra_misses"] == 6 and cell["rose_meets_slo_target"]  # 9 vs 3 misses of 1,200: within 0.005
    assert r["rollout_tokens_per_s"] == 50.0 and len(rose["reclaim_ms"]) == 3 and rose["run_sizes"] == [400] * 3
    from rose.bench.coserve import _plot_guard

    _plot_guard(tmp_path / "guard.png", rose, (100.0, 50.0))  # the first round's requests against its own trace
    assert (tmp_path / "guard.png").stat().st_size > 1000


def test_bench_coserve_takes_the_slo_as_two_positive_numbers():
    from rose.bench.coserve import _slo_pair

    assert _slo_pair(None) is None and _slo_pair([60.0, 8.0]) == (60.0, 8.0)
    for bad in ([60.0], [60.0, 8.0, 1.0], [60.0, 0.0]):
        with pytest.raises(SystemExit, match="TTFT,TPOT in ms"):
            _slo_pair(bad)
