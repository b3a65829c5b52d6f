"""Typed async client of the trainer service (for the launcher and `flywheel status`).

Status is a read and retried on transient errors; Pause/Resume/Stop set a state and are
harmless to repeat; SaveCheckpoint carries a `request_id` the trainer deduplicates on (a
retry returns the first attempt's checkpoint), so every call here is retried. An outage
(the trainer restarting) is ridden through for `outage_budget_s`, seconds by default: its
callers (the launcher, `flywheel status`) want an answer soon and ask again.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from flywheel_proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.config.services import TLSConfig
from services.common.grpc_client import RetryingClient, make_channel
from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.common.outage import PeerHealth

DEFAULT_OUTAGE_BUDGET_S = 10.0


@dataclass(frozen=True)
class TrainerStatusView:
    """The trainer's state as plain Python values."""

    step: int
    version: int
    paused: bool
    phase: str
    total_train_steps: int
    world_size: int
    last_stats: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str = ""
    last_checkpoint_step: int = 0
    skipped_updates: int = 0
    unhealthy_replica_updates: int = 0
    last_step_unix: float = 0.0

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @classmethod
    def from_proto(cls, msg: trainer_pb2.TrainerStatus) -> TrainerStatusView:
        return cls(
            step=int(msg.step),
            version=int(msg.version),
            paused=bool(msg.paused),
            phase=msg.phase,
            total_train_steps=int(msg.total_train_steps),
            world_size=int(msg.world_size),
            last_stats=dict(msg.last_stats),
            last_checkpoint=msg.last_checkpoint,
            last_checkpoint_step=int(msg.last_checkpoint_step),
            skipped_updates=int(msg.skipped_updates),
            unhealthy_replica_updates=int(msg.unhealthy_replica_updates),
            last_step_unix=float(msg.last_step_unix),
        )


@dataclass(frozen=True)
class CheckpointView:
    path: str
    step: int
    version: int


class TrainerClient(RetryingClient):
    """The trainer's rank 0 at `address`. Use as `async with TrainerClient(...) as c:`."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        timeout: float = 10.0,
        retries: int | None = None,
        outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        peer: PeerHealth | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._retry_settings("trainer", address, timeout, retries, outage_budget_s, peer)
        self._channel = make_channel(
            address, max_message_bytes=max_message_bytes, auth_token=auth_token, tls=tls
        )
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> TrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _control(self, method, request_id: str | None) -> TrainerStatusView:  # type: ignore[no-untyped-def]
        req = trainer_pb2.ControlRequest(request_id=request_id or uuid.uuid4().hex)
        return TrainerStatusView.from_proto(await self._retrying(method, req))

    async def status(self) -> TrainerStatusView:
        return TrainerStatusView.from_proto(
            await self._retrying(self._stub.Status, common_pb2.Empty())
        )

    async def pause(self, request_id: str | None = None) -> TrainerStatusView:
        """Stop taking new batches after the current step."""
        return await self._control(self._stub.Pause, request_id)

    async def resume(self, request_id: str | None = None) -> TrainerStatusView:
        return await self._control(self._stub.Resume, request_id)

    async def stop(self, request_id: str | None = None) -> TrainerStatusView:
        """Finish the current step, checkpoint if configured, and exit 0."""
        return await self._control(self._stub.Stop, request_id)

    async def save_checkpoint(
        self, request_id: str | None = None, *, timeout: float = 600.0
    ) -> CheckpointView:
        """Checkpoint at the next step boundary; waits for it (up to `timeout` seconds)."""
        req = trainer_pb2.ControlRequest(request_id=request_id or uuid.uuid4().hex)
        resp = await self._retrying(self._stub.SaveCheckpoint, req, timeout=timeout)
        return CheckpointView(path=resp.path, step=int(resp.step), version=int(resp.version))
