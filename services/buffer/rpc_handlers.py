"""How the buffer's handlers meet gRPC: a failure becomes a status (never a crash), and
the handlers are registered so that the put handlers read their request's wire bytes and a
handler may answer ready wire bytes (Claim does; see services/wire/buffer_envelopes.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
import redis.exceptions as redis_errors
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc
from services.buffer.admission import BoundsRefusal, RpcFailure
from services.buffer.metrics import BufferMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=Message)


class _Observed(Protocol):
    """What `rpc` needs of the servicer: its metrics and who to tell that Redis failed."""

    metrics: BufferMetrics
    on_redis_error: Callable[[BaseException], None]


def rpc(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Time the call, map failures to statuses, and tell the health monitor about Redis."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: _Observed, request: Any, context: grpc.aio.ServicerContext) -> T:
        start = time.perf_counter()
        try:
            return await method(self, request, context)
        except RpcFailure as err:
            if isinstance(err, BoundsRefusal):
                self.metrics.refused.labels(name, err.field).inc()
            self.metrics.rpc_errors.labels(name, err.code.name).inc()
            trailers = (("retry-after-ms", str(err.retry_after_ms)),) if err.retry_after_ms else ()
            await context.abort(err.code, err.details, trailing_metadata=trailers)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as err:
            self.metrics.rpc_errors.labels(name, "UNAVAILABLE").inc()
            self.metrics.redis_errors.inc()
            self.on_redis_error(err)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {err}")
        except redis_errors.RedisError as err:
            self.metrics.rpc_errors.labels(name, "INTERNAL").inc()
            self.metrics.redis_errors.inc()
            log.exception("redis error in %s", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"redis error: {err}")
        except Exception as err:  # a bug must answer a status, not take the service down
            if isinstance(err, grpc.aio.AbortError):
                raise
            self.metrics.rpc_errors.labels(name, "INTERNAL").inc()
            log.exception("unexpected error in %s", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)
        raise AssertionError("unreachable")  # abort() raises

    return wrapper


def _serialize(response: Any) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


RAW_REQUESTS = frozenset({"Put", "PutMany"})
"""Handlers that take the request's wire bytes: they store the groups' bytes as received."""


def parse_request(message_type: type[M], data: bytes) -> M:
    try:
        return message_type.FromString(data)
    except DecodeError as err:
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid {message_type.DESCRIPTOR.full_name}: {err}",
        ) from None


def register(servicer: buffer_pb2_grpc.BufferServiceServicer, server: grpc.aio.Server) -> None:
    """Like the generated `add_BufferServiceServicer_to_server`, built from the service
    descriptor, except that a handler may return ready wire bytes (Claim does) and the put
    handlers parse their requests themselves (see `RAW_REQUESTS`)."""
    service = buffer_pb2.DESCRIPTOR.services_by_name["BufferService"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=None
            if m.name in RAW_REQUESTS
            else message_factory.GetMessageClass(m.input_type).FromString,
            response_serializer=_serialize,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
