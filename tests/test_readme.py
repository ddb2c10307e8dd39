"""The README stays true and short: its commands exist, it fits 24 KB and 160 columns, and every figure in it is found
in the dated benchmark entry it links; docs/ has an index, and docs/subjects.md lists every channel of the registry."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
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


MAX_BYTES = 24 * 1024  # a page a newcomer reads in five minutes; the detail lives in docs/
MAX_LINE = 160  # every line: prose, lists, code, table rows and link definitions alike


def test_readme_is_short():
    size = len(README.encode())
    assert size <= MAX_BYTES, f"README.md is {size:,} bytes, over {MAX_BYTES:,}"


def test_readme_lines_fit():
    long = [f"README.md:{n}: {len(line)} characters" for n, line in enumerate(README.splitlines(), 1) if len(line) > MAX_LINE]
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


def headings(page: Path) -> Iterator[tuple[int, str, str]]:
    """Each heading outside code blocks: its line's index, the line, and the anchor GitHub gives it (repeats numbered)."""
    seen: dict[str, int] = {}
    in_code = False
    for index, line in enumerate(page.read_text().splitlines()):
        in_code ^= line.startswith("```")
        if in_code or not line.startswith("#"):
            continue
        s = slug(line)
        yield index, line, s if s not in seen else f"{s}-{seen[s]}"
        seen[s] = seen.get(s, 0) + 1


@functools.cache  # every link to a page and every figure of a row ask again: each page is read and parsed once
def anchors(page: Path, level: str = "#") -> list[str]:
    """The heading anchors GitHub gives a page, of headings that start with `level`, and its explicit `<a id="...">`
    anchors."""
    out, in_code = [], False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        out += [] if in_code else re.findall(r'<a id="([^"]+)"></a>', line)
    return out + [anchor for _, line, anchor in headings(page) if line.startswith(level)]


@functools.cache
def sections(page: Path) -> dict[str, str]:
    """Each `## ` heading's anchor and its section: the text from the heading up to the next `## ` heading."""
    lines = page.read_text().splitlines()
    tops = [(index, anchor) for index, line, anchor in headings(page) if line.startswith("## ")]
    ends = [index for index, _ in tops[1:]] + [len(lines)]
    return {anchor: "\n".join(lines[index:end]) for (index, anchor), end in zip(tops, ends, strict=True)}


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


LINK_DEFINITION = re.compile(r"^\[([^\]]+)\]:\s*(\S+)", re.M)  # a reference-style link's target: `[id]: path#anchor`


def test_relative_links_resolve():
    """The README's pointers to its reference pages, and the pages' links to each other (inline or by reference), name
    files (and headings) that exist."""
    broken = []
    for page in markdown_pages():
        text = page.read_text()
        targets = re.findall(r"\]\(([^)\s]*)\)", text) + [t for _, t in LINK_DEFINITION.findall(text)]
        for target, _, anchor in (t.partition("#") for t in targets):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert broken == []


# A figure is a number with a unit (x, %, s, ms, tokens/s, steps/h: "1.26x", "42 %", "1.88 s") or any decimal
# ("0.99"), either one a range ("1.09-1.20x"). Not figures: integers without a unit (years, dates, ports, counts,
# issue numbers), numbers glued to a letter, a dot or a plus (7B, 4xH100, p99, 1e-3, 2.13.0, 3.11+), and whatever
# sits in an inline code span (`--seeds 0 1`) or a link's target, which `figures` drops before it looks.
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.,:/#]){NUMBER}(?:-{NUMBER})?(?: ?(?:tokens/s|steps/h|ms|s|x|%))?(?![\w+]|\.\d)")
UNIT = re.compile(r"(?:tokens/s|steps/h|ms|s|x|%)$")
DATED_ENTRY = re.compile(r"docs/benchmarks/\d{4}-\d\d(?:-\d\d)?\.md#\S+")


def normalise(text: str) -> str:
    """Thin and non-breaking spaces as spaces, an en dash as a hyphen: nothing else is forgiven."""
    return re.sub("[\u00a0\u2009\u202f]", " ", text).replace("\u2013", "-")


def blocks(text: str) -> Iterator[tuple[int, str]]:
    """The paragraphs, list items, table rows and headings outside code blocks, each with its first line's number
    (link definitions are not text)."""
    lines, first, in_code = [], 0, False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        fence = line.startswith("```")
        in_code ^= fence
        starts = not line.strip() or fence or in_code or line.startswith(("#", "|")) or re.match(r" *(?:[-*]|\d+\.) ", line)
        if starts and lines:
            yield first, "\n".join(lines)
            lines = []
        if fence or in_code or not line.strip() or LINK_DEFINITION.match(line):
            continue
        if line.startswith(("#", "|")):
            yield number, line
            continue
        first = first if lines else number
        lines.append(line)


def figures(block: str) -> Iterator[tuple[int, str]]:
    """Each figure of a block: the line within the block it is on (0 for the first), and its text."""
    text = re.sub(r"`[^`]*`", lambda m: "\n" * m.group().count("\n"), normalise(block))  # code spans: no figures
    text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's target is no figure (its text is)
    for m in FIGURE.finditer(text):
        if UNIT.search(m.group()) or "." in m.group():
            yield text.count("\n", 0, m.start()), m.group()


def figure_problems(text: str, root: Path = REPO, name: str = "README.md") -> list[str]:
    """Every figure of `text` whose paragraph, list item or table row links no dated entry of the benchmark history
    (docs/benchmarks/DATE.md#anchor, inline or by reference), or whose text is not in the section of any entry linked
    there."""
    definitions = dict(LINK_DEFINITION.findall(text))
    problems = []
    for first, block in blocks(text):
        targets = re.findall(r"\]\(([^)\s]+)\)", block) + [definitions.get(ref, "") for ref in re.findall(r"\]\[([^\]]+)\]", block)]
        entries = [t.removeprefix("./") for t in targets if DATED_ENTRY.fullmatch(t.removeprefix("./"))]
        for offset, figure in figures(block):
            where = f"{name}:{first + offset}: {figure!r}"
            if not entries:
                problems.append(f"{where} is in a paragraph or row that links no dated entry (docs/benchmarks/DATE.md#anchor)")
                continue
            found = re.compile(rf"(?<![\w.]){re.escape(figure)}(?![\w]|\.\d)")
            texts = [sections(root / path).get(anchor, "") for path, _, anchor in (e.partition("#") for e in entries)]
            if not any(found.search(normalise(t)) for t in texts):
                problems.append(f"{where} is not in {' or '.join(entries)}")
    return problems


def test_every_figure_is_in_the_entry_it_links():
    """A figure in the README is a claim about a run: its paragraph or table row links the dated entry that recorded
    the run, and the entry's section says the same figure."""
    problems = figure_problems(README)
    assert problems == [], "\n".join(problems)


def test_the_figure_check_finds_a_wrong_figure(tmp_path):
    day = tmp_path / "docs" / "benchmarks" / "2026-01-01.md"
    day.parent.mkdir(parents=True)
    day.write_text("# 2026-01-01\n\n## A run\n\nrose **1.26x** static; p99 1.88 s, 0.4–0.9 s; 42 %.\n\n## Another\n\n0.5 ms\n")
    link = "(docs/benchmarks/2026-01-01.md#a-run)"
    text = (
        f"Rose made 1.26x static,\np99 1.88\u2009s and 0.4-0.9 s [there]{link}.\n\n| a row | 42 % | 0.5 ms | [there][run] |\n\n"
        "- 0.99 alone; `--seeds 0 1`, 7B, 4xH100, p99, Python 3.11+, torch 2.13.0, 127.0.0.1:4222, 2026-12-07, 3 seeds\n\n"
        f"[run]: {link[1:-1]}\n"
    )
    assert figure_problems(text, tmp_path) == [
        "README.md:4: '0.5 ms' is not in docs/benchmarks/2026-01-01.md#a-run",
        "README.md:6: '0.99' is in a paragraph or row that links no dated entry (docs/benchmarks/DATE.md#anchor)",
    ]


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
