"""Translation rules for a run's bookkeeping: names and paths, checkpoints and recovery,
evaluation, and metrics tracking."""

from __future__ import annotations

from .tree import ABSENT, TreeEditor


def names(t: TreeEditor) -> None:
    """Per-block experiment_name / trial_name / fileroot: Flywheel takes them from the root."""
    root = {
        "experiment_name": t.get("experiment_name"),
        "trial_name": t.get("trial_name"),
        "fileroot": t.get("cluster.fileroot"),
    }
    for block in ("rollout", "saver", "recover", "evaluator", "stats_logger", "perf_tracer"):
        for name, want in root.items():
            key = f"{block}.{name}"
            value = t.pop(key)
            if value is ABSENT:
                continue
            where = "cluster.fileroot" if name == "fileroot" else name
            if want is None or value == want:
                t.ignored(key, value, f"Flywheel takes it from {where}")
            else:
                t.ignored(
                    key,
                    value,
                    f"differs from {where}={want!r}; Flywheel uses {where} for every path",
                )


def checkpoints(t: TreeEditor) -> None:
    """`saver` and `recover` as `trainer.save_freq_steps`, `trainer.recover` and
    `launcher.max_restarts`."""
    saver = t.pop("saver")
    recover = t.pop("recover")
    steps: list[int] = []
    for name, block in (("saver", saver), ("recover", recover)):
        if not isinstance(block, dict):
            if block is not ABSENT and block is not None:
                t.ignored(name, block, f"AReaL's {name} is a block; not read")
            continue
        freq = block.pop("freq_steps", None)
        if freq:
            steps.append(int(freq))
            t.mapped(
                f"{name}.freq_steps",
                freq,
                "trainer.save_freq_steps (the most frequent of saver and recover)",
            )
        elif freq is None and "freq_steps" not in block:
            pass
        for timer in ("freq_epochs", "freq_secs"):
            value = block.pop(timer, None)
            if value is not None:
                t.ignored(
                    f"{name}.{timer}",
                    value,
                    "Flywheel checkpoints by trainer step only (trainer.save_freq_steps)",
                )
    if steps:
        t.set("trainer.save_freq_steps", min(steps))
    if isinstance(saver, dict):
        for key, value in saver.items():
            t.ignored(
                f"saver.{key}",
                value,
                "every checkpoint also writes the HF model (trainer.export_hf), synchronously",
            )
    if isinstance(recover, dict):
        mode = recover.pop("mode", "disabled")
        flywheel = "auto" if str(mode) in ("on", "auto") else "disabled"
        t.set("trainer.recover", flywheel)
        t.mapped("recover.mode", mode, f"trainer.recover: {flywheel}")
        retries = recover.pop("retries", None)
        if retries is not None:
            t.set("launcher.max_restarts", int(retries))
            t.mapped("recover.retries", retries, "launcher.max_restarts (per service)")
        for key, value in recover.items():
            t.ignored(
                f"recover.{key}", value, "recovery checkpoints always hold the optimizer state"
            )


def evaluation(t: TreeEditor) -> None:
    """`evaluator` and `eval_gconfig` as `launcher.eval`."""
    block = t.pop("evaluator")
    if isinstance(block, dict):
        freq = block.pop("freq_steps", None)
        if freq:
            t.set("launcher.eval.freq_steps", int(freq))
            t.mapped("evaluator.freq_steps", freq, "launcher.eval.freq_steps")
        for key, value in block.items():
            if value is None:
                continue
            t.ignored(
                f"evaluator.{key}",
                value,
                "Flywheel evaluates before the first "
                "step, every launcher.eval.freq_steps steps and after the last",
            )
    eval_g = t.pop("eval_gconfig")
    if isinstance(eval_g, dict):
        for key in ("temperature", "max_new_tokens"):
            if eval_g.get(key) is not None:
                t.set(f"launcher.eval.{key}", eval_g.pop(key))
                t.mapped(
                    f"eval_gconfig.{key}",
                    t.get(f"launcher.eval.{key}"),
                    f"launcher.eval.{key}",
                )
        for key, value in eval_g.items():
            t.ignored(
                f"eval_gconfig.{key}",
                value,
                "evaluation samples one answer per prompt with gconfig's other settings",
            )


def tracking(t: TreeEditor) -> None:
    """`stats_logger` as `tracking` (W&B and TensorBoard; secrets stay in the environment)."""
    block = t.pop("stats_logger")
    if not isinstance(block, dict):
        return
    wandb = block.pop("wandb", None)
    if isinstance(wandb, dict):
        for key in ("mode", "project", "entity", "name", "job_type", "group", "notes", "tags"):
            if wandb.get(key) is not None:
                value = wandb.pop(key)
                t.set(f"tracking.wandb.{key}", value)
                t.mapped(f"stats_logger.wandb.{key}", value, f"tracking.wandb.{key}")
        for key, value in wandb.items():
            if value in (None, "", {}):
                continue
            reason = (
                "read from the environment (WANDB_API_KEY / WANDB_BASE_URL), never from a file"
                if key in ("wandb_api_key", "wandb_base_url")
                else "not used by Flywheel's W&B run"
            )
            t.ignored(f"stats_logger.wandb.{key}", "***" if "key" in key else value, reason)
    tb = block.pop("tensorboard", None)
    if isinstance(tb, dict) and tb.get("path"):
        t.set("tracking.tensorboard.path", tb["path"])
        t.mapped("stats_logger.tensorboard.path", tb["path"], "tracking.tensorboard.path")
    for other in ("swanlab", "trackio"):
        value = block.pop(other, None)
        if isinstance(value, dict) and value.get("mode", "disabled") != "disabled":
            t.ignored(
                f"stats_logger.{other}",
                value,
                "not available; TensorBoard (always), W&B and MLflow are (tracking.*)",
            )
