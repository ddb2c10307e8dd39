"""No import cycles in the `rose` package, counting the imports inside functions too.

A lazy (function-level) import that only works because it runs after both modules have loaded
is still a cycle: it hides which module owns a concept and breaks as soon as someone moves the
import to the top. So the graph here has an edge for every `import` and `from ... import`
anywhere in a module (relative imports resolved), except under `if TYPE_CHECKING:`, which never
runs. Any strongly connected component of more than one module fails the test, naming the
imports that close the loop: move the shared thing to the module that owns it.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import rose

ROOT = Path(rose.__file__).resolve().parent


@dataclass(frozen=True)
class Import:
    target: str  # a module of the package
    line: int


def package_modules(root: Path, name: str) -> dict[str, Path]:
    """Every module of the package at ``root`` (directories reached through `__init__.py` only, so
    tests/, scripts/ and the virtualenv are not part of it), by dotted name."""
    modules: dict[str, Path] = {name: root / "__init__.py"}
    for path in sorted(root.glob("*.py")):
        if path.name != "__init__.py":
            modules[f"{name}.{path.stem}"] = path
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.name.startswith(".") and (sub / "__init__.py").is_file():
            modules.update(package_modules(sub, f"{name}.{sub.name}"))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """The package modules one module imports, wherever the import statement is."""

    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.found: list[Import] = []

    def _add(self, name: str, line: int) -> None:
        if name in self.modules:
            self.found.append(Import(name, line))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # the body only runs under a type checker
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        self._add(source, node.lineno)
        for alias in node.names:  # `from pkg import submodule`
            self._add(f"{source}.{alias.name}", node.lineno)


def import_graph(root: Path, name: str) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The package's modules, and for each the modules it imports (with the line of one such import)."""
    modules = package_modules(root, name)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        edges: dict[str, int] = {}
        for imp in visitor.found:
            if imp.target != module:
                edges.setdefault(imp.target, imp.line)
        graph[module] = edges
    return modules, graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    stack = [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    forward = {m: set(edges) for m, edges in graph.items()}
    backward: dict[str, set[str]] = {m: set() for m in graph}
    for m, edges in forward.items():
        for target in edges:
            backward[target].add(m)
    components: list[list[str]] = []
    placed: set[str] = set()
    for module in sorted(graph):
        if module in placed:
            continue
        component = _reachable(forward, module) & _reachable(backward, module)
        placed |= component
        if len(component) > 1:
            components.append(sorted(component))
    return components


def shortest_loop(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        current = queue.popleft()
        for nxt in sorted(graph[current]):
            if nxt == start:
                path = [current]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt in members and nxt not in parent:
                parent[nxt] = current
                queue.append(nxt)
    raise AssertionError(f"no loop through {start} in {component}")  # unreachable for a real component


def describe(modules: dict[str, Path], graph: dict[str, dict[str, int]], component: list[str]) -> str:
    loop = shortest_loop(graph, component)
    steps = [f"  {a} -> {b}  ({modules[a]}:{graph[a][b]})" for a, b in zip(loop, loop[1:])]
    return f"import cycle among {component}:\n" + "\n".join(steps)


def test_the_package_has_no_import_cycle():
    modules, graph = import_graph(ROOT, "rose")
    assert len(modules) > 100, sorted(modules)  # the walk found the package
    found = cycles(graph)
    assert not found, "\n\n".join(describe(modules, graph, c) for c in found)


def test_only_tests_import_the_test_helpers():
    """`rose.testing` (nats-server, CLI and OTLP helpers) is for test suites: a service, bench or
    CLI module that imported it would ship test scaffolding into production paths."""
    modules, graph = import_graph(ROOT, "rose")
    assert "rose.testing.polling" in modules
    users = [
        f"{m} ({modules[m]}:{line})"
        for m, edges in graph.items()
        if not m.startswith("rose.testing")
        for target, line in edges.items()
        if target == "rose.testing" or target.startswith("rose.testing.")
    ]
    assert not users, users


# The layers, lowest first: a module may import its own layer and those below, never one above.
# `rose` itself holds only the version. client sits below services (the trainer publishes through
# client/weights.py); integrations (other RL frameworks driving ROSE, e.g. TRL) are clients of ROSE,
# at the client's level; sim below bench (bench runs the simulator beside real runs: `rose bench sim`
# calibrates it against `rose bench coserve`, the emulated benches price with it); cli and the test
# helpers (testing/) on top.
LAYERS = (("rose",), ("contracts",), ("shared",), ("client", "integrations"), ("services",), ("sim",), ("bench",), ("cli", "testing"))


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: its top-level folder {top!r} is in no layer (add it to LAYERS)")


def layer_violations(modules: dict[str, Path], graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports that point up a layer, and imports from one service into another (services share
    contracts/ and shared/ only: what two of them need moves down to shared/)."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            where = f"{module} -> {target}  ({modules[module]}:{line})"
            if layer_of(target) > layer_of(module):
                found.append(f"points up: {where}")
            a, b = module.split("."), target.split(".")
            if len(a) > 2 and len(b) > 2 and a[1] == b[1] == "services" and a[2] != b[2]:
                found.append(f"one service imports another: {where}")
    return found


def test_imports_point_down_the_layers_and_no_service_imports_another():
    """contracts <- shared <- client <- services <- sim <- bench <- cli (and testing/), as LAYERS says."""
    modules, graph = import_graph(ROOT, "rose")
    found = layer_violations(modules, graph)
    assert not found, "\n".join(found)


def test_the_layer_check_sees_upward_and_sideways_imports():
    graph = {
        "rose.shared.a": {"rose.contracts.b": 1, "rose.bench.c": 2},
        "rose.services.x.m": {"rose.services.y.n": 3, "rose.services.x.o": 4, "rose.shared.a": 5},
        "rose.cli.main": {"rose.sim.p": 6},
        "rose.integrations.trl.q": {"rose.client.weights": 7, "rose.services.x.m": 8},
    }
    modules = {m: Path(f"{m}.py") for m in graph}
    found = layer_violations(modules, graph)
    assert sorted(f.split("  (")[0] for f in found) == [
        "one service imports another: rose.services.x.m -> rose.services.y.n",
        "points up: rose.integrations.trl.q -> rose.services.x.m",
        "points up: rose.shared.a -> rose.bench.c",
    ]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_lazy_and_relative_imports_and_skips_type_checking(tmp_path):
    """The test above is only as good as its graph: a cycle closed by a function-level relative import
    is found; one closed only under TYPE_CHECKING is not."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .sub import b\n",
            "sub/__init__.py": "",
            "sub/b.py": "def f():\n    from ..a import g\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\nelse:\n    import pkg.sub\n",
            "d.py": "import pkg.c\n",
            "tests/e.py": "import pkg.a\n",  # no __init__.py: not part of the package
        },
    )
    modules, graph = import_graph(tmp_path, "pkg")
    assert "pkg.tests.e" not in modules
    assert graph["pkg.sub.b"] == {"pkg.a": 2}
    assert graph["pkg.c"] == {"pkg.sub": 5}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert shortest_loop(graph, ["pkg.a", "pkg.sub.b"]) == ["pkg.a", "pkg.sub.b", "pkg.a"]
