"""Running one rollout turn, routed by the scheduler: what every service that generates on the policy shares
(the rollout worker for its environments, the gateway for external agents)."""
