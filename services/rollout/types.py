"""UpdateResult and RolloutStatsView moved to `services.wire.rollout_types` (the wire layer,
which every service may import); this path re-exports it for the code and plugins that
import it from here."""

from services.wire.rollout_types import (
    RolloutStatsView,
    UpdateResult,
)

__all__ = [
    "RolloutStatsView",
    "UpdateResult",
]
