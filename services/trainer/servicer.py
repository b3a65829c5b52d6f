"""`flywheel.v1.TrainerService` over the shared `Control` state (rank 0 only).

Every RPC answers from `Control` or records a request there; none blocks the training
loop or touches torch. SaveCheckpoint waits for the loop to reach a step boundary and
write the checkpoint; when the loop has already finished, it answers FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import math

import grpc

from flywheel_proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.control import Control, SavedCheckpoint

SERVICE_NAME = "flywheel.v1.TrainerService"


def status_proto(control: Control) -> trainer_pb2.TrainerStatus:
    s = control.snapshot()
    return trainer_pb2.TrainerStatus(
        step=s["step"],
        version=s["version"],
        paused=s["paused"],
        phase=s["phase"],
        total_train_steps=s["total_train_steps"],
        last_stats={k: float(v) for k, v in s["last_stats"].items() if math.isfinite(v)},
        world_size=s["world_size"],
        last_checkpoint=s["last_checkpoint"],
        last_checkpoint_step=s["last_checkpoint_step"],
        skipped_updates=s["skipped_updates"],
        unhealthy_replica_updates=s["unhealthy_replica_updates"],
        last_step_unix=s["last_step_unix"],
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, control: Control, *, save_timeout: float = 3600.0) -> None:
        self.control = control
        self.save_timeout = save_timeout

    async def Status(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        return status_proto(self.control)

    async def Pause(self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext):
        self.control.set_paused(True)
        return status_proto(self.control)

    async def Resume(self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext):
        self.control.set_paused(False)
        return status_proto(self.control)

    async def Stop(self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext):
        self.control.request_stop()
        return status_proto(self.control)

    async def SaveCheckpoint(
        self, request: trainer_pb2.ControlRequest, context: grpc.aio.ServicerContext
    ):
        if self.control.phase == "done":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "the trainer has finished; nothing to save"
            )
        future = self.control.request_save(request.request_id)
        remaining = context.time_remaining()
        timeout = self.save_timeout if remaining is None else min(remaining, self.save_timeout)
        try:
            saved: SavedCheckpoint = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the checkpoint was not written in time; it will still be written at the next "
                "step boundary",
            )
        except Exception as exc:  # noqa: BLE001 - the loop's reason goes back to the caller
            await context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {exc}")
        return trainer_pb2.SaveCheckpointResponse(
            path=saved.path, step=saved.step, version=saved.version
        )
