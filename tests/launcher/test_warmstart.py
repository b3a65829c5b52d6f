"""The demo's warm start is a `flywheel sft` run (services/launcher/warmstart.py) that
`prepare_model` (services/launcher/assets.py) runs once and then finds by its
`warm_start.json`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.config.launcher import WarmStartConfig
from services.common.tiny_model import write_tiny_model
from services.launcher.assets import prepare_model
from services.launcher.warmstart import sft_run_dir, target_text, warm_start
from services.rollout.data import arithmetic
from services.rollout.data.arithmetic import write_jsonl

pytestmark = [pytest.mark.slow]


def _metrics(out: Path) -> list[dict]:
    text = (sft_run_dir(out) / "sft_metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_the_warm_start_is_an_sft_run_with_the_smoothed_loss_and_its_schedule(
    tmp_path: Path,
) -> None:
    base = write_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2)
    rows = arithmetic.generate_split("train", 24, seed=3)
    ws = WarmStartConfig(steps=4, batch_size=8, lr=1e-3, warmup_steps=3, label_smoothing=0.2)
    out = tmp_path / "sft"
    lines: list[str] = []

    stats = warm_start(base, out, rows, ws, log=lines.append)

    records = _metrics(out)
    summary = json.loads((sft_run_dir(out) / "sft" / "summary.json").read_text())
    # What `flywheel sft` writes: a record per optimizer step, its summary and export.
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert summary["steps"] == 4 and summary["last_loss"] == records[-1]["loss"]
    assert stats["warm_start_loss"] == records[-1]["loss"]
    assert any("step 4/4" in line for line in lines)
    # The rate each step used (services/trainer/optim.py lr_factor): warm-up (s + 1) / 3 of
    # the peak at s = 0, 1, 2, then the peak (cosine_decay off: constant).
    assert [r["lr"] for r in records] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])

    # The first loss is torch's cross_entropy with label_smoothing 0.2 of the base model on
    # the answer tokens (+ EOS, in the `#### N` form) of the first batch of epoch 0 (the
    # SFT run's seeded shuffle "<seed>-sft-0"), one row at a time, no padding.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    order = list(range(len(rows)))
    random.Random(f"{ws.seed}-sft-0").shuffle(order)
    smoothed, plain, count = 0.0, 0.0, 0
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        for i in order[:8]:
            prompt = tok(rows[i]["prompt"], add_special_tokens=False)["input_ids"]
            answer = tok(target_text(rows[i]), add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer + [tok.eos_token_id]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            target = ids[0, len(prompt) :]
            smoothed += float(ce(logits, target, label_smoothing=0.2, reduction="sum"))
            plain += float(ce(logits, target, reduction="sum"))
            count += len(target)
    assert records[0]["n_tokens"] == count
    # float32 sums over ~60 tokens, batched and padded against one row at a time.
    assert records[0]["loss"] == pytest.approx(smoothed / count, rel=1e-5)
    assert abs(records[0]["loss"] - plain / count) > 1e-2  # the smoothing is in the loss

    # The model dir is the SFT run's export, byte for byte, with its tokenizer, and it moved.
    assert (out / "model.safetensors").read_bytes() == (
        Path(summary["model"]) / "model.safetensors"
    ).read_bytes()
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == tok.get_vocab()
    trained = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), trained.state_dict().values(), strict=True)
    )


def _demo_config(data: Path) -> FlywheelConfig:
    return FlywheelConfig.model_validate(
        {
            "trainer": {"device": "cpu"},
            "train_dataset": {"path": str(data)},
            "launcher": {
                "tiny_model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
                # The cosine of cosine_decay: after W = 2 warm-up steps, progress
                # (s - 2) / (6 - 2 - 1) and factor 0.1 + 0.9 * (1 + cos(pi * progress)) / 2.
                "warm_start": {
                    "steps": 6,
                    "batch_size": 4,
                    "lr": 1e-3,
                    "warmup_steps": 2,
                    "cosine_decay": True,
                    "label_smoothing": 0.2,
                },
            },
        }
    )


def test_prepare_model_warm_starts_once_and_the_rl_run_loads_the_export(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    write_jsonl(data, arithmetic.generate_split("train", 16, seed=1))
    cfg = _demo_config(data)
    run = tmp_path / "run"
    prepare_model(cfg, run, log=lambda _: None)

    sft = run / "model" / "sft"
    # The RL services load the warm-started model: the export, tokenizer included.
    assert (cfg.actor.path, cfg.tokenizer_path) == (str(sft), str(sft))
    assert json.loads((sft / "warm_start.json").read_text())["sft_run"] == str(sft_run_dir(sft))
    lrs = [r["lr"] for r in _metrics(sft)]
    factors = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 3)) for k in range(4)]
    # = 0.5, 1, 1, 0.775, 0.325, 0.1 of the peak
    assert lrs == pytest.approx([1e-3 * f for f in factors], rel=1e-9)
    weights = (sft / "model.safetensors").read_bytes()

    # warm_start.json marks it done: a second launch (a resume, `flywheel eval`) trains
    # nothing and loads the same model.
    (sft_run_dir(sft) / "sft_metrics.jsonl").unlink()
    again = _demo_config(data)
    prepare_model(again, run, log=lambda _: None)
    assert again.actor.path == str(sft)
    assert not (sft_run_dir(sft) / "sft_metrics.jsonl").exists()
    assert (sft / "model.safetensors").read_bytes() == weights
