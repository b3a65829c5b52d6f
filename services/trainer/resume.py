"""How a restarted trainer picks up where the dead one stopped (`trainer.recover: auto`).

`TrainerLoop` resumes in this order, before the first claim:
1. load the latest checkpoint: step s, version v_ckpt, weights, optimizer, schedulers, RNG;
2. acknowledge the checkpoint's own batch again (the crash may have come before its ack);
3. choose the version (`resume_version`): v_ckpt, unless the buffer or a rollout replica has
   seen a higher one (the dead trainer went on past the checkpoint and published its
   weights). Then the restored weights get v = max(buffer, replicas) + 1: versions never
   repeat, so a version tag names one set of weights, and every token already generated or
   being generated has v_behave < v;
4. set that version on the buffer and publish the restored weights to every replica that
   does not serve it;
5. cut `metrics.jsonl` back to step s (`step_records.cut_metrics`): the records of steps
   trained after the checkpoint move to `metrics.lost.jsonl` (their weights are gone; the
   step numbers are trained again);
6. repeat the claim that was in flight when the old process died (its request id is kept
   in `<run_dir>/trainer_claim.json`, `CLAIM_FILE`): the buffer hands back those groups that
   are still fresh at v (v - v_behave <= eta) and drops the others as stale, so they are
   trained once and within the bound, without waiting for the buffer's idle-time redelivery.
Groups acknowledged after the checkpoint stay acknowledged and are counted by the ledger
(`ledger.py`); `save_freq_steps` bounds how many a crash can cost.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CLAIM_FILE = "trainer_claim.json"


def record_claim(run_dir: Path, request_id: str, step: int) -> None:
    """Keep the request id of the claim about to be made, for step 6 of a later resume."""
    path = run_dir / CLAIM_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"request_id": request_id, "step": step}))
    os.replace(tmp, path)


def claim_in_flight(run_dir: Path) -> str | None:
    """The request id of the dead trainer's last claim; None when no trainer of this run
    has claimed yet."""
    path = run_dir / CLAIM_FILE
    if not path.is_file():
        return None
    request_id = json.loads(path.read_text()).get("request_id")
    return str(request_id) if request_id is not None else None


def resume_version(version: int, buffer_version: int, replicas: dict[str, int | None]) -> int:
    """The version of the restored weights: the checkpoint's `version`, unless the buffer or
    a replica has seen a higher one. The dead trainer then trained and published past its
    last checkpoint, and those weights are gone; reusing their numbers would give two sets of
    weights one tag and leave tokens with v_behave > v, so the restored weights get the next
    unused version instead."""
    seen = max([buffer_version, *(v for v in replicas.values() if v is not None)])
    if seen <= version:
        return version
    log.warning(
        "the buffer or a replica is ahead of the checkpoint (the dead trainer went on "
        "past it); the restored weights get a new version",
        extra={
            "checkpoint_version": version,
            "buffer_version": buffer_version,
            "replica_versions": replicas,
            "version": seen + 1,
        },
    )
    return seen + 1
