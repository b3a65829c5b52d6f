"""Score cache (`services/reward/cache.py`)."""

from __future__ import annotations

from services.reward.cache import ScoreCache, cache_key


def test_key_separates_fields_and_sorts_kwargs() -> None:
    k = cache_key("m:f", b"ab", "c", {})
    assert k != cache_key("m:f", b"a", "bc", {})  # no concatenation collisions
    assert k != cache_key("m:g", b"ab", "c", {})
    assert cache_key("m:f", b"x", "1", {"a": 1, "b": 2}) == cache_key(
        "m:f", b"x", "1", {"b": 2, "a": 1}
    )
    assert cache_key("m:f", b"x", "1", {"a": 1}) != cache_key("m:f", b"x", "1", {"a": 2})


def test_lru_eviction_keeps_recently_used() -> None:
    cache = ScoreCache(2)
    cache.put(b"a", 1.0)
    cache.put(b"b", 0.0)
    assert cache.get(b"a") == 1.0  # touches a: b is now the oldest
    cache.put(b"c", 0.5)
    assert cache.get(b"b") is None
    assert cache.get(b"a") == 1.0 and cache.get(b"c") == 0.5
    assert len(cache) == 2
