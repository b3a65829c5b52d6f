"""Reward block: which function scores completions and how the pool runs it."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from ._base import FlywheelModel, RuleViolation

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})*[:.]{_IDENT}(?:\.{_IDENT})*")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}")


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

    # --- added by the reward engineer -------------------------------------------------

    functions: dict[str, str] = Field(default_factory=dict)
    """More named reward functions, `name: pkg.module:fn`; `fn` and requests may then use
    the name. A name already taken (built-ins: gsm8k, math, math_verify, exact_match,
    geometry3k, clevr_count, format, arithmetic) is an error."""

    allow_dotted_paths: bool = False
    """Let requests name any dotted path, not only `fn` and `functions`. Off by default: a
    client must not be able to make the workers import arbitrary code."""

    max_deadline_ms: int = Field(default=300_000, ge=1)
    """Largest per-item deadline a request may ask for (its `deadline_ms`)."""

    max_completion_bytes: int = Field(default=1 << 20, ge=1)
    """Completions longer than this (UTF-8 bytes) get INVALID_INPUT instead of a worker."""

    chunk_size: int = Field(default=16, ge=1)
    """Most items sent to a worker in one message (each keeps its own deadline); larger
    chunks amortise the hop, smaller ones balance the workers."""

    worker_start_timeout_s: float = Field(default=120.0, gt=0)
    """Time a new worker may take to import the functions and report ready."""

    idempotency_entries: int = Field(default=4096, ge=1)
    """Answered request ids remembered, so that a retry gets the first answer back."""

    @model_validator(mode="after")
    def _check_reward_rules(self) -> RewardConfig:
        if not (_NAME.fullmatch(self.fn) or _DOTTED.fullmatch(self.fn)):
            raise RuleViolation(
                "fn",
                self.fn,
                "must be a registered name (e.g. gsm8k) or a dotted path 'pkg.module:fn'",
            )
        for name, path in self.functions.items():
            if not _NAME.fullmatch(name):
                raise RuleViolation(
                    f"functions.{name}", path, "names are letters, digits, '_' and '-'"
                )
            if not _DOTTED.fullmatch(path):
                raise RuleViolation(
                    f"functions.{name}", path, "write the function as 'pkg.module:fn'"
                )
        if self.deadline_ms > self.max_deadline_ms:
            raise RuleViolation(
                "deadline_ms",
                self.deadline_ms,
                f"exceeds max_deadline_ms={self.max_deadline_ms}; raise max_deadline_ms "
                "or lower deadline_ms",
            )
        if self.max_queue < self.max_batch:
            raise RuleViolation(
                "max_queue",
                self.max_queue,
                f"must be >= max_batch={self.max_batch}, or a full batch could never be queued",
            )
        return self
