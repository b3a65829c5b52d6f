"""An LRU cache of OK scores keyed by a hash of (function, completion, answer, kwargs).

GRPO samples n completions per prompt and short answers repeat ("#### 18" many times in
a group, the same prompt in later epochs), so identical items are common. Only OK results
are kept: a TIMEOUT or ERROR may be transient and must be retried, not remembered.

The key hashes every input the function sees except the prompt and the token ids: a
function whose value depends on those should run with `reward.cache: false`.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any


def cache_key(fn_path: str, completion: bytes, answer: str, kwargs: dict[str, Any]) -> bytes:
    """SHA-256 over length-prefixed fields, so that no two different inputs share a key
    by concatenation (`"ab"+"c"` vs `"a"+"bc"`)."""
    h = hashlib.sha256()
    canonical_kwargs = json.dumps(kwargs, sort_keys=True, separators=(",", ":")).encode()
    for part in (fn_path.encode(), completion, answer.encode(), canonical_kwargs):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


class ScoreCache:
    """Bounded LRU from key to reward."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"cache max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._data: OrderedDict[bytes, float] = OrderedDict()

    def get(self, key: bytes) -> float | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: bytes, reward: float) -> None:
        self._data[key] = reward
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
