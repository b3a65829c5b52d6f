"""The trainer's side of the acknowledgement ledger, so that a crash loses no count.

Groups acknowledged after the last checkpoint were trained by weights that are gone: they
stay acknowledged (the buffer's ledger counts them once) and are never served again. The
checkpoint records how many groups its weights account for (`acked_groups`: every claimed
batch up to and including its own, trained or filtered out); on resume, the buffer's
`acked_total` minus that (and minus earlier crashes' count) is `acked_lost_with_crash`,
logged and kept in `<run_dir>/ledger.json` (`LEDGER_FILE`; the launcher's `summary.json`
shows it beside the buffer's count), so the two ledgers match after every resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.trainer import lifecycle

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.json"


@dataclass
class Ledger:
    """Counts of acknowledged groups, kept in every checkpoint's `data_position`."""

    acked_groups: int = 0
    """Groups the live weights account for: every claimed batch, trained or filtered out."""
    acked_lost_with_crash: int = 0
    """Groups acknowledged by dead trainers after their last checkpoint."""
    resumes: int = 0
    reconciled: dict[str, Any] = field(default_factory=dict)
    """This process's reconciliation with the buffer, if any (written to the file)."""

    def reconcile(self, buffer_acked: int, checkpoint: str) -> None:
        """On resume: the groups the buffer counts as acknowledged beyond what the restored
        weights account for were acknowledged by the dead trainer after its last checkpoint.
        A buffer short of the checkpoint's count (Redis lost acknowledgements) is logged as
        an error and recorded too."""
        diff = buffer_acked - self.acked_groups - self.acked_lost_with_crash
        self.resumes += 1
        self.acked_lost_with_crash += max(diff, 0)
        self.reconciled = {
            "buffer_acked_at_resume": buffer_acked,
            "resumed_from": checkpoint or None,
            "lost_this_crash": max(diff, 0),
        }
        if diff < 0:
            self.reconciled["buffer_short_by"] = -diff
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

    def write(self, run_dir: Path, step: int) -> None:
        """`<run_dir>/ledger.json`: groups the live weights account for plus those lost with
        dead trainers equal the buffer's acked_total (the launcher compares them in
        `summary.json`)."""
        lifecycle.write_json_atomic(
            run_dir / LEDGER_FILE,
            {
                "step": step,
                "trainer_acked": self.acked_groups,
                "acked_lost_with_crash": self.acked_lost_with_crash,
                "resumes": self.resumes,
                **self.reconciled,
            },
        )
