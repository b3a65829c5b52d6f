"""RewardClient moved to `services.wire.reward_client` (the wire layer, which every service may
import); this path re-exports it for the code and plugins that import it from here."""

from services.wire.reward_client import (
    FunctionsInfo,
    RewardClient,
    RewardClientError,
)

__all__ = [
    "FunctionsInfo",
    "RewardClient",
    "RewardClientError",
]
