"""The demo's warm start is a `flywheel sft` run (services/launcher/warmstart.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from services.common.config.launcher import WarmStartConfig
from services.common.tiny_model import write_tiny_model
from services.launcher.warmstart import sft_run_dir, target_text, warm_start
from services.rollout.data import arithmetic

pytestmark = [pytest.mark.slow]


def test_warm_start_is_an_sft_run_with_its_schedule_and_smoothed_loss(tmp_path: Path):
    base = write_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2)
    rows = arithmetic.generate_split("train", 24, seed=3)
    ws = WarmStartConfig(steps=4, batch_size=8, lr=1e-3, warmup_steps=3, label_smoothing=0.2)
    out = tmp_path / "sft"
    lines: list[str] = []

    stats = warm_start(base, out, rows, ws, log=lines.append)

    run_dir = sft_run_dir(out)
    records = [json.loads(x) for x in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "sft" / "summary.json").read_text())
    # What `flywheel sft` writes: one record per optimizer step, its summary and export.
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert summary["steps"] == 4 and summary["last_loss"] == records[-1]["loss"]
    assert stats["warm_start_loss"] == records[-1]["loss"]
    assert json.loads((out / "warm_start.json").read_text())["sft_run"] == str(run_dir)
    # actor.optimizer's schedule (services/trainer/optim.py lr_factor), recorded after
    # each step has advanced it: warm-up (s+1)/W with W = 3 gives 2/3 at s = 1, then the
    # peak (1.0 x 1e-3) from s = 2 on (constant: cosine_decay is off).
    expected = [2e-3 / 3, 1e-3, 1e-3, 1e-3]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-9)
    assert (out / "model.safetensors").read_bytes() == (
        Path(summary["model"]) / "model.safetensors"
    ).read_bytes()
    assert any("step 4/4" in line for line in lines)

    # The first step's loss is torch's cross-entropy with label smoothing 0.2 of the base
    # model on the answer tokens (+ EOS) of the first shuffled batch: sft.py's answer-token
    # loss with the smoothing the warm start passes, not plain NLL.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    order = list(range(len(rows)))
    random.Random(f"{ws.seed}-sft-0").shuffle(order)
    total, count, plain = 0.0, 0, 0.0
    with torch.no_grad():
        for i in order[:8]:
            prompt = tok(rows[i]["prompt"], add_special_tokens=False)["input_ids"]
            answer = tok(target_text(rows[i]), add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer + [tok.eos_token_id]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            target = ids[0, len(prompt) :]
            n = len(target)
            ce = torch.nn.functional.cross_entropy
            total += float(ce(logits, target, label_smoothing=0.2, reduction="sum"))
            plain += float(ce(logits, target, reduction="sum"))
            count += n
    assert records[0]["n_tokens"] == count
    assert records[0]["loss"] == pytest.approx(total / count, rel=1e-4)
    assert abs(records[0]["loss"] - plain / count) > 1e-3  # the smoothing is in the loss

    # The warm-started model is the one the RL run loads: its weights moved.
    trained = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), trained.state_dict().values(), strict=True)
    ]
    assert any(moved)
