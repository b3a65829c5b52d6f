"""The tiny Qwen2-VL checkpoint loads like a user's VLM directory, through the same code.

References: HF transformers' own loaders (`AutoConfig`, `AutoModelForImageTextToText`,
`AutoImageProcessor`, `PreTrainedTokenizerFast`) and Qwen2-VL's rule for image tokens
(`Qwen2VLProcessor`: one token per merge_size x merge_size patches of the image's grid).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_source import auto_model_class, is_vision_model_dir, load_tokenizer
from services.common.tiny_vlm import IMAGE_TOKEN, write_tiny_vlm
from services.common.vision_inputs import decode_image, load_vision_processor
from tests.vision_fixtures import scene_png, tiny_vlm_dir  # noqa: F401  (fixture)


def test_loads_through_model_source_like_a_user_checkpoint(tiny_vlm_dir: Path) -> None:  # noqa: F811
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        Qwen2VLForConditionalGeneration,
    )

    assert is_vision_model_dir(tiny_vlm_dir)
    assert auto_model_class(tiny_vlm_dir) is AutoModelForImageTextToText
    model = auto_model_class(tiny_vlm_dir).from_pretrained(tiny_vlm_dir)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    cfg = AutoConfig.from_pretrained(tiny_vlm_dir)
    assert cfg.model_type == "qwen2_vl"
    # head_dim 64 / 4 = 16: 8 rotary frequency pairs split over (time, row, column).
    assert cfg.text_config.rope_scaling["mrope_section"] == [2, 3, 3]
    tok = load_tokenizer(tiny_vlm_dir)
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == cfg.image_token_id
    assert tok.decode(tok("How many?").input_ids) == "How many?"


def test_prompt_expands_each_image_to_its_grid(tiny_vlm_dir: Path) -> None:  # noqa: F811
    proc = load_vision_processor(tiny_vlm_dir)
    images = [scene_png(4, 1), scene_png(6, 2)]
    text = proc.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}],
            }
        ]
    )
    assert text.count(IMAGE_TOKEN) == 2
    ids = proc.encode_prompt(text, images)
    inputs = proc.pixel_inputs(images)
    # 56x56 pixels / 14-pixel patches = 4x4 patches; 2x2 merged: 4 tokens per image.
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert sum(t == proc.image_token_id for t in ids) == 8
    # 16 patches per image, each 3 channels x 2 frames x 14 x 14 values.
    assert tuple(inputs.pixel_values.shape) == (32, 3 * 2 * 14 * 14)
    proc.check_prompt(ids, inputs)
    with pytest.raises(ValueError, match="image placeholders"):
        proc.encode_prompt(text, images[:1])


def test_rewrite_is_idempotent_and_foreign_dirs_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "vlm"
    write_tiny_vlm(target)
    before = (target / "model.safetensors").stat().st_mtime_ns
    write_tiny_vlm(target)
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError):
        write_tiny_vlm(target, seed=1)
    with pytest.raises(ValueError, match="multiple of 28"):
        write_tiny_vlm(tmp_path / "other", image_size=50)


def test_corrupt_images_are_refused() -> None:
    with pytest.raises(ValueError, match="unreadable image"):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    assert decode_image(scene_png(2, 0)).size == (56, 56)
