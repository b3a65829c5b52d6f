"""Rollout block: AReaL's `InferenceEngineConfig` names plus Flywheel's engine choice."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ._base import FlywheelModel, RuleViolation
from .agent import AgentConfig


class SGLangServerConfig(FlywheelModel):
    """How a rollout replica reaches its SGLang server (engine `sglang`)."""

    url: str | None = None
    """Base URL of a running SGLang server (`http://host:port`); null means the rollout
    launches one itself with `launch_args`."""

    launch_args: dict[str, Any] = Field(default_factory=dict)
    """Extra `sglang.launch_server` arguments (e.g. `mem_fraction_static: 0.8`);
    free-form, passed through as `--key value`."""

    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel size of a launched server."""

    startup_timeout: float = Field(default=600.0, gt=0.0)
    """Seconds to wait for the server to answer `/ping` (launched or reached by `url`)."""

    scratch_dir: str | None = None
    """Where the rollout hands weights to SGLang: each disk update's loadable folder (links
    to the published safetensors beside the served model's `config.json` and tokenizer
    files) and the safetensors of gRPC-streamed updates are written here, and SGLang is sent
    this path. SGLang reads it from its own container, so it must be on a volume both mount
    at the same path. Null: `<cluster.fileroot>/<experiment_name>/<trial_name>/sglang_handover`,
    the run directory, which the Helm chart and compose put on the volume both mount."""


class RolloutConfig(FlywheelModel):
    """Generation service: concurrency, staleness budget, workflow and engine."""

    max_concurrent_rollouts: int | None = Field(default=None, ge=1)
    """Most prompts (groups) in flight at once per replica; null means
    `consumer_batch_size`."""

    queue_size: int | None = Field(default=None, ge=1)
    """Most groups put and not yet claimed plus groups being generated, over all replicas
    (AReaL's output-queue bound): how far the rollout runs ahead of the trainer, whatever η
    allows; null is 16 x `max_concurrent_rollouts`, as AReaL."""

    consumer_batch_size: int = Field(default=1, ge=1)
    """Groups the trainer consumes per step; the unit of the staleness budget."""

    max_head_offpolicyness: int = Field(default=0, ge=0)
    """Most versions a group's oldest token may lag the trainer; 0 is synchronous RL."""

    enable_rollout_tracing: bool = False
    """Log every generation request (debugging)."""

    check_trajectory_format: bool = False
    """Validate every trajectory a custom workflow returns (debugging a workflow)."""

    deterministic_sampling: bool = False
    """Stable per-request seeds and canonical group order (end-to-end determinism needs
    `max_head_offpolicyness: 0`)."""

    tokenizer_path: str = ""
    """Tokenizer for decoding trajectories to text; empty uses the actor's `path`."""

    dump_to_file: bool = False
    """Also write every trajectory as JSON under `cluster.fileroot` (debugging)."""

    schedule_policy: Literal["round_robin"] = "round_robin"
    """How requests are spread over generation servers."""

    setup_timeout: float = Field(default=300.0, gt=0.0)
    """Seconds to wait for engines/servers to come up."""

    request_timeout: float = Field(default=3600.0, gt=0.0)
    """Seconds one generation request may take."""

    request_retries: int = Field(default=3, ge=0)
    """Retries of a failed generation request."""

    pause_grace_period: float = Field(default=0.0, ge=0.0)
    """Seconds to wait after pausing generation before weights are applied."""

    engine: Literal["torch", "sglang"] = "torch"
    """Flywheel: generation engine, in-process torch (CPU, tests) or an SGLang server."""

    workflow: str = "rlvr"
    """Workflow by registered name (`rlvr`, `multi_turn`, `agent`: the OpenAI-client agent
    named by `agent.path`, `vision_rlvr`: AReaL's
    `VisionRLVRWorkflow`, prompts with images through the model's processor) or dotted path.
    A vision-language `actor.path` or a data set with images needs `vision_rlvr`."""

    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent of `workflow: agent` (AReaL's `rollout.agent` block): `docs/agents.md`."""

    workflow_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Flywheel: extra keyword arguments of the workflow; free-form."""

    n_replicas: int = Field(default=1, ge=1)
    """Flywheel: rollout replicas; replica i serves on `services.rollout.port + i`."""

    max_turns: int = Field(default=1, ge=1)
    """Flywheel: most assistant turns of a multi-turn workflow."""

    turn_discount: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount γ of the multi-turn workflow's per-turn rewards (AReaL's
    `turn_discount`): walking from the last turn to the first, cur = cur·γ + r_i; the
    episode's reward is the value at the first turn."""

    sglang: SGLangServerConfig = Field(default_factory=SGLangServerConfig)
    """Flywheel: SGLang server settings (engine `sglang` only)."""

    torch_max_batch_size: int = Field(default=16, ge=1)
    """Flywheel: sequences decoded together by the torch engine."""

    weight_update_timeout: float = Field(default=600.0, gt=0.0)
    """Flywheel: seconds a replica may take to apply new weights, retries included, before
    it is reported unhealthy and skipped (it is caught up once it answers again). Long on
    purpose: the largest update a replica accepts (`max_weight_bytes`, 64 GiB) read from a
    network volume at ~200 MB/s takes ~330 s, and a deadline below a healthy replica's load
    time makes it miss every update, while a hung replica costs one deadline per hang (later
    publications skip it after a 5 s version probe). Lower it to a few times
    `flywheel_trainer_weight_broadcast_seconds` when your updates are small."""

    torch_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Flywheel: device of the torch engine; `auto` uses CUDA when present."""

    torch_runner: Literal["auto", "native", "hf"] = "auto"
    """Flywheel: torch engine decoder: `native` (fast path for Qwen2/Qwen3/Llama/Mistral),
    `hf` (any causal LM through its own forward), `auto` picks native when it applies."""

    torch_num_threads: int = Field(default=1, ge=1)
    """Flywheel: CPU threads of the torch engine process (`torch.set_num_threads`)."""

    max_weight_bytes: int = Field(default=64 << 30, gt=0)
    """Flywheel: largest weight update a replica accepts, in bytes (64 GiB: a 32B model in
    bf16; raise it for larger models). Every transport checks the update's announced size
    (the manifest's `total_bytes`, which must be > 0 and equal the sum of the tensors'
    sizes) against it before allocating, so a caller cannot exhaust the replica's memory."""

    @model_validator(mode="after")
    def _agent_workflow_names_an_agent(self) -> RolloutConfig:
        if self.workflow == "agent" and not self.agent.path:
            raise RuleViolation(
                "agent.path",
                self.agent.path,
                "workflow `agent` runs the agent named here: set its dotted path, e.g. "
                "`examples.agents.tool_math:run`",
            )
        return self
