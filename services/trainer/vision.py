"""The trainer's side of a vision-language model: images back into model inputs, the tower frozen.

A trajectory group carries its prompt's images as encoded bytes once per group; the batch
keeps them per row (`SeqBatch.images`). Before a forward, `VisionBatcher` rebuilds
`pixel_values` and `image_grid_thw` with the checkpoint's own processor
(`services.common.vision_inputs`, the code the rollout engine generated with), in row order,
so the model places every image's patches at that row's image tokens and derives the same
3-axis RoPE positions (HF's `get_rope_index` from ids, grids and the attention mask). The
log-probabilities then match the engine's as they do for text.

An empty micro-batch (a rank with fewer micro-batches than another joins the FSDP
collectives with a dummy) runs a blank image on a VLM: the vision tower's layers are FSDP
units that every rank must all-gather together.

`actor.freeze_vision_tower` turns the tower's gradients off before sharding; its parameters
then never change, and weight updates leave them out (the replicas keep the tower they
loaded, which is the same checkpoint).
"""

from __future__ import annotations

import io
import time
from typing import Any

import torch
from torch import nn

from services.common.vision_inputs import VisionProcessor, vision_tower_names
from services.trainer.batch import SeqBatch


class VisionBatcher:
    """Pixel inputs of a micro-batch's rows; also counts the processor's time."""

    def __init__(self, processor: VisionProcessor) -> None:
        self.processor = processor
        self.seconds = 0.0  # processor time, summed (a metric)
        self._blank: tuple[bytes, int] | None = None

    def inputs(self, mb: SeqBatch | None, device: torch.device) -> dict[str, Any]:
        """`pixel_values` / `image_grid_thw` for the rows of `mb` that have images ({} for
        a text micro-batch)."""
        if mb is None or mb.images is None:
            return {}
        rows = [row for row in mb.images if row]
        if not rows:
            return {}
        t0 = time.perf_counter()
        # Row by row: the samples of a group share their images, so each group's are
        # processed once and found in the processor's cache for its other rows.
        parts = [self.processor.pixel_inputs(list(row)) for row in rows]
        pixels = torch.cat([v.pixel_values for v in parts])
        grids = torch.cat([v.image_grid_thw for v in parts])
        self.seconds += time.perf_counter() - t0
        return {"pixel_values": pixels.to(device), "image_grid_thw": grids.to(device)}

    def dummy(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(ids, mask, pixel inputs) of a one-row prompt that is one blank image."""
        if self._blank is None:
            from PIL import Image

            ip = self.processor.image_processor
            side = int(getattr(ip, "patch_size", 14)) * self.processor.merge_size
            buf = io.BytesIO()
            Image.new("RGB", (side, side)).save(buf, format="PNG")
            png = buf.getvalue()
            n = sum(self.processor.image_token_counts(self.processor.pixel_inputs([png])))
            self._blank = (png, n)
        png, n = self._blank
        ids = torch.full((1, n), self.processor.image_token_id, dtype=torch.long, device=device)
        v = self.processor.pixel_inputs([png])
        pixels = {
            "pixel_values": v.pixel_values.to(device),
            "image_grid_thw": v.image_grid_thw.to(device),
        }
        return ids, torch.ones_like(ids), pixels


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """Turn off the gradients of the vision tower's parameters; their names, sorted."""
    names = vision_tower_names(model)
    if not names:
        raise ValueError(
            f"actor.freeze_vision_tower is set but {type(model).__name__} has no vision tower"
        )
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return sorted(names)
