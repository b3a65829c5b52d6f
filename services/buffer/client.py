"""BufferClient moved to `services.wire.buffer_client` (the wire layer, which every service may
import); this path re-exports it for the code and plugins that import it from here."""

from services.wire.buffer_client import (
    _RESULT_NAMES,
    AnyGroup,
    BufferClient,
    BufferClientError,
    BufferFullError,
    CapacityInfo,
    ClaimResult,
    InvalidGroupError,
    PutResult,
    Reservation,
    VersionRegressionError,
)

__all__ = [
    "AnyGroup",
    "BufferClient",
    "BufferClientError",
    "BufferFullError",
    "CapacityInfo",
    "ClaimResult",
    "InvalidGroupError",
    "PutResult",
    "Reservation",
    "VersionRegressionError",
    "_RESULT_NAMES",
]
