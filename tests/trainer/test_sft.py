"""Supervised fine-tuning (`services/trainer/sft.py`, `flywheel sft`): the trainer's engine
on prompt/answer rows, loss on the answer tokens only (AReaL's SFT loss masks the prompt)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import yaml

from services import cli
from services.trainer.sft import sft_batch, smoothed_token_loss

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


def _sft_config(
    tmp_path: Path,
    model: Path,
    rows: list[dict[str, str]],
    *,
    steps: int = 3,
    batch_size: int = 4,
    **optim: float,
) -> Path:
    """A `flywheel sft` config file: `rows` as JSONL, float32 on the CPU, no weight decay."""
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
                "total_train_steps": steps,
                "actor": {
                    "path": str(model),
                    "dtype": "float32",
                    "optimizer": {"warmup_steps": 0, "weight_decay": 0.0, **optim},
                },
                "trainer": {"device": "cpu"},
                "train_dataset": {"path": str(data), "batch_size": batch_size, "type": "sft"},
            }
        )
    )
    return config


@pytest.mark.slow
def test_sft_teaches_the_answers_and_exports_the_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": f"#### {a + b}"} for a in range(4) for b in range(4)]
    config = _sft_config(tmp_path, tiny_model_dir, rows, steps=200, batch_size=8, lr=3e-3)
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


@pytest.mark.parametrize("first_position", [0, 3])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.2])
def test_smoothed_token_loss_is_torchs_label_smoothed_cross_entropy(
    smoothing: float, first_position: int
) -> None:
    gen = torch.Generator().manual_seed(7)
    b, t, v = 3, 9, 11
    full = torch.randn(b, t, v, generator=gen) * 3.0
    ids = torch.randint(0, v, (b, t), generator=gen)
    got = smoothed_token_loss(
        full[:, first_position:], ids, smoothing, first_position=first_position
    )
    # Reference, position by position: torch's cross_entropy of the output at t-1 against
    # ids[t] with label_smoothing (its definition: (1 - e) * NLL + e * mean over classes of
    # -log p); 0 where these outputs predict nothing (t <= first_position).
    want = torch.zeros(b, t)
    for pos in range(first_position + 1, t):
        want[:, pos] = torch.nn.functional.cross_entropy(
            full[:, pos - 1], ids[:, pos], label_smoothing=smoothing, reduction="none"
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if smoothing == 0.0:
        # e = 0 is AReaL's SFT loss per token (compute_packed_sft_loss in its lm_engine.py:
        # -log p of the next token, gathered from the log-softmax).
        nll = -torch.log_softmax(full[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(
            got[:, first_position + 1 :], nll[:, first_position:], rtol=1e-5, atol=1e-5
        )


@pytest.mark.slow
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_first_loss_is_the_cross_entropy_of_the_base_model_with_the_smoothing_asked(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], smoothing: float
) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": f"#### {a + b}"} for a in range(3) for b in range(4)]
    config = _sft_config(tmp_path, tiny_model_dir, rows, lr=1e-3, warmup_steps=2)
    argv = ["sft", "--config", str(config), "--label-smoothing", str(smoothing)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    run_dir = tmp_path / "runs" / "sft" / "t"
    records = [json.loads(x) for x in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    # The rate each step used (services/trainer/optim.py lr_factor): warm-up (s + 1) / 2 of
    # the peak at step s = 0, 1, then the peak (constant schedule).
    assert [r["lr"] for r in records] == pytest.approx([0.5e-3, 1e-3, 1e-3], rel=1e-12)

    # The base model on the first batch of epoch 0 (seed 1: the shuffle "1-sft-0"), one row
    # at a time without padding: the answer tokens + EOS, each predicted by the output before.
    # smoothing 0: the mean of -log p over those tokens, AReaL's SFT loss
    # (compute_packed_sft_loss: -sum(masked log p) / count(mask)); smoothing e: torch's
    # cross_entropy(label_smoothing=e) averaged over the same tokens.
    from transformers import AutoModelForCausalLM

    from services.common.model_source import load_tokenizer

    # The tokenizer run_sft reads: on transformers 5 AutoTokenizer maps this directory to
    # Qwen2Tokenizer, which drops the answer's space token that tokenizer.json keeps.
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    order = list(range(len(rows)))
    random.Random("1-sft-0").shuffle(order)
    total, nll, count = 0.0, 0.0, 0
    with torch.no_grad():
        for i in order[:4]:
            prompt = tok(rows[i]["prompt"], add_special_tokens=False)["input_ids"]
            answer = tok(rows[i]["answer"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer + [tok.eos_token_id]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            target = ids[0, len(prompt) :]
            ce = torch.nn.functional.cross_entropy
            total += float(ce(logits, target, label_smoothing=smoothing, reduction="sum"))
            nll += float(-torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum())
            count += len(target)
    assert records[0]["n_tokens"] == count
    # float32 sums over ~30 tokens, batched and padded against one row at a time.
    assert records[0]["loss"] == pytest.approx(total / count, rel=1e-5)
    if smoothing == 0.0:
        assert records[0]["loss"] == pytest.approx(nll / count, rel=1e-5)
    else:
        assert abs(records[0]["loss"] - nll / count) > 1e-2  # the smoothing is in the loss


def test_label_smoothing_outside_0_1_is_refused(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": "1+1=", "answer": "#### 2"}] * 4
    config = _sft_config(tmp_path, tiny_model_dir, rows, lr=1e-3)
    assert cli.main(["sft", "--config", str(config), "--label-smoothing", "1.0"]) == 2
    assert "label_smoothing=1.0: expected a value in [0, 1)" in capsys.readouterr().err


def test_a_text_model_on_image_rows_is_refused_at_load(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"question": "How many?", "answer": "2", "images": ["a.png"]}] * 4
    # A text model on image rows: the config refuses the text workflow at load (SFT of a
    # vision-language model on such rows: tests/trainer/test_sft_vision.py).
    config = _sft_config(tmp_path, tiny_model_dir, rows, lr=1e-3)
    assert cli.main(["sft", "--config", str(config)]) == 2
    assert "has images: the rlvr workflow would drop its images" in capsys.readouterr().err
