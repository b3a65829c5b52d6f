"""Token-in/token-out sessions: what an episode's calls rendered and sampled, and the
trajectories built from exactly those tokens.

A session is one agent episode. Every chat call made through `/sessions/{id}/v1` appends a
`CallRecord`: the prompt ids the replica rendered, the ids it sampled with their
log-probabilities and per-token policy versions (from the engine's `Completion`, so a
weight update in the middle of an episode shows in them), and the finish reason.

Trajectories are assembled from these records and never by re-tokenising text. A call's
prompt normally starts with the previous call's prompt + output (the conversation grew);
when it does not, the chat template re-rendered earlier turns differently (a template that
drops earlier reasoning, or text that tokenises differently from what was sampled): that
call is marked `drift`, counted, and its index kept in `Session.drift_turns`.

Two export styles, after AReaL's:

* `export_concat`: one trajectory per episode. The token stream is the first call's prompt,
  then for each later call the part of its prompt beyond the previous call's prompt +
  output (loss mask 0, version -1, turn id -1: tool results, user turns, template tokens),
  and each call's sampled output (loss mask 1, its logprobs and versions, turn id = call
  index). Where calls chain this is exactly the last call's prompt + output. After a drift
  the sampled tokens are still kept as sampled; the drifted call's new context is what its
  prompt holds beyond its longest common prefix with the previous prompt + output, so that
  call's context is approximate (listed in the trajectory's `template_drift_turns`
  metadata; `individual` is exact per call).
* `export_individual`: one trajectory per call (its own prompt + output), each carrying the
  episode's reward.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.core.types import Completion, Trajectory
from services.rollout.workflows.base import build_trajectory

DEFAULT_MAX_SESSIONS = 4096
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_CALLS = 256


@dataclass
class CallRecord:
    """One model call of a session, token for token."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    """The OpenAI finish reason returned (`stop`, `length`, `tool_calls`, `abort`)."""
    drift: bool
    """True when `prompt_ids` does not start with the previous call's prompt + output."""
    stop_reason: str = "stop"
    """The engine's stop reason (`stop`, `length`, `abort`): what the trajectory records."""
    reused_prefix_tokens: int = 0
    """Leading prompt tokens equal to the previous call's prompt + output: the prefill a
    KV cache kept from that call could skip."""


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Session:
    """The calls of one episode, in order. Thread-safe: calls may arrive concurrently."""

    id: str
    calls: list[CallRecord] = field(default_factory=list)
    drift_turns: list[int] = field(default_factory=list)
    closed: bool = False
    max_calls: int = DEFAULT_MAX_CALLS
    last_used: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def template_drift(self) -> int:
        """How many calls drifted (see the module docstring)."""
        return len(self.drift_turns)

    def has_room(self) -> bool:
        return len(self.calls) < self.max_calls

    def record(
        self, prompt_ids: Sequence[int], completion: Completion, finish_reason: str
    ) -> CallRecord:
        """Append one call; raises `ValueError` when the session is closed or full."""
        prompt = [int(t) for t in prompt_ids]
        with self._lock:
            if self.closed:
                raise ValueError(f"session {self.id} is closed")
            if len(self.calls) >= self.max_calls:
                raise ValueError(f"session {self.id} has reached its {self.max_calls} calls")
            drift, reused = False, 0
            if self.calls:
                prev = self.calls[-1]
                before = prev.prompt_ids + prev.output_ids
                reused = common_prefix_len(prompt, before)
                drift = reused < len(before)
            rec = CallRecord(
                prompt_ids=prompt,
                output_ids=[int(t) for t in completion.output_ids],
                logprobs=[float(x) for x in completion.logprobs],
                versions=[int(v) for v in completion.versions],
                finish_reason=finish_reason,
                drift=drift,
                stop_reason=completion.stop_reason,
                reused_prefix_tokens=reused,
            )
            if drift:
                self.drift_turns.append(len(self.calls))
            self.calls.append(rec)
            self.last_used = time.monotonic()
            return rec


class SessionStore:
    """Open sessions by id, bounded in number: the least recently used is evicted when
    `max_sessions` are open, and sessions idle for `ttl_s` are dropped on the next open."""

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        max_calls: int = DEFAULT_MAX_CALLS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: must be >= 1")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_calls = max_calls
        self._clock = clock
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str | None = None) -> Session:
        """A new session (a random id when None); an id already open is refused."""
        sid = session_id or uuid.uuid4().hex
        if not 1 <= len(sid) <= 128:
            raise ValueError("a session id is 1 to 128 characters")
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid} is already open")
            self._evict_locked()
            session = Session(id=sid, max_calls=self.max_calls, last_used=self._clock())
            self._sessions[sid] = session
            return session

    def get(self, session_id: str) -> Session:
        """The open session (marked used); `KeyError` when unknown, closed or evicted."""
        with self._lock:
            session = self._sessions[session_id]
            self._sessions.move_to_end(session_id)
            session.last_used = self._clock()
            return session

    def close(self, session_id: str) -> Session:
        """Remove the session and return it, closed (its records stay readable)."""
        with self._lock:
            session = self._sessions.pop(session_id)
        with session._lock:
            session.closed = True
        return session

    def _evict_locked(self) -> None:
        now = self._clock()
        for sid in [s for s, x in self._sessions.items() if now - x.last_used > self.ttl_s]:
            self._sessions.pop(sid).closed = True
            self.evicted += 1
        while len(self._sessions) >= self.max_sessions:
            _, oldest = self._sessions.popitem(last=False)
            oldest.closed = True
            self.evicted += 1


def _engine_stop(reason: str) -> str:
    return reason if reason in ("stop", "length", "abort") else "stop"


def export_concat(
    session: Session, *, reward: float, group_id: str, trajectory_id: str
) -> Trajectory:
    """One trajectory for the whole episode (see the module docstring)."""
    calls = list(session.calls)
    if not calls:
        raise ValueError(f"session {session.id} has no calls to export")
    first = calls[0]
    pieces: list[tuple[list[int], list[float], list[int], int]] = []
    for turn, call in enumerate(calls):
        if turn > 0:
            prev = calls[turn - 1]
            keep = common_prefix_len(call.prompt_ids, prev.prompt_ids + prev.output_ids)
            context = call.prompt_ids[keep:]
            if context:
                pieces.append((context, [], [], -1))
        pieces.append((call.output_ids, call.logprobs, call.versions, turn))
    traj = build_trajectory(
        first.prompt_ids,
        pieces,
        reward=reward,
        stop_reason=_engine_stop(calls[-1].stop_reason),
        metadata=_metadata(session),
        multi_turn=True,
    )
    traj.trajectory_id = trajectory_id
    traj.group_id = group_id
    return traj


def export_individual(session: Session, *, reward: float, group_id: str) -> list[Trajectory]:
    """One trajectory per call, each with the episode's reward; ids `<session>-<call>`."""
    calls = list(session.calls)
    out: list[Trajectory] = []
    for turn, call in enumerate(calls):
        traj = build_trajectory(
            call.prompt_ids,
            [(call.output_ids, call.logprobs, call.versions, 0)],
            reward=reward,
            stop_reason=_engine_stop(call.stop_reason),
            metadata={**_metadata(session), "turn": str(turn)},
        )
        traj.trajectory_id = f"{session.id}-{turn}"
        traj.group_id = group_id
        out.append(traj)
    return out


def _metadata(session: Session) -> dict[str, str]:
    meta = {"session_id": session.id, "turns": str(len(session.calls))}
    if session.drift_turns:
        meta["template_drift_turns"] = ",".join(str(t) for t in session.drift_turns)
    return meta
