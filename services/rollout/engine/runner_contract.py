"""What the torch engine asks of a model runner, kept apart from the two runners that provide it.

A runner turns the pending tokens of many sequences into next-token logits and owns the KV
cache. The engine hands it sequences (objects with `tokens`, `cache_len` and a runner-private
`slot`); the runner runs the model over each sequence's pending tokens `tokens[cache_len:]`,
stores their keys/values, sets `cache_len = len(tokens)` and returns the logits of the last
position of every sequence.

The engine (`torch_engine.py`) is written against this contract only and picks a runner per
model: `NativeDecoderRunner` (`native_runner.py`) for Llama-family decoders, `HFRunner`
(`hf_runner.py`) for any causal LM. Both compute the same numbers as `model(input_ids)` up to
float reassociation, so which one runs changes speed, never results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class RunnerSeq(Protocol):
    """A sequence as a runner sees it: its tokens, how many of them are cached, its slot."""

    tokens: list[int]
    cache_len: int
    slot: Any


class ModelRunner(Protocol):
    """The calls the engine makes on a runner; `max_positions` bounds a sequence's length."""

    max_positions: int

    def forward(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor: ...

    def remove(self, seq: RunnerSeq) -> None: ...

    def invalidate(self, seqs: Sequence[RunnerSeq]) -> None: ...


def model_max_positions(model: torch.nn.Module) -> int:
    """The longest sequence the model's config allows (unbounded when it names none)."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
