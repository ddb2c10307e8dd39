"""The rollout gateway: agents people already wrote, on the policy through an OpenAI-compatible API, producing ROSE trajectories."""
