"""What a trainer imports to talk to ROSE (`rose.client`)."""

from .weights import PublishFailedError, WeightsClient

__all__ = ["PublishFailedError", "WeightsClient"]
