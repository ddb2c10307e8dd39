"""The reference GRPO trainer: consumes trajectory groups, trains the policy, publishes weights."""
