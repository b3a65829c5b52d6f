"""The built-in arithmetic task: disjoint deterministic splits, GSM8K-style answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.rollout.data.arithmetic import (
    extract_answer,
    generate_split,
    is_held_out,
    write_splits,
)


def test_rows_are_two_digit_additions_with_gsm8k_answers() -> None:
    for row in generate_split("train", 200, seed=1):
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == f"#### {a + b}" and row["id"] == f"{a}+{b}"
        assert extract_answer(row["answer"]) == a + b


def test_splits_are_disjoint_whatever_the_seeds() -> None:
    train = {r["id"] for r in generate_split("train", 7279, seed=1)}
    valid = {r["id"] for r in generate_split("valid", 821, seed=2)}
    # 90*90 = 8100 pairs; the CRC32 rule holds out 821 of them (about one in ten)
    assert len(train) == 7279 and len(valid) == 821 and not train & valid
    assert all(is_held_out(*map(int, i.split("+"))) for i in valid)


def test_held_out_pairs_cover_units_digits_seen_in_training() -> None:
    """A rule linear mod 10 would hold out whole units-digit sums (e.g. all a0 == b0) that
    training never shows; the hash keeps every units-digit combination in both splits."""
    train = {
        (int(i.split("+")[0]) % 10, int(i.split("+")[1]) % 10)
        for i in (r["id"] for r in generate_split("train", 7279, seed=1))
    }
    valid = {
        (int(i.split("+")[0]) % 10, int(i.split("+")[1]) % 10)
        for i in (r["id"] for r in generate_split("valid", 821, seed=1))
    }
    assert len(train) == 100 and valid <= train


def test_deterministic_given_seed_and_repeats_beyond_the_pool() -> None:
    assert generate_split("valid", 50, seed=3) == generate_split("valid", 50, seed=3)
    assert generate_split("valid", 50, seed=3) != generate_split("valid", 50, seed=4)
    rows = generate_split("valid", 1000, seed=0)
    # 821 distinct problems, then a fresh permutation: 179 repeats
    assert len(rows) == 1000 and len({r["id"] for r in rows}) == 821
    with pytest.raises(ValueError, match="split="):
        generate_split("test", 1, seed=0)  # type: ignore[arg-type]


def test_extract_answer() -> None:
    assert extract_answer("so 12+34=46\n#### 46") == 46
    assert extract_answer("####-7") == -7
    assert extract_answer("46") is None


def test_write_splits_jsonl(tmp_path: Path) -> None:
    train, valid = write_splits(tmp_path / "data", n_train=5, n_valid=3, seed=0)
    lines = train.read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0]).keys() == {"prompt", "answer", "id"}
    assert len(valid.read_text().splitlines()) == 3
