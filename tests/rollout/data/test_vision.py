"""Vision data sets in AReaL's shapes: images by path, bytes or HF Image cell; bounds refused
by name, naming the file and row."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from services.common.image_bytes import ImageLimits
from services.rollout.data.datasets import DatasetError
from services.rollout.data.vision import VisionPromptDataset, load_images, vision_messages
from tests.image_samples import encoded


def test_areal_rows_load_with_images_by_path_bytes_and_hf_cell(tmp_path: Path) -> None:
    png, jpeg = encoded(30, 20), encoded(12, 12, "JPEG")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png)
    rows = [
        # AReaL's clevr_count_70k / geometry3k columns: problem (with <image>), answer, images
        {"problem": "<image>How many items?", "answer": "3", "images": ["imgs/a.png"]},
        {"problem": "Compare <image> and <image>.", "answer": "2", "images": [png, jpeg]},
        {"question": "Count.", "answer": "1", "images": [{"bytes": jpeg, "path": "x.jpg"}]},
    ]
    ds = VisionPromptDataset(rows, base_dir=tmp_path, shuffle=False, source="t.jsonl")
    assert [r.extra["images"] for r in ds.rows] == [[png], [png, jpeg], [jpeg]]
    assert ds.rows[0].prompt == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "How many items?"}],
        }
    ]
    assert [item["type"] for item in ds.rows[1].prompt[0]["content"]] == [
        "text",
        "image",
        "text",
        "image",
        "text",
    ]
    # No marker: images first, as a user's question about "the image" reads.
    assert ds.rows[2].prompt[0]["content"][0] == {"type": "image"}
    data = ds.next().as_data()
    assert data["answer"] == "3" and data["images"] == [png] and data["prompt_ids"] == []


def test_other_image_formats_are_re_encoded_as_png() -> None:
    from PIL import Image

    webp = encoded(9, 5, "WEBP")
    (png,) = load_images([webp], Path("."))
    assert png.startswith(b"\x89PNG")
    with Image.open(io.BytesIO(png)) as img:
        assert img.size == (9, 5)


@pytest.mark.parametrize(
    ("images", "why"),
    [
        ([b"neither png nor jpeg"], "not a PNG or JPEG"),
        (["missing.png"], "missing.png does not exist"),
        ([encoded(8, 8)] * 3, "3 images (limit 2 per prompt)"),
        ([encoded(101, 100)], "101x100 = 10100 pixels (limit 10000)"),
        ([encoded(8, 8) + b"\0" * 5000], "has 5"),
        ([3], "expected a path or bytes, got int"),
    ],
)
def test_bad_images_are_refused_naming_file_and_row(
    tmp_path: Path, images: list[object], why: str
) -> None:
    limits = ImageLimits(max_images=2, max_image_bytes=4096, max_pixels=10_000)
    rows = [{"problem": "ok", "answer": "1", "images": [encoded(4, 4)]}]
    rows.append({"problem": "?", "answer": "1", "images": images})
    with pytest.raises(DatasetError, match="t.jsonl row 1: .*" + re.escape(why)):
        VisionPromptDataset(rows, base_dir=tmp_path, source="t.jsonl", limits=limits)


def test_placeholders_must_match_the_images() -> None:
    with pytest.raises(DatasetError, match="2 image placeholders for 1 image"):
        vision_messages("<image> vs <image>", 1)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}]
    assert vision_messages(chat, 1) is chat


def test_from_config_reads_paths_relative_to_the_data_file(tmp_path: Path) -> None:
    from services.common.config import load_config

    (tmp_path / "img.png").write_bytes(encoded(6, 6))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "n?", "answer": "1", "images": ["img.png"]}) + "\n")
    cfg = load_config(None, [f"train_dataset.path={data}", "rollout.workflow=vision_rlvr"])
    ds = VisionPromptDataset.from_vision_config(cfg.train_dataset, processor=None)
    assert ds.rows[0].extra["images"] == [encoded(6, 6)]
    with pytest.raises(DatasetError, match="max_length with images needs the model's processor"):
        VisionPromptDataset([{"question": "q", "images": []}], max_length=8)


def test_a_single_image_column_named_image_is_read() -> None:
    png = encoded(5, 5)
    ds = VisionPromptDataset([{"question": "n?", "answer": "1", "image": {"bytes": png}}])
    assert ds.rows[0].extra["images"] == [png]
