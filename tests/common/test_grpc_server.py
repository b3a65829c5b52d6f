"""A real aio gRPC server on loopback: health, drain, token auth, message-size limits.

The servicer here is a one-method echo registered with a generic handler: the shared
bootstrap is what is under test, and it must behave the same for every service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel_proto.v1 import buffer_pb2_grpc, common_pb2
from services.common.grpc_client import call_with_retry, make_channel, wait_for_health
from services.common.grpc_server import ServiceServer
from tests.waiting import until

ECHO = "/test.Echo/Echo"
MB = 1 << 20


def _identity(b: bytes) -> bytes:
    return b


def _echo_handler(started: asyncio.Event | None = None, release: asyncio.Event | None = None):
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if started is not None and release is not None:
            started.set()
            await release.wait()
        return request

    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(echo, _identity, _identity)},
    )


async def _server(**kwargs) -> tuple[ServiceServer, str]:
    srv = ServiceServer("test", service_names=["test.Echo"], **kwargs)
    srv.server.add_generic_rpc_handlers([_echo_handler()])
    port = await srv.start()
    return srv, f"127.0.0.1:{port}"


def _echo(channel: grpc.aio.Channel):
    return channel.unary_unary(ECHO, request_serializer=_identity, response_deserializer=_identity)


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return resp.status


async def test_health_serving_then_not_serving_on_drain_and_inflight_call_finishes():
    started, release = asyncio.Event(), asyncio.Event()
    srv = ServiceServer("test", service_names=["test.Echo"])
    srv.server.add_generic_rpc_handlers([_echo_handler(started, release)])
    address = f"127.0.0.1:{await srv.start()}"
    await wait_for_health(address, timeout=120)  # a guard, not a timing check
    assert await _health(address, "test.Echo") == health_pb2.HealthCheckResponse.SERVING
    async with make_channel(address) as ch:
        inflight = asyncio.ensure_future(_echo(ch)(b"in flight", timeout=10))
        await started.wait()
        stopping = asyncio.ensure_future(srv.stop(grace=10))
        # Draining: health says NOT_SERVING while the call in flight is still running.
        await until(
            lambda: srv._health._server_status[""] == health_pb2.HealthCheckResponse.NOT_SERVING,
            "stop() to set NOT_SERVING",
        )
        assert srv._health._server_status["test.Echo"] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not inflight.done()
        release.set()
        assert await inflight == b"in flight"
        await stopping


async def test_a_second_server_on_a_taken_port_fails_instead_of_sharing_it():
    # gRPC binds with SO_REUSEPORT by default; then both would listen and split connections.
    first, address = await _server()
    second = ServiceServer("second")
    second.port = first.port
    try:
        with pytest.raises(RuntimeError, match="could not bind|Failed to bind"):
            await second.start()
        async with make_channel(address) as ch:  # the first still gets every call
            for _ in range(4):
                assert await _echo(ch)(b"x", timeout=5) == b"x"
    finally:
        await first.stop(grace=0)
        await second.server.stop(0)  # started only if the bind wrongly succeeded


async def _is(status: Awaitable[int], expected: int) -> bool:
    return await status == expected


async def test_set_serving_false_is_visible_over_the_wire():
    srv, address = await _server()
    try:
        # set_serving schedules the health update; the wire shows it once that has run.
        not_serving, serving = (
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        )
        srv.set_serving(False)
        await until(lambda: _is(_health(address), not_serving), "NOT_SERVING on the wire", 10)
        srv.set_serving(True)
        await until(lambda: _is(_health(address), serving), "SERVING on the wire", 10)
    finally:
        await srv.stop(0)


async def test_token_auth_accepts_right_token_and_refuses_missing_or_wrong():
    srv, address = await _server(auth_token="s3cret")
    try:
        async with make_channel(address, auth_token="s3cret") as ch:
            assert await _echo(ch)(b"hi", timeout=5) == b"hi"
        for token in (None, "wrong"):
            async with make_channel(address, auth_token=token) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _echo(ch)(b"hi", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays reachable without a token (Kubernetes probes send no headers).
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop(0)


async def test_32mb_message_passes_where_configured_and_is_refused_where_not():
    payload = b"x" * (32 * MB)
    srv, address = await _server(max_message_bytes=64 * MB)
    try:
        async with make_channel(address, max_message_bytes=64 * MB) as ch:
            assert len(await _echo(ch)(payload, timeout=30)) == len(payload)
        # A channel left at a 4 MB limit refuses to send it.
        async with make_channel(address, max_message_bytes=4 * MB) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _echo(ch)(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await srv.stop(0)
    small, address = await _server(max_message_bytes=4 * MB)
    try:
        async with make_channel(address, max_message_bytes=64 * MB) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _echo(ch)(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await small.stop(0)


async def test_retry_only_repeats_idempotent_calls():
    calls = 0

    async def flaky(request, timeout):
        nonlocal calls
        calls += 1
        if calls < 3:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return "ok"

    assert await call_with_retry(flaky, None, timeout=1, retries=3, idempotent=True) == "ok"
    assert calls == 3
    calls = 0
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(flaky, None, timeout=1, retries=3, idempotent=False)
    assert calls == 1

    async def invalid(request, timeout):
        nonlocal calls
        calls += 1
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata()
        )

    calls = 0
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(invalid, None, timeout=1, retries=3, idempotent=True)
    assert calls == 1  # a bad request cannot succeed by repetition


# -- TLS, mTLS and per-caller credentials ------------------------------------------------------


def _pem_pair(
    name: str, issuer: tuple[object, object] | None = None, *, ca: bool = False
) -> tuple[bytes, bytes, object, object]:
    """(cert PEM, key PEM, cert, key) for `name`, signed by `issuer` (cert, key) or itself."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)  # type: ignore[attr-defined]
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key, hashes.SHA256())  # type: ignore[arg-type]
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem, cert, key


@pytest.fixture
def pki(tmp_path):  # noqa: ANN001, ANN201
    """A CA, a server and a client certificate (cert-manager's file names), and a TLSConfig
    factory."""
    from services.common.config.services import TLSConfig

    ca_pem, _, ca_cert, ca_key = _pem_pair("flywheel-test-ca", ca=True)
    paths = {"ca": tmp_path / "ca.crt"}
    paths["ca"].write_bytes(ca_pem)
    for who in ("server", "client"):
        cert_pem, key_pem, _, _ = _pem_pair(f"flywheel-{who}", (ca_cert, ca_key))
        (tmp_path / who).mkdir()
        (tmp_path / who / "tls.crt").write_bytes(cert_pem)
        (tmp_path / who / "tls.key").write_bytes(key_pem)

    def make(who: str | None, *, mtls: bool = False, with_ca: bool = True) -> TLSConfig:
        return TLSConfig(
            cert_file=str(tmp_path / who / "tls.crt") if who else None,
            key_file=str(tmp_path / who / "tls.key") if who else None,
            ca_file=str(paths["ca"]) if with_ca else None,
            require_client_cert=mtls,
        )

    return make


async def _echo_code(address: str, **channel_kw) -> grpc.StatusCode:  # noqa: ANN003
    # 30 s: a TLS handshake on a loaded machine must not read as DEADLINE_EXCEEDED; a refused
    # handshake (the codes these tests expect) fails at once whatever the deadline.
    async with make_channel(address, **channel_kw) as ch:
        try:
            assert await _echo(ch)(b"ping", timeout=30) == b"ping"
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_tls_serves_tls_clients_and_refuses_plaintext(pki) -> None:  # noqa: ANN001
    from services.common.config.services import TLSConfig

    srv, address = await _server(tls=pki("server"))
    try:
        # A client that trusts the CA (and checks the server's name, 127.0.0.1 here).
        assert await _echo_code(address, tls=pki(None)) == grpc.StatusCode.OK
        # Plaintext gRPC to a TLS port gets no answer.
        assert await _echo_code(address, tls=TLSConfig()) == grpc.StatusCode.UNAVAILABLE
        # Health stays open to TLS clients, as probes need.
        from services.common.grpc_client import wait_for_health

        await wait_for_health(address, timeout=120, tls=pki(None))
    finally:
        await srv.stop(grace=0.5)


async def test_mtls_refuses_a_client_without_a_certificate(pki) -> None:  # noqa: ANN001
    srv, address = await _server(tls=pki("server", mtls=True))
    try:
        assert await _echo_code(address, tls=pki("client")) == grpc.StatusCode.OK
        assert await _echo_code(address, tls=pki(None)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(grace=0.5)


def _fake_buffer_handler() -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    h = grpc.unary_unary_rpc_method_handler(echo, _identity, _identity)
    return grpc.method_handlers_generic_handler(
        "flywheel.v1.BufferService", {"Put": h, "SetVersion": h}
    )


async def _call(address: str, method: str, token: str | None) -> grpc.StatusCode:
    async with make_channel(address, auth_token=token) as ch:
        call = ch.unary_unary(
            f"/flywheel.v1.BufferService/{method}",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        try:
            await call(b"x", timeout=30)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_per_caller_credentials_allow_each_role_its_methods() -> None:
    import hashlib

    trainer_digest = "sha256:" + hashlib.sha256(b"trainer-tok").hexdigest()
    srv = ServiceServer(
        "buffer",
        auth_token="shared-tok",  # this process's own token: not accepted once roles are set
        credentials={"rollout": "rollout-tok", "trainer": trainer_digest},
    )
    srv.server.add_generic_rpc_handlers([_fake_buffer_handler()])
    address = f"127.0.0.1:{await srv.start()}"
    try:
        ok, denied = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
        assert await _call(address, "Put", "rollout-tok") == ok
        assert await _call(address, "SetVersion", "rollout-tok") == denied  # only the trainer
        assert await _call(address, "SetVersion", "trainer-tok") == ok
        assert await _call(address, "Put", "trainer-tok") == denied
        for token in ("shared-tok", "wrong", None):
            assert await _call(address, "Put", token) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await srv.stop(grace=0.5)


async def test_the_single_shared_token_still_allows_every_method() -> None:
    srv = ServiceServer("buffer", auth_token="shared-tok", credentials={})
    srv.server.add_generic_rpc_handlers([_fake_buffer_handler()])
    address = f"127.0.0.1:{await srv.start()}"
    try:
        for method in ("Put", "SetVersion"):
            assert await _call(address, method, "shared-tok") == grpc.StatusCode.OK
            assert await _call(address, method, None) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await srv.stop(grace=0.5)


@pytest.mark.integration
async def test_a_real_buffer_over_mtls_lets_each_role_do_only_its_part(
    redis_server,  # noqa: ANN001
    pki,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
) -> None:
    """The buffer service as deployed with per-caller tokens over mTLS: rollout puts, the
    trainer sets versions, neither may do the other's part, and a caller without a client
    certificate gets nowhere."""
    from services.buffer.client import BufferClient
    from services.buffer.service import BufferParts, BufferService
    from services.common.config import BufferConfig, RolloutConfig
    from tests.buffer.helpers import make_group

    service = BufferService(
        BufferParts(
            buffer=BufferConfig(redis_url=redis_server.url),
            rollout=RolloutConfig(max_head_offpolicyness=1),
            prefix="{test:sec}:buf",
            export_dir=str(tmp_path / "exports"),
            credentials={"rollout": "rollout-tok", "trainer": "trainer-tok"},
            tls=pki("server", mtls=True),
        )
    )
    await service.start()
    # Each client is handed its TLS settings: here the server's certificate, signed by the CA.
    tls = pki("server", mtls=True)
    rollout = BufferClient(service.address, auth_token="rollout-tok", retries=0, tls=tls)
    trainer = BufferClient(service.address, auth_token="trainer-tok", retries=0, tls=tls)
    try:
        assert (await rollout.put(make_group("g1"))).result == "admitted"
        assert await trainer.set_version(1) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rollout.set_version(2)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await trainer.put(make_group("g2"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Without a client certificate:
        from services.common.config.services import TLSConfig
        from services.common.grpc_client import make_channel

        async with make_channel(service.address, tls=pki(None)) as ch:  # CA only, no cert
            stub = buffer_pb2_grpc.BufferServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetVersion(common_pb2.Empty(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert TLSConfig().enabled is False  # nothing leaked into the environment
        s = await trainer.stats()
        assert (s.put_total, s.pending, s.version) == (1, 1, 1) and s.invariant_ok
    finally:
        await rollout.close()
        await trainer.close()
        await service.stop(grace=0.5)


def test_every_rpc_the_trainer_makes_on_a_replica_is_allowed_to_its_role() -> None:
    """The trainer's calls to rollout replicas (services/trainer/weight_sync.py and the
    parity probe in services/trainer/parity.py, which decodes its probe through Generate)
    must be in its role: the probe was PERMISSION_DENIED under per-caller tokens, paused every
    replica for good and starved the run."""
    from services.common.grpc_server import ROLE_METHODS, _allows

    rollout = "flywheel.v1.RolloutService"
    for method in ("Generate", "UpdateWeights", "StreamWeights", "Pause", "Resume", "GetVersion"):
        assert _allows(ROLE_METHODS["trainer"], f"/{rollout}/{method}"), method
    assert not _allows(ROLE_METHODS["rollout"], f"/{rollout}/UpdateWeights")


async def test_refused_credentials_are_counted_per_method_and_code() -> None:
    """docs/security.md: UNAUTHENTICATED without a token the server accepts,
    PERMISSION_DENIED for a token used beyond its role; each refusal is counted in
    flywheel_<service>_auth_failures_total{method,code}, and a method the server does not
    have is counted as `unknown` (a caller cannot grow the label set)."""
    from prometheus_client import CollectorRegistry

    from services.common.grpc_server import AuthFailureMetrics

    registry = CollectorRegistry()
    srv = ServiceServer(
        "buffer",
        credentials={"rollout": "rollout-tok", "trainer": "trainer-tok"},
        auth_metrics=AuthFailureMetrics("buffer", registry),
    )
    srv.server.add_generic_rpc_handlers([_fake_buffer_handler()])
    address = f"127.0.0.1:{await srv.start()}"

    def count(method: str, code: str) -> float:
        value = registry.get_sample_value(
            "flywheel_buffer_auth_failures_total", {"method": method, "code": code}
        )
        return value or 0.0

    try:
        assert await _call(address, "Put", "rollout-tok") == grpc.StatusCode.OK
        for token in ("wrong", None):
            assert await _call(address, "Put", token) == grpc.StatusCode.UNAUTHENTICATED
        assert await _call(address, "SetVersion", "rollout-tok") == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert await _call(address, "NoSuchMethod", None) == grpc.StatusCode.UNAUTHENTICATED
        assert count("flywheel.v1.BufferService/Put", "UNAUTHENTICATED") == 2
        assert count("flywheel.v1.BufferService/SetVersion", "PERMISSION_DENIED") == 1
        assert count("unknown", "UNAUTHENTICATED") == 1
        # The accepted call counted nothing; health stays open and uncounted.
        assert count("flywheel.v1.BufferService/Put", "PERMISSION_DENIED") == 0
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
        total = sum(
            s.value
            for m in registry.collect()
            for s in m.samples
            if s.name == "flywheel_buffer_auth_failures_total"
        )
        assert total == 4
    finally:
        await srv.stop(grace=0.5)
