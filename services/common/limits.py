"""Bounds every service applies to what callers send, defined once.

Ids are held in Redis keys, idempotency caches and logs, so each service refuses one longer
than this rather than storing whatever arrives (an 8 MiB request id kept in a cache of
4,096 entries is 32 GiB).
"""

from __future__ import annotations

MAX_ID_BYTES = 256
"""Longest id (group, trajectory, request, reservation, consumer, rollout) in UTF-8 bytes."""
