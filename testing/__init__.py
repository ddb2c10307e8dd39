"""Helpers the test suite shares: real nats-server, `rose` CLI and OTLP helpers, and small builders of
messages, models and weights for tests.

A user plugging a framework into ROSE can reuse them in their own tests too: `polling` waits for
asynchronous things with a deadline, `rose_cli` drives the `rose` command as a user would,
`otlp_receiver` is a real OTLP/HTTP receiver, `sglang_sender` pickles what slime sends SGLang.

Only tests import this package: no module of `rose` outside it may (it pulls in test-only
dependencies such as hypothesis), so it cannot close an import cycle.
"""

from importlib.util import find_spec

from rose.shared.errors import RoseError

# What the helpers import beyond ROSE's own dependencies: the `test` extra's (pyproject.toml)
TEST_EXTRA_MODULES = ("pytest", "hypothesis")


class TestExtraMissing(RoseError, ImportError):
    """rose.testing needs the `test` extra: said at import, by name, rather than as a bare ModuleNotFoundError deep in
    a helper."""

    __test__ = False  # a class named Test*: not a pytest test case


def _check_test_extra() -> None:
    missing = [m for m in TEST_EXTRA_MODULES if find_spec(m) is None]
    if missing:
        raise TestExtraMissing(f"rose.testing needs {', '.join(missing)}: install the test extra (pip install 'rose-rl[test]')")


_check_test_extra()
