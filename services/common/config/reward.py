"""Reward block: which function scores completions and how the pool runs it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ._base import FlywheelModel


class RewardConfig(FlywheelModel):
    """Asynchronous scoring of completions in a process pool with deadlines."""

    fn: str = "arithmetic"
    """Reward function: a registered name (`arithmetic`, `math_verify`, ...) or a dotted
    path `pkg.module:fn` / `pkg.module.fn` with the `reward_fn(prompt, completions,
    prompt_ids, completion_ids, answer, **kwargs) -> float` signature."""

    fn_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to the function; free-form."""

    num_workers: int = Field(default=4, ge=1)
    """Worker processes of the scoring pool."""

    deadline_ms: int = Field(default=15_000, ge=1)
    """Time one score may take; a late worker is killed and the failure policy applies."""

    max_queue: int = Field(default=1024, ge=1)
    """Requests waiting for a worker; more are refused with RESOURCE_EXHAUSTED."""

    max_batch: int = Field(default=64, ge=1)
    """Completions scored in one request at most."""

    worker_memory_mb: int | None = Field(default=2048, ge=1)
    """Address-space limit of a worker process (RLIMIT_AS); null: no limit."""

    worker_cpu_seconds: int | None = Field(default=None, ge=1)
    """CPU-time limit of a worker process (RLIMIT_CPU); null: no limit."""

    cache: bool = True
    """Remember scores of identical (completion, answer) pairs."""

    cache_size: int = Field(default=65_536, ge=1)
    """Entries kept in the score cache."""

    on_failure: Literal["zero", "drop_group"] = "zero"
    """A completion whose scoring fails or times out gets reward 0, or its whole group
    is dropped."""
