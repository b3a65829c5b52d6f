"""Service child processes: started, log-streamed, health-gated, stopped cleanly, and the
restart budget that decides whether a dead one is started again.

Each service's output is prefixed with its name on the launcher's stderr and copied to
`<run_dir>/logs/<name>.log`; the last lines are kept in memory so that when a service dies
the launcher can say why without asking the user to dig through files.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import IO

from services.common.proc import orphan_proof


class ServiceProcess:
    """One service process (or the trainer's rank launcher) and its log pump."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        drop: Collection[str] = (),
        cpus: Sequence[int] | None = None,
        echo: bool = True,
        tail_lines: int = 40,
    ) -> None:
        """`env` is added to the launcher's environment, less the variables named in `drop`
        (credentials meant for other services: a child gets only its own through `env`)."""
        self.name = name
        self.args = list(args)
        if cpus:
            self.args = ["taskset", "-c", ",".join(str(c) for c in cpus), *self.args]
        self.log_path = log_dir / f"{name}.log"
        inherited = {k: v for k, v in os.environ.items() if k not in drop}
        self.env = {**inherited, **(env or {})}
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            orphan_proof(self.args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops us in order
        )
        self._pump = threading.Thread(target=self._pump_logs, name=f"log-{self.name}", daemon=True)
        self._pump.start()
        return self

    def _pump_logs(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stream: IO[bytes] = self.proc.stdout
        with open(self.log_path, "ab") as sink:
            for raw in iter(stream.readline, b""):
                sink.write(raw)
                sink.flush()
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.tail.append(line)
                if self.echo:
                    sys.stderr.write(f"[{self.name}] {line}\n")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (the services drain), then SIGKILL of the whole session after `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join_pump()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        self._join_pump()
        return code

    def _join_pump(self) -> None:
        if self._pump is not None:
            self._pump.join(timeout=2)

    def last_lines(self, n: int = 20) -> str:
        return "\n".join(list(self.tail)[-n:])


def wait_until_serving(
    proc: ServiceProcess, address: str, timeout: float, *, may_finish: bool = False
) -> bool:
    """Block until grpc health reports SERVING (True); fail fast (with its log) if the process
    dies. With `may_finish`, a clean exit (code 0) before the first SERVING answer returns
    False instead: a short job (a trainer with a few steps) can be done before it is looked
    at, and its caller judges the outcome from what it wrote."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.grpc_client import make_sync_channel

    deadline = time.monotonic() + timeout
    # Reconnects within a second or two of the server binding (a plain channel's back-off
    # after refused connections grows past ten seconds while a service loads).
    channel = make_sync_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while True:
            code = proc.poll()
            if code == 0 and may_finish:
                return False
            if code is not None:
                raise ServiceFailed(proc, f"exited with code {code} before it was healthy")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise ServiceFailed(proc, f"not SERVING on {address} after {timeout:.0f}s")
            time.sleep(0.2)
    finally:
        channel.close()


class ServiceFailed(RuntimeError):
    """A service died or never became healthy; carries its last log lines."""

    def __init__(self, proc: ServiceProcess, what: str) -> None:
        self.proc = proc
        super().__init__(f"{proc.name} {what}; last log lines:\n{proc.last_lines()}")


def describe_exit(code: int | None) -> str:
    """`exit code 3`, `signal SIGKILL` (Popen reports death by signal N as -N), `running`."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RestartBudget:
    """How many times, and after how long a wait, each service may be restarted.

    At most `max_restarts` restarts of one service within the last `window_s` seconds; the
    n-th restart in the window (counting from 0) waits `min(backoff_max_s, backoff_s * 2**n)`.
    A restart that fails (the new process dies or never becomes healthy) counts like any
    other, so a crash loop runs out of budget instead of spinning. Deaths older than the
    window are forgotten: a service that crashes rarely is restarted for ever."""

    def __init__(
        self,
        max_restarts: int,
        window_s: float,
        backoff_s: float,
        backoff_max_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._history: dict[str, list[float]] = {}

    def recent(self, name: str) -> int:
        """Restarts of `name` within the window."""
        now = self._clock()
        kept = [t for t in self._history.get(name, []) if now - t < self.window_s]
        self._history[name] = kept
        return len(kept)

    def next_delay(self, name: str) -> float | None:
        """Seconds to wait before restarting `name`, or None when its budget is spent."""
        n = self.recent(name)
        if n >= self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2**n)

    def record(self, name: str) -> int:
        """Count one restart of `name` now; returns the restarts within the window."""
        self._history.setdefault(name, []).append(self._clock())
        return self.recent(name)


class Liveness:
    """Whether a running service still answers its gRPC health check.

    Any answer counts, NOT_SERVING included (a service draining or applying weights says
    so on purpose); only silence does not: a process that is stopped (SIGSTOP), deadlocked
    or thrashing answers nothing, and once it has been silent for `timeout_s` the launcher
    treats it as dead (kills and restarts it), as a Kubernetes liveness probe would."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from grpc_health.v1 import health_pb2_grpc

        from services.common.grpc_client import make_sync_channel

        self.address = address
        self.timeout_s = timeout_s
        self._clock = clock
        self._channel = make_sync_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.last_answer = clock()

    def probe(self, deadline_s: float = 2.0) -> bool:
        """One health check; True when the service answered (with any status)."""
        import grpc
        from grpc_health.v1 import health_pb2

        try:
            self._stub.Check(health_pb2.HealthCheckRequest(), timeout=deadline_s)
        except grpc.RpcError:
            return False
        self.last_answer = self._clock()
        return True

    def silent_for(self) -> float:
        """Seconds since the last answer (or since this probe was set up)."""
        return self._clock() - self.last_answer

    def hung(self) -> bool:
        return self.silent_for() >= self.timeout_s

    def close(self) -> None:
        self._channel.close()
