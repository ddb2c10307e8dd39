"""`rose up` refuses what it cannot start before starting anything, saying what to change (tests/test_up.py runs it for real).

In-process, through `rose`'s own parser: each refusal is exit status 2 with its message; NATS it cannot
provision is exit status 1, and then nothing is left behind (no up.json, no server).
"""

from __future__ import annotations

import socket

import pytest

from rose.cli.main import build_parser
from rose.cli.status import UP_FILE
from rose.cli.up import up


def _up(*argv: str) -> int:
    return up(build_parser().parse_args(["up", *argv]))


def _said(capsys) -> str:
    """What `rose up` printed, as one line (rich wraps it to the terminal's width)."""
    return " ".join(capsys.readouterr().out.split())


@pytest.fixture(autouse=True)
def _no_outside_nats(monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("ROSE_RUNTIME__INSTANCE", raising=False)


def test_unknown_services_are_refused_with_the_known_ones(tmp_path, capsys):
    assert _up("--state-dir", str(tmp_path), "--services", "scheduler", "shceduler") == 2
    out = _said(capsys)
    assert "unknown services ['shceduler']" in out and "'scheduler'" in out
    assert not (tmp_path / UP_FILE).exists() and not (tmp_path / "nats").exists()


def test_a_cluster_size_out_of_range_is_refused(tmp_path, capsys):
    assert _up("--state-dir", str(tmp_path), "--nats-cluster", "7") == 2
    assert "--nats-cluster takes 1 to 5 nodes" in _said(capsys)
    assert not list(tmp_path.glob("nats-cluster-*"))


def test_a_cluster_and_nats_url_together_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    assert _up("--state-dir", str(tmp_path), "--nats-cluster", "3") == 2
    assert "NATS_URL=nats://127.0.0.1:1 is set: unset one of them" in _said(capsys)
    assert not list(tmp_path.glob("nats-cluster-*"))


def test_an_instance_name_that_is_no_subject_token_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ROSE_RUNTIME__INSTANCE", "executor.one")
    assert _up("--state-dir", str(tmp_path), "--services", "executor") == 2
    assert "instance name 'executor.one' is not a subject token" in _said(capsys)
    assert not (tmp_path / "security").exists()  # refused before any credentials were made


def test_a_nats_url_that_cannot_be_provisioned_fails_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("NATS_URL", f"nats://127.0.0.1:{port}")
    monkeypatch.setenv("ROSE_BUS__INITIAL_CONNECT_DEADLINE_S", "1")
    assert _up("--state-dir", str(tmp_path), "--services") == 1
    assert f"cannot provision JetStream storage on nats://127.0.0.1:{port}" in _said(capsys)
    assert not (tmp_path / UP_FILE).exists()
