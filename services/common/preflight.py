"""`python -m services.X --check`: everything a service does at start, up to binding.

A service started in a pod or a container exits at once on a bad configuration, a missing
model, or an address it cannot bind. The check mode of every entry module runs the same
steps without serving, so a deployment (the Helm chart's preflight in `make helm-check`,
compose's `prepare`) finds such a pod before it is scheduled: it loads the config with the
container's own arguments, runs the service's start-up validation, builds what the service
builds at start where that needs no model or network (the trainer's optimizer and lr
schedule, over a stand-in parameter), and makes sure each address the service would bind
belongs to this machine (a wildcard, a local address, or a name that resolves to one). Exit 0 and one line on stdout when the service would start;
exit 2 and the reason on stderr when it would not.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterable


class PreflightError(ValueError):
    """The service would exit at start; the message says what to change."""


def check_bindable(what: str, host: str, ports: Iterable[int]) -> None:
    """`host` must be an address this process can listen on, and every port in range
    (0: the service picks one). The port itself is not taken here: another process on
    the checking machine may hold it, which says nothing about the pod."""
    for port in ports:
        if not 0 <= port <= 65535:
            raise PreflightError(f"{what}: port {port} is not a TCP port")
    try:
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as err:
        raise PreflightError(
            f"{what}: the service would bind host {host!r}, which does not resolve here "
            f"({err.strerror}); a service binds 0.0.0.0 in its own pod or container "
            "(override services.<name>.host=0.0.0.0) and the others dial its name"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.bind((address[0], 0))
        except OSError as err:
            raise PreflightError(
                f"{what}: host {host!r} ({address[0]}) is not an address of this machine "
                f"({err.strerror}); bind 0.0.0.0 in a pod or container"
            ) from None


def passed(service: str, detail: str = "") -> int:
    """Print the success line of a check and return exit code 0."""
    print(f"{service}: check passed" + (f" ({detail})" if detail else ""))
    return 0


def failed(service: str, err: BaseException) -> int:
    """Print why the service would not start and return exit code 2."""
    print(f"{service}: check failed: {err}", file=sys.stderr)
    return 2
