"""The built-in arithmetic task of the embedded demo: two-digit addition, GSM8K-style answers.

A row is `{"prompt": "12+34=", "answer": "#### 46", "id": "12+34"}`: the prompt is what the
policy sees, the answer what the `gsm8k` reward compares the completion with (the number after
`####`). The completion the policy should learn is the answer text itself followed by EOS.

Train and held-out ("valid") problems come from a fixed partition of all 90 x 90 operand pairs
(about one pair in ten is held out), so the two splits are disjoint whatever the seeds and sizes;
the seed only chooses and orders the rows within a split.
"""

from __future__ import annotations

import json
import os
import random
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

Split = Literal["train", "valid"]
OPERAND_RANGE = range(10, 100)
_ANSWER_RE = re.compile(r"####\s*(-?\d+)")


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def format_answer(value: int) -> str:
    """GSM8K's final-answer form."""
    return f"#### {value}"


def extract_answer(text: str) -> int | None:
    """The integer after the first `####` in `text`, or None."""
    m = _ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


def is_held_out(a: int, b: int) -> bool:
    """Fixed, seed-independent rule putting about 1 in 10 pairs in the held-out split.

    A hash, not a linear rule: any rule linear mod 10 depends only on the units digits
    (e.g. `a CRC32 hash of the pair` holds exactly when the units digits are equal), which would
    hold out whole units-digit sums the model then never sees in training.
    """
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


def _pool(split: Split) -> list[tuple[int, int]]:
    if split not in ("train", "valid"):
        raise ValueError(f"split={split!r}: use 'train' or 'valid'")
    want_valid = split == "valid"
    return [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE if is_held_out(a, b) == want_valid]


def make_row(a: int, b: int) -> dict[str, str]:
    return {"prompt": format_prompt(a, b), "answer": format_answer(a + b), "id": f"{a}+{b}"}


def generate_split(split: Split, n: int, seed: int) -> list[dict[str, str]]:
    """`n` rows of `split`, deterministic given `seed`.

    Rows are drawn without repetition while the split has enough distinct problems (train:
    7,279 pairs; valid: 821) and then cycle through fresh permutations, so a large training
    set simply repeats problems, as epochs would.
    """
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    pool = _pool(split)
    rng = random.Random(f"flywheel-arithmetic-{split}-{seed}")
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        order = pool[:]
        rng.shuffle(order)
        rows.extend(make_row(a, b) for a, b in order[: n - len(rows)])
    return rows


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, object]]) -> Path:
    """Write rows as JSON lines (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def write_splits(
    directory: str | os.PathLike[str], *, n_train: int, n_valid: int, seed: int
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `valid.jsonl` into `directory`; returns their paths."""
    directory = Path(directory)
    train = write_jsonl(directory / "train.jsonl", generate_split("train", n_train, seed))
    valid = write_jsonl(directory / "valid.jsonl", generate_split("valid", n_valid, seed))
    return train, valid
