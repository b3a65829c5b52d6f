"""RolloutClient moved to `services.wire.rollout_client` (the wire layer, which every service
may import); this path re-exports it for the code and plugins that import it from here."""

from services.wire.rollout_client import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_OUTAGE_BUDGET_S,
    GenerateResult,
    RolloutClient,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_OUTAGE_BUDGET_S",
    "GenerateResult",
    "RolloutClient",
]
