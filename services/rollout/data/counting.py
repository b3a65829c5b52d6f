"""A synthetic CLEVR-like counting task: 1 to 9 coloured shapes on a canvas, "how many?".

A row has AReaL's vision shape: `{"question": ..., "answer": "4", "images": [<png path>],
"id": ...}`. The question is what the policy reads beside the image, the answer is what the
`clevr_count` reward compares the completion's number with, and the image is a PNG file
beside the JSONL (a path relative to the data set file, as a user's data set names its
images). The completion the policy should learn is the digit itself.

A canvas is a 3 x 3 grid of cells; a scene puts one shape (square, disc or triangle, in one
of six colours, jittered inside its cell) into each of `count` distinct cells, so shapes never
overlap and the count is always visible. Train and held-out scenes come from a fixed,
seed-independent partition of scene descriptions (about one in ten is held out, by a hash),
so the splits are disjoint whatever the seeds and sizes; the seed only picks the scenes.
"""

from __future__ import annotations

import argparse
import io
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.rollout.data.arithmetic import write_jsonl

Split = Literal["train", "valid"]
QUESTION = "How many objects are there?"
COUNTS = range(1, 10)
GRID = 3
SHAPES = ("square", "disc", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 200),
    "cyan": (40, 200, 210),
}
BACKGROUND = (128, 128, 128)


@dataclass(frozen=True)
class Item:
    """One shape: its grid cell, kind, colour, and offset inside the cell (pixels)."""

    cell: int
    shape: str
    colour: str
    dx: int
    dy: int


def scene_key(items: tuple[Item, ...]) -> str:
    """A canonical description of a scene (what the split partition hashes)."""
    return ";".join(f"{i.cell}{i.shape[0]}{i.colour}{i.dx},{i.dy}" for i in items)


def is_held_out(items: tuple[Item, ...]) -> bool:
    """Fixed, seed-independent rule putting about one scene in ten in the held-out split."""
    return zlib.crc32(scene_key(items).encode()) % 10 == 0


def random_scene(rng: random.Random, count: int, size: int) -> tuple[Item, ...]:
    """`count` shapes in distinct cells, cells in ascending order."""
    if count not in COUNTS:
        raise ValueError(f"count={count}: must be in 1..9")
    cell = size // GRID
    shape_size = _shape_size(size)
    slack = max(0, cell - shape_size - 2)
    cells = sorted(rng.sample(range(GRID * GRID), count))
    return tuple(
        Item(
            cell=c,
            shape=rng.choice(SHAPES),
            colour=rng.choice(sorted(COLOURS)),
            dx=rng.randint(0, slack),
            dy=rng.randint(0, slack),
        )
        for c in cells
    )


def _shape_size(size: int) -> int:
    return max(4, (size // GRID) * 3 // 5)


def render(items: tuple[Item, ...], size: int) -> bytes:
    """The scene as PNG bytes, `size` x `size` pixels."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell, s = size // GRID, _shape_size(size)
    for it in items:
        x0 = (it.cell % GRID) * cell + 1 + it.dx
        y0 = (it.cell // GRID) * cell + 1 + it.dy
        box = (x0, y0, x0 + s - 1, y0 + s - 1)
        fill = COLOURS[it.colour]
        if it.shape == "square":
            draw.rectangle(box, fill=fill)
        elif it.shape == "disc":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x0 + s // 2, y0), (x0, y0 + s - 1), (x0 + s - 1, y0 + s - 1)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def generate_scenes(split: Split, n: int, seed: int, size: int) -> list[tuple[Item, ...]]:
    """`n` scenes of `split` (counts uniform over 1..9), deterministic given `seed`."""
    if split not in ("train", "valid"):
        raise ValueError(f"split={split!r}: use 'train' or 'valid'")
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    rng = random.Random(f"flywheel-counting-{split}-{seed}")
    want_valid = split == "valid"
    out: list[tuple[Item, ...]] = []
    while len(out) < n:
        scene = random_scene(rng, rng.choice(COUNTS), size)
        if is_held_out(scene) == want_valid:
            out.append(scene)
    return out


def make_row(items: tuple[Item, ...], image: str | bytes, index: int) -> dict[str, Any]:
    """AReaL's vision row: question, answer (the count as a digit), images."""
    return {"question": QUESTION, "answer": str(len(items)), "images": [image], "id": index}


def write_split(directory: str | Path, split: Split, n: int, *, seed: int, size: int = 84) -> Path:
    """Write `<split>.jsonl` and its PNGs (`<split>_images/<i>.png`) into `directory`.
    Image paths in the rows are relative to the JSONL file's directory."""
    directory = Path(directory)
    img_dir = directory / f"{split}_images"
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, scene in enumerate(generate_scenes(split, n, seed, size)):
        name = f"{split}_images/{i:06d}.png"
        (directory / name).write_bytes(render(scene, size))
        rows.append(make_row(scene, name, i))
    return write_jsonl(directory / f"{split}.jsonl", rows)


def write_splits(
    directory: str | Path, *, n_train: int, n_valid: int, seed: int, size: int = 84
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `valid.jsonl` (and their images) into `directory`."""
    return (
        write_split(directory, "train", n_train, seed=seed, size=size),
        write_split(directory, "valid", n_valid, seed=seed, size=size),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic counting data set.")
    parser.add_argument("directory")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-valid", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=84)
    args = parser.parse_args(argv)
    train, valid = write_splits(
        args.directory,
        n_train=args.n_train,
        n_valid=args.n_valid,
        seed=args.seed,
        size=args.size,
    )
    print(train, valid)


if __name__ == "__main__":
    main()
