"""The trainer's acknowledgement ledger across crashes (services/trainer/ledger.py)."""

from __future__ import annotations

import json
from pathlib import Path

from services.trainer.ledger import LEDGER_FILE, Ledger


def test_groups_acked_after_the_checkpoint_are_counted_once_per_crash(tmp_path: Path) -> None:
    # The checkpoint accounts for 12 groups; the buffer has acknowledged 20, so the dead
    # trainer acknowledged 20 - 12 - 0 = 8 groups after it.
    ledger = Ledger(acked_groups=12)
    ledger.reconcile(buffer_acked=20, checkpoint="step-00000003")
    assert (ledger.acked_lost_with_crash, ledger.resumes) == (8, 1)
    # A second crash: the same checkpoint's 12 groups plus 4 more trained and checkpointed
    # (16), and the buffer at 30: 30 - 16 - 8 = 6 more lost, 14 in all.
    ledger.acked_groups = 16
    ledger.reconcile(buffer_acked=30, checkpoint="step-00000004")
    assert (ledger.acked_lost_with_crash, ledger.resumes) == (14, 2)
    ledger.write(tmp_path, step=4)
    written = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert written == {
        "step": 4,
        "trainer_acked": 16,
        "acked_lost_with_crash": 14,
        "resumes": 2,
        "buffer_acked_at_resume": 30,
        "resumed_from": "step-00000004",
        "lost_this_crash": 6,
    }
    # The two ledgers match: trained + lost = the buffer's count.
    assert written["trainer_acked"] + written["acked_lost_with_crash"] == 30


def test_a_buffer_short_of_the_checkpoint_is_recorded_not_subtracted() -> None:
    # Redis lost acknowledgements: the buffer counts 10, the checkpoint accounts for 12.
    ledger = Ledger(acked_groups=12)
    ledger.reconcile(buffer_acked=10, checkpoint="")
    assert ledger.acked_lost_with_crash == 0
    assert ledger.reconciled == {
        "buffer_acked_at_resume": 10,
        "resumed_from": None,
        "lost_this_crash": 0,
        "buffer_short_by": 2,
    }
