"""The vision_rlvr workflow on the real torch engine serving the tiny Qwen2-VL, with rows of the
counting data set and the `clevr_count` reward function itself (called in-process: the reward
service's transport is covered elsewhere)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from services.common.tiny_vlm import image_tokens
from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, ScoreRequest, ScoreResult
from services.reward.builtins import clevr_count_reward
from services.rollout.data.counting import write_split
from services.rollout.data.datasets import read_rows
from services.rollout.data.vision import VisionPromptDataset
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.workflows.base import load_workflow
from services.rollout.workflows.vision_rlvr import VisionRLVRWorkflow
from tests.image_samples import encoded
from tests.vision_fixtures import IMAGE_SIZE, tiny_vlm_dir  # noqa: F401


class ClevrCountScorer:
    """Scores with the `clevr_count` reward function itself, and records the requests."""

    def __init__(self) -> None:
        self.seen: list[ScoreRequest] = []

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        self.seen.extend(items)
        return [
            ScoreResult(
                clevr_count_reward(
                    r.prompt, str(r.completion), list(r.prompt_ids), [], r.answer, **r.kwargs
                )
            )
            for r in items
        ]


@pytest.fixture
async def vlm_engine(tiny_vlm_dir: Path) -> AsyncIterator[TorchEngine]:  # noqa: F811
    eng = TorchEngine(tiny_vlm_dir, max_batch_size=4, device="cpu")
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_a_group_carries_its_images_once_and_is_scored_as_text_rlvr(
    vlm_engine: TorchEngine, tmp_path: Path
) -> None:
    data_file = write_split(tmp_path, "train", 2, seed=3, size=IMAGE_SIZE)
    ds = VisionPromptDataset(read_rows(data_file), base_dir=tmp_path, shuffle=False)
    seen: list[tuple[int, int, float]] = []
    scorer = ClevrCountScorer()
    ctx = WorkflowContext(
        vlm_engine.tokenizer,
        SamplingParams(n_samples=3, max_new_tokens=4, seed=5),
        scorer,
        processor=vlm_engine.vision,
        on_images=lambda *a: seen.append(a),
    )
    wf = load_workflow("vision_rlvr", ctx)
    assert isinstance(wf, VisionRLVRWorkflow)
    row = ds.next().as_data()
    group = await wf.arun_episode(vlm_engine, row)
    assert group is not None and len(group.trajectories) == 3
    png = (tmp_path / "train_images" / "000000.png").read_bytes()
    assert group.images == [png]  # the data set's bytes, once for the whole group
    # The prompt as Qwen's chat format writes one image: <|vision_start|>, one <|image_pad|>
    # per merged patch (tiny_vlm.image_tokens: patches of 14 pixels, merged 2x2),
    # <|vision_end|>, then the question (tiny_vlm.py's template; ids from its tokenizer).
    tok = vlm_engine.tokenizer
    vs, pad, ve = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    )
    prompt = group.trajectories[0].input_ids[: group.trajectories[0].prompt_len].tolist()
    start, n = prompt.index(vs), image_tokens(IMAGE_SIZE)
    assert prompt[start : start + n + 2] == [vs] + [pad] * n + [ve]
    assert tok.decode(prompt[start + n + 2 :]).startswith("How many objects are there?")
    assert seen == [(1, n, seen[0][2])] and seen[0][2] > 0  # metrics: images, tokens, time
    for t, req in zip(group.trajectories, scorer.seen, strict=True):
        assert t.input_ids[: t.prompt_len].tolist() == prompt
        assert t.input_ids[t.prompt_len :].tolist() == list(req.completion_ids)
        assert t.loss_mask[: t.prompt_len].sum() == 0 and (t.versions[t.prompt_len :] == 0).all()
        assert req.answer == row["answer"] and "images" not in req.kwargs
        assert t.reward == clevr_count_reward("", req.completion, [], [], row["answer"])


async def test_the_processor_is_required_and_text_engines_refuse_images(
    engine: TorchEngine,  # the tiny text model
) -> None:
    ctx = WorkflowContext(engine.tokenizer, SamplingParams(max_new_tokens=2), ClevrCountScorer())
    with pytest.raises(ValueError, match="needs the model's processor"):
        load_workflow("vision_rlvr", ctx)
    assert not engine.accepts_images
    with pytest.raises(ValueError, match="text-only model and was given 1 image"):
        await engine.agenerate_n(
            [1, 2, 3], SamplingParams(max_new_tokens=2), images=[encoded(4, 4)]
        )
    with pytest.raises(ValueError, match="text-only model"):
        await engine.agenerate([1, 2, 3], SamplingParams(max_new_tokens=2), images=[encoded(4, 4)])
