"""Launcher block: what `flywheel run` prepares before the services start, and how it evaluates.

These settings only matter to the local launcher and the embedded demo; a cluster run that
points `actor.path` at a real checkpoint and the datasets at real files ignores them.
"""

from __future__ import annotations

from pydantic import Field

from ._base import FlywheelModel


class TinyModelConfig(FlywheelModel):
    """Shape of the tiny Qwen2 written locally when `actor.path` is empty."""

    hidden_size: int = Field(default=128, ge=8)
    """Hidden width."""

    num_layers: int = Field(default=2, ge=1)
    """Decoder layers."""

    num_heads: int = Field(default=4, ge=1)
    """Attention heads (must divide hidden_size)."""

    seed: int = 0
    """Seed of the initial weights."""


class TinyVLMConfig(FlywheelModel):
    """Shape of the tiny Qwen2-VL written locally when `actor.path` is empty and the run is
    a vision one (`rollout.workflow: vision_rlvr`); `services/common/tiny_vlm.py`."""

    image_size: int = Field(default=84, ge=28, multiple_of=28)
    """Side of the square every image is resized to (patch 14 x merge 2 = 28 pixels per
    image token: 84 gives 9 tokens); the built-in counting images are drawn at this size."""

    hidden_size: int = Field(default=64, ge=32, multiple_of=32)
    """Language model width (4 heads; a multiple of 32 for the 3-axis rotary sections)."""

    num_layers: int = Field(default=2, ge=1)
    """Language model decoder layers."""

    vision_dim: int = Field(default=32, ge=8)
    """Vision transformer width."""

    vision_depth: int = Field(default=2, ge=1)
    """Vision transformer blocks."""

    seed: int = 0
    """Seed of the initial weights."""


class WarmStartConfig(FlywheelModel):
    """A short supervised phase on generated data before RL (as real recipes start from an
    instruction-tuned model); skipped when `enabled` is false or the model is given.

    It is a `flywheel sft` run (the trainer's engine, the answer-token loss, the optimizer's
    schedule) on the train rows with their answers in the `#### N` form (a vision run's: the
    count as written, each row with its image, through the VLM's processor): `steps` is its
    `total_train_steps`, `batch_size` its `train_dataset.batch_size`, `lr`, `warmup_steps`
    and `cosine_decay` its AdamW schedule (no weight decay, clipping at 1), `seed` its data
    order, and `label_smoothing` its loss's label smoothing (`flywheel sft
    --label-smoothing`), a Flywheel option: AReaL's SFT loss has none, and 0 is that loss.
    The run writes to `<trial dir>/model/sft-run/`; its model is copied to
    `<trial dir>/model/sft` with `warm_start.json`, whose presence makes a later launch of
    the same trial reuse it. The smoothing is what leaves RL its job: after the demo's 600
    steps (`label_smoothing: 0.2`) the model answers 0.918 of the 500 held-out prompts right
    greedily but 0.144 sampled at temperature 1 (`flywheel eval`); without smoothing the
    same steps give 0.920 and 0.838. To warm-start another model, run `flywheel sft`
    and set `actor.path` to the `<trial dir>/sft/hf` it exports: with a model given, the
    launcher writes no tiny model and runs no warm start."""

    enabled: bool = True
    """Run the supervised warm start on the freshly written tiny model."""

    steps: int = Field(default=220, ge=0)
    """Optimizer steps."""

    batch_size: int = Field(default=128, ge=1)
    """Examples per step."""

    lr: float = Field(default=1e-3, gt=0.0)
    """Peak AdamW learning rate."""

    warmup_steps: int = Field(default=50, ge=0)
    """Linear warm-up steps (without it the first steps overshoot)."""

    cosine_decay: bool = False
    """Decay the rate along a half cosine to 10% of the peak after warm-up (else constant).
    For the short demo phase a constant rate learns more: the tiny model is still far from
    converged when the phase ends."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Cross-entropy label smoothing: the warm-started policy ranks the right answer first but
    stays unsure, like an instruction-tuned model sampled at temperature 1 (high greedy,
    low sampled accuracy) - the gap RL closes by sharpening."""

    seed: int = 0
    """Seed of data order."""

    rows_fn: str | None = None
    """`module:function` that turns the train rows into the warm start's `{"prompt",
    "answer"}` rows (a prompt may be chat messages; the answer is taught as written). Set,
    the warm start also runs on a given `actor.path` (written to `<trial dir>/model/sft`,
    which then replaces it), e.g. the tool-math agent's call-format transcripts
    (`examples.agents.tool_math_transcripts:warm_start_rows`); unset, only the tiny model
    is warm-started, on the train rows with their answers in the `#### N` form."""


class EvalConfig(FlywheelModel):
    """Held-out evaluation the launcher runs through the rollout and reward services."""

    freq_steps: int = Field(default=10, ge=0)
    """Evaluate every this many trainer steps (and before the first and after the last);
    0 evaluates only before and after."""

    n_prompts: int = Field(default=256, ge=1)
    """Held-out prompts per evaluation (one sample each)."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of the evaluation (1.0 measures what the policy samples)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """Cap on generated tokens; null uses `gconfig.max_new_tokens`."""


class LauncherConfig(FlywheelModel):
    """Local launcher settings."""

    tiny_model: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Model written when `actor.path` is empty."""

    tiny_vlm: TinyVLMConfig = Field(default_factory=TinyVLMConfig)
    """Vision-language model written when `actor.path` is empty in a vision run."""

    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    """Supervised phase before RL."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation."""

    startup_timeout: float = Field(default=180.0, gt=0.0)
    """Seconds each service may take to report SERVING."""

    max_restarts: int = Field(default=3, ge=0)
    """Restarts of one service (buffer, reward, each rollout replica, the trainer, the local
    `redis-server`) allowed within `restart_window_seconds`; one more death in the window
    ends the run with the service's last log lines. 0 ends the run at the first death."""

    restart_window_seconds: float = Field(default=600.0, gt=0.0)
    """Window over which `max_restarts` is counted: a service that crashes once an hour is
    restarted for ever, one in a crash loop is given up on."""

    restart_backoff_seconds: float = Field(default=1.0, ge=0.0)
    """Wait before the first restart of a service in the window; each further restart in
    the window waits twice as long as the one before (exponential back-off)."""

    restart_backoff_max_seconds: float = Field(default=30.0, ge=0.0)
    """Longest back-off between two restarts of one service."""

    liveness_timeout_seconds: float | None = Field(default=120.0, gt=0.0)
    """A running service whose gRPC health check has not answered at all (any status counts,
    NOT_SERVING too) for this long - stopped, deadlocked, thrashing - is killed and restarted
    like a dead one. null: only processes that exit are restarted."""

    starvation_timeout_seconds: float | None = Field(default=300.0, gt=0.0)
    """When the trainer has waited this long for data (no new step, its phase
    `waiting_for_data`), the launcher names the stage that holds the run (buffer
    unreachable, no capacity, rollout not generating, reward holds, everything dropped, ...)
    with the numbers that show it, on its output and in `<run_dir>/starvation.json`
    (`flywheel status` prints it), and again every this many seconds while it lasts.
    null: no watchdog."""

    liveness_period_seconds: float = Field(default=2.0, gt=0.0)
    """How often each running service's health is checked for `liveness_timeout_seconds`;
    each check waits at most this long for its answer."""

    progress: bool = True
    """Show the one-line progress display."""

    python: str | None = None
    """Interpreter that runs the services; null uses the launcher's own."""

    rollout_cpus: list[int] | None = None
    """CPU cores the rollout processes are pinned to (`taskset`); null: no pinning."""

    trainer_cpus: list[int] | None = None
    """CPU cores the trainer processes are pinned to; null: no pinning."""
