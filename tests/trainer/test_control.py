"""Control state shared by the servicer and the loop: requests are kept and deduplicated."""

from __future__ import annotations

import pytest

from services.trainer.control import Control, SavedCheckpoint


def test_save_requests_are_deduplicated_by_request_id() -> None:
    c = Control(total_train_steps=5, world_size=2)
    f1 = c.request_save("a")
    assert c.request_save("a") is f1  # a retry waits on the same checkpoint
    f2 = c.request_save("")  # no id: always a new request
    assert c.has_save_requests()
    taken = c.take_save_requests()
    assert taken == [f1, f2] and not c.has_save_requests()
    f1.set_result(SavedCheckpoint("/x", 3, 3))
    assert c.request_save("a").result() == SavedCheckpoint("/x", 3, 3)


def test_snapshot_and_update() -> None:
    c = Control(total_train_steps=None, world_size=1)
    c.set_paused(True)
    c.finish_step(step=2, version=2, stats={"loss": 0.5})
    s = c.snapshot()
    assert (s["step"], s["version"], s["paused"], s["total_train_steps"]) == (2, 2, True, 0)
    assert s["last_stats"] == {"loss": 0.5} and s["last_step_unix"] > 0
    with pytest.raises(AttributeError, match="no field"):
        c.update(nonsense=1)
