"""The buffer's admission rules (services/buffer/admission.py) on a real Redis store.

The staleness verdicts are checked against AReaL's rule for how off-policy a sample may be
(areal/core/staleness_manager.py, `StalenessManager`): a sample generated with the weights
of version v may still be trained at version V only while V - v <= max_head_offpolicyness
(the same bound AReaL's capacity formula (max_staleness + V + 1) * consumer_batch_size -
(accepted + running) keeps). `areal_fresh` below writes that rule out on its own; the
buffer's verdicts come from its admission code and its Redis script.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from flywheel_proto.v1 import buffer_pb2
from services.buffer.admission import Admission, BoundsRefusal, RpcFailure, check_ids, full_reason
from services.buffer.metrics import BufferMetrics
from services.buffer.store import PutOutcome, RedisStore
from services.common.codec import CodecLimits, group_to_proto
from services.core.types import TrajectoryGroup

from .helpers import exploding_filter, make_group

pytestmark = pytest.mark.integration


def areal_fresh(current: int, version: int, eta: int) -> bool:
    """AReaL's bound: data from version `version` may train at `current` iff
    current - version <= max_head_offpolicyness."""
    return current - version <= eta


def admission(store: RedisStore, **kw: Any) -> Admission:
    args: dict[str, Any] = {
        "max_group_bytes": 1 << 20,
        "codec_limits": CodecLimits(),
        "filter_name": "",
        "filter_at": "put",
        "max_head_offpolicyness": store.settings.eta,
        "group_filter": None,
    }
    return Admission(store, BufferMetrics(CollectorRegistry()), **{**args, **kw})


def put_request(group: TrajectoryGroup, request_id: str = "") -> buffer_pb2.PutRequest:
    return buffer_pb2.PutRequest(request_id=request_id, group=group_to_proto(group))


async def step_to(store: RedisStore, version: int) -> None:
    """The trainer's version moves one step at a time."""
    for v in range(1, version + 1):
        ok, _ = await store.set_version(v)
        assert ok


async def put(adm: Admission, group: TrajectoryGroup) -> buffer_pb2.PutResponse:
    req = put_request(group)
    item = await adm.admissible(req, None)
    (outcome,) = await adm.store.put_many([item])
    return adm.put_response(group.group_id, item.oldest_version, outcome)


@pytest.mark.parametrize("eta", [0, 1, 2])
async def test_stale_verdicts_follow_areals_off_policyness_bound(
    make_store: Callable[..., RedisStore], eta: int
) -> None:
    store = make_store(max_head_offpolicyness=eta)
    current = 4
    await step_to(store, current)
    adm = admission(store)
    for oldest in range(current + 1):
        group = make_group(f"g-{eta}-{oldest}", version=current, oldest=oldest)
        resp = await put(adm, group)
        if areal_fresh(current, oldest, eta):
            assert resp.result == buffer_pb2.ADMISSION_RESULT_ADMITTED, (oldest, resp.reason)
            assert resp.reason == ""
        else:
            assert resp.result == buffer_pb2.ADMISSION_RESULT_STALE, (oldest, resp.reason)
            assert f"oldest token version {oldest} < version {current}" in resp.reason
            assert f"max_head_offpolicyness {eta}" in resp.reason
        assert resp.version == current
    stale = sum(not areal_fresh(current, v, eta) for v in range(current + 1))
    stats = await store.stats()
    assert stats.dropped["stale_at_put"] == stale
    assert stats.admitted == current + 1 - stale


async def test_tokens_from_beyond_current_plus_eta_plus_one_are_refused_once(
    make_store: Callable[..., RedisStore],
) -> None:
    store = make_store(max_head_offpolicyness=1)
    await step_to(store, 2)
    adm = admission(store)
    assert adm.version_seen == 0  # a lower bound only: Redis is asked on a miss
    # 2 + 1 + 1 = 4: the newest a rollout's tokens may be
    item = await adm.admissible(put_request(make_group("ahead-ok", version=4)), None)
    assert item.newest_version == 4
    assert adm.version_seen == 2  # learnt from Redis when 4 missed the bound 0 + 1 + 1
    with pytest.raises(BoundsRefusal) as err:
        await adm.admissible(put_request(make_group("ahead-bad", version=5)), None)
    assert err.value.field == "group.versions"
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token version 5 is beyond current version 2" in err.value.details
    stats = await store.stats()
    assert stats.put == 1 and stats.dropped["invalid"] == 1  # the refused one, counted once


async def test_an_oversize_group_is_refused_for_good_and_counted(
    make_store: Callable[..., RedisStore],
) -> None:
    store = make_store()
    req = put_request(make_group("big", gen_len=64))
    size = req.group.ByteSize()
    adm = admission(store, max_group_bytes=size - 1)
    with pytest.raises(RpcFailure) as err:
        await adm.admissible(req, None)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"is {size} bytes, above buffer.max_group_bytes={size - 1}" in err.value.details
    assert (await store.stats()).dropped["invalid"] == 1
    # One byte more and the very same group goes in.
    ok = await admission(store, max_group_bytes=size).admissible(req, None)
    assert len(ok.payload) == size


async def test_a_bad_id_is_counted_under_no_id(make_store: Callable[..., RedisStore]) -> None:
    store = make_store()
    adm = admission(store)
    req = put_request(make_group("has space"))
    with pytest.raises(BoundsRefusal) as err:
        await adm.admissible(req, None)
    assert err.value.field == "group_id"
    assert "whitespace" in err.value.details
    stats = await store.stats()
    assert stats.put == 1 and stats.dropped["invalid"] == 1
    # No key was made from the bad id (it must never become part of a Redis key).
    assert await store.read_group("has space") is None


async def test_a_group_with_no_generated_token_is_invalid(
    make_store: Callable[..., RedisStore],
) -> None:
    store = make_store()
    group = make_group("prompt-only")
    for t in group.trajectories:
        t.loss_mask[:] = 0
    with pytest.raises(RpcFailure) as err:
        await admission(store).admissible(put_request(group), None)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (await store.stats()).dropped["invalid"] == 1


async def test_the_filter_at_put_marks_groups_and_a_broken_filter_stores_nothing(
    make_store: Callable[..., RedisStore],
) -> None:
    store = make_store()

    def one_reward_only(group: TrajectoryGroup) -> bool:  # DAPO's rule: drop 0-variance
        return len({t.reward for t in group.trajectories}) > 1

    adm = admission(store, group_filter=one_reward_only, filter_name="dapo")
    kept = await adm.admissible(put_request(make_group("mixed", rewards=(0.0, 1.0))), None)
    dropped = await adm.admissible(put_request(make_group("flat", rewards=(1.0, 1.0))), None)
    assert (kept.filtered, dropped.filtered) == (False, True)
    outcomes: list[PutOutcome] = await store.put_many([kept, dropped])
    assert [o.result for o in outcomes] == ["admitted", "filtered"]
    assert "rejected by buffer.filter 'dapo'" in adm.put_response("flat", 0, outcomes[1]).reason

    broken = admission(store, group_filter=exploding_filter, filter_name="boom")
    with pytest.raises(RpcFailure) as err:
        await broken.admissible(put_request(make_group("any")), None)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert "nothing was stored" in err.value.details
    assert (await store.stats()).put == 2  # the broken filter's group was never put


def test_optional_ids_may_be_empty_and_required_ones_may_not() -> None:
    check_ids(request_id="", reservation_id="", rollout_id="")
    with pytest.raises(BoundsRefusal) as err:
        check_ids(group_id=["g1", ""])
    assert err.value.field == "group_id" and "must not be empty" in err.value.details
    with pytest.raises(BoundsRefusal) as err:
        check_ids(consumer_id="tab\there")
    assert err.value.field == "consumer_id"


def test_the_full_reason_names_what_is_stored_and_the_limits() -> None:
    text = full_reason(PutOutcome("full", 3, stored_groups=7, stored_bytes=4096))
    assert "7 groups / 4096 bytes" in text
    assert "buffer.max_stored_groups" in text and "buffer.max_stored_bytes" in text
