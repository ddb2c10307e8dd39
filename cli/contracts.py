"""`rose contracts export|docs`: the bus contracts as JSON Schemas, AsyncAPI and Markdown.

Their arguments beside the code that runs them; rose.contracts.export loads only when one runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose contracts` and its actions to `rose`'s commands."""
    p = commands.add_parser("contracts", help="the bus contracts")
    actions = p.add_subparsers(dest="contracts_command", required=True, metavar="ACTION")
    e = actions.add_parser("export", help="write a JSON Schema per message and an AsyncAPI 3.0 document into DIR")
    e.add_argument("dir", help="output directory")
    e.set_defaults(func=export)
    e = actions.add_parser("docs", help="write the Markdown reference of every public event (docs/events.md) from the AsyncAPI document")
    e.add_argument("file", nargs="?", default="docs/events.md", help="output file (default: docs/events.md)")
    e.set_defaults(func=docs)


def export(args: argparse.Namespace) -> int:
    from rose.contracts.export import export as export_contracts

    written = export_contracts(args.dir)
    print(f"wrote {len(written) - 1} JSON Schemas and asyncapi.json under {Path(args.dir).resolve()}")
    return 0


def docs(args: argparse.Namespace) -> int:
    from rose.contracts.export import events_markdown

    path = Path(args.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events_markdown())
    print(f"wrote {path.resolve()}")
    return 0
