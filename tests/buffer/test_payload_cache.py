"""The buffer's in-memory payload cache (services/buffer/payload_cache.py): its byte bound,
eviction order and the admission check that keeps old bytes of a reused id from serving."""

from __future__ import annotations

import pytest

from services.buffer.payload_cache import PayloadCache


def test_a_hit_needs_the_same_admission() -> None:
    cache = PayloadCache(100)
    cache.add("g", "01:g", b"first")
    assert cache.get("g", "01:g") == b"first"
    assert cache.get("g", "02:g") is None  # the id was admitted again since: not these bytes
    assert cache.get("h", "01:g") is None


def test_bytes_are_bounded_and_the_oldest_entries_go_first() -> None:
    cache = PayloadCache(10)
    for gid in "abc":
        cache.add(gid, gid, gid.encode() * 4)  # 4 bytes each: the third pushes out the first
    assert (len(cache), cache.bytes) == (2, 8)
    assert cache.get("a", "a") is None and (cache.get("b", "b"), cache.get("c", "c")) == (
        b"bbbb",
        b"cccc",
    )
    cache.add("d", "d", b"y" * 10)  # exactly the bound: everything else goes
    assert (len(cache), cache.bytes) == (1, 10) and cache.get("d", "d") == b"y" * 10


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing() -> None:
    cache = PayloadCache(10)
    cache.add("a", "a", b"xxxx")
    cache.add("big", "big", b"z" * 11)
    assert cache.get("big", "big") is None and cache.get("a", "a") == b"xxxx"
    assert cache.bytes == 4


def test_discard_replace_and_clear_keep_the_byte_count_exact() -> None:
    cache = PayloadCache(100)
    cache.add("a", "1:a", b"12345")
    cache.add("b", "1:b", b"123")
    cache.add("a", "2:a", b"1")  # a new admission of the same id replaces the old bytes
    assert cache.bytes == 4 and cache.get("a", "2:a") == b"1" and cache.get("a", "1:a") is None
    cache.discard(["a", "never-added"])
    assert (len(cache), cache.bytes) == (1, 3)
    cache.clear()
    assert (len(cache), cache.bytes) == (0, 0)


def test_a_view_into_something_mutable_is_copied() -> None:
    request = bytearray(b"....payload....")
    cache = PayloadCache(100)
    cache.add("g", "g", memoryview(request)[4:11])
    request[4:11] = b"changed"
    got = cache.get("g", "g")
    assert type(got) is bytes and got == b"payload" and cache.bytes == 7


def test_views_into_one_request_share_it_and_count_it_once() -> None:
    request = b"<envelope>" + b"A" * 30 + b"B" * 30 + b"</envelope>"
    whole = memoryview(request)
    a, b = whole[10:40], whole[40:70]
    cache = PayloadCache(200)
    cache.add("a", "a", a)
    cache.add("b", "b", b)
    got = cache.get("a", "a")
    assert isinstance(got, memoryview) and got.obj is request and bytes(got) == b"A" * 30
    assert cache.bytes == len(request)  # the whole request is held, once
    cache.discard(["a"])
    assert cache.bytes == len(request)  # "b" still holds it
    cache.discard(["b"])
    assert (len(cache), cache.bytes) == (0, 0)


def test_eviction_frees_a_request_only_when_its_last_group_goes() -> None:
    first, second = b"1" * 40, b"2" * 40
    cache = PayloadCache(100)
    for i in range(4):
        cache.add(f"f{i}", "m", memoryview(first)[i * 10 : (i + 1) * 10])
    assert cache.bytes == 40
    cache.add("s0", "m", memoryview(second)[:10])
    assert cache.bytes == 80
    third = b"3" * 40  # 120 > 100: the oldest request goes, all four of its groups
    cache.add("t0", "m", memoryview(third)[:10])
    assert cache.bytes == 80 and len(cache) == 2
    assert [cache.get(g, "m") is None for g in ("f0", "f3", "s0", "t0")] == [
        True,
        True,
        False,
        False,
    ]


def test_a_request_larger_than_the_bound_keeps_only_a_copy_of_the_group() -> None:
    request = b"x" * 500
    cache = PayloadCache(100)
    cache.add("g", "g", memoryview(request)[:50])
    got = cache.get("g", "g")
    assert type(got) is bytes and len(got) == 50 and cache.bytes == 50


def test_zero_turns_it_off_and_negative_is_refused() -> None:
    off = PayloadCache(0)
    off.add("g", "g", b"x")
    assert not off.enabled and off.get("g", "g") is None and off.bytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PayloadCache(-1)
