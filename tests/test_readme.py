"""The README stays true and short: its two commands exist, its lines fit a terminal, docs/ has an index;
and docs/subjects.md, the reference the README points to, lists every channel of the registry."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rose.cli.service_table import SERVICE_MODULES
from rose.contracts.registry import CHANNELS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SUBJECTS = REPO / "docs" / "subjects.md"


def test_quick_start_commands_exist_and_ci_runs_the_test_command():
    for script in ("scripts/rose", "scripts/test", "scripts/bootstrap.sh"):
        assert os.access(REPO / script, os.X_OK), script
    assert "./scripts/rose demo" in README and "./scripts/rose up" in README and "./scripts/test" in README
    assert "./scripts/test" in (REPO / ".ci" / "run").read_text()


def test_every_channel_is_in_the_subject_table():
    table = SUBJECTS.read_text()
    missing = [c.template for c in CHANNELS if f"| `{c.template}` |" not in table]
    assert missing == []
    assert "](docs/subjects.md)" in README


def test_every_service_is_named():
    assert [s for s in SERVICE_MODULES if f"`{s}" not in README] == []


MAX_LINE = 120  # what a terminal (or `less`) shows without wrapping mid-word
# Markdown cannot wrap a table row: the current figures' rows are data (the generated tables live in docs/)
LONG_ROW_TABLES = ("| bench | command |",)


def test_readme_lines_fit_a_terminal():
    """Prose, lists and code blocks within MAX_LINE; only the rows of LONG_ROW_TABLES may be longer."""
    long, table = [], None
    for number, line in enumerate(README.splitlines(), 1):
        if line.startswith("|"):
            table = table or line
            if table.startswith(LONG_ROW_TABLES):
                continue
        else:
            table = None
        if len(line) > MAX_LINE:
            long.append(f"README.md:{number}: {len(line)} characters")
    assert not long, "\n".join(long)


def test_the_docs_index_lists_every_page():
    """docs/README.md is the index: every page of docs/ is linked from it, and every link resolves."""
    docs = REPO / "docs"
    index = (docs / "README.md").read_text()
    pages = sorted(p.name for p in docs.glob("*.md") if p.name != "README.md")
    assert pages and [p for p in pages if f"]({p})" not in index] == []
    assert "](../README.md)" in index


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def anchors(page: Path, level: str = "#") -> list[str]:
    """The heading anchors GitHub gives a page (repeats numbered), of headings that start with `level`, and its
    explicit `<a id="...">` anchors."""
    seen: dict[str, int] = {}
    out, in_code = [], False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        out += [] if in_code else re.findall(r'<a id="([^"]+)"></a>', line)
        if in_code or not line.startswith("#"):
            continue
        s = slug(line)
        if line.startswith(level):
            out.append(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_relative_links_resolve():
    """The README's pointers to its reference pages, and the pages' links to each other, name files (and headings) that exist."""
    broken = []
    for page in markdown_pages():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert broken == []


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_the_benchmark_history_is_one_page_per_day_with_an_index():
    """docs/benchmarks.md indexes docs/benchmarks/: every day's page, every entry of it, each page a day's."""
    index = (REPO / "docs" / "benchmarks.md").read_text()
    days = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
    assert days and [d.name for d in days if f"](benchmarks/{d.name})" not in index] == []
    for day in days:
        entries = anchors(day, level="## ")
        assert [a for a in entries if f"](benchmarks/{day.name}#{a})" not in index] == [], day.name


def test_reference_pages_keep_no_dated_notes():
    """What was tried and measured goes to the benchmark history, by day; a reference page says how it works."""
    dated = [
        f"{page.relative_to(REPO)}: {line}"
        for page in sorted((REPO / "docs").glob("*.md"))
        if page.name != "benchmarks.md"
        for line in page.read_text().splitlines()
        if line.startswith("#") and DATED.search(line)
    ]
    assert dated == []
