"""Errors that cross a service boundary and that a caller acts on by type.

The rollout loop classifies a failed episode or a refused put by these types, whatever
client or stand-in raised them: the wire layer's clients raise them (or subclasses that
add the gRPC status), and a test's fake can raise them too.
"""

from __future__ import annotations


class RewardUnavailableError(RuntimeError):
    """Scoring failed as a whole: the reward service stayed unreachable or refused the
    request after the client's retries. Failures of single items are never raised; they
    are `ScoreResult`s with `ok` false."""


class InvalidGroupError(ValueError):
    """The buffer refused a trajectory group as malformed or oversized; nothing was stored,
    and sending the same group again cannot succeed."""


__all__ = ["InvalidGroupError", "RewardUnavailableError"]
