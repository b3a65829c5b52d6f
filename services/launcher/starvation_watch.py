"""The launcher's starvation watch over a running local run: when no step has come for
`launcher.starvation_timeout_seconds` while the trainer waits for data, ask the services
what they hold (two snapshots, half a timeout apart) and name the stage that holds the run.

Which stage it is, from two snapshots, is `starvation.py`'s pure rule; this module does the
asking (one unary gRPC call per service, with the launcher's token) and the timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.launcher.metrics_log import MetricsTail
from services.launcher.processes import ServiceProcess
from services.launcher.restarts import say
from services.launcher.starvation import Snapshot, as_record, diagnose
from services.trainer.lifecycle import write_json_atomic


class StarvationWatch:
    """Called once per supervision round; says (and writes `starvation.json`) when the run
    starves, then again every timeout while it still does."""

    def __init__(
        self,
        cfg: FlywheelConfig,
        run_dir: Path,
        auth_token: str | None,
        reward_up: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._clock = clock  # injected by tests, which step it instead of waiting
        self.run_dir = run_dir
        self.auth_token = auth_token
        self.reward_up = reward_up
        self.timeout = cfg.launcher.starvation_timeout_seconds
        self._progress_mark: tuple[int, int] = (-1, -1)
        self._waiting_since = clock()
        self._before: Snapshot | None = None
        self._next = self.timeout

    def check(self, tail: MetricsTail, trainer: ServiceProcess) -> None:
        """No step for `starvation_timeout_seconds` while the trainer waits for data: name
        the stage that holds the run (see `starvation.py`), then again every timeout."""
        mark = (len(tail.records), len(tail.superseded))
        if mark != self._progress_mark:
            self._progress_mark = mark
            self._waiting_since = self._clock()
            self._before, self._next = None, self.timeout
            (self.run_dir / "starvation.json").unlink(missing_ok=True)
            return
        if self.timeout is None or self._next is None or not trainer.alive():
            return
        waited = self._clock() - self._waiting_since
        if self._before is None and waited >= self.timeout / 2:
            self._before = self.snapshot()
        if self._before is None or waited < self._next:
            return
        self._next += self.timeout
        if self.trainer_phase() != "waiting_for_data":
            return  # a long step, a checkpoint or a weight push is not starvation
        now = self.snapshot()
        verdict = diagnose(
            self._before, now, batch=self.cfg.rollout.consumer_batch_size, waited_s=waited
        )
        write_json_atomic(self.run_dir / "starvation.json", as_record(self._before, now, verdict))
        self._before = now
        say(
            f"starving: no training step for {waited:.0f}s: {verdict['stage']} "
            f"({verdict['detail']})"
        )

    def trainer_phase(self) -> str | None:
        """The trainer's `Status.phase`, or None when it does not answer."""
        from flywheel_proto.v1 import common_pb2, trainer_pb2_grpc

        msg = self._ask(
            self.cfg.services.trainer.address,
            lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).Status(
                common_pb2.Empty(), timeout=3
            ),
        )
        return None if msg is None else str(msg["phase"])

    def snapshot(self) -> Snapshot:
        """What the buffer and every rollout replica report now, and whether reward is up."""
        from flywheel_proto.v1 import buffer_pb2_grpc, common_pb2, rollout_pb2_grpc

        s = self.cfg.services
        buffer = self._ask(
            s.buffer.address,
            lambda ch: buffer_pb2_grpc.BufferServiceStub(ch).Stats(common_pb2.Empty(), timeout=3),
        )
        rollouts = {
            f"rollout-{i}": self._ask(
                s.rollout.replica_address(i),
                lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).Stats(
                    common_pb2.Empty(), timeout=3
                ),
            )
            for i in range(self.cfg.rollout.n_replicas)
        }
        return Snapshot(time.time(), buffer, rollouts, self.reward_up())

    def _ask(self, address: str, call: Any) -> dict[str, Any] | None:
        """One unary call's answer as a dict, or None when the service does not answer."""
        import grpc
        from google.protobuf.json_format import MessageToDict

        from services.common.grpc_client import make_sync_channel

        ch = make_sync_channel(address, auth_token=self.auth_token)
        try:
            return MessageToDict(
                call(ch),
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
            )
        except grpc.RpcError:
            return None
        finally:
            ch.close()
