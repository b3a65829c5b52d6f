"""3-digit × 2-digit products for the tool-math agent (`examples/smollm2_tool_math.yaml`).

A row is `{"prompt": "What is 347 * 28?", "answer": "#### 9716", "id": "347*28"}`. A
135M model cannot multiply these in its head; with the `calculator` tool it only has to
copy the operands into a call and the result into its answer. Held-out problems are a
fixed tenth of all 900 × 90 operand pairs (by a hash, seed-free), so train and held-out
never share a problem whatever the sizes.

    python -m examples.agents.tool_math_data examples/data/tool_math
"""

from __future__ import annotations

import argparse
import random
import zlib
from pathlib import Path

from services.rollout.data.arithmetic import format_answer, write_jsonl

QUESTION = "What is {a} * {b}?"
LEFT, RIGHT = range(100, 1000), range(10, 100)


def is_held_out(a: int, b: int) -> bool:
    return zlib.crc32(f"product:{a}*{b}".encode()) % 10 == 0


def make_row(a: int, b: int) -> dict[str, str]:
    return {"prompt": QUESTION.format(a=a, b=b), "answer": format_answer(a * b), "id": f"{a}*{b}"}


def generate(split: str, n: int, seed: int) -> list[dict[str, str]]:
    """`n` distinct problems of `split` (`train` or `valid`), deterministic given `seed`."""
    rng = random.Random(f"tool-math-{split}-{seed}")
    want = split == "valid"
    rows: list[dict[str, str]] = []
    seen: set[tuple[int, int]] = set()
    while len(rows) < n:
        a, b = rng.choice(LEFT), rng.choice(RIGHT)
        if (a, b) not in seen and is_held_out(a, b) == want:
            seen.add((a, b))
            rows.append(make_row(a, b))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-valid", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_jsonl(args.directory / "train.jsonl", generate("train", args.n_train, args.seed))
    write_jsonl(args.directory / "valid.jsonl", generate("valid", args.n_valid, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
