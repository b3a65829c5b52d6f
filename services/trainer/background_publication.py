"""A step's weights published on the I/O loop while the next step trains.

With eta > 0 and `trainer.overlap_weight_publication` (the default), rank 0 copies the
gathered weights and publishes them in the background while every rank goes on to the next
claim and step; the next publication first waits for this one (phase `publish_wait`), and the
step's line of `metrics.jsonl` is written once its publication is complete (a copy waits in
`step_records.PENDING_RECORDS_DIR` meanwhile). A crash with a publication in flight is covered
by the resume's choice of version: the replicas may or may not serve that version, and the
restored weights get a version above both.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from services.trainer.ppo import StepResult
from services.trainer.weight_sync import PublishReport, WeightPublisher


@dataclass
class PendingStep:
    """A trained step whose weights are being published in the background: its record waits
    for the publication's report."""

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


async def publish_and_probe(
    publisher: WeightPublisher, sd: dict[str, torch.Tensor], version: int
) -> PublishReport:
    """The publication of `sd` as `version`, run on the I/O loop while the main thread trains
    on; the parity probe follows as it does inline."""
    report = await publisher.publish(sd, version)
    return await publisher.check_parity(sd, report)
