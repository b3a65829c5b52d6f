"""Supervised fine-tuning (`services/trainer/sft.py`, `flywheel sft`): the trainer's engine
on prompt/answer rows, loss on the answer tokens only (AReaL's SFT loss masks the prompt)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from services import cli
from services.trainer.sft import sft_batch

AREAL_SRC = os.environ.get("AREAL_SRC", "")


def test_the_loss_mask_covers_the_answer_and_eos_only() -> None:
    # prompt [5, 6] + answer [7, 1(eos)]; prompt [8] + answer [9, 10, 1]; pad 0.
    mb = sft_batch([([5, 6], [7, 1]), ([8], [9, 10, 1])], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 1], [8, 9, 10, 1]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    mb = sft_batch([([5], [7, 1]), ([8, 8, 8], [9, 1])], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 7, 1, 0, 0], [8, 8, 8, 9, 1]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
    assert mb.attention_mask.tolist()[0] == [True, True, True, False, False]


@pytest.mark.slow
def test_sft_teaches_the_answers_and_exports_the_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": f"#### {a + b}"} for a in range(4) for b in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "sft",
                "trial_name": "t",
                "cluster": {"fileroot": str(tmp_path / "runs")},
                "total_train_steps": 200,
                "actor": {
                    "path": str(tiny_model_dir),
                    "dtype": "float32",
                    "optimizer": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
                },
                "trainer": {"device": "cpu"},
                "train_dataset": {"path": str(data), "batch_size": 8, "type": "sft"},
            }
        )
    )
    assert cli.main(["sft", "--config", str(config)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 200
    run_dir = tmp_path / "runs" / "sft" / "t"
    lines = [json.loads(x) for x in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 201))
    # Every step trains 8 rows of answer tokens: "#### N" (6 or 7 tokens) + EOS.
    assert all(56 <= r["n_tokens"] <= 64 for r in lines)
    assert lines[-1]["loss"] < 0.25 * lines[0]["loss"]

    # The exported model answers a training prompt greedily with the trained answer.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["model"], torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(summary["model"])
    ids = tok("2+3=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.strip() == "#### 5"
    assert (run_dir / "tensorboard").is_dir()  # the tracking block's event files


@pytest.mark.skipif(
    not AREAL_SRC or not (Path(AREAL_SRC) / "examples/math/gsm8k_sft.yaml").is_file(),
    reason="AReaL's gsm8k_sft.yaml is in no registry package and is not copied here (see "
    "tests/common/config/test_areal_compat.py): set AREAL_SRC to an AReaL checkout",
)
def test_areals_gsm8k_sft_yaml_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(tmp_path))
    path = Path(AREAL_SRC) / "examples/math/gsm8k_sft.yaml"
    assert cli.main(["sft", "--config", str(path), "--dry-run"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["train_dataset"]["type"] == "sft"
    assert resolved["actor"]["optimizer"]["lr"] == pytest.approx(2e-5, rel=0, abs=1e-12)
