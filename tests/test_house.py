"""The house's limits, checked as imports are (tests/test_import_graph.py): units a reader can hold, one engine
surface the service talks to, and every word the code branches on defined once.

Read from the source (ast), not by importing: what is measured is what a reader sees.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from test_import_graph import ROOT, package_modules

MAX_UNIT_LINES = 120  # a function or method, decorators and docstring included
MAX_FILE_LINES = 900  # a module outside tests/
MAX_ENGINE_METHODS = 50  # services/executor/engine.py's Engine: what it owns, not what its parts do


def project_sources() -> dict[str, Path]:
    """Every module of the package, and deploy/'s scripts (no package, but shipped beside it)."""
    sources = {module: path for module, path in package_modules(ROOT, "rose").items()}
    sources.update({f"deploy/{p.relative_to(ROOT / 'deploy')}": p for p in sorted((ROOT / "deploy").rglob("*.py"))})
    return sources


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in project_sources().values()}


def test_no_unit_over_the_limit():
    long = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > MAX_UNIT_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"split these into named steps (at most {MAX_UNIT_LINES} lines each):\n" + "\n".join(sorted(long))


def test_no_module_over_the_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in project_sources().values() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"split these by what each part owns (at most {MAX_FILE_LINES} lines):\n" + "\n".join(sorted(long))


def test_the_engine_is_a_few_objects_and_the_service_talks_to_its_protocol():
    engine = ast.parse((ROOT / "services" / "executor" / "engine.py").read_text())
    (cls,) = [n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) < MAX_ENGINE_METHODS, f"Engine has {len(methods)} methods: move what a part owns into that part"
    asked = []
    for path in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            is_isinstance = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2
            if is_isinstance and {getattr(node.args[1], "id", ""), getattr(node.args[1], "attr", "")} & {"Engine", "SGLangBackend"}:
                asked.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not asked, "the service asks which engine it has (use the protocol, backend.CoServingEngine):\n" + "\n".join(asked)


def _word_lists(tree: ast.Module) -> list[tuple[tuple[str, ...], int]]:
    """Every ``Literal[...]`` of two or more strings in a module: its words (sorted) and its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            words = tuple(sorted(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)))
            if len(words) >= 2:
                found.append((words, node.lineno))
    return found


def test_every_word_list_is_defined_once():
    """A set of words the code branches on (a policy, a finish reason, a role, a lease's state) written as a Literal in
    two places drifts: define it once (a named Literal, and ``typing.get_args`` where the words are needed at run
    time) and import it."""
    where: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path, tree in _trees().items():
        for words, line in _word_lists(tree):
            where[words].append(f"{path.relative_to(ROOT)}:{line}")
    twice = [f"{list(words)}: {', '.join(places)}" for words, places in sorted(where.items()) if len(places) > 1]
    assert not twice, "define each once and import it:\n" + "\n".join(twice)


def test_the_word_list_check_sees_a_duplicate():
    one = ast.parse('from typing import Literal\nA = Literal["x", "y"]\ndef f(a: Literal["y", "x"]): ...\n')
    assert [w for w, _ in _word_lists(one)] == [("x", "y"), ("x", "y")]
