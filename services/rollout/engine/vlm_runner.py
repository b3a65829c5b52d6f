"""The runner for vision-language models: the HF forward with images and 3-axis RoPE positions.

A Qwen2-VL-family model reads a prompt's images during prefill: the image-pad tokens of the
prompt are replaced by the vision tower's embeddings of `pixel_values`, and positions are
multimodal RoPE (`mrope`): three axes (time, patch row, patch column) that advance inside an
image along its grid and together over text. The runner asks the model for those positions
(`get_rope_index`, the function HF `generate` uses) instead of counting tokens, keeps each
sequence's offset between its next position and its length (`rope_delta`, counted without
the row's left padding), and gives a decoded
token position `cache_len + rope_delta` on all three axes, which is what HF `generate`
computes step by step. Everything else (the shared left-padded cache, merging, dropping rows)
is `HFRunner`'s.

A sequence carries its images as `vision` (a `services.common.vision_inputs.VisionInputs`, or
None for a text prompt); it is kept on the sequence so a weight update, which drops the cache,
re-reads the images on the next prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.rollout.engine.hf_runner import HFRunner
from services.rollout.engine.runner_contract import RunnerSeq


class VisionRunner(HFRunner):
    """`HFRunner` plus images at prefill and multimodal RoPE positions."""

    def __init__(self, model: torch.nn.Module, *, max_slots: int, pad_id: int = 0) -> None:
        super().__init__(model, max_slots=max_slots, pad_id=pad_id)
        rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
        if rope_index is None:
            raise ValueError(
                f"{type(model).__name__} has no get_rope_index: the vision runner serves "
                "Qwen2-VL-family models"
            )
        self._rope_index = rope_index
        self._dtype = next(model.parameters()).dtype
        self._delta: dict[int, int] = {}

    def invalidate(self, seqs: Sequence[RunnerSeq]) -> None:
        super().invalidate(seqs)
        self._delta.clear()

    def remove(self, seq: RunnerSeq) -> None:
        super().remove(seq)
        self._delta.pop(id(seq), None)

    def _decode_positions(self, batch: Sequence[RunnerSeq]) -> torch.Tensor:
        pos = [[s.cache_len + self._delta.get(id(s), 0)] for s in batch]
        return torch.tensor(pos, device=self.device).unsqueeze(0).expand(3, -1, -1)

    def _prefill_inputs(
        self, seqs: Sequence[RunnerSeq], ids: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        visions = [v for v in (getattr(s, "vision", None) for s in seqs) if v is not None]
        grid = torch.cat([v.image_grid_thw for v in visions]).to(self.device) if visions else None
        positions, deltas = self._rope_index(ids, grid, None, mask)
        # HF counts the delta against the padded row length (its decode positions count
        # padding too); ours count the sequence's own tokens, so the row's padding is added.
        pads = (mask.shape[1] - mask.sum(dim=1)).tolist()
        for s, d, pad in zip(seqs, deltas.reshape(-1).tolist(), pads, strict=True):
            self._delta[id(s)] = int(d) + int(pad)
        inputs: dict[str, Any] = {"position_ids": positions}
        if visions:
            pixels = torch.cat([v.pixel_values for v in visions])
            inputs["pixel_values"] = pixels.to(device=self.device, dtype=self._dtype)
            inputs["image_grid_thw"] = grid
        return inputs
