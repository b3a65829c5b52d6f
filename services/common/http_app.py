"""The small HTTP side app of every service: `/healthz`, `/readyz` and `/metrics`.

Prometheus and Kubernetes HTTP probes cannot speak gRPC health, so each service also
serves these over HTTP. The registry is the service's own `CollectorRegistry`, never the
global default, so tests can run several services in one process without name clashes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def build_app(
    name: str, registry: CollectorRegistry, ready: Callable[[], bool], extra: Any = None
) -> FastAPI:
    """The side app; `extra` (an ASGI app) serves every other path, e.g. a replica's
    OpenAI-compatible API, behind its own authentication (probes stay open)."""
    app = FastAPI(title=f"flywheel-{name}", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "service": name}

    @app.get("/readyz")
    def readyz(response: Response) -> dict[str, str]:
        ok = bool(ready())
        response.status_code = 200 if ok else 503
        return {"status": "ready" if ok else "not ready", "service": name}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if extra is not None:
        app.mount("/", extra)
    return app


class MetricsServer:
    """Runs the side app with uvicorn in a daemon thread, so it works beside any event loop."""

    def __init__(
        self,
        name: str,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        host: str = "127.0.0.1",
        port: int = 0,
        extra: Any = None,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self._app = build_app(name, registry, ready, extra)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> int:
        """Start serving; returns the bound port (a free one when port=0)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off")
        # uvicorn (>= 0.29) captures signals only on the main thread, so serving from this
        # thread leaves the service's own SIGTERM handling alone.
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name=f"{self.name}-http",
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} metrics server did not start")
            time.sleep(0.01)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
