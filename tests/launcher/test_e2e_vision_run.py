"""`flywheel run --config examples/vision_count.yaml`, shrunk to a few steps: the launcher
writes the tiny Qwen2-VL and the counting images, warm-starts the VLM on them, runs the
four services with images through the buffer, and evaluates the held-out rows with their
images. The machinery is checked here; learning is the demo's measurement
(docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vision_count.yaml"


def test_the_vision_demo_runs_through_every_service(tmp_path: Path) -> None:
    overrides = [
        f"cluster.fileroot={tmp_path / 'runs'}",
        "trial_name=t",
        "total_train_steps=3",
        "launcher.progress=false",
        "launcher.tiny_vlm.image_size=56",
        "launcher.tiny_vlm.hidden_size=32",
        "launcher.warm_start.steps=4",
        "launcher.warm_start.batch_size=8",
        "launcher.eval.freq_steps=0",
        "launcher.eval.n_prompts=8",
        "train_dataset.builtin_size=64",
        "valid_dataset.builtin_size=8",
        "gconfig.n_samples=4",
        "rollout.consumer_batch_size=4",
        "rollout.max_concurrent_rollouts=4",
        "rollout.queue_size=4",
        "buffer.filter=null",
        "trainer.save_freq_steps=null",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--config", str(EXAMPLE), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "vision_count" / "t"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["invariants_ok"], summary["invariants"]
    # Before and after training, every held-out row answered and scored, none failed.
    assert [(e["n"], e["failures"]) for e in summary["evals"]] == [(8, 0), (8, 0)]
    assert (run_dir / "model" / "sft" / "warm_start.json").is_file()
    assert (run_dir / "model" / "sft" / "preprocessor_config.json").is_file()
    assert len(list((run_dir / "data" / "valid_images").glob("*.png"))) == 8
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (run_dir / "learning_curve.png").stat().st_size > 0
