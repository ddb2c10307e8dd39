"""Ed25519 signatures of weight manifests: the publisher signs, executors verify before fetching anything.

Why: a manifest decides what a serving device runs next; its shard digests protect the bytes,
the signature protects the digests. Only a holder of a trusted private key can announce a
version an executor will apply.

Canonical bytes (what is signed): ``CONTEXT`` followed by the manifest as compact JSON with
the ``signature`` field left out, every field equal to its default left out (recursively),
and object keys sorted. Leaving defaults out keeps a signature valid for a reader whose
schema adds new defaulted fields; a reader that drops a non-default field it does not know
computes other bytes and refuses the version (it cannot vouch for what it cannot read).

Keys: PEM files made by ``rose security weights-key DIR`` (``NAME.key``, PKCS#8, mode 0600,
and ``NAME.pub``). A key's id is the first 16 hex digits of the SHA-256 of its raw 32-byte
public key; the manifest carries it in ``key_id`` so executors trusting several keys (a
rotation) pick the right one. Trusted keys are re-read for every manifest, so adding or
removing a ``.pub`` file takes effect at the next version, without a restart.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from rose.contracts.weights import WeightManifest
from rose.shared.errors import RoseError

log = logging.getLogger("rose.weight_signing")

CONTEXT = b"rose-weight-manifest-v1\n"  # domain separation: these bytes are never signed for anything else
KEYS_DIRNAME = "keys"  # under the state dir: where `rose up` / `rose demo` keep the default key pair
DEFAULT_KEY_NAME = "weights"


class SigningError(RoseError):
    """A key that cannot be made, read or used; the message says what to do."""


class SignatureError(RoseError):
    """A manifest this executor must refuse: unsigned, signed by an untrusted key, or altered."""


@dataclass(frozen=True)
class KeyPaths:
    private: Path
    public: Path
    key_id: str


def default_keys_dir() -> Path:
    """`$ROSE_STATE_DIR/keys` (default ./.rose/keys): the embedded default's key pair."""
    from rose.shared.nats_server import state_dir

    return state_dir() / KEYS_DIRNAME


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# ---- canonical bytes ----------------------------------------------------------------------


def _canonical(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        out = {}
        for f in msgspec.structs.fields(value):
            v = getattr(value, f.name)
            if f.default is not msgspec.NODEFAULT and v == f.default:
                continue
            if f.default_factory is not msgspec.NODEFAULT and v == f.default_factory():
                continue
            out[f.encode_name] = _canonical(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def canonical_bytes(manifest: WeightManifest) -> bytes:
    """The bytes a signature covers (see the module docstring)."""
    tree = _canonical(msgspec.structs.replace(manifest, signature=""))
    return CONTEXT + msgspec.json.encode(tree, order="sorted")


# ---- keys on disk -------------------------------------------------------------------------


def generate_keypair(directory: str | Path, name: str = DEFAULT_KEY_NAME) -> KeyPaths:
    """Write `NAME.key` (0600) and `NAME.pub` in `directory`; refuses to overwrite a key."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    private_path, public_path = d / f"{name}.key", d / f"{name}.pub"
    if private_path.exists() or public_path.exists():
        raise SigningError(f"{private_path} or {public_path} already exists: pick another name (a rotation adds a key beside the old one)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = key.public_key()
    tmp = public_path.with_suffix(".pub.tmp")
    tmp.write_bytes(public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    tmp.replace(public_path)  # atomic: an executor reading the directory never sees half a key
    return KeyPaths(private_path, public_path, key_id(public))


def ensure_keypair(directory: str | Path, name: str = DEFAULT_KEY_NAME) -> Path:
    """The private key `directory/NAME.key`, generated once if missing (safe when several processes race)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / f"{name}.key").exists():
            paths = generate_keypair(d, name)
            log.info("generated weight-signing key %s (id %s)", paths.private, paths.key_id)
    return d / f"{name}.key"


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise SigningError(f"weight-signing key {p} does not exist: create one with `rose security weights-key DIR`") from None
    if mode & 0o077:
        raise SigningError(f"weight-signing key {p} is readable by others (mode {mode & 0o777:o}): run `chmod 600 {p}`")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{p} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{p} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    p = Path(path)
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except FileNotFoundError:
        raise SigningError(f"trusted key {p} does not exist") from None
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{p} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{p} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def load_trusted_keys(paths: list[str | Path]) -> tuple[dict[str, Ed25519PublicKey], list[str]]:
    """Key id -> key from `.pub` files and directories of them; and what could not be read."""
    keys: dict[str, Ed25519PublicKey] = {}
    problems: list[str] = []
    for entry in paths:
        p = Path(entry)
        files = sorted(p.glob("*.pub")) if p.is_dir() else [p]
        if p.is_dir() and not files:
            problems.append(f"no .pub file in {p}")
        for f in files:
            try:
                key = load_public_key(f)
            except SigningError as exc:
                problems.append(str(exc))
                continue
            keys[key_id(key)] = key
    return keys, problems


# ---- signing and verifying ----------------------------------------------------------------


class ManifestSigner:
    """The publisher's side: `sign(manifest)` returns it with `key_id` and `signature` set."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.key_id = key_id(key.public_key())

    @classmethod
    def from_file(cls, path: str | Path) -> ManifestSigner:
        return cls(load_private_key(path))

    @classmethod
    def from_settings(cls, signing_key_file: str) -> ManifestSigner:
        """The configured key; none configured: the state dir's default pair, generated on first use."""
        return cls.from_file(signing_key_file or ensure_keypair(default_keys_dir()))

    def sign(self, manifest: WeightManifest) -> WeightManifest:
        unsigned = msgspec.structs.replace(manifest, key_id=self.key_id, signature="")
        signature = self.key.sign(canonical_bytes(unsigned))
        return msgspec.structs.replace(unsigned, signature=base64.b64encode(signature).decode())


class ManifestVerifier:
    """The executor's side: `check(manifest)` raises `SignatureError` unless a trusted key signed exactly it."""

    def __init__(self, trusted: list[str | Path]) -> None:
        self.trusted = [Path(p) for p in trusted]

    @classmethod
    def from_settings(cls, trusted_keys: list[str]) -> ManifestVerifier:
        """The configured keys (files or directories of `.pub`); none configured: the state dir's keys."""
        return cls(list(trusted_keys) or [default_keys_dir()])

    def keys(self) -> tuple[dict[str, Ed25519PublicKey], list[str]]:
        return load_trusted_keys(list(self.trusted))

    def check(self, manifest: WeightManifest) -> str:
        """The id of the key that signed `manifest`; raises `SignatureError` with the reason otherwise."""
        v = manifest.version
        if not manifest.signature or not manifest.key_id:
            raise SignatureError(f"version {v} is unsigned; this executor applies only signed versions (weights.require_signed)")
        keys, problems = self.keys()
        if not keys:
            where = ", ".join(map(str, self.trusted))
            raise SignatureError(
                f"version {v} cannot be verified: no trusted weight-signing key in {where} ({'; '.join(problems) or 'nothing there'}); "
                "set weights.trusted_keys (ROSE_WEIGHTS__TRUSTED_KEYS) to the publisher's .pub"
            )
        key = keys.get(manifest.key_id)
        if key is None:
            raise SignatureError(f"version {v} is signed by key {manifest.key_id}, which this executor does not trust (trusted: {sorted(keys)})")
        try:
            key.verify(base64.b64decode(manifest.signature, validate=True), canonical_bytes(manifest))
        except (InvalidSignature, binascii.Error, ValueError):
            raise SignatureError(
                f"version {v}: the signature does not match the manifest (key {manifest.key_id}): it was altered after signing"
            ) from None
        return manifest.key_id
