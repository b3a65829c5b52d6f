"""Vision RLVR: RLVR over prompts with images (AReaL's `VisionRLVRWorkflow`).

As AReaL's: the row's question and images go through the model's processor (its chat
template writes each image's placeholder, the image processor decides how many image
tokens each image takes), the engine generates from those token ids with the images, and
the reward function scores the decoded completions exactly as text RLVR does. What differs
from AReaL's is where the images go next: the group carries them once, as the encoded bytes
the data set holds (`TrajectoryGroup.images`), and the trainer rebuilds the pixel inputs with
the same processor, instead of every sample carrying pixel tensors.

Rows come from `services.rollout.data.vision.VisionPromptDataset`: `prompt` holds the chat
messages with image items, `images` the encoded images, `prompt_ids` the rendered prompt
when the data set already rendered it (it does with `max_length`), else empty.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.core.contracts import InferenceEngine, WorkflowContext
from services.core.types import TrajectoryGroup
from services.rollout.workflows.rlvr import RLVRWorkflow


class VisionRLVRWorkflow(RLVRWorkflow):
    """Single-turn RLVR whose prompts hold images; the reward function is text RLVR's.

    `processor`: a checkpoint directory whose processor to use (AReaL's `processor`
    argument); by default the served model's, which the rollout service puts into the
    context (`WorkflowContext.processor`)."""

    def __init__(self, ctx: WorkflowContext, *, processor: str | None = None) -> None:
        super().__init__(ctx)
        if processor is not None:
            from services.common.vision_inputs import load_vision_processor

            self.processor: Any = load_vision_processor(processor)
        else:
            self.processor = ctx.processor
        if self.processor is None:
            raise ValueError(
                "rollout.workflow=vision_rlvr needs the model's processor: serve a "
                "vision-language model (actor.path holding a preprocessor_config.json) or set "
                "rollout.workflow_kwargs.processor to a checkpoint directory"
            )

    async def render(self, data: dict[str, Any]) -> tuple[list[int], str, float]:
        """The prompt's token ids and text, and the seconds the processor took (0 when the
        data set had rendered it)."""
        ids = [int(t) for t in data.get("prompt_ids") or []]
        if ids:
            return ids, str(data.get("prompt_text", "")), 0.0
        images = list(data.get("images") or [])
        messages = data["prompt"]
        if isinstance(messages, str):  # a text row: one user message
            messages = [{"role": "user", "content": messages}]

        def build() -> tuple[list[int], str]:
            text = self.processor.apply_chat_template(messages)
            return list(self.processor.encode_prompt(text, images)), text

        t0 = time.perf_counter()
        # The image processor is CPU-bound; the event loop keeps serving other episodes.
        ids, text = await asyncio.to_thread(build)
        return ids, text, time.perf_counter() - t0

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None:
        images = [bytes(i) for i in data.get("images") or []]
        prompt_ids, prompt_text, seconds = await self.render(data)
        image_token = self.processor.image_token_id
        self.ctx.on_images(len(images), sum(1 for t in prompt_ids if t == image_token), seconds)
        completions = await engine.agenerate_n(prompt_ids, self.ctx.sampling, images=images or None)
        group = await self.score_group(prompt_ids, prompt_text, completions, data)
        if group is not None:
            group.images = images
        return group
