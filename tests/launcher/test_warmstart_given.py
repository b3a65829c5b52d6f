"""The warm start of a given model (`launcher.warm_start.rows_fn`,
services/launcher/warmstart_given.py): `prepare_model` runs `flywheel sft` on the rows the
user's function writes, replaces `actor.path` with the result and reuses it next time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import FlywheelConfig
from services.common.tiny_model import write_tiny_model
from services.launcher.assets import prepare_model
from services.launcher.warmstart import sft_run_dir
from services.rollout.data.arithmetic import write_jsonl


def _cfg(tmp_path: Path, rows_fn: str, **warm: object) -> FlywheelConfig:
    base = write_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2)
    data = tmp_path / "train.jsonl"
    write_jsonl(
        data, [{"prompt": f"What is {i} * 3?", "answer": f"#### {3 * i}"} for i in range(6)]
    )
    return FlywheelConfig.model_validate(
        {
            "actor": {"path": str(base)},
            "ref": {"path": str(base)},
            "train_dataset": {"path": str(data)},
            "launcher": {
                "warm_start": {"rows_fn": rows_fn, "steps": 2, "batch_size": 4, "lr": 1e-3, **warm}
            },
        }
    )


def test_a_given_model_is_warm_started_on_the_functions_rows_once(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tests.launcher.warm_rows:transcripts")
    base = cfg.actor.path
    run_dir = tmp_path / "run"
    lines: list[str] = []
    prepare_model(cfg, run_dir, log=lines.append)
    out = run_dir / "model" / "sft"
    assert cfg.actor.path == str(out) and cfg.ref is not None and cfg.ref.path == str(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    stats = json.loads((out / "warm_start.json").read_text())
    assert stats["warm_start_seconds"] > 0 and stats["sft_run"] == str(sft_run_dir(out))
    data = [json.loads(x) for x in (sft_run_dir(out) / "data.jsonl").read_text().splitlines()]
    assert len(data) == 12 and data[0]["answer"] == "<call>x</call>"  # as written, no `####`
    steps = (sft_run_dir(out) / "sft_metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
    assert any("warm start step 2/2" in line for line in lines)

    again = _cfg(tmp_path / "again", "tests.launcher.warm_rows:transcripts")
    lines.clear()
    prepare_model(again, run_dir, log=lines.append)
    assert again.actor.path == str(out)
    assert lines == [f"warm start: reusing {out}"]
    assert base != cfg.actor.path


def test_without_rows_fn_a_given_model_is_left_as_it_is(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tests.launcher.warm_rows:transcripts")
    cfg.launcher.warm_start.rows_fn = None
    base = cfg.actor.path
    prepare_model(cfg, tmp_path / "run")
    assert cfg.actor.path == base
    assert not (tmp_path / "run" / "model").exists()


def test_rows_without_answers_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tests.launcher.warm_rows:not_rows")
    with pytest.raises(ValueError, match="rows_fn='tests.launcher.warm_rows:not_rows' must"):
        prepare_model(cfg, tmp_path / "run")
