"""Each service's credentials do what its role needs and are refused what it must not, on a real server.

The server runs the config `rose security init` generates from the registry. A refusal must
surface from the bus helper as PermissionDenied naming the subject, and nothing may be written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time

import nats
import pytest
from nats.js.errors import NotFoundError

from rose.contracts import GenerateReply, GenerateRequest, Heartbeat, RolloutTask, SloAlert
from rose.contracts.lease import Lease
from rose.contracts.registry import (
    GENERATE,
    HEADROOM,
    HEARTBEAT,
    LEASE,
    MANIFESTS_STREAM,
    ROLLOUT_TASK,
    ROUTE_TURN,
    SERVICE_REGISTRY,
    SLO_ALERT,
    TRAJECTORY,
    WEIGHT_MANIFEST,
    WEIGHT_PUBLISH,
    WEIGHTS_OBJECTS,
    WEIGHTS_STAGING_OBJECTS,
)
from rose.contracts.weights import WeightManifest, WeightPublishAccepted, WeightPublishRequest
from rose.shared.bus import Bus, Delivery, PermissionDenied
from rose.shared.config import BusConfig
from rose.shared.security import SEED_SUFFIX, USERS, permissions, public_key
from rose.shared.weight_store import WeightStore
from rose.testing.polling import within

NOW = time.time()


def _manifest(version: int) -> WeightManifest:
    return WeightManifest(
        model="policy", version=version, base_version=None, keyframe=True, created_at=NOW, bucket="rose_weights", shards=[], tensors=[]
    )


def _lease(executor: str) -> Lease:
    return Lease(
        lease_id="l1",
        executor_id=executor,
        epoch=1,
        state="active",
        granted_at=NOW,
        expires_at=NOW + 60,
        kv_bytes=1 << 20,
        compute_share=0.5,
        max_rollout_batch=2,
    )


def _beat(service: str, instance: str) -> Heartbeat:
    return Heartbeat(service=service, instance=instance, version="t", host="h", pid=1, started_at=NOW, sent_at=NOW, interval_s=1.0, state="ready")


def test_credential_files_are_private(credentials):
    assert stat.S_IMODE(os.stat(credentials.directory).st_mode) == 0o700
    for user in USERS:
        seed = credentials.seed_file(user)
        assert stat.S_IMODE(os.stat(seed).st_mode) == 0o600, seed
        assert seed.read_bytes().startswith(b"SU")  # an NKey user seed
    text = credentials.server_include.read_text()
    for user in USERS:  # only public keys in the server's file
        assert credentials.seed_file(user).read_text().strip() not in text
        assert f'nkey: "{public_key(credentials.seed_file(user))}"' in text
    assert stat.S_IMODE(os.stat(credentials.server_include).st_mode) == 0o600
    assert len({credentials.seed_file(u).read_bytes() for u in USERS}) == len(USERS)  # one identity each


def test_the_rules_the_issue_names_hold_in_the_derived_permissions():
    manifests = "rose.weights.manifest.*.*.*"
    assert manifests in permissions("weight_publisher").publish
    assert f"$O.{WEIGHTS_OBJECTS.bucket}.>" in permissions("weight_publisher").publish
    for user in ("rollout_worker", "executor", "trainer", "scheduler", "slo_monitor", "integrations"):
        pub = permissions(user).publish
        assert manifests not in pub and f"$O.{WEIGHTS_OBJECTS.bucket}.>" not in pub, user
        assert not any(s.startswith("$KV.rose_leases") for s in pub) or user == "scheduler", user
    assert "$KV.rose_leases.*" in permissions("scheduler").publish
    assert {"rose.rollout.tasks", "rose.weights.publish.*"} <= set(permissions("trainer").publish)
    for user in USERS:  # nobody but the operator may create, change or delete storage
        if user != "cli":
            assert not any(".STREAM.CREATE." in s or ".STREAM.DELETE." in s or ".STREAM.UPDATE." in s for s in permissions(user).publish)


async def test_no_credentials_and_unknown_credentials_are_refused_at_once(secured_server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rose.bus")
    with pytest.raises(ConnectionError, match="refused the credentials of executor.*no credentials"):
        await Bus(BusConfig(url=secured_server.url, initial_connect_deadline_s=30.0), service="executor", instance="anon").connect()
    import nkeys

    stranger = tmp_path / f"stranger{SEED_SUFFIX}"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    cfg = BusConfig(url=secured_server.url, nkey_seed_file=str(stranger), initial_connect_deadline_s=30.0)
    with pytest.raises(ConnectionError, match="an NKey seed"):
        await Bus(cfg, service="executor", instance="stranger").connect()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # refused at once, not retried until the 30 s deadline
    with pytest.raises(nats.errors.Error):  # plain nats-py too
        await nats.connect(secured_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


async def test_rollout_worker_cannot_publish_a_manifest_and_nothing_is_written(as_user, operator):
    async with Bus(as_user("rollout_worker"), service="rollout_worker", instance="rw-1") as worker:
        with pytest.raises(PermissionDenied) as err:
            await worker.publish(WEIGHT_MANIFEST, _manifest(7), model="policy", kind="keyframe", version="7")
        assert err.value.subject == "rose.weights.manifest.policy.keyframe.7" and err.value.operation == "publish"
        assert "rose.weights.manifest.policy.keyframe.7" in str(err.value) and "rollout_worker" in str(err.value)
        with pytest.raises(PermissionDenied), worker.permission_errors(stream=f"OBJ_{WEIGHTS_OBJECTS.bucket}"):  # nor touch the weights store
            await WeightStore(worker.js, WEIGHTS_OBJECTS.bucket).put("policy/v7/evil", b"x" * 100)
        with pytest.raises(PermissionDenied), worker.permission_errors(f"$O.{WEIGHTS_OBJECTS.bucket}.C.evil"):  # even blind
            await worker.js.publish(f"$O.{WEIGHTS_OBJECTS.bucket}.C.evil", b"x" * 100)
    with pytest.raises(NotFoundError):
        await operator.js.get_last_msg(MANIFESTS_STREAM.name, "rose.weights.manifest.policy.keyframe.7")
    info = await operator.js.stream_info(f"OBJ_{WEIGHTS_OBJECTS.bucket}")
    assert info.state.messages == 0


async def test_weight_publisher_may_publish_manifests_and_write_the_weights_store(as_user, operator):
    async with Bus(as_user("weight_publisher"), service="weight_publisher", instance="wp-1") as publisher:
        await publisher.publish(WEIGHT_MANIFEST, _manifest(3), model="policy", kind="keyframe", version="3")
        store = WeightStore(publisher.js, WEIGHTS_OBJECTS.bucket)
        await store.put("policy/v3/shard-0", b"w" * 5000)
        await store.delete("policy/v3/shard-0")  # pruning old versions
    async with Bus(as_user("executor"), service="executor", instance="ex-1") as executor:  # executors read both
        msg = await executor.js.get_last_msg(MANIFESTS_STREAM.name, "rose.weights.manifest.policy.keyframe.3")
        assert b'"version":3' in msg.data
        with pytest.raises(PermissionDenied):
            await executor.publish(WEIGHT_MANIFEST, _manifest(4), model="policy", kind="keyframe", version="4")


async def test_executor_reads_but_cannot_grant_itself_a_lease(as_user, operator):
    async with Bus(as_user("scheduler"), service="scheduler", instance="sch-1") as scheduler:
        await scheduler.kv_put(LEASE, _lease("ex-1"), executor_id="ex-1")
        assert [lease.executor_id for lease in await scheduler.kv_values(LEASE)] == ["ex-1"]
    async with Bus(as_user("executor"), service="executor", instance="ex-1") as executor:
        seen: list[str] = []

        async def on_lease(key: str, lease: Lease | None) -> None:
            seen.append(key)

        await executor.kv_watch(LEASE, on_lease, executor_id="ex-1")
        assert (await executor.kv_get(LEASE, executor_id="ex-1")).epoch == 1
        with pytest.raises(PermissionDenied) as err:
            await executor.kv_put(LEASE, _lease("ex-1"), executor_id="ex-1")
        assert err.value.subject == "$KV.rose_leases.ex-1"
        with pytest.raises(PermissionDenied):
            await executor.kv_delete(LEASE, executor_id="ex-1")
        await within(lambda: seen, 5)
        assert seen == ["ex-1"]
    kv = await operator.js.key_value("rose_leases")
    assert (await kv.get("ex-1")).revision == 1  # still the scheduler's one write


async def test_trainer_publishes_tasks_and_weight_requests_worker_consumes_them(as_user, operator):
    async with (
        Bus(as_user("trainer"), service="trainer", instance="tr-1") as trainer,
        Bus(as_user("rollout_worker"), service="rollout_worker", instance="rw-2") as worker,
        Bus(as_user("weight_publisher"), service="weight_publisher", instance="wp-2") as publisher,
    ):
        got: list[str] = []

        async def on_task(task: RolloutTask, d: Delivery) -> None:
            got.append(task.task_id)

        async def on_publish(req: WeightPublishRequest, d: Delivery) -> WeightPublishAccepted:
            return WeightPublishAccepted(request_id=req.request_id, model=req.model, version=req.version, queued=1)

        await worker.consume(ROLLOUT_TASK, on_task, durable="sec-workers")
        await publisher.serve(WEIGHT_PUBLISH, on_publish, queue="publishers")
        await trainer.publish(ROLLOUT_TASK, RolloutTask(task_id="sec-t1", env="conversation", prompt="hi"), msg_id="sec-t1")
        accepted = await trainer.request(
            WEIGHT_PUBLISH,
            WeightPublishRequest(request_id="rq1", model="policy", version=1, source="object", object_name="policy-v1"),
            model="policy",
        )
        assert accepted.version == 1
        await WeightStore(trainer.js, WEIGHTS_STAGING_OBJECTS.bucket).put("policy-v1", b"s" * 1000)  # the staging upload
        await within(lambda: got, 10)
        assert got == ["sec-t1"]
        with pytest.raises(PermissionDenied):  # a worker hands out no work
            await worker.publish(ROLLOUT_TASK, RolloutTask(task_id="sec-t2", env="conversation", prompt="hi"))
        with pytest.raises(PermissionDenied):  # nor asks for weights to be published
            await worker.request(
                WEIGHT_PUBLISH, WeightPublishRequest(request_id="rq2", model="policy", version=2, source="path", path="/x"), model="policy"
            )


async def test_request_reply_between_services_and_refusals_of_the_wrong_side(as_user, operator):
    async with (
        Bus(as_user("executor"), service="executor", instance="ex-9") as executor,
        Bus(as_user("rollout_worker"), service="rollout_worker", instance="rw-9") as worker,
        Bus(as_user("slo_monitor"), service="slo_monitor", instance="mon-9") as monitor,
    ):

        async def generate(req: GenerateRequest, d: Delivery) -> GenerateReply:
            return GenerateReply(request_id=req.request_id, executor_id="ex-9", status="ok", token_ids=[4])

        await executor.serve(GENERATE, generate, executor_id="ex-9")
        req = GenerateRequest(request_id="g1", trajectory_id="t", turn_index=0, prompt_token_ids=[1])
        assert (await worker.request(GENERATE, req, executor_id="ex-9")).token_ids == [4]
        with pytest.raises(PermissionDenied) as err:  # the worker may not serve executor requests
            await worker.serve(GENERATE, generate, executor_id="ex-fake")
        assert err.value.operation == "subscription" and err.value.subject == "rose.executor.ex-fake.generate"
        with pytest.raises(PermissionDenied):  # nor route turns
            await worker.serve(ROUTE_TURN, generate)
        # core events: the monitor publishes headroom and alerts, the worker may not
        from rose.contracts import Headroom

        headroom = Headroom(
            executor_id="ex-9",
            at=NOW,
            kv_bytes=1,
            compute_share=0.5,
            rollout_batch_slots=1,
            ttft_p99_ms=1.0,
            tpot_p99_ms=1.0,
            slo_ttft_ms=500.0,
            slo_tpot_ms=100.0,
            arrival_rate_rps=1.0,
            serving_queue=0,
        )
        await monitor.publish(HEADROOM, headroom, executor_id="ex-9")
        with pytest.raises(PermissionDenied):
            await worker.publish(HEADROOM, headroom, executor_id="ex-9")
        alert = SloAlert(executor_id="ex-9", at=NOW, severity="burst", reason="test")
        with pytest.raises(PermissionDenied):
            await executor.publish(SLO_ALERT, alert, executor_id="ex-9")
        with pytest.raises(PermissionDenied):  # an executor cannot forge a finished trajectory
            await executor.subscribe(TRAJECTORY, generate)


async def test_services_cannot_impersonate_each_other_or_create_storage(as_user, operator):
    async with Bus(as_user("executor"), service="executor", instance="ex-5") as executor:
        await executor.publish(HEARTBEAT, _beat("executor", "ex-5"), service="executor", instance="ex-5")
        await executor.kv_put(SERVICE_REGISTRY, _beat("executor", "ex-5"), service="executor", instance="ex-5")
        with pytest.raises(PermissionDenied):
            await executor.publish(HEARTBEAT, _beat("scheduler", "s"), service="scheduler", instance="s")
        with pytest.raises(PermissionDenied):
            await executor.kv_put(SERVICE_REGISTRY, _beat("scheduler", "s"), service="scheduler", instance="s")
        # storage belongs to the operator: no creating, purging or deleting streams
        for subject in ("$JS.API.STREAM.CREATE.EVIL", "$JS.API.STREAM.DELETE.ROSE_EVENTS", "$JS.API.STREAM.PURGE.ROSE_TRAJECTORIES"):
            with pytest.raises(PermissionDenied), executor.permission_errors(subject):
                await executor.nc.request(subject, b"{}", timeout=10)
        # nor reading another service's replies
        with pytest.raises(PermissionDenied), executor.permission_errors("_INBOX_rollout_worker.>"):
            await executor.nc.subscribe("_INBOX_rollout_worker.>")
            await executor.nc.flush()
            await executor.nc.flush()  # nats-py's first PING may overtake the SUB (see Bus._processed)
    info = await operator.js.stream_info("ROSE_EVENTS")
    assert info.config.name == "ROSE_EVENTS"


async def test_status_reads_heartbeats_with_operator_credentials(as_user, operator):
    async with Bus(as_user("slo_monitor"), service="slo_monitor", instance="mon-7") as monitor:
        await monitor.kv_put(SERVICE_REGISTRY, _beat("slo_monitor", "mon-7"), service="slo_monitor", instance="mon-7")
    beats = await operator.kv_values(SERVICE_REGISTRY)
    assert "mon-7" in {b.instance for b in beats}


async def test_no_consumer_on_storage_a_service_can_write(as_user, operator):
    """A consumer may deliver to any subject: on a stream it can fill, a service could replay its own bytes as a manifest."""
    import json

    async with Bus(as_user("executor"), service="executor", instance="ex-3") as executor:
        request = {"stream_name": "ROSE_EVENTS", "config": {"deliver_subject": "rose.weights.manifest.policy.keyframe.9", "ack_policy": "none"}}
        with pytest.raises(PermissionDenied), executor.permission_errors(stream="ROSE_EVENTS"):
            await executor.nc.request("$JS.API.CONSUMER.CREATE.ROSE_EVENTS", json.dumps(request).encode(), timeout=10)
    async with Bus(as_user("rollout_worker"), service="rollout_worker", instance="rw-3") as worker:
        with pytest.raises(PermissionDenied):  # it writes trajectories, so it may not consume them
            await worker.consume(TRAJECTORY, lambda m, d: asyncio.sleep(0), durable="evil")


def test_the_docs_table_is_the_generated_one():
    from pathlib import Path

    from rose.shared.security import permissions_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert permissions_markdown() in page, "docs/security.md's permission table is stale: paste `rose security permissions`"


async def test_a_service_cannot_create_missing_storage_and_says_so(tmp_path, credentials):
    from rose.shared.config import RuntimeConfig
    from rose.shared.nats_server import NatsServer
    from rose.shared.service import ServiceRuntime

    with NatsServer(tmp_path / "bare", extra_config=credentials.server_config()) as server:  # never provisioned
        cfg = BusConfig(url=server.url, nkey_seed_file=str(credentials.seed_file("slo_monitor")), request_timeout_s=30.0)
        with pytest.raises(RuntimeError, match=r"(?i)stream\.create.*rose provision"):  # the refusal, not an API timeout
            async with ServiceRuntime("slo_monitor", bus=cfg, runtime=RuntimeConfig(instance="mon-bare", metrics_port=-1)):
                pass
