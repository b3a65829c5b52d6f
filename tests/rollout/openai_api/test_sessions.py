"""Session records and trajectory export (services/rollout/openai_api/sessions.py).

The export layout is AReaL 2.0's (areal/experimental/openai): `concat` puts an episode's
calls into one sequence with only sampled tokens in the loss and turn ids on them;
`individual` keeps one sequence per call, each with the episode's reward. Expected arrays
are written out by hand below.
"""

from __future__ import annotations

import threading

import pytest

from services.core.types import Completion
from services.rollout.openai_api.sessions import (
    Session,
    SessionStore,
    export_concat,
    export_individual,
)


def _done(ids: list[int], version: int, reason: str = "stop") -> Completion:
    return Completion(ids, [-0.5] * len(ids), [version] * len(ids), reason)  # type: ignore[arg-type]


def _chained() -> Session:
    s = Session(id="ep")
    s.record([1, 2], _done([3, 4], 0), "stop")  # prompt 1 2, sampled 3 4
    s.record([1, 2, 3, 4, 5], _done([6], 1), "tool_calls")  # + tool result 5, sampled 6
    return s


def test_concat_of_chained_calls_is_the_last_prompt_plus_output() -> None:
    s = _chained()
    assert [c.drift for c in s.calls] == [False, False] and s.drift_turns == []
    assert [c.reused_prefix_tokens for c in s.calls] == [0, 4]
    t = export_concat(s, reward=1.0, group_id="g", trajectory_id="t1")
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert t.versions.tolist() == [-1, -1, 0, 0, -1, 1]
    assert t.turn_ids.tolist() == [-1, -1, 0, 0, -1, 1]
    assert t.logprobs.tolist() == [0, 0, -0.5, -0.5, 0, -0.5]
    assert (t.prompt_len, t.reward, t.group_id, t.trajectory_id) == (2, 1.0, "g", "t1")
    assert "template_drift_turns" not in t.metadata


def test_individual_is_one_trajectory_per_call_with_the_episode_reward() -> None:
    ts = export_individual(_chained(), reward=0.25, group_id="g")
    assert [t.input_ids.tolist() for t in ts] == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]
    assert [t.loss_mask.tolist() for t in ts] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert [t.reward for t in ts] == [0.25, 0.25]
    assert [t.trajectory_id for t in ts] == ["ep-0", "ep-1"]


def test_drift_keeps_the_sampled_tokens() -> None:
    s = Session(id="ep")
    s.record([1, 2], _done([3, 4], 0), "stop")
    # The template re-rendered the answer as 7 (e.g. dropped reasoning) before the user turn 5.
    s.record([1, 2, 7, 5], _done([6], 0), "stop")
    assert s.drift_turns == [1] and s.calls[1].drift and s.calls[1].reused_prefix_tokens == 2
    t = export_concat(s, reward=0.0, group_id="g", trajectory_id="t")
    # Sampled 3 4 stay; the drifted call's context is its prompt past the common prefix.
    assert t.input_ids.tolist() == [1, 2, 3, 4, 7, 5, 6]
    assert t.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert t.metadata["template_drift_turns"] == "1"


def test_store_bounds_sessions_by_count_and_idle_time() -> None:
    now = [0.0]
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    a, b = store.open("a"), store.open("b")
    store.get("a")  # b is now the least recently used
    store.open("c")
    assert b.closed and store.evicted == 1
    with pytest.raises(KeyError):
        store.get("b")
    now[0] = 11.0
    store.open("d")  # a and c idle for 11 s > ttl
    assert a.closed and len(store) == 1
    with pytest.raises(ValueError, match="already open"):
        store.open("d")
    closed = store.close("d")
    assert closed.closed and len(store) == 0
    with pytest.raises(ValueError, match="closed"):
        closed.record([1], _done([2], 0), "stop")
    assert len(store.open().id) == 32  # a random id


def test_concurrent_records_keep_every_call() -> None:
    s = Session(id="ep", max_calls=1000)
    threads = [
        threading.Thread(target=lambda: [s.record([1], _done([2], 0), "stop") for _ in range(50)])
        for _ in range(8)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(s.calls) == 400
    with pytest.raises(ValueError, match="reached its 0 calls"):
        Session(id="x", max_calls=0).record([1], _done([2], 0), "stop")
    with pytest.raises(ValueError, match="no calls"):
        export_concat(Session(id="empty"), reward=0, group_id="g", trajectory_id="t")
