"""Plain data types of the rollout service's own RPCs: weight-update results and stats.

The types other services share with the rollout (`SamplingParams`, `Completion`) live in
`services.core.types`. Part of the wire layer: the rollout's servicer answers with these and
its client (`rollout_client.py`) returns them. No torch here: the client imports these
without a model stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class UpdateResult:
    """Outcome of a weight update. `ok=False` means the old weights still serve, `message`
    says why, and `version` is the (old) version served."""

    ok: bool
    version: int
    message: str = ""
    pause_seconds: float = 0.0
    total_seconds: float = 0.0

    def raise_for_status(self) -> UpdateResult:
        if not self.ok:
            raise RuntimeError(
                f"weight update refused (still serving v{self.version}): {self.message}"
            )
        return self

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import rollout_pb2

        return rollout_pb2.UpdateWeightsResponse(
            ok=self.ok,
            version=self.version,
            message=self.message,
            pause_seconds=self.pause_seconds,
            total_seconds=self.total_seconds,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> UpdateResult:
        return cls(msg.ok, msg.version, msg.message, msg.pause_seconds, msg.total_seconds)


@dataclass
class RolloutStatsView:
    """What `Stats` reports about one replica."""

    version: int
    requests_in_flight: int
    groups_produced: int
    tokens_generated: int
    paused: bool
    rejected: dict[str, int]
    rollout_id: str
    checksum: str = ""
    draining: bool = False
    weight_updates: int = 0
    weight_updates_failed: int = 0
    last_update_error: str = ""
    engine: str = ""

    @classmethod
    def from_proto(cls, msg: Any) -> RolloutStatsView:
        return cls(
            version=msg.version,
            requests_in_flight=msg.requests_in_flight,
            groups_produced=msg.groups_produced,
            tokens_generated=msg.tokens_generated,
            paused=msg.paused,
            rejected=dict(msg.rejected),
            rollout_id=msg.rollout_id,
            checksum=msg.checksum,
            draining=msg.draining,
            weight_updates=msg.weight_updates,
            weight_updates_failed=msg.weight_updates_failed,
            last_update_error=msg.last_update_error,
            engine=msg.engine,
        )
