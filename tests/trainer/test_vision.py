"""The trainer on the tiny Qwen2-VL model: log-probabilities as the engine's, weight updates.

- Engine and trainer: completions sampled by the torch engine (with images) are scored by the
  sharded trainer engine (1-rank FSDP2) from the groups' encoded images; per-token
  log-probabilities agree within the text tolerance (atol 1e-5, as the torch engine against a
  fresh HF forward in tests/rollout/engine/test_torch_engine.py).
- A weight update leaves the replica bit-identical to the trainer, the vision tower included
  when it trains; with `actor.freeze_vision_tower` the tower gets no gradient, is not sent,
  and the replica still equals the trainer to the bit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from services.common.vision_inputs import load_vision_processor
from services.common.weights.manifest import make_manifest
from services.core.types import SamplingParams, Trajectory, TrajectoryGroup
from services.rollout.engine.torch_engine import TorchEngine
from services.trainer.batch import from_groups
from services.trainer.engine import TrainEngine
from tests.trainer.helpers import trainer_config
from tests.vision_fixtures import scene_png, tiny_vlm_dir  # noqa: F401  (fixture)

ATOL = 1e-5
TOWER = "model.visual."
VISION = "rollout.workflow=vision_rlvr"


def _ctx():  # type: ignore[no-untyped-def]
    from services.trainer.dist import init_distributed

    return init_distributed("cpu")


def _prompt(model_dir: Path, n_images: int, images: list[bytes]) -> list[int]:
    proc = load_vision_processor(model_dir)
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "How many?"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}])
    return proc.encode_prompt(text, images)


async def _rollout(model_dir: Path, image_sets: list[list[bytes]]) -> list[TrajectoryGroup]:
    eng = TorchEngine(model_dir, max_batch_size=4, device="cpu")
    await eng.start()
    groups = []
    try:
        sp = SamplingParams(temperature=1.0, max_new_tokens=6, n_samples=2, seed=7)
        for g, images in enumerate(image_sets):
            prompt = _prompt(model_dir, len(images), images)
            outs = await eng.agenerate_n(prompt, sp, images=images)
            trajs = []
            for k, c in enumerate(outs):
                n_p, n = len(prompt), len(prompt) + len(c.output_ids)
                mask = np.zeros(n, dtype=np.int8)
                mask[n_p:] = 1
                trajs.append(
                    Trajectory(
                        trajectory_id=f"g{g}-{k}",
                        group_id=f"g{g}",
                        input_ids=np.array(prompt + c.output_ids, dtype=np.int64),
                        loss_mask=mask,
                        logprobs=np.concatenate([np.zeros(n_p), c.logprobs]).astype(np.float32),
                        versions=np.array([-1] * n_p + c.versions, dtype=np.int64),
                        reward=float(k),
                        no_eos=c.stop_reason != "stop",
                        prompt_len=n_p,
                    )
                )
            groups.append(TrajectoryGroup(group_id=f"g{g}", trajectories=trajs, images=images))
    finally:
        await eng.stop()
    return groups


def test_trainer_logprobs_match_the_engine(tiny_vlm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    image_sets = [[scene_png(2, 1)], [scene_png(6, 2), scene_png(9, 3)], [scene_png(4, 4)]]
    groups = asyncio.run(_rollout(tiny_vlm_dir, image_sets))
    cfg = trainer_config(tiny_vlm_dir, tmp_path, VISION).actor
    engine = TrainEngine(cfg, _ctx(), total_steps=1)
    assert engine.vision is not None
    batch = from_groups(groups)
    assert batch.images is not None and len(batch.images) == 6
    # The whole batch, and a micro-batch of rows from two groups (rows select their images).
    for mb in (batch, batch.select([1, 2, 5])):
        with torch.no_grad():
            logp, _ = engine.logprobs(mb)
        mask = mb.loss_mask.bool()
        torch.testing.assert_close(logp[mask], mb.behave_logp[mask], rtol=0, atol=ATOL)
    # The images are read: the same tokens with other images score differently.
    swapped = from_groups(
        [
            TrajectoryGroup(g.group_id, g.trajectories, images=[scene_png(8, 9)] * len(g.images))
            for g in groups
        ]
    )
    with torch.no_grad():
        other, _ = engine.logprobs(swapped)
    mask = batch.loss_mask.bool()
    assert (other[mask] - batch.behave_logp[mask]).abs().max() > 1e-3


def _one_step(engine: TrainEngine, model_dir: Path) -> None:
    batch = from_groups([TrajectoryGroup("g", [_traj(model_dir)], images=[scene_png(3, 5)])])
    logp, _ = engine.logprobs(batch)
    (-(logp * batch.loss_mask).sum()).backward()
    engine.clip_and_step()


def _traj(model_dir: Path) -> Trajectory:
    prompt = _prompt(model_dir, 1, [scene_png(3, 5)])
    ids = np.array(prompt + [20, 21, 22], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[len(prompt) :] = 1
    return Trajectory(
        "t",
        "g",
        ids,
        mask,
        np.zeros(len(ids), np.float32),
        np.zeros(len(ids), np.int64),
        1.0,
        False,
        len(prompt),
    )


async def _replica_after_update(
    model_dir: Path, sd: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    eng = TorchEngine(model_dir, max_batch_size=1, device="cpu")
    await eng.start()
    try:
        result = await eng.update_weights_from_tensors(sd, make_manifest(sd, 1))
        assert result.ok, result.message
        assert eng.version == 1
        return {k: v.clone() for k, v in eng.current_weights().items()}
    finally:
        await eng.stop()


def test_update_carries_a_trained_tower_bit_for_bit(tiny_vlm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    engine = TrainEngine(
        trainer_config(tiny_vlm_dir, tmp_path, VISION).actor, _ctx(), total_steps=2
    )
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _one_step(engine, tiny_vlm_dir)
    full = engine.full_state_dict()
    sent = engine.full_state_dict(for_update=True)
    assert sent.keys() == full.keys()
    tower = [n for n in full if n.startswith(TOWER)]
    assert tower and any(not torch.equal(full[n], before[n]) for n in tower)  # it trained
    served = asyncio.run(_replica_after_update(tiny_vlm_dir, sent))
    assert served.keys() == full.keys()
    for n, t in full.items():
        assert torch.equal(served[n], t), n


def test_frozen_tower_is_not_trained_nor_sent(tiny_vlm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = trainer_config(tiny_vlm_dir, tmp_path, VISION, "actor.freeze_vision_tower=true").actor
    engine = TrainEngine(cfg, _ctx(), total_steps=2)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _one_step(engine, tiny_vlm_dir)
    full = engine.full_state_dict()
    sent = engine.full_state_dict(for_update=True)
    tower = {n for n in full if n.startswith(TOWER)}
    assert tower and engine.frozen_names == tower
    assert not sent.keys() & tower and sent.keys() == full.keys() - tower
    assert all(torch.equal(full[n], before[n]) for n in tower)
    assert any(not torch.equal(full[n], before[n]) for n in sent)  # the rest trained
    served = asyncio.run(_replica_after_update(tiny_vlm_dir, sent))
    for n, t in full.items():  # the replica's own tower is the trainer's frozen one
        assert torch.equal(served[n], t), n


def test_lora_on_a_frozen_tower_adapts_the_language_model_only(
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import pytest

    lora = ("actor.use_lora=true", "actor.lora_rank=2", "actor.freeze_vision_tower=true")
    every_linear = trainer_config(tiny_vlm_dir, tmp_path, VISION, *lora).actor
    with pytest.raises(ValueError, match="match the vision tower"):
        TrainEngine(every_linear, _ctx(), total_steps=1)
    text_only = trainer_config(
        tiny_vlm_dir, tmp_path, VISION, *lora, "actor.target_modules=[self_attn.q_proj]"
    ).actor
    engine = TrainEngine(text_only, _ctx(), total_steps=1)
    assert engine.lora and not any(n.startswith(TOWER) for n in engine.lora)
