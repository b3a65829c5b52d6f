"""Decoded trajectory groups → right-padded `[B, T]` tensors the step works on.

Rows are the trajectories of the claimed groups in claim order (group by group), so every
rank that decodes the same claim builds the same batch. Per-token fields keep the wire
convention: `logprobs[t]` and `versions[t]` belong to token t, prompt tokens have
`loss_mask` 0 and version -1. Padding is on the right with token 0, mask 0, version -1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from services.core.types import TrajectoryGroup


@dataclass
class SeqBatch:
    """A batch of sequences, padded to the longest one."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool
    loss_mask: torch.Tensor  # [B, T] float32
    behave_logp: torch.Tensor  # [B, T] float32
    versions: torch.Tensor  # [B, T] int64
    rewards: torch.Tensor  # [B] float32
    no_eos: torch.Tensor  # [B] bool
    seq_lens: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64
    group_index: torch.Tensor  # [B] int64, index into the batch's groups
    turn_ids: torch.Tensor | None = None  # [B, T] int64, multi-turn only
    # Per row, its group's encoded images (a vision-language run); None for text. The
    # trainer rebuilds pixel values from them (services/trainer/vision.py).
    images: tuple[tuple[bytes, ...], ...] | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SeqBatch:
        """A copy with `fn` applied to every tensor field (an absent `turn_ids` stays None)."""
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        return replace(self, **changes)

    def select(self, rows: Sequence[int]) -> SeqBatch:
        """The given rows, trimmed to their own longest sequence."""
        idx = torch.as_tensor(list(rows), dtype=torch.int64)
        width = int(self.seq_lens[idx].max()) if len(idx) else 1
        out = self._map(lambda v: v[idx, :width] if v.dim() == 2 else v[idx])
        if self.images is not None:
            out = replace(out, images=tuple(self.images[int(i)] for i in idx))
        return out

    def to(self, device: torch.device) -> SeqBatch:
        return self._map(lambda v: v.to(device))


def from_groups(groups: Sequence[TrajectoryGroup], pad_id: int = 0) -> SeqBatch:
    """Stack every trajectory of `groups` into one padded batch (groups in order)."""
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not trajs:
        raise ValueError("cannot build a training batch from zero trajectories")
    b = len(trajs)
    width = max(t.num_tokens for _, t in trajs)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.float32)
    logp = np.zeros((b, width), dtype=np.float32)
    vers = np.full((b, width), -1, dtype=np.int64)
    has_turns = any(t.turn_ids is not None for _, t in trajs)
    turns = np.full((b, width), -1, dtype=np.int64) if has_turns else None
    for row, (_, t) in enumerate(trajs):
        n = t.num_tokens
        ids[row, :n] = t.input_ids
        mask[row, :n] = t.loss_mask
        logp[row, :n] = np.where(t.loss_mask.astype(bool), t.logprobs, 0.0)
        vers[row, :n] = t.versions
        if turns is not None and t.turn_ids is not None:
            turns[row, :n] = t.turn_ids
    lens = torch.tensor([t.num_tokens for _, t in trajs], dtype=torch.int64)
    attn = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    return SeqBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=attn,
        loss_mask=torch.from_numpy(mask),
        behave_logp=torch.from_numpy(logp),
        versions=torch.from_numpy(vers),
        rewards=torch.tensor([float(t.reward) for _, t in trajs], dtype=torch.float32),
        no_eos=torch.tensor([bool(t.no_eos) for _, t in trajs], dtype=torch.bool),
        seq_lens=lens,
        prompt_lens=torch.tensor([int(t.prompt_len) for _, t in trajs], dtype=torch.int64),
        group_index=torch.tensor([gi for gi, _ in trajs], dtype=torch.int64),
        turn_ids=None if turns is None else torch.from_numpy(turns),
        images=tuple(tuple(g.images) for g in groups for _ in g.trajectories)
        if any(g.images for g in groups)
        else None,
    )
