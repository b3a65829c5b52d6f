"""The chat-style single-digit sums of examples/smollm2_math.yaml."""

from __future__ import annotations

import json
from pathlib import Path

from services.reward.builtins import gsm8k_reward
from services.rollout.data import arithmetic

SHIPPED = Path(__file__).resolve().parents[3] / "examples" / "data" / "smollm2_sums"


def _ids(rows: list[dict[str, str]]) -> set[str]:
    return {r["id"] for r in rows}


def test_splits_partition_the_hundred_problems() -> None:
    train = arithmetic.generate_sums("train", 71, seed=0)
    valid = arithmetic.generate_sums("valid", 29, seed=0)
    assert len(_ids(train)) == 71 and len(_ids(valid)) == 29
    assert not _ids(train) & _ids(valid)
    assert len(_ids(train) | _ids(valid)) == 100
    # A different seed reorders, never moves a problem between splits.
    assert _ids(arithmetic.generate_sums("valid", 29, seed=5)) == _ids(valid)


def test_rows_ask_in_words_and_answer_gsm8k_style() -> None:
    row = arithmetic.make_sum_row(3, 4)
    assert row == {
        "prompt": "What is 3 + 4? Answer with just the number.",
        "answer": "#### 7",
        "id": "3+4",
    }
    # What SmolLM2 writes, as the gsm8k reward reads it (final number vs. the number after ####).
    for text, reward in [
        ("3 + 4 = 7", 1.0),
        ("7", 1.0),
        ("The answer is 7.", 1.0),
        ("3 + 4 = 8", 0.0),
        ("Seven", 0.0),
    ]:
        assert gsm8k_reward(row["prompt"], text, [], [], row["answer"]) == reward, text


def test_longer_splits_repeat_every_problem_evenly() -> None:
    rows = arithmetic.generate_sums("valid", 29 * 5 + 3, seed=0)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["id"]] = counts.get(r["id"], 0) + 1
    assert len(counts) == 29 and set(counts.values()) <= {5, 6}


def test_shipped_files_are_the_generator_output() -> None:
    def read(name: str) -> list[dict[str, str]]:
        return [json.loads(line) for line in (SHIPPED / name).read_text().splitlines()]

    assert read("train.jsonl") == arithmetic.generate_sums("train", 71, seed=0)
    assert read("valid.jsonl") == arithmetic.generate_sums("valid", 160, seed=0)
