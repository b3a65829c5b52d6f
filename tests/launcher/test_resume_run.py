"""Resume as a user meets it: `flywheel run` of the demo, `kill -9` of the trainer
after a checkpoint (with steps trained past it), the same command again.

The resumed run must continue at the checkpoint's step, train every group at most once
across both runs, keep every token within the staleness bound, and pass the launcher's four
invariants; its first evaluation is labelled with the checkpoint's step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SAVE_EVERY = 4
TOTAL = 24
BATCH = 4


def _command(fileroot: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        str(ROOT / "examples" / "demo.yaml"),
        "experiment_name=chaos",
        "trial_name=t",
        f"cluster.fileroot={fileroot}",
        f"total_train_steps={TOTAL}",
        f"trainer.save_freq_steps={SAVE_EVERY}",
        # The demo's topology and algorithm at the size of the other end-to-end tests, so that
        # both runs fit in a few minutes on two cores: what is checked is the resume, not
        # learning. Without the warm start every reward is 0, so the DAPO filter (which drops
        # groups of equal rewards) is off; the trainer still trains on every group.
        "launcher.tiny_model.hidden_size=32",
        "launcher.tiny_model.num_layers=1",
        "launcher.tiny_model.num_heads=2",
        "launcher.warm_start.enabled=false",
        "buffer.filter=null",
        "launcher.eval.freq_steps=0",
        "launcher.eval.n_prompts=8",
        "launcher.progress=false",
        "launcher.max_restarts=0",  # the launcher ends the run at the trainer's death
        "train_dataset.builtin_size=200",
        "valid_dataset.builtin_size=8",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=8",
        f"rollout.consumer_batch_size={BATCH}",
        "rollout.max_concurrent_rollouts=8",
    ]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _pending_records(run_dir: Path) -> list[dict]:
    out = []
    for p in sorted((run_dir / "metrics.pending").glob("step-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:  # cut short by the kill
            continue
    return out


def _latest_checkpoint_step(run_dir: Path) -> int:
    steps = [
        int(p.name.split("_")[1])
        for p in (run_dir / "checkpoints").glob("step_*")
        if (p / "trainer_state.json").is_file()
    ]
    return max(steps, default=0)


def test_kill_after_a_checkpoint_then_the_same_command_resumes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "chaos" / "t"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        _command(tmp_path / "runs"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # A step of this model takes about 0.1 s on quiet cores, so the moment is taken by
        # freezing the trainer (SIGSTOP) as soon as a checkpoint has steps trained past it,
        # then reading the state it left; the kill follows while it is frozen.
        trainer = 0
        deadline = time.monotonic() + 900  # guards a hang; not a timing assertion
        while True:
            assert first.poll() is None, first.stdout.read()[-4000:] if first.stdout else ""
            assert time.monotonic() < deadline, "the first run made no progress"
            done = [r["step"] for r in _records(run_dir / "metrics.jsonl")]
            ckpt = _latest_checkpoint_step(run_dir)
            if ckpt and done and ckpt < done[-1] < TOTAL:
                trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
                os.kill(trainer, signal.SIGSTOP)
                done = [r["step"] for r in _records(run_dir / "metrics.jsonl")]
                if _latest_checkpoint_step(run_dir) < done[-1] < TOTAL:
                    break
                os.kill(trainer, signal.SIGCONT)  # it moved on meanwhile: try again
            time.sleep(0.01)
        os.kill(trainer, signal.SIGKILL)
        out1, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            first.wait(timeout=120)
    assert first.returncode != 0, out1[-3000:]
    before = _records(run_dir / "metrics.jsonl")
    ckpt = _latest_checkpoint_step(run_dir)
    assert ckpt % SAVE_EVERY == 0 and before[-1]["step"] > ckpt  # steps past it die
    # Lines the dead trainer had not written yet (their publication was in flight) wait in
    # metrics.pending/; those past the checkpoint are lost too (services/trainer/step_records.py).
    pending = _pending_records(run_dir)
    assert not [r for r in pending if r["step"] <= ckpt]  # a later line was written
    lost_steps = sorted([r["step"] for r in before + pending if r["step"] > ckpt])
    dead_version = max(r["version"] for r in before + pending)

    second = subprocess.run(
        _command(tmp_path / "runs"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("staleness_within_eta", "versions_increase", "buffer_accounting"):
        assert summary["invariants"][name]["ok"], (name, summary["invariants"][name])
    assert summary["invariants"]["metrics_exported"]["ok"], summary["invariants"]
    assert summary["invariants_ok"] and summary["steps"] == TOTAL

    records = _records(run_dir / "metrics.jsonl")
    lost = _records(run_dir / "metrics.lost.jsonl")
    # One record per step: the checkpoint's steps kept, the lost ones set aside, trained again.
    assert [r["step"] for r in records] == list(range(1, TOTAL + 1))
    assert [r["step"] for r in lost] == lost_steps
    assert records[:ckpt] == before[:ckpt]
    # Versions never repeat: the restored weights got a version above what the dead trainer
    # published, so every token has v_behave <= v; and v - v_behave <= eta on every token.
    eta = summary["eta"]
    assert records[ckpt]["version"] > dead_version + 1
    for r in records:
        assert all(0 <= s <= eta for s in r["staleness_per_seq"]), (r["step"], r["version"])
    # Every group trained at most once, across both runs (lost steps included).
    trained = [g for r in [*records, *lost] for g in r["group_ids"]]
    assert len(trained) == len(set(trained))
    # The buffer's ledger counts each of them once; a kill between a step's ack and its record
    # (the weights are published in between) leaves one batch acked without a record.
    assert len(trained) <= int(summary["buffer"]["acked_total"]) <= len(trained) + BATCH
    # The resumed trainer counted the groups the dead one acknowledged after its checkpoint
    # (those of the lost steps, and that batch when it was acked before its record), and
    # its ledger matches the buffer's.
    ledger = summary["ledger"]
    lost_groups = sum(len(r["group_ids"]) for r in lost)
    assert lost_groups <= ledger["acked_lost_with_crash"] <= lost_groups + BATCH, ledger
    assert ledger["resumes"] == 1 and ledger["ok"], ledger
    assert ledger["trainer_acked"] + ledger["acked_lost_with_crash"] == ledger["buffer_acked"]
    assert ledger["buffer_acked"] == int(summary["buffer"]["acked_total"])
    # The resumed run's first evaluation is labelled with the checkpoint's step.
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0  # the first run's
    assert summary["evals"][0]["step"] == ckpt, summary["evals"]
    assert f"eval at step {ckpt} " in out2
    assert "did not finish: resuming it" in out2  # the launcher says it resumes
    # The run is recorded as completed, and a trainer started on it trains nothing.
    completed = json.loads((run_dir / "checkpoints" / "completed.json").read_text())
    assert (completed["state"], completed["step"]) == ("completed", TOTAL)
    assert json.loads((run_dir / "trainer_exit.json").read_text())["code"] == 0
