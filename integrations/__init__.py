"""Other RL frameworks driving ROSE: each integration is a client of ROSE (contracts, shared, client), never of a service.

`rose.integrations.trl`: Hugging Face TRL's trainers train through ROSE (docs/trl.md).
"""
