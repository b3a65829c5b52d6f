"""The fast admission check (services/buffer/validate.py) never accepts what the codec rejects,
and agrees with it on the versions of what both accept."""

from __future__ import annotations

import asyncio
import unicodedata
from collections.abc import Callable

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from services.buffer.client import BufferClient
from services.buffer.service import BufferParts, BufferService
from services.buffer.validate import MAX_VERSION, fast_versions, id_problem, max_resume_version
from services.common.codec import (
    CodecError,
    CodecLimits,
    array_to_tensor,
    group_from_proto,
    group_to_proto,
)
from services.common.config import load_config
from services.common.grpc_client import make_sync_channel
from tests.image_samples import encoded

from .conftest import BufferFactory
from .helpers import make_group

Msg = common_pb2.TrajectoryGroup


def codec_verdict(msg: Msg, limits: CodecLimits = CodecLimits()) -> tuple[int, int] | None:
    try:
        g = group_from_proto(msg, limits)
    except CodecError:
        return None
    return g.oldest_version, g.newest_version


def base() -> Msg:
    return group_to_proto(make_group("g", version=4, oldest=2, rewards=(0.0, 1.0, 0.5)))


def set_tensor(t: common_pb2.Trajectory, field: str, arr: np.ndarray) -> None:
    getattr(t, field).CopyFrom(array_to_tensor(arr))


def arr(t: common_pb2.Trajectory, field: str) -> np.ndarray:
    from services.common.codec import tensor_to_array

    return tensor_to_array(getattr(t, field)).copy()


def poke(field: str, index: int, value: float) -> Callable[[Msg], None]:
    def mutate(m: Msg) -> None:
        t = m.trajectories[1]
        a = arr(t, field)
        a[index] = value
        set_tensor(t, field, a)

    return mutate


MUTATIONS: dict[str, Callable[[Msg], None]] = {
    "empty group id": lambda m: setattr(m, "group_id", ""),
    "no trajectories": lambda m: m.ClearField("trajectories"),
    "empty trajectory id": lambda m: setattr(m.trajectories[0], "trajectory_id", ""),
    "repeated trajectory id": lambda m: setattr(m.trajectories[1], "trajectory_id", "g/0"),
    "foreign group id": lambda m: setattr(m.trajectories[2], "group_id", "other"),
    "missing tensor": lambda m: m.trajectories[0].ClearField("logprobs"),
    "unknown dtype": lambda m: setattr(m.trajectories[0].versions, "dtype", "int128"),
    "2-D tensor": lambda m: m.trajectories[0].loss_mask.shape.append(1),
    "short bytes": lambda m: setattr(
        m.trajectories[0].input_ids, "data", m.trajectories[0].input_ids.data[:-1]
    ),
    "lengths differ": lambda m: set_tensor(
        m.trajectories[0], "versions", np.array([-1, -1, -1, 4])
    ),
    "prompt_len 0": lambda m: setattr(m.trajectories[0], "prompt_len", 0),
    "prompt_len too long": lambda m: setattr(m.trajectories[0], "prompt_len", 99),
    "mask value 2": poke("loss_mask", 5, 2),
    "mask value -1": poke("loss_mask", 5, -1),
    "mask 1 in prompt": poke("loss_mask", 1, 1),
    "version in prompt": poke("versions", 0, 3),
    "generated version -1": poke("versions", 4, -1),
    "nan logprob": poke("logprobs", 4, np.nan),
    "-inf logprob": poke("logprobs", 4, -np.inf),
    "positive logprob": poke("logprobs", 4, 0.5),
    "negative token id": poke("input_ids", 2, -7),
    "infinite reward": lambda m: setattr(m.trajectories[0], "reward", float("inf")),
    "huge metadata": lambda m: m.trajectories[0].metadata.update({"k": "x" * (70 << 10)}),
    "float loss mask": lambda m: set_tensor(
        m.trajectories[0], "loss_mask", arr(m.trajectories[0], "loss_mask").astype(np.float32)
    ),
    "float64 logprobs": lambda m: set_tensor(
        m.trajectories[0], "logprobs", arr(m.trajectories[0], "logprobs").astype(np.float64)
    ),
    "int32 ids": lambda m: set_tensor(
        m.trajectories[0], "input_ids", arr(m.trajectories[0], "input_ids").astype(np.int32)
    ),
    "multi-turn": lambda m: set_tensor(m.trajectories[0], "turn_ids", np.array([-1] * 3 + [0] * 4)),
    "no generated tokens": lambda m: [
        set_tensor(t, "loss_mask", np.zeros(7, np.int8)) for t in m.trajectories
    ],
    "an image that is no PNG or JPEG": lambda m: m.images.append(b"GIF89a-not-accepted"),
    "more images than a group may carry": lambda m: m.images.extend(
        [encoded(8, 8)] * (CodecLimits().images.max_images + 1)
    ),
    "a truncated image": lambda m: m.images.append(encoded(8, 8)[:20]),
}


def test_agrees_with_the_codec_on_a_group_with_images() -> None:
    m = base()
    m.images.extend([encoded(56, 56), encoded(9, 7, "JPEG")])
    assert fast_versions(m) == codec_verdict(m) == (2, 4)


def test_agrees_with_the_codec_on_a_valid_group() -> None:
    m = base()
    assert fast_versions(m) == codec_verdict(m) == (2, 4)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_never_accepts_what_the_codec_rejects(name: str) -> None:
    m = base()
    MUTATIONS[name](m)
    fast, codec = fast_versions(m), codec_verdict(m)
    if codec is None:
        assert fast is None
    else:  # valid, maybe outside the fast path's common case: then it defers
        assert fast in (None, codec)


@pytest.mark.parametrize(
    ("limits", "why"),
    [
        (CodecLimits(max_trajectories=2), "3 trajectories > 2"),
        (CodecLimits(max_tokens=6), "7 tokens > 6"),
    ],
)
def test_respects_the_codec_limits(limits: CodecLimits, why: str) -> None:
    m = base()
    assert codec_verdict(m, limits) is None, why
    assert fast_versions(m, limits) is None


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=4),
    versions=st.lists(st.integers(0, 9), min_size=1, max_size=24),
    corrupt=st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from(["loss_mask", "versions"]), st.integers(0, 50), st.integers(-2, 3)
        ),
    ),
)
def test_random_groups_match_the_codec(lens, versions, corrupt) -> None:  # noqa: ANN001
    msg = Msg(group_id="h")
    k = 0
    for i, (p, g) in enumerate(lens):
        n = p + g
        vs = np.array([-1] * p + [versions[(k + j) % len(versions)] for j in range(g)])
        k += g
        mask = np.array([0] * p + [1] * g, dtype=np.int8)
        t = msg.trajectories.add(trajectory_id=f"t{i}", prompt_len=p, reward=float(i))
        set_tensor(t, "input_ids", np.arange(n, dtype=np.int64))
        set_tensor(t, "loss_mask", mask)
        set_tensor(t, "logprobs", np.where(mask == 1, -0.5, 0.0).astype(np.float32))
        set_tensor(t, "versions", vs.astype(np.int64))
    if corrupt is not None:
        field, pos, value = corrupt
        t = msg.trajectories[pos % len(msg.trajectories)]
        a = arr(t, field)
        a[pos % a.size] = value
        set_tensor(t, field, a)
    fast, codec = fast_versions(msg), codec_verdict(msg)
    if codec is None:
        assert fast is None
    else:
        assert fast == codec  # common-case dtypes only here: the fast path must decide


# -- bounds on ids and versions, against a real buffer on a real redis-server ----------------

BAD_IDS = ["a\nb", "a b", "tab\there", "nul\x00", "esc\x1b[0m", "nbsp\u00a0", "x" * 257, ""]


def _stub(client: BufferClient) -> buffer_pb2_grpc.BufferServiceStub:
    return buffer_pb2_grpc.BufferServiceStub(client.channel)


def _refused(service: BufferService, method: str, field: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "flywheel_buffer_refused_requests_total", {"method": method, "field": field}
    )
    return value or 0.0


async def _put_code(client: BufferClient, group: Msg) -> grpc.StatusCode:
    try:
        await _stub(client).Put(buffer_pb2.PutRequest(group=group))
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.integration
async def test_set_version_stays_within_one_step(make_buffer: BufferFactory) -> None:
    # A regression: SetVersion(2**63 - 1) came back negative; after SetVersion(2**62) the
    # trainer's next SetVersion failed and every put was stale.
    service, client = await make_buffer()
    stub = _stub(client)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SetVersion(buffer_pb2.SetVersionRequest(version=2**63 - 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await client.get_version() == 0
    assert await client.set_version(1) == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SetVersion(buffer_pb2.SetVersionRequest(version=2**40))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one step ahead" in err.value.details()
    assert await client.set_version(2) == 2  # the trainer's next step still works
    assert _refused(service, "SetVersion", "version") == 2


@pytest.mark.integration
async def test_set_version_allows_what_a_resumed_trainer_does(make_buffer: BufferFactory) -> None:
    # services/trainer/resume.py `resume_version`: the checkpoint's version, or one past the
    # highest the buffer or a replica saw. On a fresh buffer (version 0) the checkpoint's
    # version is set in one jump; on the same buffer it is at most current + 1.
    _, client = await make_buffer()
    assert await client.set_version(50) == 50
    assert await client.set_version(51, request_id="trainer:v51") == 51
    assert await client.set_version(51, request_id="trainer:v51") == 51  # a retry
    assert await client.set_version(52) == 52


@pytest.mark.integration
async def test_put_of_future_versions_is_refused_and_counted(make_buffer: BufferFactory) -> None:
    # eta = 1 (conftest), version 3: tokens up to 3 + 1 + 1 = 5 are admissible.
    service, client = await make_buffer()
    await client.set_version(1)
    await client.set_version(2)
    await client.set_version(3)
    ok = group_to_proto(make_group("ok", version=5))
    assert await _put_code(client, ok) == grpc.StatusCode.OK
    for gid, v in [("six", 6), ("huge", 2**62)]:
        assert await _put_code(client, group_to_proto(make_group(gid, version=v))) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    s = await client.stats()
    assert (s.put_total, s.dropped_total["invalid"], s.pending) == (3, 2, 1) and s.invariant_ok
    assert _refused(service, "Put", "group.versions") == 2


@pytest.mark.integration
@pytest.mark.parametrize("bad", BAD_IDS)
async def test_bad_ids_are_refused_everywhere(make_buffer: BufferFactory, bad: str) -> None:
    service, client = await make_buffer()
    stub = _stub(client)
    group = group_to_proto(make_group("g"))
    group.group_id = bad
    for t in group.trajectories:
        t.group_id = bad
    assert await _put_code(client, group) == grpc.StatusCode.INVALID_ARGUMENT
    calls = [
        stub.Claim(buffer_pb2.ClaimRequest(consumer_id=bad, n_groups=1)),
        stub.Ack(buffer_pb2.AckRequest(group_ids=["fine", bad])),
        stub.ReadGroup(buffer_pb2.ReadGroupRequest(group_id=bad)),
    ]
    if bad:  # optional ids may be empty
        calls += [
            stub.SetVersion(buffer_pb2.SetVersionRequest(version=1, request_id=bad)),
            stub.ReserveCapacity(buffer_pb2.ReserveCapacityRequest(count=1, rollout_id=bad)),
            stub.ReleaseCapacity(buffer_pb2.ReleaseCapacityRequest(reservation_ids=[bad])),
        ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s = await client.stats()
    # The refused put is counted once as dropped{invalid}, under no key.
    assert (s.put_total, s.dropped_total["invalid"], s.pending) == (1, 1, 0) and s.invariant_ok
    # (An empty group id is the codec's to name: refused too, not by the id bounds.)
    assert _refused(service, "Put", "group_id") == (1 if bad else 0)
    assert _refused(service, "Claim", "consumer_id") == 1
    assert await client.get_version() == 0


def _is_id(s: str) -> bool:
    """The issue's rule, spelled independently of validate.id_problem: no control, format,
    unassigned, private-use or surrogate character (Unicode category C*), no separator
    (Z*, spaces and line breaks), at most 256 UTF-8 bytes, not empty."""
    return (
        0 < len(s.encode("utf-8", "surrogatepass")) <= 256
        and all(unicodedata.category(c)[0] not in "CZ" for c in s)
        and not any(c in "\t\n\v\f\r\x1c\x1d\x1e\x1f\x85" for c in s)
    )


@pytest.mark.integration
@pytest.mark.slow
async def test_ledger_holds_over_any_ids_and_versions(make_buffer: BufferFactory) -> None:
    """Property (hypothesis, real redis-server): whatever ids and versions producers send,
    put = acked + dropped + pending + in_flight after every call, exactly the well-formed
    puts are stored, and a claim (and its retry) hands back every stored group."""
    eta = 1000  # large, so that no stored group turns stale at claim as the version moves
    service, client = await make_buffer(
        buffer={"max_stored_groups": 100_000}, rollout={"max_head_offpolicyness": eta}
    )
    await client.set_version(1)
    channel = make_sync_channel(service.address)
    stub = buffer_pb2_grpc.BufferServiceStub(channel)
    stored: set[str] = set()
    current = [1]

    @settings(max_examples=150, deadline=None, database=None)
    @given(
        gid=st.one_of(st.text(min_size=0, max_size=80), st.text(min_size=250, max_size=260)),
        version=st.one_of(st.integers(-3, eta + 10), st.integers(0, 2**63 - 1)),
        new_version=st.one_of(st.integers(-1, 5), st.integers(0, 2**63 - 1)),
    )
    def one_put(gid: str, version: int, new_version: int) -> None:
        msg = group_to_proto(make_group("g", version=version))
        msg.group_id = gid
        for i, t in enumerate(msg.trajectories):
            t.group_id, t.trajectory_id = gid, f"t{i}"
        try:
            resp = stub.Put(buffer_pb2.PutRequest(group=msg))
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        well_formed = _is_id(gid) and 0 <= version <= current[0] + eta + 1
        assert code == (grpc.StatusCode.OK if well_formed else grpc.StatusCode.INVALID_ARGUMENT)
        if code == grpc.StatusCode.OK and resp.result == buffer_pb2.ADMISSION_RESULT_ADMITTED:
            stored.add(gid)
        try:  # a hostile SetVersion moves the version by one step at most
            stub.SetVersion(buffer_pb2.SetVersionRequest(version=new_version))
        except grpc.RpcError as err:
            assert err.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if new_version == current[0] + 1:
            current[0] += 1
        assert stub.GetVersion(common_pb2.Empty()).version == current[0]
        s = stub.Stats(common_pb2.Empty())
        assert s.invariant_ok
        assert s.put_total == s.acked_total + sum(s.dropped_total.values()) + s.pending + (
            s.in_flight
        )

    try:
        await asyncio.to_thread(one_put)
    finally:
        channel.close()
    n = len(stored)
    first = await client.claim(n, consumer_id="t", request_id="c1", allow_partial=True)
    again = await client.claim(n, consumer_id="t", request_id="c1", allow_partial=True)
    assert set(first.group_ids) == stored and set(again.group_ids) == stored
    s = await client.stats()
    assert s.invariant_ok and s.in_flight == len(stored)


def test_id_rule_over_every_code_point() -> None:
    # validate.id_problem (a C-speed fast path, then a per-character scan) against the
    # issue's rule spelled with Unicode categories (`_is_id`), for each code point alone
    # and inside an otherwise good id.
    for cp in range(0x110000):
        c = chr(cp)
        assert (id_problem(c) is None) == _is_id(c), hex(cp)
        assert (id_problem(f"g-{c}-1") is None) == _is_id(f"g-{c}-1"), hex(cp)
    assert id_problem("x" * 256) is None and id_problem("é" * 128) is None
    assert id_problem("x" * 257) is not None and id_problem("é" * 129) is not None
    assert id_problem("", allow_empty=True) is None and id_problem("") is not None


def test_the_resume_bound_comes_from_the_run() -> None:
    # Explicit wins (capped at what Redis stores); else 2 * total_train_steps + 100; a run of
    # epochs (no total_train_steps) gets a million.
    assert max_resume_version(500, 10) == 500
    assert max_resume_version(2**60, None) == MAX_VERSION
    assert max_resume_version(None, 10) == 120
    assert max_resume_version(None, None) == 1_000_000
    cfg = load_config(None, ["total_train_steps=40"])
    assert BufferParts.from_config(cfg).max_resume_version == 180
    cfg = load_config(None, ["total_train_steps=40", "buffer.max_resume_version=7"])
    assert BufferParts.from_config(cfg).max_resume_version == 7


@pytest.mark.integration
async def test_a_fresh_buffer_takes_a_resumed_trainers_version_and_no_more(
    make_buffer: BufferFactory,
) -> None:
    # docs/security.md, "moving the version out of reach": SetVersion(2**53 - 1) on a buffer
    # at version 0 used to be accepted, and then no version could ever follow. A run of
    # total_train_steps = 10 with save_freq_steps = 5 (services/trainer/loop.py
    # `_resume_version`): crash at step 9 (version 9) after the checkpoint of step 5 ->
    # resumed at step 5 as version 10 -> steps 6..10 give versions 11..15 -> checkpoint of
    # step 10 holds version 15. A trainer resuming from it onto a new Redis sets 15:
    # within the bound 2 * 10 + 100 = 120, which a resume of this run cannot pass.
    cfg = load_config(None, ["total_train_steps=10"])
    bound = BufferParts.from_config(cfg).max_resume_version
    assert bound == 120
    service, client = await make_buffer(parts={"max_resume_version": bound})
    stub = _stub(client)
    for version in (MAX_VERSION, 2**40, bound + 1):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SetVersion(buffer_pb2.SetVersionRequest(version=version))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "buffer.max_resume_version=120" in err.value.details()
    assert await client.get_version() == 0
    assert _refused(service, "SetVersion", "version") == 3
    assert await client.set_version(15) == 15  # the resumed trainer of the example
    assert await client.set_version(16) == 16  # and its next step
    assert _refused(service, "SetVersion", "version") == 3


@pytest.mark.integration
async def test_the_largest_resumable_version_is_taken(make_buffer: BufferFactory) -> None:
    _, client = await make_buffer(parts={"max_resume_version": 120})
    assert await client.set_version(120) == 120
    assert await client.set_version(121) == 121  # past version 0: one step at a time


@pytest.mark.integration
async def test_claim_size_and_wait_refusals_are_counted(make_buffer: BufferFactory) -> None:
    # docs/security.md: "Every refusal of the buffer's bounds is counted". Claim's n_groups
    # and wait_ms bounds were answered INVALID_ARGUMENT without being counted, as was a
    # claim whose groups do not fit in one reply (RESOURCE_EXHAUSTED).
    # max_message_bytes 1 MiB + 2,000: one reply may carry 2,000 bytes, less than a group.
    service, client = await make_buffer(parts={"max_message_bytes": (1 << 20) + 2000})
    stub = _stub(client)
    for req, field in [
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=0), "n_groups"),
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=100_001), "n_groups"),
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=1, wait_ms=-5), "wait_ms"),
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=1, wait_ms=600_001), "wait_ms"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Claim(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
    assert _refused(service, "Claim", "n_groups") == 2
    assert _refused(service, "Claim", "wait_ms") == 2
    group = group_to_proto(make_group("big", gen_len=200))
    assert group.ByteSize() > 2000
    assert await _put_code(client, group) == grpc.StatusCode.OK
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Claim(buffer_pb2.ClaimRequest(consumer_id="t", n_groups=1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "claim fewer groups per call" in err.value.details()
    assert _refused(service, "Claim", "n_groups") == 3
    s = await client.stats()
    assert (s.pending, s.in_flight) == (1, 0)  # the refused claim took nothing


@pytest.mark.integration
async def test_refused_tokens_are_counted_on_the_buffers_metrics(
    make_buffer: BufferFactory,
) -> None:
    service, client = await make_buffer(auth_token="s3cret")
    assert await client.get_version() == 0
    async with grpc.aio.insecure_channel(service.address) as ch:
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await buffer_pb2_grpc.BufferServiceStub(ch).GetVersion(common_pb2.Empty())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{service.metrics_port}/metrics")).text
    line = (
        'flywheel_buffer_auth_failures_total{code="UNAUTHENTICATED",'
        'method="flywheel.v1.BufferService/GetVersion"} 2.0'
    )
    assert line in text
