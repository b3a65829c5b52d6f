"""Sampling settings of the rollout (`gconfig`), named and defaulted as in AReaL."""

from __future__ import annotations

from pydantic import Field

from ._base import FlywheelModel


class GenerationHyperparameters(FlywheelModel):
    """How completions are sampled; `n_samples` is the group size the algorithm sees."""

    n_samples: int = Field(default=1, ge=1)
    """Completions generated per prompt (the GRPO group)."""

    max_new_tokens: int = Field(default=16384, ge=1)
    """Most tokens generated for one completion; longer ones stop with no EOS (truncated)."""

    min_new_tokens: int = Field(default=0, ge=0)
    """Fewest tokens generated before EOS may end a completion."""

    max_tokens: int = Field(default=32768, ge=1)
    """Most tokens of prompt plus completion together."""

    greedy: bool = False
    """Take the most likely token at each step instead of sampling (evaluation)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass in (0, 1]; 1 keeps the whole distribution."""

    top_k: int = Field(default=100_000_000, ge=1)
    """Sample among the k most likely tokens; the huge default means no limit."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature; the trainer must use the same value (`actor.temperature`)
    or its log-probabilities will not match the behaviour policy's."""

    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's EOS/pad."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks only: every completion runs to the limit)."""

    skip_special_tokens: bool = True
    """Drop special tokens when completions are decoded to text for the reward."""

    stop: list[str] | None = None
    """Stop strings; generation ends once one of them has been sampled."""

    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Penalty on tokens by how often they already appeared, in [-2, 2]."""

    seed: int | None = None
    """Per-request sampling seed; None derives a distinct, stable seed per sample."""

    drop_incomplete_group: bool = False
    """Discard a whole group when any of its samples fails, instead of training on the rest."""
