"""Every exception class the package defines derives from `RoseError` (shared/errors.py).

Read from the source, not by importing every module (some import torch or SGLang): a class is an
exception when one of its bases is a builtin exception or another of the package's exception
classes; it must then be RoseError itself, name RoseError as a base, or derive from a project
exception that does.
"""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
from pathlib import Path

from test_import_graph import ROOT, package_modules

from rose.shared.errors import RoseError, WeightError

BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def project_sources(root: Path) -> list[Path]:
    """The package's modules, and the deploy checks beside them (deploy/ is no package, but ships with it)."""
    return [*package_modules(root, "rose").values(), *sorted((root / "deploy").rglob("*.py"))]


def exception_classes(root: Path) -> dict[str, tuple[str, list[str]]]:
    """Class name -> (where, base names), for every class in the project deriving from an exception."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in project_sources(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (f"{path.relative_to(root)}:{node.lineno}", [_base_name(b) for b in node.bases])
    found: dict[str, tuple[str, list[str]]] = {}
    changed = True
    while changed:
        changed = False
        for name, (where, bases) in classes.items():
            if name not in found and any(b in BUILTIN_EXCEPTIONS or b in found for b in bases):
                found[name] = (where, bases)
                changed = True
    return found


def test_every_project_exception_derives_from_rose_error():
    found = exception_classes(ROOT)
    assert {"RemoteError", "InvalidRequest", "CheckFailed"} <= set(found)  # the scan sees the package's exceptions and deploy's
    rooted = {"RoseError"}
    changed = True
    while changed:
        changed = False
        for name, (_, bases) in found.items():
            if name not in rooted and any(b in rooted for b in bases):
                rooted.add(name)
                changed = True
    stray = sorted(f"{name} ({where}; bases {bases})" for name, (where, bases) in found.items() if name not in rooted)
    assert not stray, "derive these from RoseError (shared/errors.py), keeping the builtin as a second base:\n" + "\n".join(stray)


def test_a_rose_error_is_still_the_builtin_it_refines():
    from rose.shared.bus import PermissionDenied, RequestRefused
    from rose.shared.config import ConfigError

    assert issubclass(ConfigError, ValueError) and issubclass(RequestRefused, ValueError) and issubclass(PermissionDenied, PermissionError)
    err = WeightError("corrupt", "object x: truncated")
    assert isinstance(err, RoseError) and err.kind == "corrupt" and str(err) == "object x: truncated"


def test_the_cli_turns_a_rose_error_into_one_line_and_an_exit_code(models_dir):
    """An executor told to co-batch a policy that is a model of its own refuses to start: one line that says why
    and what to change, exit code 1, no traceback (the CLI catches RoseError, and only it)."""
    import os

    from rose.testing.rose_cli import rose

    env = {**os.environ, "ROSE_MODELS__DIR": str(models_dir), "ROSE_ENGINE__ROLLOUT_MODE": "co_batched", "ROSE_ENGINE__DEVICE": "cpu"}
    out = rose("run", "executor", env=env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("rose run: EngineModeError: ") and "LoRA adapter of the serving model" in line and "rose models init" in line


def test_rose_testing_without_the_test_extra_says_which_extra():
    """rose.testing ships with the package but needs the `test` extra: imported without it (hypothesis hidden here),
    it names what is missing and how to install it, as a RoseError."""
    code = "import sys; sys.modules['hypothesis'] = None; import rose.testing.polling"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "TestExtraMissing: rose.testing needs hypothesis: install the test extra (pip install 'rose-rl[test]')" in proc.stderr
