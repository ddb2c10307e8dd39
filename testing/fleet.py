"""Instance ids of the end-to-end fleet that tests/rollout_worker starts as real processes: its
fixture names the executors and the worker with them, and its tests check which executor took a turn."""

SERVING, DEDICATED, WORKER, GATEWAY = "ex-e2e-serving", "ex-e2e-dedicated", "worker-e2e", "gateway-e2e"
