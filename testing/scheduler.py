"""The scheduler as a real process in tests: short ticks, leases and heartbeats, so that a test sees
grants, renewals, expiries and a dead instance within seconds."""

START_TIMEOUT_S = 60.0  # until its 'ready' heartbeat
ENV = {
    "ROSE_TICK_S": "0.2",
    "ROSE_LEASES__TTL_S": "3",
    "ROSE_LEASES__RENEW_BEFORE_S": "1.5",
    "ROSE_LEASES__COOLDOWN_S": "1.5",
    "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
}
