"""The service loop around `PPOTrainer`: claim, train, checkpoint, ack, version, publish.

Rank 0 decides what happens next and tells the other ranks with one small JSON command
per iteration (`train`, `save`, `idle`, `stop`); a `train` command is followed by the
claimed groups as protobuf bytes, so every rank trains on exactly the same batch.

Order of one step (rank 0's side in brackets):
  claim [buffer] -> train (all ranks) -> checkpoint if due (all ranks)
  -> [pause rollouts if eta = 0] -> [ack] -> [buffer version v+1]
  -> gather full weights (all ranks) -> [publish to every replica] -> [resume rollouts]
  -> metrics line.
The checkpoint is written before the ack and records the batch's group ids, so a crash
between the two is repaired on resume by acknowledging them again (acks are idempotent).
With eta > 0 and `trainer.overlap_weight_publication` (the default), rank 0 copies the
gathered weights and publishes them on the I/O loop while every rank goes on to the next
claim and step; the next publication first waits for this one (phase `publish_wait`), and
the step's metrics line is written once its publication is complete (a copy waits in
`metrics.pending/` from before the step's checkpoint until then; resume step 5 restores the
lines of checkpointed steps from it). A crash with a publication in flight is covered by
resume step 3: the replicas may or may not serve that version, and the restored weights get
a version above both.

Resume (`trainer.recover: auto`), in this order, before the first claim:
1. load the latest checkpoint: step s, version v_ckpt, weights, optimizer, schedulers, RNG;
2. acknowledge the checkpoint's own batch again (the crash may have come before its ack);
3. choose the version: v_ckpt, unless the buffer or a rollout replica has seen a higher one
   (the dead trainer went on past the checkpoint and published its weights). Then the
   restored weights get v = max(buffer, replicas) + 1: versions never repeat, so a version
   tag names one set of weights, and every token already generated or being generated has
   v_behave < v;
4. set that version on the buffer and publish the restored weights to every replica that
   does not serve it;
5. cut `metrics.jsonl` back to step s: the records of steps trained after the checkpoint
   move to `metrics.lost.jsonl` (their weights are gone; the step numbers are trained again);
6. repeat the claim that was in flight when the old process died (its request id is kept
   in `<run_dir>/trainer_claim.json`): the buffer hands back those groups that are still
   fresh at v (v - v_behave <= eta) and drops the others as stale, so they are trained once
   and within the bound, without waiting for the buffer's idle-time redelivery.
Groups acknowledged after the checkpoint were trained by weights that are gone: they stay
acknowledged (the buffer's ledger counts them once) and are never served again; that is the
cost of a checkpoint interval, and `save_freq_steps` bounds it. The resumed trainer counts
them: the checkpoint records how many groups its weights account for (`acked_groups`: every
claimed batch up to and including its own, trained or filtered out), and the buffer's
`acked_total` minus that (and minus earlier crashes' count) is `acked_lost_with_crash`,
logged and kept in `<run_dir>/ledger.json` (`LEDGER_FILE`; the launcher's `summary.json`
shows it beside the buffer's count), so the two ledgers match after every resume.

A run that reached `total_train_steps` writes `completed.json` next to its checkpoints
(see `lifecycle.py`); every exit writes `<run_dir>/trainer_exit.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel_proto.v1 import buffer_pb2
from services.buffer.client import BufferClient, VersionRegressionError
from services.common.codec import group_from_proto, group_to_proto
from services.common.config import FlywheelConfig
from services.core.types import TrajectoryGroup
from services.trainer import checkpoint as ckpt
from services.trainer import lifecycle
from services.trainer.control import Control, SavedCheckpoint
from services.trainer.dist import broadcast_bytes, broadcast_json
from services.trainer.io_loop import IOLoop
from services.trainer.metrics import JsonlWriter, TrainerMetrics
from services.trainer.paths import RunPaths
from services.trainer.ppo import PPOTrainer, StepResult
from services.trainer.tracking import Tracker
from services.trainer.weight_sync import PublishReport, WeightPublisher

log = logging.getLogger(__name__)

CLAIM_FILE = "trainer_claim.json"
LOST_METRICS_FILE = "metrics.lost.jsonl"
LEDGER_FILE = "ledger.json"
PENDING_RECORDS_DIR = "metrics.pending"
"""Next to `metrics.jsonl`: one JSON file per trained step whose line is not written yet (it
waits for the step's publication). Written before the step's checkpoint, so a trainer that
dies with the line unwritten leaves it here, and the resumed one restores the lines of the
steps its checkpoint holds (`_cut_metrics`)."""
INTERRUPTED_PUBLICATION = "interrupted: the trainer stopped before the replicas confirmed it"


def consumer_id(cfg: FlywheelConfig) -> str:
    return cfg.trainer.consumer_id or f"trainer-{cfg.experiment_name}-{cfg.trial_name}"


@dataclass
class _PendingStep:
    """A trained step whose weights are being published in the background
    (`trainer.overlap_weight_publication`): its record waits for the publication's report."""

    publication: Future[PublishReport]
    result: StepResult
    phases: dict[str, float]
    ids: list[str]
    step: int
    version: int
    step_seconds: float
    wall_time: float


def snapshot_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `sd`'s tensors: a gathered state dict may share storage with the live
    parameters (one rank, CPU), which the next optimizer step overwrites in place while a
    background publication still reads them."""
    return {k: t.detach().clone() for k, t in sd.items()}


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
        self.jsonl = JsonlWriter(paths.metrics_jsonl) if self.ctx.is_main else None
        self.tracker = Tracker(cfg, paths.run_dir) if self.ctx.is_main else None
        self.consumer = consumer_id(cfg)
        self.consumed_groups = 0
        self.consumed_trajectories = 0
        # The ledger against the buffer's acked_total (see the module docstring).
        self.acked_groups = 0
        self.acked_lost_with_crash = 0
        self.resumes = 0
        self._reconciled: dict[str, Any] = {}  # this process's reconciliation, if any
        self.last_batch_ids: list[str] = []
        self.last_saved_step = -1
        self._waiting_since: float | None = None
        self._replay_request_id: str | None = None
        self._pending: _PendingStep | None = None  # rank 0: a publication in flight
        if self.ctx.is_main and (io is None or buffer is None):
            raise ValueError("rank 0 needs the I/O loop and a buffer client")

    # -- helpers of rank 0 -------------------------------------------------------------------
    def _io(self, coro: Any, timeout: float | None = None) -> Any:
        assert self.io is not None
        return self.io.run(coro, timeout)

    def _record_claim(self, request_id: str) -> None:
        path = self.paths.run_dir / CLAIM_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"request_id": request_id, "step": self.trainer.step + 1}))
        os.replace(tmp, path)

    def _claim(self) -> list[TrajectoryGroup]:
        assert self.buffer is not None
        n = self.cfg.rollout.consumer_batch_size
        if self._replay_request_id is not None:
            rid, wait_ms = self._replay_request_id, 0
            self._replay_request_id = None
        else:
            rid, wait_ms = f"{self.consumer}:{uuid.uuid4().hex}", self.cfg.trainer.claim_wait_ms
            self._record_claim(rid)
        result = self._io(
            self.buffer.claim(n, consumer_id=self.consumer, wait_ms=wait_ms, request_id=rid),
            timeout=self.buffer.longest_call_s(self.buffer.timeout + wait_ms / 1000) + 30,
        )
        return result.groups

    def _decide(self) -> tuple[dict[str, Any], bytes | None]:
        """Rank 0: the next command for every rank (and the batch bytes for `train`)."""
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
        groups = self._claim()
        if not groups:
            waited = time.monotonic() - self._waiting_since
            if waited > self.cfg.trainer.batch_timeout:
                return {
                    "op": "fail",
                    "reason": f"no batch from the buffer for {waited:.0f}s "
                    f"(trainer.batch_timeout={self.cfg.trainer.batch_timeout})",
                }, None
            return {"op": "idle"}, None
        payload = buffer_pb2.ClaimResponse(
            groups=[group_to_proto(g) for g in groups]
        ).SerializeToString()
        wait = time.monotonic() - self._waiting_since
        self._waiting_since = None
        return {"op": "train", "wait_batch": wait}, payload

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Train until `total_train_steps`, Stop or SIGTERM; returns the exit code."""
        try:
            code, reason = self._run()
        except BaseException as exc:
            self._write_exit(1, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self.tracker is not None:
                self.tracker.close()
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
                    cmd, payload = self._decide()
                except Exception as exc:  # noqa: BLE001 - tell the other ranks, then fail
                    log.exception("rank 0 could not get the next batch")
                    cmd, payload = {"op": "fail", "reason": f"{type(exc).__name__}: {exc}"}, None
            else:
                cmd, payload = None, None
            cmd = broadcast_json(cmd)
            op = cmd["op"]
            if op == "train":
                raw = broadcast_bytes(payload)
                msg = buffer_pb2.ClaimResponse.FromString(raw)
                groups = [group_from_proto(g) for g in msg.groups]
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
        from services.trainer.algorithms.config_adapters import should_accept_from_config

        accept = should_accept_from_config(actor)
        return [g for g in groups if accept(g)]  # services.api.GroupFilter: the group

    def _train_step(self, groups: list[TrajectoryGroup], *, wait_batch: float) -> None:
        t0 = time.perf_counter()
        ids = [g.group_id for g in groups]
        kept = self._dynamic_filter(groups)
        self.acked_groups += len(ids)  # before the checkpoint, which records it
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
            record = self._step_record(result, phases, ids, time.perf_counter() - t0)
            lifecycle.write_json_atomic(self._pending_record_path(self.trainer.step), record)

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
            sd = self.trainer.actor.full_state_dict()
            if self.ctx.is_main and publish:
                assert self.publisher is not None
                if not sync and self.cfg.trainer.overlap_weight_publication:
                    snap = snapshot_state_dict(sd)
                    phases["publish_wait"] = self._finish_pending()
                    publication = self._io_submit(
                        self._publish_and_probe(snap, self.trainer.version)
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
            self._pending = _PendingStep(
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
            self._record_step(result, phases, ids, time.perf_counter() - t0, report)

    def _io_submit(self, coro: Any) -> Future[Any]:
        assert self.io is not None
        return self.io.submit(coro)

    async def _publish_and_probe(self, sd: dict[str, torch.Tensor], version: int) -> PublishReport:
        """The asynchronous-mode publication of `sd` as `version`, run on the I/O loop while
        the main thread trains on; the parity probe follows as it does inline."""
        assert self.publisher is not None
        report = await self.publisher.publish(sd, version)
        return await self.publisher.check_parity(sd, report)

    def _finish_pending(self) -> float:
        """Rank 0: wait for the publication in flight, if any, and write its step's record;
        returns the seconds waited. A publication that raised re-raises here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        t = time.perf_counter()
        report = pending.publication.result()
        waited = time.perf_counter() - t
        self._record_step(
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
            self._write_ledger()

    def _write_ledger(self) -> None:
        """Rank 0: `<run_dir>/ledger.json`, the trainer's side of the acknowledgement ledger:
        groups the live weights account for plus those lost with dead trainers equal the
        buffer's acked_total (the launcher compares them in `summary.json`)."""
        lifecycle.write_json_atomic(
            self.paths.run_dir / LEDGER_FILE,
            {
                "step": self.trainer.step,
                "trainer_acked": self.acked_groups,
                "acked_lost_with_crash": self.acked_lost_with_crash,
                "resumes": self.resumes,
                **self._reconciled,
            },
        )

    def _set_buffer_version(self, version: int) -> None:
        assert self.buffer is not None
        try:
            self._io(self.buffer.set_version(version, request_id=f"{self.consumer}:v{version}"))
        except VersionRegressionError as exc:
            log.warning(
                "buffer already at a higher version", extra={"want": version, "have": exc.current}
            )

    def _record_step(
        self,
        r: StepResult,
        phases: dict[str, float],
        ids: list[str],
        step_seconds: float,
        report: Any,
        *,
        step: int | None = None,
        version: int | None = None,
        wall_time: float | None = None,
    ) -> None:
        """Rank 0: the step's record (metrics.jsonl, tracking, Prometheus, control). `step`,
        `version` and `wall_time` are the step's own when it is recorded after a background
        publication; by default the trainer's current ones."""
        step = self.trainer.step if step is None else step
        version = self.trainer.version if version is None else version
        record = self._step_record(
            r, phases, ids, step_seconds, step=step, version=version, wall_time=wall_time
        )
        if report is not None:
            record["weight_broadcast_seconds"] = report.seconds
            record["replicas_updated"] = len(report.updated)
            record["replicas_failed"] = sorted(report.failed)
        assert self.jsonl is not None
        self.jsonl.write(record)
        self._pending_record_path(step).unlink(missing_ok=True)
        if self.tracker is not None:
            self.tracker.log(record)
        if self.metrics is not None:
            self.metrics.observe_step(record)
            if report is not None:
                self.metrics.broadcast_seconds.labels(transport=report.transport).observe(
                    report.seconds
                )
                self.metrics.unhealthy.inc(len(report.failed))
        skipped = self.control.skipped_updates + r.skipped_updates
        unhealthy = self.control.unhealthy_replica_updates + (len(report.failed) if report else 0)
        self.control.update(skipped_updates=skipped, unhealthy_replica_updates=unhealthy)
        self.control.finish_step(
            step=step,
            version=version,
            stats={k: v for k, v in r.stats.items() if isinstance(v, float)}
            | {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr},
        )
        if step % self.cfg.trainer.log_every_steps == 0:
            log.info(
                "step",
                extra={
                    "step": step,
                    "version": version,
                    "loss": round(r.loss, 5),
                    "task_reward": r.stats.get("task_reward"),
                    "seconds": round(step_seconds, 3),
                },
            )

    def _pending_record_path(self, step: int) -> Path:
        return self.paths.metrics_jsonl.with_name(PENDING_RECORDS_DIR) / f"step-{step:08d}.json"

    def _step_record(
        self,
        r: StepResult,
        phases: dict[str, float],
        ids: list[str],
        step_seconds: float,
        *,
        step: int | None = None,
        version: int | None = None,
        wall_time: float | None = None,
    ) -> dict[str, Any]:
        """The step's line of `metrics.jsonl` without the publication's fields."""
        step = self.trainer.step if step is None else step
        version = self.trainer.version if version is None else version
        train_s = phases.get("train", 0.0)
        record: dict[str, Any] = {
            "step": step,
            "version": version,
            "task_reward": r.stats.get("task_reward"),
            "staleness_max": r.stats.get("staleness_max", 0.0),
            "staleness_avg": r.stats.get("staleness_avg", 0.0),
            "importance_weight": r.stats.get("importance_weight/avg"),
            "behave_imp_weight": r.stats.get("behave_imp_weight/avg"),
            "no_eos_ratio": r.stats.get("no_eos_ratio"),
            "loss": r.loss,
            "losses": r.minibatch_losses,
            "grad_norm": r.grad_norm,
            "lr": r.lr,
            "samples": r.n_seqs,
            "tokens": r.n_tokens,
            "tokens_per_second": r.n_tokens / train_s if train_s > 0 else 0.0,
            "skipped_updates": r.skipped_updates,
            "prox_forwards": r.prox_forwards,
            "step_seconds": step_seconds,
            "phase_seconds": phases,
            "group_ids": ids,
            "staleness_per_seq": r.staleness_per_seq,
            "stats": r.stats,
            "wall_time": time.time() if wall_time is None else wall_time,
        }
        if r.critic_loss is not None:
            record["critic_loss"] = r.critic_loss
        return record

    # -- checkpoints -------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "version": self.trainer.version,
            "seed": self.cfg.seed,
            "schedulers": self.trainer.scheduler_states(),
            "data_position": {
                "consumed_groups": self.consumed_groups,
                "consumed_trajectories": self.consumed_trajectories,
                "acked_groups": self.acked_groups,
                "acked_lost_with_crash": self.acked_lost_with_crash,
                "resumes": self.resumes,
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
            self.acked_groups = int(pos.get("acked_groups", self.consumed_groups))
            self.acked_lost_with_crash = int(pos.get("acked_lost_with_crash", 0))
            self.resumes = int(pos.get("resumes", 0))
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
            claim_file = self.paths.run_dir / CLAIM_FILE
            previous_life = bool(name)
            if self.cfg.trainer.recover == "auto" and claim_file.is_file():
                self._replay_request_id = json.loads(claim_file.read_text()).get("request_id")
                previous_life = True  # a trainer of this run claimed, perhaps before a checkpoint
            if self.last_batch_ids:
                self._ack(self.last_batch_ids)  # the crash may have come before the ack
            if previous_life:
                self._reconcile_ledger(name)
            target_version, replicas = self._resume_version(target_version)
            if target_version > 0:
                self._set_buffer_version(target_version)
            stale = [a for a, v in replicas.items() if v is None or v != target_version]
            needs_push = bool(stale) and target_version > 0
            self._cut_metrics(self.trainer.step)
        target_version = int(broadcast_json(target_version))
        needs_push = bool(broadcast_json(needs_push))
        # Every rank's checkpoints carry the same ledger.
        self.acked_lost_with_crash, self.resumes = broadcast_json(
            [self.acked_lost_with_crash, self.resumes]
        )
        self.trainer.version = target_version
        if needs_push:
            sd = self.trainer.actor.full_state_dict()
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

    def _reconcile_ledger(self, checkpoint: str) -> None:
        """Rank 0, on resume: the groups the buffer counts as acknowledged beyond what the
        restored weights account for were acknowledged by the dead trainer after its last
        checkpoint (trained by weights that are gone). Counted as `acked_lost_with_crash`,
        logged, and written to the ledger file; a buffer short of the checkpoint's count
        (Redis lost acknowledgements) is logged as an error and recorded too."""
        assert self.buffer is not None
        buffer_acked = int(self._io(self.buffer.stats()).acked_total)
        diff = buffer_acked - self.acked_groups - self.acked_lost_with_crash
        self.resumes += 1
        self.acked_lost_with_crash += max(diff, 0)
        self._reconciled = {
            "buffer_acked_at_resume": buffer_acked,
            "resumed_from": checkpoint or None,
            "lost_this_crash": max(diff, 0),
        }
        if diff < 0:
            self._reconciled["buffer_short_by"] = -diff
            log.error(
                "the buffer counts fewer acknowledged groups than the checkpoint accounts for "
                "(Redis lost acknowledgements)",
                extra={"buffer_acked": buffer_acked, "checkpoint_acked": self.acked_groups},
            )
        log.warning(
            "ledger reconciled with the buffer after a crash",
            extra={
                "checkpoint_acked": self.acked_groups,
                "buffer_acked": buffer_acked,
                "acked_lost_with_crash": self.acked_lost_with_crash,
                "lost_this_crash": max(diff, 0),
            },
        )
        self._write_ledger()

    def _resume_version(self, version: int) -> tuple[int, dict[str, int | None]]:
        """Rank 0: the version of the restored weights, and each replica's version now.

        The checkpoint's version, unless the buffer or a replica has seen a higher one: the
        dead trainer trained and published past its last checkpoint, and those weights are
        gone. Reusing their numbers would give two sets of weights one tag and leave tokens
        with v_behave > v; the restored weights get the next unused version instead."""
        assert self.buffer is not None
        replicas: dict[str, int | None] = {}
        if self.publisher is not None and self.publisher.enabled:
            replicas = self._io(self.publisher.versions())
        have = self._io(self.buffer.get_version())
        seen = max([have, *(v for v in replicas.values() if v is not None)])
        if seen > version:
            log.warning(
                "the buffer or a replica is ahead of the checkpoint (the dead trainer went on "
                "past it); the restored weights get a new version",
                extra={
                    "checkpoint_version": version,
                    "buffer_version": have,
                    "replica_versions": replicas,
                    "version": seen + 1,
                },
            )
            version = seen + 1
        return version, replicas

    def _take_pending_records(
        self, step: int, seen: set[int], keep: list[str], lost: list[str]
    ) -> None:
        """Move the dead trainer's unwritten lines into `keep` (steps up to `step` not yet
        in `metrics.jsonl`) or `lost` (steps after it), and clear the directory."""
        folder = self.paths.metrics_jsonl.with_name(PENDING_RECORDS_DIR)
        restored = False
        for f in sorted(folder.glob("step-*.json")) if folder.is_dir() else []:
            try:
                record = json.loads(f.read_text())
            except ValueError:  # cut short by the crash: that step's checkpoint is not there
                record = None
            new = (
                isinstance(record, dict)
                and isinstance(record.get("step"), int)
                and record["step"] not in seen
            )
            if new:
                assert isinstance(record, dict)
                record["publication"] = INTERRUPTED_PUBLICATION
                if record["step"] <= step:
                    keep.append(json.dumps(record))
                    restored = True
                else:
                    lost.append(json.dumps(record))
            f.unlink(missing_ok=True)
        if restored:
            keep.sort(key=lambda x: json.loads(x).get("step", 0))

    def _cut_metrics(self, step: int) -> None:
        """Rank 0: `metrics.jsonl` keeps the steps up to the resumed one, each once; records
        of steps after it (trained by weights that are gone) move to `metrics.lost.jsonl`.
        A step the checkpoint holds whose line the dead trainer never wrote (its publication
        was in flight) gets it from `PENDING_RECORDS_DIR`, marked as interrupted."""
        path = self.paths.metrics_jsonl
        keep: list[str] = []
        lost: list[str] = []
        lines = [x for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
        seen: set[int] = set()
        for line in lines:
            try:
                record_step = json.loads(line).get("step")
            except ValueError:  # a line cut short by the crash
                continue
            if isinstance(record_step, int):
                seen.add(record_step)
            (lost if isinstance(record_step, int) and record_step > step else keep).append(line)
        self._take_pending_records(step, seen, keep, lost)
        if keep == lines and not lost:
            return
        lost_groups = sum(len(json.loads(x).get("group_ids", [])) for x in lost)
        with open(path.with_name(LOST_METRICS_FILE), "a") as fh:
            fh.writelines(x + "\n" for x in lost)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)
        if lost:
            log.warning(
                "steps after the checkpoint were lost with the old trainer; they are trained "
                "again (their groups stay acknowledged)",
                extra={
                    "resumed_at_step": step,
                    "lost_steps": [json.loads(x).get("step") for x in lost],
                    "lost_groups": lost_groups,
                    "moved_to": str(path.with_name(LOST_METRICS_FILE)),
                },
            )
