"""docs/subjects.md's table is the registry's rendering (its consumers are checked against a
running fleet in test_fleet_observability.py), regenerated with `python -m rose.contracts.subjects_table`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.contracts.registry import CHANNELS
from rose.contracts.subjects_table import main, subjects_table, with_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "subjects.md"


def test_the_page_table_is_the_generated_one():
    text = PAGE.read_text()
    assert with_table(text) == text, "docs/subjects.md is out of date: run `python -m rose.contracts.subjects_table docs/subjects.md`"
    assert len(subjects_table()) == len(CHANNELS) + 2


def test_a_hand_edited_table_is_caught_and_regenerated(tmp_path):
    text = PAGE.read_text()
    row = next(line for line in text.split("\n") if line.startswith("| `rose.events.weights.applied."))
    edited = tmp_path / "subjects.md"
    edited.write_text(text.replace(row, row.replace("| cli, integrations, trainer |", "| weight_publisher, integrations |")))
    assert main(["--check", str(edited)]) == 1
    assert main([str(edited)]) == 0 and edited.read_text() == text
    assert main(["--check", str(edited)]) == 0


def test_a_file_without_the_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Subjects"):
        with_table("# nothing here\n")
