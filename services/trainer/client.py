"""TrainerClient moved to `services.wire.trainer_client` (the wire layer, which every service
may import); this path re-exports it for the code and plugins that import it from here."""

from services.wire.trainer_client import (
    DEFAULT_OUTAGE_BUDGET_S,
    CheckpointView,
    TrainerClient,
    TrainerStatusView,
)

__all__ = [
    "CheckpointView",
    "DEFAULT_OUTAGE_BUDGET_S",
    "TrainerClient",
    "TrainerStatusView",
]
