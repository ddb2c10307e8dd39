"""Instance ids of the end-to-end fleet (a uniquely named module: every test folder has a `conftest`)."""

SERVING, DEDICATED, WORKER = "ex-e2e-serving", "ex-e2e-dedicated", "worker-e2e"
