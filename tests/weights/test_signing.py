"""Signed weight manifests: a trusted signature is checked before anything is fetched; anything else is refused.

Real publisher code (ModelVersions), real follower, real nats-server; keys made by the same
function as `rose security weights-key`.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from rose.contracts import DeadLetter
from rose.contracts.registry import DEAD_LETTER, WEIGHT_MANIFEST, WEIGHTS_OBJECTS
from rose.contracts.weights import WeightManifest
from rose.services.weight_publisher.config import PublisherSettings
from rose.services.weight_publisher.versions import ModelVersions
from rose.shared.codec import decode, encode
from rose.shared.weight_signing import (
    ManifestSigner,
    ManifestVerifier,
    SignatureError,
    SigningError,
    canonical_bytes,
    ensure_keypair,
    generate_keypair,
    load_private_key,
)
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import until
from rose.testing.weights import Executor, as_sources, make_state, rl_step, same

SETTINGS = PublisherSettings(shard_bytes=1 << 20, keyframe_interval=100)
TIMEOUT = 10.0


class Signed:
    """A publisher with a signer and a follower with a verifier; version 1 applied."""

    def __init__(self, bus, follower_bus, model: str, events, tmp_path) -> None:
        self.bus, self.follower_bus, self.model, self.events = bus, follower_bus, model, events
        self.old = generate_keypair(tmp_path / "publisher", "old")
        self.trusted = tmp_path / "trusted"
        self.trusted.mkdir()
        (self.trusted / "old.pub").write_bytes(self.old.public.read_bytes())
        self.pub = ModelVersions(model, bus, WeightStore(bus.js, WEIGHTS_OBJECTS.bucket), SETTINGS, ManifestSigner.from_file(self.old.private))
        self.states = {1: make_state(31)}
        self.follower: WeightFollower | None = None

    def state(self, version: int):
        if version not in self.states:
            self.states[version] = rl_step(self.state(version - 1), version)
        return self.states[version]

    async def start(self) -> None:
        await self.pub.publish(as_sources(self.state(1)), 1)
        self.executor = Executor(make_state(0), None)
        self.follower = WeightFollower(self.follower_bus, model=self.model, apply=self.executor.apply, verifier=ManifestVerifier([self.trusted]))
        await self.follower.start(self.executor.state, None)
        assert await self.follower.wait_for_version(1, TIMEOUT) == 1

    async def announce(self, manifest: WeightManifest) -> None:
        await self.bus.publish(WEIGHT_MANIFEST, manifest, model=self.model, kind=manifest.kind, version=str(manifest.version))

    def failures(self):
        return [e for e in self.events.failed if e.model == self.model]

    async def expect_refused(self, version: int, needle: str) -> None:
        """Refused as `signature` with `needle` in the reason; nothing fetched, the previous version keeps serving."""
        fetched, calls, serving = self.follower.stats.fetched_bytes, list(self.executor.calls), self.follower.version
        await until(lambda: any(f.version == version for f in self.failures()), TIMEOUT)
        await asyncio.sleep(0.1)
        refusal = next(f for f in self.failures() if f.version == version)
        assert refusal.kind == "signature" and needle in refusal.reason, refusal
        assert refusal.kept_version == serving and refusal.next_step == "none"
        assert self.follower.version == serving and self.executor.calls == calls
        assert self.follower.stats.fetched_bytes == fetched  # refused before a single shard was fetched
        assert same(self.executor.state, self.states[serving])
        last = await self.bus.js.get_last_msg("ROSE_DLQ", DEAD_LETTER.pattern(service=self.follower_bus.service))
        letter = msgspec.json.decode(last.data, type=DeadLetter)
        assert letter.kind == "unauthorised" and needle in letter.reason
        assert decode(letter.payload, WeightManifest).version == version

    async def stop(self) -> None:
        if self.follower is not None:
            await self.follower.stop()


@pytest.fixture
async def signed(bus, follower_bus, model_name, events, tmp_path):
    s = Signed(bus, follower_bus, model_name, events, tmp_path)
    yield s
    await s.stop()


async def test_signed_versions_apply(signed):
    await signed.start()
    m2 = await signed.pub.publish(as_sources(signed.state(2)), 2)
    assert m2.key_id == signed.pub.signer.key_id and m2.signature
    assert await signed.follower.wait_for_version(2, TIMEOUT) == 2
    assert same(signed.executor.state, signed.state(2))


async def test_a_tampered_manifest_is_refused_before_fetching(signed):
    await signed.start()
    staged = await signed.pub.stage(as_sources(signed.state(2)), 2)
    m = staged.manifest
    shard = next(s for s in m.shards if s.object_name)
    digest = bytearray(shard.sha256.encode())
    digest[0] = ord("0") if digest[0] != ord("0") else ord("1")  # one byte of a digest
    shards = [msgspec.structs.replace(s, sha256=digest.decode()) if s is shard else s for s in m.shards]
    tampered = decode(encode(msgspec.structs.replace(m, shards=shards)), WeightManifest)  # re-encoded, as on the wire
    await signed.announce(tampered)
    await signed.expect_refused(2, "altered after signing")
    # the untouched manifest of the same version is still taken
    await signed.announce(m)
    assert await signed.follower.wait_for_version(2, TIMEOUT) == 2


async def test_a_manifest_signed_by_an_untrusted_key_is_refused(signed, tmp_path):
    await signed.start()
    stranger = generate_keypair(tmp_path / "stranger")
    signed.pub.signer = ManifestSigner.from_file(stranger.private)
    await signed.pub.publish(as_sources(signed.state(2)), 2)
    await signed.expect_refused(2, f"signed by key {stranger.key_id}, which this executor does not trust")


async def test_a_trusted_key_id_with_another_keys_signature_is_refused(signed, tmp_path):
    await signed.start()
    stranger = ManifestSigner.from_file(generate_keypair(tmp_path / "stranger").private)
    staged = await signed.pub.stage(as_sources(signed.state(2)), 2)
    forged = stranger.sign(staged.manifest)
    await signed.announce(msgspec.structs.replace(forged, key_id=signed.old.key_id))
    await signed.expect_refused(2, "does not match")


async def test_unsigned_is_refused_when_signatures_are_required(signed):
    await signed.start()
    signed.pub.signer = None
    await signed.pub.publish(as_sources(signed.state(2)), 2)
    await signed.expect_refused(2, "unsigned")


async def test_no_trusted_key_refuses_everything_with_a_clear_reason(signed, tmp_path):
    await signed.start()
    empty = tmp_path / "empty"
    empty.mkdir()
    signed.follower.verifier = ManifestVerifier([empty])
    await signed.pub.publish(as_sources(signed.state(2)), 2)
    await signed.expect_refused(2, "no trusted weight-signing key")


async def test_key_rotation(signed, tmp_path):
    """Add the new key, publish with it, remove the old one: an old-key version is then refused."""
    await signed.start()
    new = generate_keypair(tmp_path / "publisher", "new")
    await signed.pub.publish(as_sources(signed.state(2)), 2)  # old key, trusted
    assert await signed.follower.wait_for_version(2, TIMEOUT) == 2
    (signed.trusted / "new.pub").write_bytes(new.public.read_bytes())  # 1. executors trust both (re-read per manifest)
    signed.pub.signer = ManifestSigner.from_file(new.private)  # 2. the publisher switches
    await signed.pub.publish(as_sources(signed.state(3)), 3)
    assert await signed.follower.wait_for_version(3, TIMEOUT) == 3
    (signed.trusted / "old.pub").unlink()  # 3. the old key is retired
    signed.pub.signer = ManifestSigner.from_file(signed.old.private)
    await signed.pub.publish(as_sources(signed.state(4)), 4)
    await signed.expect_refused(4, f"signed by key {signed.old.key_id}")
    signed.pub.signer = ManifestSigner.from_file(new.private)
    await signed.pub.publish(as_sources(signed.state(5)), 5, keyframe=True)  # v4 never applied: a keyframe heals the chain
    assert await signed.follower.wait_for_version(5, TIMEOUT) == 5
    assert same(signed.executor.state, signed.state(5))


# ---- the canonical form and the key files -----------------------------------------------------------


def _manifest() -> WeightManifest:
    from rose.contracts.weights import ShardInfo, TensorInfo

    shard = ShardInfo(shard_id=0, encoding="dense", object_name="m/v1/s0", wire_bytes=8, decoded_bytes=8, sha256="ab" * 32)
    tensor = TensorInfo(name="w", dtype="float32", shape=[2], shard_id=0, offset=0, nbytes=8)
    return WeightManifest(
        model="m", version=1, base_version=None, keyframe=True, created_at=1.7e9 + 0.123456789, bucket="b", shards=[shard], tensors=[tensor]
    )


def test_canonical_bytes_survive_the_wire_and_ignore_defaults(tmp_path):
    signer = ManifestSigner.from_file(generate_keypair(tmp_path).private)
    m = signer.sign(_manifest())
    again = decode(encode(m), WeightManifest)
    assert canonical_bytes(again) == canonical_bytes(m)
    assert ManifestVerifier([tmp_path]).check(again) == signer.key_id
    body = canonical_bytes(m).split(b"\n", 1)[1]
    assert b"signature" not in body and b"lossy" not in body  # the signature itself and default fields are left out
    assert list(msgspec.json.decode(body)) == sorted(msgspec.json.decode(body))
    with pytest.raises(SignatureError, match="altered"):
        ManifestVerifier([tmp_path]).check(msgspec.structs.replace(m, created_at=m.created_at + 1e-6))


def test_private_key_files_must_be_private(tmp_path):
    paths = generate_keypair(tmp_path)
    assert os.stat(paths.private).st_mode & 0o777 == 0o600
    os.chmod(paths.private, 0o644)
    with pytest.raises(SigningError, match="chmod 600"):
        load_private_key(paths.private)
    with pytest.raises(SigningError, match="does not exist"):
        ManifestSigner.from_settings(str(tmp_path / "nope.key"))
    with pytest.raises(SigningError, match="already exists"):
        generate_keypair(tmp_path)


def test_the_default_pair_is_made_once(tmp_path):
    first = ensure_keypair(tmp_path / "keys")
    key = first.read_bytes()
    assert ensure_keypair(tmp_path / "keys") == first and first.read_bytes() == key
    assert (tmp_path / "keys" / "weights.pub").exists()


def test_any_manifest_is_verified_or_refused_never_a_crash(tmp_path):
    """Whatever a decoded manifest holds (any key_id, any signature string), `check` raises only SignatureError."""
    import msgspec.inspect as mi
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rose.testing.strategies import strategy_for

    signer = ManifestSigner.from_file(generate_keypair(tmp_path).private)
    verifier = ManifestVerifier([tmp_path])

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(mi.type_info(WeightManifest)), st.sampled_from(["as_is", "signed", "resigned_then_edited"]))
    def run(m, how):
        if how != "as_is":
            m = signer.sign(m)
        if how == "resigned_then_edited":
            m = msgspec.structs.replace(m, version=m.version + 1)
        try:
            assert verifier.check(decode(encode(m), WeightManifest)) == signer.key_id and how == "signed"
        except SignatureError as exc:
            assert how != "signed" and str(exc)

    run()
