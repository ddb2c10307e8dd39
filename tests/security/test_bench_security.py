"""`rose bench security --quick`: the JSON it writes, and that every attack it tried was blocked.

The same attacks run one by one in test_confused_deputy.py and test_unpickler.py (and the sandbox's
in tests/agentic/); this checks the bench's own wiring: each category present, the row shape, the counts."""

from __future__ import annotations

import json

from rose.bench.security import SecurityOptions, run_security_bench

ROW_KEYS = {"attack", "category", "as_user", "blocked", "evidence"}


def test_quick_bench_blocks_every_attack(tmp_path):
    out = tmp_path / "security.json"
    result = run_security_bench(SecurityOptions(quick=True), out)
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert result["attacks_tried"] == len(rows) >= 25
    assert all(set(r) == ROW_KEYS and isinstance(r["blocked"], bool) and r["evidence"] for r in rows)
    assert {r["category"] for r in rows} == {"bus", "unpickler", "http", "sandbox", "gateway"}, result["notes"]
    assert {r["as_user"] for r in rows if r["category"] == "sandbox"} == {"root", "nobody"}, result["notes"]
    assert {r["as_user"] for r in rows if r["category"] == "bus"} >= {"rollout_worker", "trainer"}
    assert sum(r["category"] == "gateway" for r in rows) == 13
    not_blocked = [r for r in rows if not r["blocked"]]
    assert result["attacks_blocked"] == result["attacks_tried"], not_blocked
