"""The tensor unpickler of `update_weights_from_tensor` (issue 22): it opens nothing a payload names
and allocates nothing the model's own parameters do not account for.

Payloads are built as an attacker would (rose.bench.security) and judged by what is seen:
a TCP or unix listener that must receive no connection, a secret that must not come back, a
marker file that must not appear, a peak RSS that must not grow. The controls load the same
payloads with torch's own unpickler (what SGLang does) to show they are live.
"""

from __future__ import annotations

import base64
import os
import resource
import secrets
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from rose.bench.security import (
    Listener,
    payload_bare_dupfd,
    payload_call,
    payload_dupfd,
    payload_filename,
    payload_tensors,
)
from rose.services.executor.sglang_tensors import UnsafePayload, deserialize_named_tensors, serialize_named_tensors
from rose.testing.polling import within_sync
from rose.testing.sglang_sender import flattened_tensor_metadata

HUGE = 16 << 30


@pytest.fixture
def params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    return {n: p.detach() for n, p in model.state_dict().items()}


def _stock_load_dials(payload: str, listener: Listener) -> int:
    """torch's own reading of a payload (SGLang's MultiprocessingSerializer.deserialize), in a process of its own (torch
    keeps the first shm manager it talks to for the process): the connections it made to `listener` (stopped once one arrived)."""
    code = (
        "import base64, sys, torch.multiprocessing; from multiprocessing.reduction import ForkingPickler; "
        "ForkingPickler.loads(base64.b64decode(sys.argv[1]))"
    )
    child = subprocess.Popen([sys.executable, "-c", code, payload], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        within_sync(lambda: listener.connections or child.poll() is not None, 60, step=0.05)
        return _wait_connections(listener, 1.0)
    finally:
        child.kill()
        child.wait()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _wait_connections(listener: Listener, seconds: float = 1.0) -> int:
    within_sync(lambda: listener.connections, seconds, step=0.05)
    return listener.connections


def test_host_tensors_round_trip(params):
    new = [(n, torch.randn_like(t)) for n, t in params.items()]
    out = deserialize_named_tensors(serialize_named_tensors(new), params=params)
    assert [n for n, _ in out] == [n for n, _ in new] and all(torch.equal(a, b) for (_, a), (_, b) in zip(out, new))


def test_bf16_applies_to_fp32_parameters(params):
    name, t = next(iter(params.items()))
    out = deserialize_named_tensors(serialize_named_tensors([(name, t.to(torch.bfloat16))]), params=params)
    assert out[0][1].dtype == torch.bfloat16


def test_dupfd_dials_nothing(params):
    name, t = next(iter(params.items()))
    listener = Listener()
    try:
        with pytest.raises(UnsafePayload, match="rebuild_storage_fd"):
            deserialize_named_tensors(payload_dupfd(listener.address, name, tuple(t.shape)), params=params)
        with pytest.raises(UnsafePayload, match="DupFd"):
            deserialize_named_tensors(payload_bare_dupfd(listener.address), params=params)
        assert _wait_connections(listener) == 0
        with pytest.raises((EOFError, OSError)):  # control: torch's own unpickler (SGLang's) dials the payload's address
            ForkingPickler.loads(base64.b64decode(payload_dupfd(listener.address, name, tuple(t.shape))))
        assert _wait_connections(listener) >= 1
    finally:
        listener.close()


def test_shm_manager_socket_of_the_payloads_choice_is_never_dialed(params, tmp_path):
    name, t = next(iter(params.items()))
    listener = Listener(unix_path=str(tmp_path / "mgr.sock"))
    payload = payload_filename(str(tmp_path / "mgr.sock").encode(), f"/torch_{os.getpid()}_1_0".encode(), t.numel() * 4, name, tuple(t.shape))
    try:
        with pytest.raises(UnsafePayload):
            deserialize_named_tensors(payload, params=params)
        assert _wait_connections(listener) == 0
        assert _stock_load_dials(payload, listener) >= 1  # control: torch's rebuild_storage_filename connects to the named manager socket
    finally:
        listener.close()


def test_file_names_other_than_torch_segments_are_refused(params):
    secret = f"SECRET-{secrets.token_hex(8)}" * 16
    target = Path("/dev/shm") / f"rose-test-secret-{secrets.token_hex(4)}"
    target.write_bytes(secret.encode())
    link = Path("/dev/shm") / f"torch_{os.getpid()}_{secrets.randbelow(10**9)}_3"
    link.symlink_to(target)
    name = next(n for n, t in params.items() if t.dim() == 1)
    n = len(secret) // 4 * 4
    try:
        for handle in (f"/{target.name}", f"/../../{target}", f"/{link.name}", "/etc/passwd"):
            with pytest.raises(UnsafePayload) as err:
                deserialize_named_tensors(payload_filename(b"", handle.encode(), n, name, (n // 4,)), params=params)
            assert secret[:16] not in str(err.value)
    finally:
        link.unlink(missing_ok=True)
        target.unlink(missing_ok=True)


def test_oversized_storages_and_direct_allocations_are_refused_before_allocating(params):
    name, t = next(iter(params.items()))
    before = _peak_rss()
    with pytest.raises(UnsafePayload, match="refused before allocating"):
        deserialize_named_tensors(payload_filename(b"", f"/torch_{os.getpid()}_2_0".encode(), HUGE, name, tuple(t.shape)), params=params)
    for fn, arg in ((torch.UntypedStorage, HUGE), (torch.Tensor, HUGE // 4), (torch.empty, HUGE // 4)):
        with pytest.raises(UnsafePayload):
            deserialize_named_tensors(payload_call(fn, arg), params=params)
    assert _peak_rss() - before < HUGE // 8


def test_storages_together_cannot_exceed_the_policy(params):
    name, t = max(params.items(), key=lambda kv: kv[1].numel())
    copies = [(name, t.clone()) for _ in range(3)]  # each fits, together they are more bytes than the whole policy
    with pytest.raises(UnsafePayload, match="exceed the policy's own size"):
        deserialize_named_tensors(serialize_named_tensors(copies), params=params)


@pytest.mark.parametrize(
    ("what", "make"),
    [
        ("wrong shape", lambda n, t: [(n, torch.zeros(t.shape[0] + 1, *t.shape[1:]))]),
        ("unknown name", lambda n, t: [("model.backdoor", torch.zeros_like(t))]),
        ("int32 dtype", lambda n, t: [(n, torch.zeros(t.shape, dtype=torch.int32))]),
        ("float64 dtype", lambda n, t: [(n, torch.zeros(t.shape, dtype=torch.float64))]),
        ("same name twice", lambda n, t: [(n, torch.zeros_like(t)), (n, torch.zeros_like(t))]),
        ("a view reaching past its storage", None),
    ],
)
def test_tensors_must_match_the_policy(params, what, make):
    name, t = max(params.items(), key=lambda kv: kv[1].numel())
    if make is None:  # a real 16-byte segment of ours, claimed to hold the whole parameter
        keep = torch.zeros(4)
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            _manager, handle, size = keep.untyped_storage()._share_filename_cpu_()
        finally:
            torch.multiprocessing.set_sharing_strategy("file_descriptor")
        with pytest.raises(UnsafePayload, match="reaches past its storage"):
            deserialize_named_tensors(payload_filename(b"", handle, size, name, tuple(t.shape)), params=params)
        return
    named = make(name, t)
    with pytest.raises(UnsafePayload):
        deserialize_named_tensors(serialize_named_tensors(named), params=params)


def test_code_in_the_pickle_runs_nothing(params, tmp_path):
    marker = tmp_path / "pwned"
    for payload in (payload_call(os.system, f"touch {marker}"), payload_call(exec, f"open({str(marker)!r}, 'w').close()")):
        with pytest.raises(UnsafePayload, match="refusing to load"):
            deserialize_named_tensors(payload, params=params)
    assert not marker.exists()


def test_flattened_bucket_is_checked_against_the_policy(params, monkeypatch):
    """slime pickles sglang's FlattenedTensorMetadata (as tests/executor/test_sglang_endpoints.py sends it)."""

    FlattenedTensorMetadata = flattened_tensor_metadata(monkeypatch)
    named = list(params.items())
    flat = torch.cat([t.reshape(-1) for _, t in named])
    metas, start = [], 0
    for n, t in named:
        metas.append(FlattenedTensorMetadata(n, t.shape, t.dtype, start, start + t.numel(), t.numel()))
        start += t.numel()
    ok = deserialize_named_tensors(serialize_named_tensors({"flattened_tensor": flat, "metadata": metas}), params=params, flattened=True)
    assert [n for n, _ in ok] == [n for n, _ in named]
    metas[0].shape = torch.Size([metas[0].numel])  # right size, wrong shape
    with pytest.raises(UnsafePayload, match="not a parameter of the policy with that shape"):
        deserialize_named_tensors(serialize_named_tensors({"flattened_tensor": flat, "metadata": metas}), params=params, flattened=True)


def test_payload_tensors_helper_matches_sglang_format(params):
    name, t = next(iter(params.items()))
    keep = [(name, t.clone())]
    assert deserialize_named_tensors(payload_tensors(keep), params=params)[0][0] == name
