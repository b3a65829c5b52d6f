"""The tiny Qwen2-VL model and counting images that the vision tests share.

Import the fixture into a test module (`from tests.vision_fixtures import tiny_vlm_dir`). The
model is written once per test session into the session's base temp directory; a second
module asking for it finds it there (`write_tiny_vlm` is idempotent).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.tiny_vlm import write_tiny_vlm
from services.rollout.data.counting import random_scene, render

IMAGE_SIZE = 56


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vlm(tmp_path_factory.getbasetemp() / "tiny_vlm", image_size=IMAGE_SIZE)


def scene_png(count: int, seed: int) -> bytes:
    """A counting scene with `count` shapes, as PNG bytes."""
    return render(random_scene(random.Random(seed), count, IMAGE_SIZE), IMAGE_SIZE)
