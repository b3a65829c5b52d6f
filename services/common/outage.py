"""How long a service's peers have been unreachable, as its clients see them.

A client that rides through a peer restart (see `services/common/grpc_client.py`) tells
the peer's `PeerHealth` after every attempt: `failed()` when the attempt found no server
(UNAVAILABLE, or DEADLINE_EXCEEDED: a server that does not answer), `answered()` when the
server answered, whatever it said. From that, each service exports on its own registry

| metric | type | a bad trend means |
| --- | --- | --- |
| `flywheel_<service>_peer_unavailable_seconds_total{peer}` | counter | rising: `peer` is down or unreachable now; steps in it are outages ridden through |
| `flywheel_<service>_peer_unavailable{peer}` | gauge | 1: the last attempt to reach `peer` found no server |

The seconds are wall time while the peer was down, once per peer (not per call waiting on
it): ten calls waiting out the same 30 s outage add 30 s, not 300 s. They are added as the
retries go, so a scrape during an outage already shows it growing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.metrics import metric_name

log = logging.getLogger(__name__)


class PeerHealth:
    """Whether one peer is reachable, shared by every call a process makes to it."""

    def __init__(
        self,
        peer: str,
        address: str = "",
        *,
        seconds: Counter | None = None,
        down: Gauge | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peer = peer
        self.address = address
        self._seconds = seconds
        self._down = down
        self._clock = clock
        self._lock = threading.Lock()  # sync clients may call from several threads
        self._since: float | None = None  # start of the current outage, None while up
        self._counted_to = 0.0  # the outage is counted up to this instant
        self._total = 0.0
        self.outages = 0

    @property
    def down(self) -> bool:
        """True from the first failed attempt until the peer answers again."""
        return self._since is not None

    @property
    def unavailable_seconds(self) -> float:
        """Seconds counted so far (the same number the counter holds)."""
        return self._total

    def _count(self, now: float) -> None:
        elapsed = max(0.0, now - self._counted_to)
        self._counted_to = now
        self._total += elapsed
        if self._seconds is not None and elapsed > 0:
            self._seconds.inc(elapsed)

    def failed(self, since: float | None = None) -> None:
        """An attempt found no server. `since`: when that attempt started (a deadline
        that expired means the peer was silent for the whole attempt)."""
        with self._lock:
            now = self._clock()
            if self._since is None:
                start = min(now, since) if since is not None else now
                self._since = self._counted_to = start
                self.outages += 1
                if self._down is not None:
                    self._down.set(1)
                log.warning(
                    "peer unreachable; retrying", extra={"peer": self.peer, "address": self.address}
                )
            self._count(now)

    def answered(self) -> None:
        """The peer answered an attempt (any status it sent itself)."""
        if self._since is None:  # the common case: no lock, nothing to do
            return
        with self._lock:
            if self._since is None:
                return
            now = self._clock()
            self._count(now)
            log.info(
                "peer reachable again",
                extra={
                    "peer": self.peer,
                    "address": self.address,
                    "outage_s": round(now - self._since, 3),
                },
            )
            self._since = None
            if self._down is not None:
                self._down.set(0)


class PeerOutageMetrics:
    """The two outage series of one service, and one `PeerHealth` per peer name."""

    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.seconds = Counter(
            metric_name(service, "peer_unavailable", "seconds"),
            "Seconds a peer service was unreachable from this one (calls waited and retried).",
            ["peer"],
            registry=registry,
        )
        self.down = Gauge(
            metric_name(service, "peer_unavailable"),
            "1 while the last attempt to reach the peer found no server, else 0.",
            ["peer"],
            registry=registry,
        )
        self._peers: dict[str, PeerHealth] = {}

    def peer(self, name: str, address: str = "") -> PeerHealth:
        """The health of peer `name` (one object per name, so every client of it shares it)."""
        health = self._peers.get(name)
        if health is None:
            self.down.labels(peer=name).set(0)
            health = PeerHealth(
                name,
                address,
                seconds=self.seconds.labels(peer=name),
                down=self.down.labels(peer=name),
            )
            self._peers[name] = health
        return health
