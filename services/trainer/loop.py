"""The service loop around `PPOTrainer`: claim, train, checkpoint, ack, version, publish.

Rank 0 decides what happens next and tells the other ranks with one small JSON command
per iteration (`train`, `save`, `idle`, `stop`); a `train` command is followed by the
claimed groups as protobuf bytes, so every rank trains on exactly the same batch. Rank 0
decodes the groups it claimed once and broadcasts the messages as they arrived from the buffer;
the other ranks decode those bytes once.

Order of one step (rank 0's side in brackets):
  claim [buffer] -> train (all ranks) -> checkpoint if due (all ranks)
  -> [pause rollouts if eta = 0] -> [ack] -> [buffer version v+1]
  -> gather full weights (all ranks) -> [publish to every replica] -> [resume rollouts]
  -> metrics line.
The checkpoint is written before the ack and records the batch's group ids, so a crash
between the two is repaired on resume by acknowledging them again (acks are idempotent).

The loop owns the order of these steps across ranks; each step's details live in a module of
its own: `resume.py` (what a restarted trainer does before its first claim, and why),
`ledger.py` (the acknowledgement counts a crash must not lose), `step_records.py` (the lines
of `metrics.jsonl`, and how they are put right after a crash), `step_report.py` (where a
finished step is reported), `background_publication.py`
(eta > 0: a step's weights published while the next step trains).

A run that reached `total_train_steps` writes `completed.json` next to its checkpoints
(see `lifecycle.py`); every exit writes `<run_dir>/trainer_exit.json`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from flywheel_proto.v1 import buffer_pb2
from services.common.codec import group_from_proto
from services.common.config import FlywheelConfig
from services.core.types import TrajectoryGroup
from services.trainer import checkpoint as ckpt
from services.trainer import lifecycle
from services.trainer.background_publication import (
    PendingStep,
    publish_and_probe,
    snapshot_state_dict,
)
from services.trainer.control import Control, SavedCheckpoint
from services.trainer.dist import broadcast_bytes, broadcast_json
from services.trainer.io_loop import IOLoop
from services.trainer.ledger import Ledger
from services.trainer.metrics import TrainerMetrics
from services.trainer.paths import RunPaths
from services.trainer.ppo import PPOTrainer
from services.trainer.resume import claim_in_flight, record_claim, resume_version
from services.trainer.step_records import (
    PENDING_RECORDS_DIR,
    cut_metrics,
    pending_record_path,
    step_record,
)
from services.trainer.step_report import StepReporter
from services.trainer.weight_sync import PublishReport, WeightPublisher
from services.wire.buffer_client import BufferClient, ClaimResult, VersionRegressionError

log = logging.getLogger(__name__)


def consumer_id(cfg: FlywheelConfig) -> str:
    return cfg.trainer.consumer_id or f"trainer-{cfg.experiment_name}-{cfg.trial_name}"


class TrainerLoop:
    """Runs on every rank; rank 0 additionally owns the buffer client, the publisher,
    the control state and the metrics."""

    def __init__(
        self,
        cfg: FlywheelConfig,
        trainer: PPOTrainer,
        *,
        paths: RunPaths,
        control: Control,
        io: IOLoop | None = None,
        buffer: BufferClient | None = None,
        publisher: WeightPublisher | None = None,
        metrics: TrainerMetrics | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_ready = on_ready
        self.trainer = trainer
        self.ctx = trainer.ctx
        self.paths = paths
        self.control = control
        self.io = io
        self.buffer = buffer
        self.publisher = publisher
        self.metrics = metrics
        self.reporter = StepReporter(cfg, paths, control, metrics) if self.ctx.is_main else None
        self.consumer = consumer_id(cfg)
        self.consumed_groups = 0
        self.consumed_trajectories = 0
        self.ledger = Ledger()  # against the buffer's acked_total (see ledger.py)
        self.last_batch_ids: list[str] = []
        self.last_saved_step = -1
        self._waiting_since: float | None = None
        self._replay_request_id: str | None = None
        self._pending: PendingStep | None = None  # rank 0: a publication in flight
        if self.ctx.is_main and (io is None or buffer is None):
            raise ValueError("rank 0 needs the I/O loop and a buffer client")

    # -- helpers of rank 0 -------------------------------------------------------------------
    def _io(self, coro: Any, timeout: float | None = None) -> Any:
        assert self.io is not None
        return self.io.run(coro, timeout)

    def _claim(self) -> ClaimResult:
        assert self.buffer is not None
        n = self.cfg.rollout.consumer_batch_size
        if self._replay_request_id is not None:
            rid, wait_ms = self._replay_request_id, 0
            self._replay_request_id = None
        else:
            rid, wait_ms = f"{self.consumer}:{uuid.uuid4().hex}", self.cfg.trainer.claim_wait_ms
            record_claim(self.paths.run_dir, rid, self.trainer.step + 1)
        return self._io(
            self.buffer.claim(n, consumer_id=self.consumer, wait_ms=wait_ms, request_id=rid),
            timeout=self.buffer.longest_call_s(self.buffer.timeout + wait_ms / 1000) + 30,
        )

    def _decide(self) -> tuple[dict[str, Any], ClaimResult | None]:
        """Rank 0: the next command for every rank (and the claimed batch for `train`)."""
        if self._pending is not None and self._pending.publication.done():
            self._finish_pending()
        total = self.cfg.total_train_steps
        if total is not None and self.trainer.step >= total:
            return {"op": "stop", "reason": "total_train_steps"}, None
        if self.control.stop_requested:
            return {"op": "stop", "reason": "requested"}, None
        if self.control.has_save_requests():
            return {"op": "save"}, None
        if self.control.paused:
            self.control.update(phase="paused")
            time.sleep(0.2)
            return {"op": "idle"}, None
        self.control.update(phase="waiting_for_data")
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        claimed = self._claim()
        if not claimed.groups:  # decoded (and validated) once, here, where a bad group fails
            waited = time.monotonic() - self._waiting_since
            if waited > self.cfg.trainer.batch_timeout:
                return {
                    "op": "fail",
                    "reason": f"no batch from the buffer for {waited:.0f}s "
                    f"(trainer.batch_timeout={self.cfg.trainer.batch_timeout})",
                }, None
            return {"op": "idle"}, None
        wait = time.monotonic() - self._waiting_since
        self._waiting_since = None
        return {"op": "train", "wait_batch": wait}, claimed

    def _broadcast_batch(self, claimed: ClaimResult | None) -> list[TrajectoryGroup]:
        """Every rank: the batch rank 0 claimed. Rank 0 decodes its messages once and sends
        them as they arrived; the other ranks decode the bytes once."""
        if self.ctx.world_size == 1:
            assert claimed is not None
            return claimed.groups
        payload = None
        if self.ctx.is_main:
            assert claimed is not None
            payload = buffer_pb2.ClaimResponse(groups=claimed.messages).SerializeToString()
        raw = broadcast_bytes(payload)
        if self.ctx.is_main:
            assert claimed is not None
            return claimed.groups
        return [group_from_proto(g) for g in buffer_pb2.ClaimResponse.FromString(raw).groups]

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Train until `total_train_steps`, Stop or SIGTERM; returns the exit code."""
        try:
            code, reason = self._run()
        except BaseException as exc:
            self._write_exit(1, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self.reporter is not None:
                self.reporter.close()
        self._write_exit(code, reason)
        return code

    def _write_exit(self, code: int, reason: str) -> None:
        if not self.ctx.is_main:
            return
        try:
            lifecycle.write_exit(
                self.paths,
                code=code,
                reason=reason,
                step=self.trainer.step,
                version=self.trainer.version,
            )
        except OSError:
            log.exception("could not write the exit record")

    def _complete(self) -> None:
        """Rank 0: the durable record that this run reached `total_train_steps`."""
        total = self.cfg.total_train_steps
        assert total is not None
        latest = ckpt.latest_checkpoint(self.paths.checkpoint_dir)
        path = lifecycle.write_completion(
            self.paths,
            step=self.trainer.step,
            version=self.trainer.version,
            total_train_steps=total,
            checkpoint=str(latest) if latest else None,
        )
        log.info(
            "run completed",
            extra={"step": self.trainer.step, "version": self.trainer.version, "record": str(path)},
        )

    def _run(self) -> tuple[int, str]:
        code, reason = 0, "requested"
        self._resume()
        if self.on_ready is not None:
            self.on_ready()
        while True:
            if self.ctx.is_main:
                try:
                    cmd, claimed = self._decide()
                except Exception as exc:  # noqa: BLE001 - tell the other ranks, then fail
                    log.exception("rank 0 could not get the next batch")
                    cmd, claimed = {"op": "fail", "reason": f"{type(exc).__name__}: {exc}"}, None
            else:
                cmd, claimed = None, None
            cmd = broadcast_json(cmd)
            op = cmd["op"]
            if op == "train":
                groups = self._broadcast_batch(claimed)
                self._train_step(groups, wait_batch=float(cmd.get("wait_batch", 0.0)))
            elif op == "save":
                futures = self.control.take_save_requests() if self.ctx.is_main else []
                self._save(futures)
            elif op == "idle":
                continue
            elif op == "stop":
                reason = str(cmd.get("reason"))
                log.info("trainer stopping", extra={"reason": reason})
                break
            elif op == "fail":
                reason = str(cmd.get("reason"))
                log.error("trainer failed", extra={"reason": reason})
                code = 1
                break
        if self.ctx.is_main and self._pending is not None:
            # The last step's weights reach the replicas (and its record the metrics) before
            # the run counts as complete: the launcher's final evaluation samples them.
            self._finish_pending()
        if self.ctx.is_main:  # every line written: no empty folder left in the run directory
            with contextlib.suppress(OSError):
                self.paths.metrics_jsonl.with_name(PENDING_RECORDS_DIR).rmdir()
        if code == 0 and self._should_save_on_exit():
            self._save([])
        if self.ctx.is_main:
            for fut in self.control.take_save_requests():
                fut.set_exception(RuntimeError("the trainer stopped before saving"))
            if code == 0 and reason == "total_train_steps":
                self._complete()
            self.control.update(phase="done")
        return code, reason

    def _should_save_on_exit(self) -> bool:
        t = self.cfg.trainer
        return (
            t.save_on_exit
            and t.save_freq_steps is not None
            and self.trainer.step > 0
            and self.last_saved_step != self.trainer.step
        )

    # -- one step ----------------------------------------------------------------------------
    def _dynamic_filter(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """DAPO dynamic sampling (`actor.dynamic_sampling` / `should_accept_fn`): groups whose
        rewards carry no signal are dropped from this step's batch, so its size varies. They
        are still acknowledged with the batch: consumed, not trained on. Every rank holds the
        same groups, so every rank keeps the same ones."""
        actor = self.cfg.actor
        if not (actor.dynamic_sampling or actor.should_accept_fn):
            return groups
        from services.core.filters import resolve_should_accept

        accept = resolve_should_accept(
            actor.should_accept_fn, dynamic_sampling=actor.dynamic_sampling
        )
        return [g for g in groups if accept(g)]  # services.api.GroupFilter: the group

    def _train_step(self, groups: list[TrajectoryGroup], *, wait_batch: float) -> None:
        t0 = time.perf_counter()
        ids = [g.group_id for g in groups]
        kept = self._dynamic_filter(groups)
        self.ledger.acked_groups += len(ids)  # before the checkpoint, which records it
        if not kept:  # nothing to learn from: consume the batch and claim the next one
            if self.ctx.is_main:
                self._ack(ids)
            log.info("every claimed group was filtered out", extra={"groups": len(ids)})
            return
        groups = kept
        if self.ctx.is_main:
            self.control.update(phase="training")
        result = self.trainer.train_batch(groups)
        self.last_batch_ids = ids
        self.consumed_groups += len(groups)
        self.consumed_trajectories += result.n_seqs
        phases = dict(result.phase_seconds)
        phases.pop("step", None)
        phases["wait_batch"] = wait_batch
        if self.ctx.is_main:  # before the checkpoint: see PENDING_RECORDS_DIR
            record = step_record(
                result,
                phases,
                ids,
                time.perf_counter() - t0,
                step=self.trainer.step,
                version=self.trainer.version,
            )
            path = pending_record_path(self.paths.metrics_jsonl, self.trainer.step)
            lifecycle.write_json_atomic(path, record)

        freq = self.cfg.trainer.save_freq_steps
        if freq is not None and self.trainer.step % freq == 0:
            t = time.perf_counter()
            self._save([])
            phases["checkpoint"] = time.perf_counter() - t

        sync = self.cfg.rollout.max_head_offpolicyness == 0
        publish = self.publisher is not None and self.publisher.enabled
        if self.ctx.is_main:
            t = time.perf_counter()
            if sync and publish:
                assert self.publisher is not None
                self._io(self.publisher.pause())
            self._ack(ids)
            self._set_buffer_version(self.trainer.version)
            phases["ack"] = time.perf_counter() - t
        # Whether to gather is decided from the config, identically on every rank.
        gather = bool(self.cfg.services.rollout.port)
        report = None
        publication: Future[PublishReport] | None = None
        if gather:
            if self.ctx.is_main:
                self.control.update(phase="broadcasting")
            t = time.perf_counter()
            sd = self.trainer.actor.full_state_dict(for_update=True)
            if self.ctx.is_main and publish:
                assert self.publisher is not None
                if not sync and self.cfg.trainer.overlap_weight_publication:
                    snap = snapshot_state_dict(sd)
                    phases["publish_wait"] = self._finish_pending()
                    publication = self._io_submit(
                        publish_and_probe(self.publisher, snap, self.trainer.version)
                    )
                else:
                    report = self._io(self.publisher.publish(sd, self.trainer.version))
                    if sync:
                        self._io(self.publisher.resume())
                    # The replicas decode again: probe that they compute what we do.
                    report = self._io(self.publisher.check_parity(sd, report))
            phases["broadcast"] = time.perf_counter() - t - phases.get("publish_wait", 0.0)
            del sd
        if not self.ctx.is_main:
            return
        if publication is not None:
            self._pending = PendingStep(
                publication=publication,
                result=result,
                phases=phases,
                ids=ids,
                step=self.trainer.step,
                version=self.trainer.version,
                step_seconds=time.perf_counter() - t0,
                wall_time=time.time(),
            )
        else:
            assert self.reporter is not None
            self.reporter.record(
                result,
                phases,
                ids,
                time.perf_counter() - t0,
                report,
                step=self.trainer.step,
                version=self.trainer.version,
            )

    def _io_submit(self, coro: Any) -> Future[Any]:
        assert self.io is not None
        return self.io.submit(coro)

    def _finish_pending(self) -> float:
        """Rank 0: wait for the publication in flight, if any, and write its step's record;
        returns the seconds waited. A publication that raised re-raises here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        t = time.perf_counter()
        report = pending.publication.result()
        waited = time.perf_counter() - t
        assert self.reporter is not None
        self.reporter.record(
            pending.result,
            pending.phases,
            pending.ids,
            pending.step_seconds,
            report,
            step=pending.step,
            version=pending.version,
            wall_time=pending.wall_time,
        )
        return waited

    def _ack(self, ids: list[str]) -> None:
        assert self.buffer is not None
        if ids:
            self._io(self.buffer.ack(ids, consumer_id=self.consumer))
            self.ledger.write(self.paths.run_dir, self.trainer.step)

    def _set_buffer_version(self, version: int) -> None:
        assert self.buffer is not None
        try:
            self._io(self.buffer.set_version(version, request_id=f"{self.consumer}:v{version}"))
        except VersionRegressionError as exc:
            log.warning(
                "buffer already at a higher version", extra={"want": version, "have": exc.current}
            )

    # -- checkpoints -------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "version": self.trainer.version,
            "seed": self.cfg.seed,
            "schedulers": self.trainer.scheduler_states(),
            "data_position": {
                "consumed_groups": self.consumed_groups,
                "consumed_trajectories": self.consumed_trajectories,
                "acked_groups": self.ledger.acked_groups,
                "acked_lost_with_crash": self.ledger.acked_lost_with_crash,
                "resumes": self.ledger.resumes,
            },
            "buffer": {
                "consumer_id": self.consumer,
                "last_batch_group_ids": self.last_batch_ids,
            },
            "world_size": self.ctx.world_size,
            "wall_time": time.time(),
        }

    def _save(self, futures: list[Future]) -> None:
        """Collective checkpoint (+ HF export); resolves rank 0's waiting SaveCheckpoint RPCs."""
        step = self.trainer.step
        if self.ctx.is_main:
            self.control.update(phase="checkpointing")
        try:
            path = ckpt.save_checkpoint(
                self.paths.checkpoint_dir,
                step,
                models=self.trainer.checkpoint_models(),
                trainer_state=self._trainer_state(),
                rank=self.ctx.rank,
                keep_last=self.cfg.trainer.keep_last_checkpoints,
            )
            if self.cfg.trainer.export_hf:
                sd = self.trainer.actor.full_state_dict()
                if self.ctx.is_main:
                    ckpt.export_hf(sd, self.trainer.actor_cfg.path, path / "hf")
        except Exception as exc:
            for f in futures:
                f.set_exception(exc)
            raise
        self.last_saved_step = step
        if self.ctx.is_main:
            saved = SavedCheckpoint(str(path), step, self.trainer.version)
            self.control.update(last_checkpoint=str(path), last_checkpoint_step=step)
            if self.metrics is not None:
                self.metrics.checkpoints.inc()
            for f in futures:
                f.set_result(saved)

    def _resume(self) -> None:
        """Load the latest checkpoint (`recover: auto`) and reconcile buffer and replicas."""
        latest = None
        if self.cfg.trainer.recover == "auto":
            latest = ckpt.latest_checkpoint(self.paths.checkpoint_dir)
        # Every rank must agree on the checkpoint (the directory may be seen late on NFS).
        name = broadcast_json(latest.name if (self.ctx.is_main and latest) else "")
        target_version = 0
        if name:
            state = ckpt.load_checkpoint(
                self.paths.checkpoint_dir / name,
                models=self.trainer.checkpoint_models(),
                rank=self.ctx.rank,
            )
            self.trainer.load_scheduler_states(state["schedulers"])
            self.trainer.step = int(state["step"])
            self.trainer.version = int(state["version"])
            pos = state.get("data_position", {})
            self.consumed_groups = int(pos.get("consumed_groups", 0))
            self.consumed_trajectories = int(pos.get("consumed_trajectories", 0))
            # A checkpoint from before the ledger: every consumed group was trained.
            self.ledger.acked_groups = int(pos.get("acked_groups", self.consumed_groups))
            self.ledger.acked_lost_with_crash = int(pos.get("acked_lost_with_crash", 0))
            self.ledger.resumes = int(pos.get("resumes", 0))
            self.last_batch_ids = list(state.get("buffer", {}).get("last_batch_group_ids", []))
            self.last_saved_step = self.trainer.step
            target_version = self.trainer.version
            if self.ctx.is_main:
                self.control.update(
                    last_checkpoint=str(self.paths.checkpoint_dir / name),
                    last_checkpoint_step=self.trainer.step,
                )
        needs_push = False
        if self.ctx.is_main:
            assert self.buffer is not None
            self.paths.run_dir.mkdir(parents=True, exist_ok=True)
            previous_life = bool(name)
            in_flight = claim_in_flight(self.paths.run_dir)
            if self.cfg.trainer.recover == "auto" and in_flight is not None:
                self._replay_request_id = in_flight
                previous_life = True  # a trainer of this run claimed, perhaps before a checkpoint
            if self.last_batch_ids:
                self._ack(self.last_batch_ids)  # the crash may have come before the ack
            if previous_life:
                buffer_acked = int(self._io(self.buffer.stats()).acked_total)
                self.ledger.reconcile(buffer_acked, name)
                self.ledger.write(self.paths.run_dir, self.trainer.step)
            target_version, replicas = self._resume_version(target_version)
            if target_version > 0:
                self._set_buffer_version(target_version)
            stale = [a for a, v in replicas.items() if v is None or v != target_version]
            needs_push = bool(stale) and target_version > 0
            cut_metrics(self.paths.metrics_jsonl, self.trainer.step)
        target_version = int(broadcast_json(target_version))
        needs_push = bool(broadcast_json(needs_push))
        # Every rank's checkpoints carry the same ledger.
        self.ledger.acked_lost_with_crash, self.ledger.resumes = broadcast_json(
            [self.ledger.acked_lost_with_crash, self.ledger.resumes]
        )
        self.trainer.version = target_version
        if needs_push:
            sd = self.trainer.actor.full_state_dict(for_update=True)
            if self.ctx.is_main:
                assert self.publisher is not None
                report = self._io(self.publisher.publish(sd, target_version))
                log.info(
                    "restored weights published",
                    extra={"version": target_version, "failed": sorted(report.failed)},
                )
        if self.ctx.is_main:
            self.control.update(step=self.trainer.step, version=self.trainer.version)
            if name:
                log.info(
                    "resumed",
                    extra={
                        "step": self.trainer.step,
                        "version": self.trainer.version,
                        "checkpoint": name,
                    },
                )

    def _resume_version(self, version: int) -> tuple[int, dict[str, int | None]]:
        """Rank 0: the version of the restored weights (`resume.resume_version`), and each
        replica's version now."""
        assert self.buffer is not None
        replicas: dict[str, int | None] = {}
        if self.publisher is not None and self.publisher.enabled:
            replicas = self._io(self.publisher.versions())
        have = self._io(self.buffer.get_version())
        return resume_version(version, have, replicas), replicas
