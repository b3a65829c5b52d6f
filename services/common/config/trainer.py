"""Trainer block: ranks, checkpoints, recovery and weight transport."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._base import FlywheelModel, RuleViolation


class TrainerConfig(FlywheelModel):
    """How the trainer process group runs; the algorithm itself lives in `actor`."""

    n_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks (processes) of the trainer; FSDP shards over them."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend: gloo on CPU, nccl on GPUs."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; `auto` picks cuda when available."""

    master_addr: str = "127.0.0.1"
    """Rendezvous address of rank 0."""

    master_port: int = Field(default=0, ge=0, le=65535)
    """Rendezvous port of rank 0; 0 picks a free port."""

    save_freq_steps: int | None = Field(default=50, ge=1)
    """Checkpoint every this many steps; null disables step checkpoints."""

    checkpoint_dir: str | None = None
    """Checkpoint directory; null means `<cluster.fileroot>/<experiment>/<trial>/checkpoints`."""

    keep_last_checkpoints: int = Field(default=2, ge=1)
    """Older checkpoints beyond this many are deleted."""

    recover: Literal["auto", "disabled"] = "auto"
    """Resume from the latest complete checkpoint if one exists (`auto`), or start fresh."""

    weight_transport: Literal["disk", "distributed", "grpc"] = "disk"
    """How new weights reach rollout replicas: a safetensors file on shared disk, a
    torch.distributed broadcast, or streamed over gRPC."""

    parity_probe_freq: int = Field(default=1, ge=0)
    """Flywheel: run the weight-sync parity probe (services/trainer/parity.py) after every
    N-th publication (by version): each replica decodes a fixed probe and the trainer scores
    the same tokens on the published weights. 1 probes every update; 0 turns it off (no
    reference copy of the model is kept on rank 0). On a real model on CPU a probe costs
    seconds per update (SmolLM2-135M: ~10 s, as much as the disk transport itself), so a
    larger N trades how soon a silently corrupted update is caught for step time."""

    overlap_weight_publication: bool = True
    """Flywheel: with `rollout.max_head_offpolicyness` > 0, publish version v+1 in the
    background while the trainer claims and trains the next batch (the state dict is copied
    first, so the next optimizer step cannot tear it); the trainer waits for a publication
    only before starting the next one. Meanwhile the replicas still generate with version v;
    the buffer grants a replica capacity by the version it serves, so what it starts stays
    within eta. Synchronous runs (eta = 0) always publish before the next claim. Step
    records (`metrics.jsonl`) are written once the step's publication is complete. `false`
    publishes before the next claim in every mode (the trainer idles during it)."""

    weight_dir: str | None = None
    """Directory of published weights (`disk`); null means
    `<cluster.fileroot>/<experiment>/<trial>/weights`."""

    batch_timeout: float = Field(default=3600.0, gt=0.0)
    """Seconds to wait for a training batch from the buffer before giving up."""

    metrics_jsonl: str | None = None
    """File receiving one JSON line of training stats per step; null means
    `<cluster.fileroot>/<experiment>/<trial>/metrics.jsonl`."""

    log_every_steps: int = Field(default=1, ge=1)
    """Log training stats every this many steps."""

    # -- Flywheel trainer additions (trainer engineer) -------------------------------------

    lr_schedule_steps: int | None = Field(default=None, ge=1)
    """Trainer steps the learning-rate schedule spans (warm-up and decay are laid out over
    this many steps x `actor.ppo_n_minibatches` optimizer steps); null means
    `total_train_steps`. Set it to decay over a horizon longer than this run."""

    reuse_first_minibatch_logp: bool = True
    """Skip the proximal forward pass for the first minibatch: before the first optimizer step
    of a batch π_prox is π_θ, so the training forward's own log-probabilities (detached) are
    the recomputation. With `ppo_n_minibatches=1` this removes the whole extra pass; with n
    minibatches, 1/n of it. Applies only without a reference model (its KL shaping needs
    π_old for every row up front) and without dropout (train- and eval-mode forwards must
    agree). Set false to always run the separate pass."""

    consumer_id: str | None = None
    """Name the trainer claims under in the buffer; null means
    `trainer-<experiment_name>-<trial_name>`. A restarted trainer must keep it, so that
    its unfinished claim of the previous life is handed back to it."""

    claim_wait_ms: int = Field(default=1000, ge=0, le=60_000)
    """How long one Claim waits for a full batch; between claims the trainer answers
    Pause/Stop/SaveCheckpoint requests."""

    save_on_exit: bool = True
    """Write a checkpoint when the run ends (total_train_steps reached or Stop), unless
    the last step was just saved; needs `save_freq_steps` to be set."""

    export_hf: bool = True
    """With every checkpoint, also write the policy in Hugging Face format
    (`<checkpoint>/hf`) for serving and evaluation."""

    weight_bucket_bytes: int = Field(default=64 << 20, ge=0)
    """Bucket size of the `distributed` weight transport (bytes per broadcast); 0 sends one
    broadcast per tensor. With `rollout.engine: sglang` 0 is always used (SGLang's layout)."""

    weight_chunk_bytes: int = Field(default=4 << 20, ge=1 << 10)
    """Chunk size of the `grpc` weight transport (bytes per message)."""

    weight_fanout: Literal["flat", "two_level"] = "flat"
    """Flywheel: topology of the `distributed` transport. `flat`: one group of the trainer's
    rank 0 and every replica. `two_level`: the trainer broadcasts to one relay replica per
    node, and each relay re-broadcasts every bucket to its node's replicas in a group of
    their own (docs/scale.md, "Weight fan-out"): the trainer's group has one rank per node,
    and a replica that dies or joins re-forms its node's group only. Torch engine only."""

    weight_fanout_replicas_per_node: int = Field(default=0, ge=0)
    """Flywheel: with `weight_fanout: two_level`, replicas `i` with the same
    `i // weight_fanout_replicas_per_node` share a node; 0 groups replicas by the host of
    their address instead (`services.rollout.host` with `{i}` replaced)."""

    weights_group_port: int = Field(default=0, ge=0, le=65535)
    """Port of the rendezvous store of the `distributed` weight transport, hosted by the
    trainer's rank 0; 0 picks a free port."""

    keep_weight_versions: int = Field(default=2, ge=1)
    """Published weight directories (`disk` transport) kept under `weight_dir`; older ones
    are deleted once every replica serves a newer one."""

    weight_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of published weights: the fp32 master copy (exact), or half the bytes for
    replicas that serve in bf16/fp16 anyway (SGLang on GPUs)."""

    @model_validator(mode="after")
    def _check_fanout(self) -> TrainerConfig:
        if self.weight_fanout == "two_level" and self.weight_transport != "distributed":
            raise RuleViolation(
                "weight_fanout",
                self.weight_fanout,
                f"a fan-out topology applies to weight_transport: distributed, not "
                f"{self.weight_transport!r}; set weight_transport: distributed or "
                "weight_fanout: flat",
            )
        return self
