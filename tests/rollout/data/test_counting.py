"""The synthetic counting data set: rows in AReaL's vision shape, images that show the count.

The count is checked against the rendered pixels, not the generator's own bookkeeping: the
number of 4-connected regions of non-background colour (a flood fill written here) equals the
row's answer.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from services.rollout.data.counting import (
    BACKGROUND,
    QUESTION,
    generate_scenes,
    is_held_out,
    render,
    scene_key,
    write_splits,
)


def _blobs(png: bytes) -> int:
    from PIL import Image

    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    fg = (px != np.array(BACKGROUND)).any(axis=-1)
    seen = np.zeros_like(fg)
    count = 0
    for y, x in zip(*np.nonzero(fg), strict=True):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if (
                    0 <= ny < fg.shape[0]
                    and 0 <= nx < fg.shape[1]
                    and fg[ny, nx]
                    and not seen[ny, nx]
                ):
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_rows_have_the_vision_shape_and_images_show_the_count(tmp_path: Path) -> None:
    train, valid = write_splits(tmp_path, n_train=60, n_valid=30, seed=3)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 60
    for row in rows:
        assert row["question"] == QUESTION
        assert row["answer"] in {str(n) for n in range(1, 10)}
        (image,) = row["images"]
        assert _blobs((tmp_path / image).read_bytes()) == int(row["answer"])
    # Counts cover the range (uniform draw; 60 rows miss a count with probability < 1e-2).
    assert len(Counter(r["answer"] for r in rows)) >= 8
    assert len(valid.read_text().splitlines()) == 30


def test_splits_are_disjoint_and_seeded() -> None:
    train = generate_scenes("train", 300, seed=0, size=56)
    valid = generate_scenes("valid", 50, seed=0, size=56)
    assert not {scene_key(s) for s in train} & {scene_key(s) for s in valid}
    assert all(is_held_out(s) for s in valid) and not any(is_held_out(s) for s in train)
    assert generate_scenes("train", 20, seed=1, size=56) == generate_scenes(
        "train", 20, seed=1, size=56
    )
    assert generate_scenes("train", 20, seed=1, size=56) != generate_scenes(
        "train", 20, seed=2, size=56
    )
    assert _blobs(render(valid[0], 84)) == len(valid[0])
    with pytest.raises(ValueError, match="split"):
        generate_scenes("test", 1, seed=0, size=56)  # type: ignore[arg-type]
