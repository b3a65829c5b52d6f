"""What `flywheel run` prepares for a vision run (`services/launcher/assets.py`): the
counting images, the tiny Qwen2-VL and its supervised warm start on the images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import FlywheelConfig
from services.common.vision_inputs import load_vision_processor
from services.launcher.assets import prepare_data, prepare_model
from services.launcher.warmstart import sft_run_dir
from services.rollout.data.datasets import read_rows


def _config(**launcher: object) -> FlywheelConfig:
    return FlywheelConfig.model_validate(
        {
            "seed": 2,
            "rollout": {"workflow": "vision_rlvr"},
            "reward": {"fn": "clevr_count"},
            "train_dataset": {"builtin": "counting", "builtin_size": 12},
            "valid_dataset": {"builtin": "counting", "builtin_size": 5},
            "launcher": {
                "tiny_vlm": {"image_size": 56, "hidden_size": 32, "vision_dim": 16},
                **launcher,
            },
        }
    )


def test_counting_splits_are_written_with_their_images(tmp_path: Path) -> None:
    from PIL import Image

    cfg = _config()
    prepare_data(cfg, tmp_path)
    assert cfg.train_dataset.path == str(tmp_path / "data" / "train.jsonl")
    assert cfg.valid_dataset is not None
    train = read_rows(str(cfg.train_dataset.path))
    valid = read_rows(str(cfg.valid_dataset.path))
    assert (len(train), len(valid)) == (12, 5)
    for row in train + valid:
        assert 1 <= int(row["answer"]) <= 9
        with Image.open(tmp_path / "data" / row["images"][0]) as img:
            assert img.size == (56, 56)  # drawn at launcher.tiny_vlm.image_size


def test_counting_under_a_text_workflow_is_refused(tmp_path: Path) -> None:
    cfg = _config()
    cfg.rollout.workflow = "rlvr"
    with pytest.raises(ValueError, match="set rollout.workflow: vision_rlvr"):
        prepare_data(cfg, tmp_path)


def test_the_tiny_vlm_is_warm_started_on_the_images(tmp_path: Path) -> None:
    cfg = _config(warm_start={"steps": 3, "batch_size": 4, "lr": 1e-3, "warmup_steps": 0})
    prepare_data(cfg, tmp_path)
    prepare_model(cfg, tmp_path, log=lambda _: None)
    sft = tmp_path / "model" / "sft"
    assert (cfg.actor.path, cfg.tokenizer_path) == (str(sft), str(sft))
    config = json.loads((sft / "config.json").read_text())
    assert config["vision_config"]["embed_dim"] == 16  # the tiny VLM of launcher.tiny_vlm
    # The processor loads from the export (56 x 56 pixels: 4 image tokens per image).
    processor = load_vision_processor(sft)
    assert processor.image_processor.max_pixels == 56 * 56
    # The SFT rows: each train row's question, its digit, its image by absolute path.
    run = sft_run_dir(sft)
    rows = read_rows(run / "data.jsonl")
    train = read_rows(str(cfg.train_dataset.path))
    assert [r["answer"] for r in rows] == [r["answer"] for r in train]
    assert rows[0]["images"] == [str(tmp_path / "data" / train[0]["images"][0])]
    records = [json.loads(x) for x in (run / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["n_tokens"] for r in records] == [8, 8, 8]  # 4 rows x (digit + EOS)
