"""Supervised fine-tuning of a vision-language model on rows with images
(`services/trainer/sft_vision.py` and its use in `services/trainer/sft.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from services import cli
from services.common.datasets import DatasetError
from services.common.vision_inputs import load_vision_processor
from services.trainer.sft import sft_batch
from services.trainer.sft_vision import encode_vision_rows
from tests.vision_fixtures import scene_png, tiny_vlm_dir  # noqa: F401

QUESTION = "How many objects are there?"


def _rows(tmp_path: Path, counts: list[int]) -> list[dict[str, object]]:
    """Counting rows whose images are PNG files beside the data (paths relative to it)."""
    (tmp_path / "img").mkdir(exist_ok=True)
    rows: list[dict[str, object]] = []
    for i, n in enumerate(counts):
        name = f"img/{i}.png"
        (tmp_path / name).write_bytes(scene_png(n, seed=100 + i))
        rows.append({"question": QUESTION, "answer": str(n), "images": [name]})
    return rows


def test_rows_become_the_processors_prompt_ids_with_their_images(
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    processor = load_vision_processor(tiny_vlm_dir)
    rows = _rows(tmp_path, [3, 7])
    examples, images = encode_vision_rows(processor, rows, "prompt", "answer", base_dir=tmp_path)
    assert [img[0] for img in images] == [(tmp_path / f"img/{i}.png").read_bytes() for i in (0, 1)]
    tok = processor.tokenizer
    for (prompt, answer), row, imgs in zip(examples, rows, images, strict=True):
        # The ids the rollout engine generates from: the chat template's placeholder
        # expanded to the image's tokens (56 x 56 pixels: 4 x 4 patches, 2 x 2 merged = 4).
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ]
        want = processor.encode_prompt(processor.apply_chat_template(messages), list(imgs))
        assert prompt == want
        assert sum(1 for t in prompt if t == processor.image_token_id) == 4
        assert answer == [tok.convert_tokens_to_ids(str(row["answer"])), tok.eos_token_id]
    mb = sft_batch(examples, tok.pad_token_id, images)
    assert mb.images == tuple(images)
    assert sft_batch(examples, tok.pad_token_id).images is None


def test_a_row_with_a_missing_image_is_named(
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    rows = _rows(tmp_path, [2, 5])
    rows[1]["images"] = ["img/absent.png"]
    with pytest.raises(DatasetError, match=r"row 1: image file .*absent.png does not exist"):
        encode_vision_rows(
            load_vision_processor(tiny_vlm_dir), rows, "prompt", "answer", base_dir=tmp_path
        )


def _config(tmp_path: Path, model: Path, rows: list[dict[str, object]], lr: float) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "sft",
                "trial_name": "t",
                "seed": 1,
                "cluster": {"fileroot": str(tmp_path / "runs")},
                "total_train_steps": 2,
                "actor": {
                    "path": str(model),
                    "dtype": "float32",
                    "optimizer": {"lr": lr, "warmup_steps": 0, "weight_decay": 0.0},
                },
                "trainer": {"device": "cpu"},
                "rollout": {"workflow": "vision_rlvr"},
                "train_dataset": {"path": str(data), "batch_size": 4, "type": "sft"},
            }
        )
    )
    return config


def _answer_loss(
    model: torch.nn.Module,
    processor: object,
    rows: list[dict[str, object]],
    base: Path,
    images_from: list[int] | None = None,
) -> float:
    """Mean -log p of the answer tokens (digit + EOS) of `rows` under the HF model,
    one row at a time, with each row's image (or the image of row `images_from[i]`)."""
    examples, images = encode_vision_rows(processor, rows, "prompt", "answer", base_dir=base)
    total, count = 0.0, 0
    for i, (prompt, answer) in enumerate(examples):
        imgs = images[images_from[i] if images_from else i]
        v = processor.pixel_inputs(list(imgs))  # type: ignore[attr-defined]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = model(
                input_ids=ids, pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw
            ).logits
        logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
        total -= float(logp.gather(1, torch.tensor(answer)[:, None]).sum())
        count += len(answer)
    return total / count


def test_sft_of_a_vlm_trains_on_the_answers_with_the_rows_images(
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers import AutoModelForImageTextToText

    rows = _rows(tmp_path, [1, 4, 6, 9])
    # A learning rate of ~0 leaves the weights as they are: step 1's loss is the model's.
    config = _config(tmp_path, tiny_vlm_dir, rows, lr=1e-12)
    assert cli.main(["sft", "--config", str(config)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run_dir = tmp_path / "runs" / "sft" / "t"
    records = [json.loads(x) for x in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert records[0]["n_tokens"] == 8  # 4 rows x (digit + EOS)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    processor = load_vision_processor(tiny_vlm_dir)
    own = _answer_loss(model, processor, rows, tmp_path)
    assert records[0]["loss"] == pytest.approx(own, abs=2e-5)
    # The images are in that loss: the same answers with the images shifted by one row
    # score differently.
    shifted = _answer_loss(model, processor, rows, tmp_path, images_from=[1, 2, 3, 0])
    assert abs(shifted - own) > 2e-4  # 5e-4 here: a random tower, faint features
    # The export is a VLM directory the processor and the model load from.
    exported = Path(summary["model"])
    assert (exported / "preprocessor_config.json").is_file()
    assert AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32) is not None


def test_image_rows_for_a_text_model_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from services.common.config import FlywheelConfig
    from services.trainer.sft import check_sft_inputs

    rows = _rows(tmp_path, [2, 3, 4, 5])
    config = yaml.safe_load(_config(tmp_path, tiny_model_dir, rows, lr=1e-3).read_text())
    # The loader refuses this file already (vision_rlvr on a text model); a config built
    # in code, as the launcher's warm start builds one, meets SFT's own check.
    cfg = FlywheelConfig.model_validate({**config, "rollout": {}})
    with pytest.raises(ValueError, match="has images but actor.path .* is not a local vision"):
        check_sft_inputs(cfg, 0.0)
