"""The reward service over real gRPC on loopback (`services/reward/servicer.py` and the
pool behind it): GSM8K answers as models write them, every fault of the issue, request
ids, the cache, concurrency, a fuzz through the wire, and /metrics over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel_proto.v1 import common_pb2, reward_pb2
from services.common.limits import MAX_ID_BYTES
from services.core.types import ScoreRequest
from services.reward.client import RewardClient
from services.reward.servicer import MAX_KWARGS_DEPTH
from tests.reward.conftest import RunningReward, process_identity, service_config

pytestmark = pytest.mark.integration

S = reward_pb2
GOLD = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n50 minutes: 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"


@pytest.fixture(scope="module")
def svc() -> Iterator[RunningReward]:
    service = RunningReward(service_config(cache=True), metrics=True)
    try:
        yield service
    finally:
        service.stop()


def item(
    completion: str | bytes,
    answer: str = "10",
    fn: str = "",
    deadline_ms: int = 0,
    **kwargs: object,
) -> S.ScoreRequest:
    raw = completion.encode() if isinstance(completion, str) else completion
    return S.ScoreRequest(
        fn=fn,
        prompt="p",
        completion=raw,
        prompt_ids=[1, 2],
        completion_ids=[3],
        answer=answer,
        kwargs_json=json.dumps(kwargs) if kwargs else "",
        deadline_ms=deadline_ms,
    )


def batch(
    svc: RunningReward, items: list[S.ScoreRequest], request_id: str = ""
) -> list[S.ScoreResult]:
    resp = svc.stub.ScoreBatch(S.ScoreBatchRequest(request_id=request_id, items=items), timeout=120)
    assert len(resp.results) == len(items)
    return list(resp.results)


def killed_pid(res: S.ScoreResult) -> int:
    """The worker named in a TIMEOUT / crash message ("... worker 1234 ...")."""
    return int(res.message.split("worker ")[1].split()[0])


def assert_serving_on_fresh_workers(
    svc: RunningReward, before: set[tuple[int, int]], killed: int | None
) -> None:
    """The service answers the next call correctly, and the killed worker is gone (by
    pid and start time: the pid alone may already belong to a new process)."""
    now = svc.identities(2)
    if killed is not None:
        [old] = [ident for ident in before if ident[0] == killed]
        assert old not in now
        assert process_identity(killed) != old
    [res] = batch(svc, [item("#### 10")])
    assert (res.status, res.reward) == (S.REWARD_STATUS_OK, 1.0)


# --- correct scoring ------------------------------------------------------------------


def test_gsm8k_answers_as_models_write_them(svc: RunningReward) -> None:
    right = [
        "Weng earns 12 / 60 = $0.2 per minute. For 50 minutes she earns 0.2 * 50 = $10.\n#### 10",
        "Per minute: 12/60 = 0.2 dollars, so 50 minutes pay 10 dollars.\nThe answer is 10.",
        "She earned $\\boxed{10}$.",
        "0.2 * 50 = 10\n#### $10.00",
        "Weng earned 10 dollars",
    ]
    wrong = [
        "12 * 50 / 60 = 10... no wait, 12 * 50 = 600.\n#### 600",
        "#### 12",
        "She earns \\boxed{\\frac{1}{5}} per minute",
        "I cannot solve this.",
    ]
    results = batch(svc, [item(c, GOLD) for c in right + wrong])
    assert [r.status for r in results] == [S.REWARD_STATUS_OK] * 9
    assert [r.reward for r in results] == [1.0] * 5 + [0.0] * 4


def test_single_score_rpc_and_list_functions(svc: RunningReward) -> None:
    res = svc.stub.Score(item("#### 10", GOLD), timeout=60)
    assert (res.status, res.reward) == (S.REWARD_STATUS_OK, 1.0)
    info = svc.stub.ListFunctions(common_pb2.Empty(), timeout=10)
    assert info.default_fn == "gsm8k" and "echo_kwargs" in info.names
    assert (info.max_batch_size, info.default_deadline_ms) == (64, 5000)


def test_dataset_fields_arrive_as_kwargs(svc: RunningReward) -> None:
    # echo_kwargs = weight * len(prompt_ids) + (prompt == "p") = 1.5 * 2 + 1 = 4.0
    [res] = batch(svc, [item("x", fn="echo_kwargs", weight=1.5)])
    assert (res.status, res.reward) == (S.REWARD_STATUS_OK, 4.0)


# --- faults: each gets its status, the service keeps serving, fresh workers take over ----


def test_function_that_raises_is_an_error_with_its_message(svc: RunningReward) -> None:
    before = svc.identities(2)
    results = batch(svc, [item("#### 10", fn="raises"), item("#### 10")])
    assert results[0].status == S.REWARD_STATUS_ERROR
    assert results[0].message == "ValueError: bad answer field '10'"
    assert (results[1].status, results[1].reward) == (S.REWARD_STATUS_OK, 1.0)
    assert svc.identities(2) == before  # an exception does not cost the worker


def test_infinite_loop_is_killed_at_its_deadline(svc: RunningReward) -> None:
    before = svc.identities(2)
    [res] = batch(svc, [item("x", fn="loops_forever", deadline_ms=1000)])
    assert res.status == S.REWARD_STATUS_TIMEOUT
    assert "deadline of 1s exceeded" in res.message
    # Enforcement: the loop never ends by itself, so any answer at all shows the kill, and
    # never before the deadline (no upper bound here: the benchmark measures the overshoot).
    assert res.seconds >= 1.0
    assert_serving_on_fresh_workers(svc, before, killed_pid(res))


def test_hanging_latex_times_out(svc: RunningReward) -> None:
    # sympy evaluates the power tower 9^(9^(9^9)) eagerly: the parse never returns.
    before = svc.identities(2)
    [res] = batch(svc, [item("\\boxed{9^{9^{9^{9}}}}", "1", fn="math", deadline_ms=1500)])
    assert res.status == S.REWARD_STATUS_TIMEOUT
    assert res.seconds >= 1.5
    assert_serving_on_fresh_workers(svc, before, killed_pid(res))


def test_unbounded_allocation_hits_the_memory_limit(svc: RunningReward) -> None:
    before = svc.identities(2)
    [res] = batch(svc, [item("x", fn="allocates_forever", deadline_ms=20000)])
    # RLIMIT_AS (512 MiB here) turns the allocation into MemoryError well before the
    # deadline; the worker reports it and is replaced.
    assert res.status == S.REWARD_STATUS_ERROR
    assert "MemoryError" in res.message or "died while scoring" in res.message
    assert_serving_on_fresh_workers(svc, before, None)


def test_process_exit_inside_the_function_is_an_error(svc: RunningReward) -> None:
    before = svc.identities(2)
    results = batch(svc, [item("x", fn="exits_process"), item("#### 10")])
    assert results[0].status == S.REWARD_STATUS_ERROR
    # The worker's own exit code. (It once read 255 now and then: the kill went through
    # Popen.send_signal, whose poll reaped the exited worker before asyncio's watcher could.)
    assert "died while scoring (exit code 7)" in results[0].message
    assert results[1].reward == 1.0
    assert_serving_on_fresh_workers(svc, before, killed_pid(results[0]))


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [("returns_nan", "returned nan"), ("returns_text", "returned str")],
)
def test_non_float_rewards_are_errors(svc: RunningReward, fn: str, fragment: str) -> None:
    [res] = batch(svc, [item("x", fn=fn)])
    assert res.status == S.REWARD_STATUS_ERROR and fragment in res.message and res.reward == 0.0


def test_one_megabyte_completion_gets_a_status_within_its_deadline(svc: RunningReward) -> None:
    svc.wait_workers(2)
    # ~1 MB of worked-solution text ending in the answer (1,000,000 bytes < the 1 MiB cap).
    body = ("The price goes up by 3 then down by 2. " * 26_000)[: 1_000_000 - 8] + "\n#### 10"
    assert len(body.encode()) == 1_000_000
    [res] = batch(svc, [item(body, GOLD, deadline_ms=3000)])
    assert res.status in (S.REWARD_STATUS_OK, S.REWARD_STATUS_TIMEOUT)
    if res.status == S.REWARD_STATUS_OK:
        assert res.reward == 1.0  # extraction reads only the tail: cheap and right
    else:
        assert "deadline of 3s exceeded" in res.message


def test_invalid_utf8_and_oversized_completions_are_invalid_input(svc: RunningReward) -> None:
    results = batch(
        svc,
        [
            item(b"#### 1\xff\xfe0"),
            item(b"#" * ((1 << 20) + 1)),
            item("#### 10"),
        ],
    )
    assert results[0].status == S.REWARD_STATUS_INVALID_INPUT
    assert "not valid UTF-8 (invalid start byte at byte 6)" in results[0].message
    assert results[1].status == S.REWARD_STATUS_INVALID_INPUT
    assert "exceeds reward.max_completion_bytes=1048576" in results[1].message
    assert (results[2].status, results[2].reward) == (S.REWARD_STATUS_OK, 1.0)


def test_bad_kwargs_are_invalid_input_for_that_item(svc: RunningReward) -> None:
    bad_json = item("#### 10")
    bad_json.kwargs_json = "{not json"
    not_object = item("#### 10")
    not_object.kwargs_json = "[1, 2]"
    clash = item("#### 10")
    clash.kwargs_json = json.dumps({"answer": "11"})
    results = batch(svc, [bad_json, not_object, clash, item("#### 10")])
    assert [r.status for r in results] == [S.REWARD_STATUS_INVALID_INPUT] * 3 + [S.REWARD_STATUS_OK]
    assert "not valid JSON" in results[0].message
    assert "must be a JSON object, got list" in results[1].message
    assert "clash" in results[2].message


@pytest.mark.parametrize(
    "depth",
    [
        100_000,  # Python's json parser hits its recursion limit (RecursionError)
        MAX_KWARGS_DEPTH + 1,  # parsed, but one level past the bound
    ],
)
def test_deeply_nested_kwargs_are_invalid_input_for_that_item_and_counted(
    svc: RunningReward, depth: int
) -> None:
    # Reference: CPython's json.loads raises RecursionError on 100k nested '[' (its C
    # scanner recurses once per level); that used to fail the whole batch with UNKNOWN.
    nested = '{"weight": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    if depth > 10_000:
        with pytest.raises(RecursionError):
            json.loads(nested)
    counted = svc.service.metrics.results.labels(fn="echo_kwargs", status="INVALID_INPUT")
    before = counted._value.get()
    bad = item("x", fn="echo_kwargs")
    bad.kwargs_json = nested
    results = batch(svc, [item("x", fn="echo_kwargs", weight=1.5), bad, item("#### 10")])
    assert results[1].status == S.REWARD_STATUS_INVALID_INPUT
    assert results[1].message == (
        f"kwargs_json nests lists and objects deeper than {MAX_KWARGS_DEPTH} levels"
    )
    # The neighbours are scored: echo_kwargs = 1.5 * 2 + 1 = 4.0; gsm8k "#### 10" vs 10.
    assert (results[0].status, results[0].reward) == (S.REWARD_STATUS_OK, 4.0)
    assert (results[2].status, results[2].reward) == (S.REWARD_STATUS_OK, 1.0)
    assert counted._value.get() == before + 1


def test_kwargs_nested_up_to_the_bound_are_scored(svc: RunningReward) -> None:
    # MAX_KWARGS_DEPTH levels exactly: the object plus 63 lists reach the function.
    nested = '{"weight": 1.5, "deep": ' + "[" * (MAX_KWARGS_DEPTH - 1)
    nested += "]" * (MAX_KWARGS_DEPTH - 1) + "}"
    ok = item("x", fn="echo_kwargs")
    ok.kwargs_json = nested
    [res] = batch(svc, [ok])
    assert (res.status, res.reward) == (S.REWARD_STATUS_OK, 4.0)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"weight": NaN}', "NaN is not a JSON value"),
        ('{"weight": Infinity}', "Infinity is not a JSON value"),
        ('{"weight": [1, -Infinity]}', "-Infinity is not a JSON value"),
        ('{"weight": 1e999}', "1e999 is out of the range of a float"),
    ],
)
def test_nan_and_infinity_in_kwargs_are_invalid_input(
    svc: RunningReward, text: str, why: str
) -> None:
    # Python's json.loads accepts these; JSON (RFC 8259, section 6) has no NaN
    # or Infinity, and 1e999 is no float. Before, such an item reached the worker
    # encoder and came back ERROR; the control item shows the neighbours unharmed.
    bad = item("x", fn="echo_kwargs")
    bad.kwargs_json = text
    results = batch(svc, [bad, item("x", fn="echo_kwargs", weight=1.5)])
    assert results[0].status == S.REWARD_STATUS_INVALID_INPUT
    assert f"kwargs_json is not valid JSON: {why}" in results[0].message
    assert (results[1].status, results[1].reward) == (S.REWARD_STATUS_OK, 4.0)


def test_a_missing_or_unreadable_reference_is_invalid_input(svc: RunningReward) -> None:
    # A regression: an empty or unreadable reference used to score a silent OK 0.0. A
    # completion without an answer, against a good reference, is still OK 0.0.
    results = batch(
        svc,
        [
            item("#### 10", answer=""),
            item("#### 10", answer="#### "),
            item("\\boxed{10}", answer="\\boxed{}", fn="math"),
            item("[3]", answer="three", fn="clevr_count"),
            item("#### 10", fn="refuses_answer"),
            item("I cannot solve this.", GOLD),
            item("#### 10", GOLD),
        ],
    )
    assert [r.status for r in results] == [S.REWARD_STATUS_INVALID_INPUT] * 5 + [
        S.REWARD_STATUS_OK
    ] * 2
    assert (
        results[0].message
        == "InvalidInput: answer is empty: there is no reference to score against"
    )
    assert "has no value math-verify can read (read '####')" in results[1].message
    assert "has no value math-verify can read" in results[2].message
    assert results[3].message == "InvalidInput: answer 'three' is not a number"
    assert results[4].message == "InvalidInput: answer '10' names no test case"
    assert [r.reward for r in results] == [0.0] * 6 + [1.0]


# --- requests refused as a whole ------------------------------------------------------------


def test_batch_over_the_limit_is_invalid_argument(svc: RunningReward) -> None:
    with pytest.raises(grpc.RpcError) as err:
        svc.stub.ScoreBatch(S.ScoreBatchRequest(items=[item("#### 10")] * 65), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "65 items exceed reward.max_batch=64" in err.value.details()


def test_unknown_function_and_bad_deadline_are_invalid_argument(svc: RunningReward) -> None:
    with pytest.raises(grpc.RpcError) as err:
        batch(svc, [item("x"), item("x", fn="gsm9k")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].fn 'gsm9k'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        batch(svc, [item("x", fn="os:system")])
    assert "must be registered" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        batch(svc, [item("x", deadline_ms=-5)])
    assert "items[0].deadline_ms = -5" in err.value.details()


# --- request ids, cache, concurrency -------------------------------------------------------


def test_retry_with_the_same_request_id_is_answered_once(svc: RunningReward) -> None:
    dedup = svc.service.metrics.deduplicated
    before = dedup._value.get()
    items = [item(f"#### {k}", fn="echo_kwargs", weight=k) for k in range(5)]
    first = batch(svc, items, request_id="retry-1")
    again = batch(svc, items, request_id="retry-1")
    assert again == first  # the stored answer, `seconds` included
    assert dedup._value.get() == before + 1
    with pytest.raises(grpc.RpcError) as err:
        batch(svc, items[:2], request_id="retry-1")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already used for a different request" in err.value.details()


def test_a_request_id_longer_than_the_buffers_bound_is_refused_and_counted(
    svc: RunningReward,
) -> None:
    # Reference: the buffer's own bound on every id it keeps (services/buffer/validate.py
    # MAX_ID_BYTES). An 8 MiB id used to be stored in the idempotency cache as it came.
    refused = svc.service.metrics.rejected.labels(reason="invalid")
    before = refused._value.get()
    stored = len(svc.service.servicer._requests)
    for rid, size in (("r" * (8 << 20), 8 << 20), ("é" * 129, 258)):  # é is 2 bytes in UTF-8
        with pytest.raises(grpc.RpcError) as err:
            batch(svc, [item("#### 10")], request_id=rid)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"request_id of {size} bytes is longer than {MAX_ID_BYTES} bytes"
        )
        with pytest.raises(grpc.RpcError) as err:
            svc.stub.Score(S.ScoreRequest(request_id=rid, completion=b"#### 10"), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused._value.get() == before + 4
    assert len(svc.service.servicer._requests) == stored  # nothing kept for them
    # The longest id the buffer takes is taken here too, and deduplicates.
    longest = "é" * (MAX_ID_BYTES // 2)
    first = batch(svc, [item("#### 10")], request_id=longest)
    assert batch(svc, [item("#### 10")], request_id=longest) == first
    assert first[0].reward == 1.0


def test_cache_serves_identical_items(svc: RunningReward) -> None:
    text = "unique cache probe: 4 + 6 = 10\n#### 10"
    first = batch(svc, [item(text, GOLD), item(text, GOLD)])  # duplicates in one batch: scored once
    assert [r.cached for r in first] == [False, False]
    assert first[0].seconds == first[1].seconds
    [again] = batch(svc, [item(text, GOLD)])
    assert (again.cached, again.reward, again.status) == (True, 1.0, S.REWARD_STATUS_OK)
    [other_answer] = batch(svc, [item(text, "#### 11")])
    assert (other_answer.cached, other_answer.reward) == (False, 0.0)


async def test_many_concurrent_batches_get_every_result_once(svc: RunningReward) -> None:
    # 16 batches x 24 items at once; echo_kwargs returns weight * 2 + 1, a value unique to
    # each item, so a result delivered to the wrong item or twice would show.
    async with RewardClient(svc.address) as client:

        async def one(b: int) -> list[float]:
            items = [
                ScoreRequest(
                    completion="x", prompt="p", prompt_ids=[7, 8], kwargs={"weight": b * 100 + k}
                )
                for k in range(24)
            ]
            out = await client.score_batch(items, fn="echo_kwargs")
            assert all(o.ok for o in out)
            return [o.reward for o in out]

        results = await asyncio.gather(*(one(b) for b in range(16)))
    for b, rewards in enumerate(results):
        assert rewards == [(b * 100 + k) * 2 + 1.0 for k in range(24)]


# --- fuzz through the wire ------------------------------------------------------------------

completion_bytes = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.builds(
        lambda pre, n: f"{pre}\n#### {n}".encode("utf-8", "surrogatepass"),
        st.text(max_size=100),
        st.integers(),
    ),
)
fuzz_item = st.builds(
    lambda c, a, fn: S.ScoreRequest(fn=fn, completion=c, answer=a, prompt="p", deadline_ms=2000),
    completion_bytes,
    st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40),
    st.sampled_from(
        ["gsm8k", "math", "exact_match", "geometry3k", "clevr_count", "format", "arithmetic"]
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(items=st.lists(fuzz_item, min_size=1, max_size=10))
def test_fuzz_every_result_is_well_formed(svc: RunningReward, items: list[S.ScoreRequest]) -> None:
    results = batch(svc, items)
    for req, res in zip(items, results, strict=True):
        assert res.status in (
            S.REWARD_STATUS_OK,
            S.REWARD_STATUS_TIMEOUT,
            S.REWARD_STATUS_ERROR,
            S.REWARD_STATUS_INVALID_INPUT,
        )
        if res.status == S.REWARD_STATUS_OK:
            assert res.reward in (0.0, 1.0)
        else:
            assert res.reward == 0.0 and res.message
        try:
            req.completion.decode("utf-8")
        except UnicodeDecodeError:
            assert res.status == S.REWARD_STATUS_INVALID_INPUT


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_over_http_show_statuses_restarts_and_cache(svc: RunningReward) -> None:
    # Self-contained: with xdist the module's timeout tests may run on another worker.
    batch(svc, [item("x", fn="raises"), item("#### 10")])
    [res] = batch(svc, [item("x", fn="loops_forever", deadline_ms=1000)])
    assert res.status == S.REWARD_STATUS_TIMEOUT
    port = svc.service.metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'flywheel_reward_results_total{fn="raises",status="ERROR"}' in text
    assert 'flywheel_reward_results_total{fn="gsm8k",status="OK"}' in text
    assert 'flywheel_reward_worker_restarts_total{reason="timeout"}' in text
    assert "flywheel_reward_score_seconds_bucket" in text
    assert "flywheel_reward_cache_hits_total" in text
    assert "flywheel_reward_queue_items" in text
    assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200


def test_fn_kwargs_go_to_the_default_function_and_dataset_fields_win() -> None:
    # _prepare alone (no server): config kwargs reach only the default function, and a
    # dataset field of the same name overrides the config's value.
    from services.reward.metrics import RewardMetrics
    from services.reward.pool import PoolConfig, WorkerPool
    from services.reward.registry import RewardRegistry
    from services.reward.servicer import RewardServicer

    config = service_config(
        fn="format", fn_kwargs={"format_style": "boxed", "bonus": 1}, cache=True
    )
    registry = RewardRegistry(config.functions, default=config.fn)
    servicer = RewardServicer(config, registry, WorkerPool(PoolConfig()), RewardMetrics())
    default, explicit, other = servicer._prepare(
        [item("x"), item("x", fn="format", format_style="hash"), item("x", fn="gsm8k")],
        single=False,
    )
    assert default.payload is not None and default.payload["kwargs"] == {
        "format_style": "boxed",
        "bonus": 1,
    }
    assert explicit.payload is not None and explicit.payload["kwargs"] == {
        "format_style": "hash",
        "bonus": 1,
    }
    assert other.payload is not None and other.payload["kwargs"] == {}
    assert default.key != explicit.key  # kwargs are part of the cache key
