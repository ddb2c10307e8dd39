"""Helpers the test suite shares: real nats-server, `rose` CLI and OTLP helpers, and small builders of
messages, models and weights for tests.

A user plugging a framework into ROSE can reuse them in their own tests too: `polling` waits for
asynchronous things with a deadline, `rose_cli` drives the `rose` command as a user would,
`otlp_receiver` is a real OTLP/HTTP receiver, `sglang_sender` pickles what slime sends SGLang.

Only tests import this package: no module of `rose` outside it may (it pulls in test-only
dependencies such as hypothesis), so it cannot close an import cycle.
"""
