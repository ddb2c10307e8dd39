"""docs/subjects.md's table, generated from the registry (publishers and consumers included).

    python -m rose.contracts.subjects_table docs/subjects.md           # rewrite the table in place
    python -m rose.contracts.subjects_table --check docs/subjects.md   # exit 1 when it is out of date

The registry is the record of who publishes and who consumes each channel (the services'
NATS permissions are derived from it too); the table is its rendering, never edited by hand.
That the consumers are true is checked against what each service's `Bus` really read in a
running fleet (tests/observability/test_fleet_observability.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .registry import ALL_SERVICES, CHANNELS, Channel, Retention

SECTION = "## Subjects"
HEADER = ("| subject | kind | storage | payload | publishers | consumers |", "| --- | --- | --- | --- | --- | --- |")


def _storage(c: Channel) -> str:
    if c.stream is not None:
        return c.stream.name + (" (work queue)" if c.stream.retention is Retention.WORK_QUEUE else "")
    if c.kv is not None:
        return f"KV `{c.kv.bucket}`"
    if c.objects is not None:
        return f"object store `{c.objects.bucket}`"
    return "core"


def _payload(c: Channel) -> str:
    if c.payload is None:
        return "bytes"
    return c.payload.__name__ + (f" → {c.reply.__name__}" if c.reply is not None else "")


def _who(services: tuple[str, ...]) -> str:
    return "every service" if services == ALL_SERVICES else ", ".join(services)


def subjects_table() -> list[str]:
    """The Markdown table's lines, one row per channel in registry order."""
    rows = [f"| `{c.template}` | {c.kind.value} | {_storage(c)} | {_payload(c)} | {_who(c.publishers)} | {_who(c.consumers)} |" for c in CHANNELS]
    return [*HEADER, *rows]


def with_table(text: str) -> str:
    """`text` (docs/subjects.md) with the table under its Subjects heading replaced by the generated one."""
    lines = text.split("\n")
    try:
        heading = lines.index(SECTION)
    except ValueError:
        raise ValueError(f"no {SECTION!r} heading to put the table under") from None
    start = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("|")), None)
    if start is None or any(lines[i].strip() for i in range(heading + 1, start)):
        raise ValueError(f"the {SECTION!r} heading is not followed by its table")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join([*lines[:start], *subjects_table(), *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rose.contracts.subjects_table", description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", default="docs/subjects.md", help="the Markdown file holding the table (default: docs/subjects.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when the table is not the generated one")
    args = parser.parse_args(argv)
    path = Path(args.file)
    text = path.read_text()
    updated = with_table(text)
    if args.check:
        if updated != text:
            print(f"{path}: the Subjects table is out of date: run `python -m rose.contracts.subjects_table {path}`")
            return 1
        print(f"{path}: the Subjects table matches the registry")
        return 0
    if updated != text:
        path.write_text(updated)
        print(f"{path}: Subjects table regenerated from the registry")
    else:
        print(f"{path}: Subjects table already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
