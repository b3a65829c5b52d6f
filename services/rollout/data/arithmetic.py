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
from collections.abc import Callable, Iterable, Mapping
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
    return _cycle(_pool(split), n, random.Random(f"flywheel-arithmetic-{split}-{seed}"), make_row)


def _cycle(
    pool: list[tuple[int, int]],
    n: int,
    rng: random.Random,
    make: Callable[[int, int], dict[str, str]],
) -> list[dict[str, str]]:
    """`n` rows over `pool`: a shuffled pass, then fresh passes while more are asked for."""
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        order = pool[:]
        rng.shuffle(order)
        rows.extend(make(a, b) for a, b in order[: n - len(rows)])
    return rows


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, object]]) -> Path:
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


# --------------------------------------------------------------------------------------
# Chat-style sums for a pretrained instruct model (examples/smollm2_math.yaml).
#
# A row is `{"prompt": "What is 3 + 4? Answer with just the number.", "answer": "#### 7",
# "id": "3+4"}`: the prompt is one user message (the rollout renders it through the
# model's chat template), the answer is GSM8K-style for the `gsm8k` reward, which reads
# the model's final number ("3 + 4 = 7", "7", "The answer is 7."). Operands are 0-9, so
# there are only 100 problems: the held-out split is a fixed fifth of them (by a hash, as
# above), and `generate_sums` cycles through a split to give the rows a run asks for (each
# held-out problem then appears several times, every sample scored independently).

SUM_QUESTION = "What is {a} + {b}? Answer with just the number."
SUM_OPERANDS = range(10)


def is_held_out_sum(a: int, b: int) -> bool:
    """About one single-digit pair in five is held out (a hash of the pair, seed-free)."""
    return zlib.crc32(f"sum:{a}+{b}".encode()) % 5 == 0


def make_sum_row(a: int, b: int) -> dict[str, str]:
    return {
        "prompt": SUM_QUESTION.format(a=a, b=b),
        "answer": format_answer(a + b),
        "id": f"{a}+{b}",
    }


def generate_sums(split: Split, n: int, seed: int) -> list[dict[str, str]]:
    """`n` chat-style single-digit sums of `split`, deterministic given `seed`; the split's
    problems in a shuffled order, repeated (fresh order each pass) when `n` exceeds them."""
    if split not in ("train", "valid"):
        raise ValueError(f"split={split!r}: use 'train' or 'valid'")
    want_valid = split == "valid"
    pool = [
        (a, b) for a in SUM_OPERANDS for b in SUM_OPERANDS if is_held_out_sum(a, b) == want_valid
    ]
    return _cycle(pool, n, random.Random(f"flywheel-sums-{split}-{seed}"), make_sum_row)


def main(argv: list[str] | None = None) -> None:
    """Write the shipped sum data sets: `python -m services.rollout.data.arithmetic sums DIR`."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("kind", choices=["sums"])
    p.add_argument("directory")
    p.add_argument("--n-valid", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.directory)
    n_train = len([1 for a in SUM_OPERANDS for b in SUM_OPERANDS if not is_held_out_sum(a, b)])
    write_jsonl(out / "train.jsonl", generate_sums("train", n_train, args.seed))
    write_jsonl(out / "valid.jsonl", generate_sums("valid", args.n_valid, args.seed))


if __name__ == "__main__":
    main()
