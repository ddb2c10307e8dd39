"""The scheduler's lending modes (`lending.mode`): rose (the default), none, always, elastic_baseline.

Pure decisions, as `rose bench e2e` runs them on real fleets: `none` lends nothing, `always` keeps
a whole lease on every live serving executor whatever the latency and the alerts, and
`elastic_baseline` lends whole executors only after a long lendable window, keeps `min_serving`
unlent, and takes every lease back at once on any alert, then lends nothing for a cooldown.
"""

from __future__ import annotations

import msgspec
import pytest

from rose.contracts.slo import Headroom, SloAlert
from rose.services.scheduler.config import LeaseSettings, LendingSettings, SchedulerConfig
from rose.services.scheduler.fleet import Fleet
from rose.services.scheduler.leases import ExecutorView, last_preemption, plan_leases, plan_lending, revoke_on_alert
from rose.shared.config import ConfigError, load_config

S = LeaseSettings(ttl_s=10.0, renew_before_s=4.0, keep_fraction=0.8, cooldown_s=5.0, headroom_max_age_s=3.0)
ELASTIC = LendingSettings(mode="elastic_baseline", idle_s=20.0, cooldown_s=30.0, min_serving=1, whole_batch=16, whole_kv_mib=1024.0)
NOW = 10_000.0


def headroom(ex: str, at: float, *, lendable: bool = True, ttft: float = 50.0) -> Headroom:
    return Headroom(
        executor_id=ex,
        at=at,
        kv_bytes=8 << 20,
        compute_share=0.25,
        rollout_batch_slots=4,
        ttft_p99_ms=ttft,
        tpot_p99_ms=10.0,
        slo_ttft_ms=500.0,
        slo_tpot_ms=100.0,
        arrival_rate_rps=5.0,
        serving_queue=0,
        lendable=lendable,
        reason="test",
    )


def view(
    ex: str,
    now: float = NOW,
    *,
    lease=None,
    lendable_since: float = 0.0,
    h: Headroom | None = None,
    alive: bool = True,
    role: str = "serving",
    alert_at: float = 0.0,
) -> ExecutorView:
    return ExecutorView(ex, role, alive, h if h is not None else headroom(ex, now), lease, alert_at, lendable_since)


def alert(ex: str, severity: str = "burst") -> SloAlert:
    return SloAlert(executor_id=ex, at=NOW, severity=severity, reason="arrivals 3x baseline")  # type: ignore[arg-type]


def test_default_mode_is_rose_and_settings_load_from_the_environment():
    assert SchedulerConfig().lending.mode == "rose"
    cfg = load_config(SchedulerConfig, env={"ROSE_LENDING__MODE": "elastic_baseline", "ROSE_LENDING__IDLE_S": "7"})
    assert cfg.lending.mode == "elastic_baseline" and cfg.lending.idle_s == 7.0
    with pytest.raises(ConfigError, match="lending.mode"):
        load_config(SchedulerConfig, env={"ROSE_LENDING__MODE": "greedy"})
    views = [view("a", lendable_since=NOW - 100), view("b")]
    assert plan_lending(NOW, views, S, LendingSettings()) == plan_leases(NOW, views, S)


def test_none_lends_nothing_and_takes_back_a_leftover_lease():
    views = [view("a", lendable_since=NOW - 100), view("d", role="dedicated")]
    assert plan_lending(NOW, views, S, LendingSettings(mode="none")) == []
    leftover = plan_lending(NOW, views, S, LendingSettings(mode="always"))[0].lease
    actions = plan_lending(NOW + 1, [view("a", NOW + 1, lease=leftover)], S, LendingSettings(mode="none"))
    assert [a.kind for a in actions] == ["revoked"]


def test_always_lends_whole_executors_whatever_the_latency_and_ignores_alerts():
    always = LendingSettings(mode="always", whole_batch=16, whole_kv_mib=1024.0)
    hot = headroom("a", NOW, lendable=False, ttft=5000.0)
    actions = plan_lending(NOW, [view("a", h=hot), view("b", h=hot), view("d", role="dedicated"), view("gone", alive=False)], S, always)
    assert sorted(a.lease.executor_id for a in actions) == ["a", "b"] and {a.kind for a in actions} == {"granted"}
    lease = actions[0].lease
    assert lease.max_rollout_batch == 16 and lease.kv_bytes == 1024 << 20 and lease.compute_share == 1.0
    assert plan_lending(NOW + 1, [view("a", NOW + 1, lease=lease, h=hot)], S, always) == []  # latency never revokes it
    renewed = plan_lending(NOW + 7, [view("a", NOW + 7, lease=lease, h=hot)], S, always)
    assert [a.kind for a in renewed] == ["renewed"] and renewed[0].lease.expires_at == NOW + 7 + S.ttl_s
    assert revoke_on_alert([view("a", lease=lease)], alert("a"), NOW + 1, always) == []
    gone = plan_lending(NOW + 2, [view("a", NOW + 2, lease=lease, alive=False)], S, always)
    assert [a.kind for a in gone] == ["revoked"]


def test_elastic_lends_only_after_the_idle_window_and_keeps_min_serving():
    # lendable for 10 s only: not yet (rose would lend at once)
    assert plan_lending(NOW, [view("a", lendable_since=NOW - 10), view("b", lendable_since=NOW - 10)], S, ELASTIC) == []
    assert plan_leases(NOW, [view("a", lendable_since=NOW - 10)], S)
    # both lendable long enough: only one is lent (min_serving = 1), the longest-idle first, whole
    actions = plan_lending(NOW, [view("a", lendable_since=NOW - 25), view("b", lendable_since=NOW - 40)], S, ELASTIC)
    assert [(a.kind, a.lease.executor_id) for a in actions] == [("granted", "b")]
    assert actions[0].lease.max_rollout_batch == 16 and actions[0].lease.kv_bytes == 1024 << 20
    lease = actions[0].lease
    # held: renewed whatever the latency, and the other one stays unlent
    hot = headroom("b", NOW + 7, lendable=False, ttft=450.0)
    again = plan_lending(NOW + 7, [view("a", NOW + 7, lendable_since=NOW - 30), view("b", NOW + 7, lease=lease, h=hot)], S, ELASTIC)
    assert [(a.kind, a.lease.executor_id) for a in again] == [("renewed", "b")]
    # stale or non-lendable headroom never lends
    stale = headroom("a", NOW - 10)
    assert plan_lending(NOW, [view("a", lendable_since=NOW - 40, h=stale), view("b")], S, ELASTIC) == []
    # with min_serving = 0 both may go
    both = plan_lending(
        NOW, [view("a", lendable_since=NOW - 25), view("b", lendable_since=NOW - 40)], S, msgspec.structs.replace(ELASTIC, min_serving=0)
    )
    assert len(both) == 2


def test_elastic_any_alert_revokes_every_lease_then_a_fleet_wide_cooldown():
    two = LendingSettings(mode="elastic_baseline", idle_s=20.0, cooldown_s=30.0, min_serving=0)
    granted = plan_lending(NOW, [view("a", lendable_since=NOW - 25), view("b", lendable_since=NOW - 25)], S, two)
    leases = {a.lease.executor_id: a.lease for a in granted}
    views = [view("a", lease=leases["a"]), view("b", lease=leases["b"]), view("c", lendable_since=NOW - 60)]
    # an alert on an executor that holds no lease takes back both leases, at once
    actions = revoke_on_alert(views, alert("c"), NOW + 1, two)
    assert sorted(a.lease.executor_id for a in actions) == ["a", "b"] and {a.kind for a in actions} == {"revoked"}
    assert all(a.lease.state == "revoked" and a.lease.expires_at == NOW + 1 and "whole-job preemption" in a.reason for a in actions)
    assert revoke_on_alert(views, alert("c", "recovered"), NOW + 1, two) == []
    after = [view(a.lease.executor_id, NOW + 20, lease=a.lease, lendable_since=NOW - 60) for a in actions]
    assert last_preemption(after) == NOW + 1
    assert plan_lending(NOW + 20, after, S, two) == []  # cooling down, although lendable for long
    later = [view(a.lease.executor_id, NOW + 32, lease=a.lease, lendable_since=NOW - 60) for a in actions]
    regrant = plan_lending(NOW + 32, later, S, two)
    assert {a.kind for a in regrant} == {"granted"} and all(a.lease.epoch == 2 for a in regrant)
    # rose, by contrast, revokes only the alerting executor's lease
    assert [a.lease.executor_id for a in revoke_on_alert(views, alert("a"), NOW + 1, LendingSettings())] == ["a"]
    assert revoke_on_alert(views, alert("c"), NOW + 1, LendingSettings()) == []


def test_fleet_tracks_an_unbroken_lendable_run():
    fleet = Fleet(SchedulerConfig())
    fleet.on_headroom(headroom("a", NOW))
    fleet.on_headroom(headroom("a", NOW + 5))
    assert fleet.info("a").lendable_since == NOW
    fleet.on_headroom(headroom("a", NOW + 6, lendable=False))
    assert fleet.info("a").lendable_since == 0.0
    fleet.on_headroom(headroom("a", NOW + 7))
    assert fleet.view("a", NOW + 7).lendable_since == NOW + 7
