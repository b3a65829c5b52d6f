"""Translation rules for what is trained and how: dynamic batches, the
rejection sampling and reward normalisation switches, SFT data sets, and the teacher."""

from __future__ import annotations

from .report import IGNORED, Translation
from .tree import ABSENT, TreeEditor


def small_keys(t: TreeEditor) -> None:
    """`dynamic_bs`, the agent's turn discount, rejection sampling without the
    decoupled loss, and `gconfig.reward_normalization`."""
    dynamic = t.pop("dynamic_bs")
    if dynamic is not ABSENT:
        t.set("actor.dynamic_sampling", bool(dynamic))
        t.mapped(
            "dynamic_bs",
            dynamic,
            "actor.dynamic_sampling (groups whose rewards are "
            "all equal are dropped; the batch shrinks as with AReaL's dynamic_bs)",
        )
    if t.get("actor.rejection_sampling") is not None and not t.get(
        "actor.use_decoupled_loss", False
    ):
        t.drop(
            "actor.rejection_sampling",
            "AReaL ignores it without "
            "use_decoupled_loss (its PPOActorConfig warns so); not applied",
        )
    norm = t.pop("gconfig.reward_normalization")
    if norm is not ABSENT:
        if norm and t.get("actor.reward_norm") is None:
            group = t.get("gconfig.n_samples", 1)
            t.set(
                "actor.reward_norm",
                {"mean_level": "group", "std_level": "group", "group_size": group},
            )
            t.mapped(
                "gconfig.reward_normalization",
                norm,
                "actor.reward_norm: {mean_level: group, std_level: group}",
            )
        else:
            t.ignored("gconfig.reward_normalization", norm, "off (or actor.reward_norm is set)")


def sft(t: TreeEditor) -> None:
    """A data set of another type than `rl`: AReaL trains it with another entry point."""
    kind = t.get("train_dataset.type")
    if kind is not None and str(kind) != "rl":
        t.rows.append(
            Translation(
                "train_dataset.type",
                kind,
                IGNORED,
                f"AReaL trains {kind!r} with another entry point; `flywheel run` trains "
                "with RL on these prompts, `flywheel sft --config FILE` fine-tunes on "
                "their answers",
            )
        )


def teacher(t: TreeEditor) -> None:
    """AReaL 2.0's teacher: `train: {...}` (engine_type train) nests the engine fields,
    which TeacherConfig reads as its own (teacher.path wins, as in AReaL); a rollout-engine
    teacher (AReaL's default engine_type) is scored in the trainer instead."""
    block = t.get("teacher")
    if not isinstance(block, dict):
        return
    train = block.get("train")
    if isinstance(train, dict):
        t.mapped(
            "teacher.train",
            train,
            "the teacher block's engine fields (teacher.path wins over train.path, as "
            "in AReaL); its loss settings are not used: the teacher is not trained",
        )
    rollout = block.pop("rollout", None)
    engine = block.get("engine_type")
    if engine == "rollout" or rollout is not None:
        block["engine_type"] = "train"
        t.mapped(
            "teacher.engine_type",
            engine if engine is not None else "rollout",
            "teacher.engine_type: train: the teacher's log-probabilities of the sampled "
            "tokens are computed by a forward pass in the trainer (like ref), not by an "
            "inference server; the same values, on the trainer's ranks",
        )
    if rollout is not None:
        t.ignored(
            "teacher.rollout",
            rollout,
            "the teacher is scored in the trainer (teacher.engine_type: train), not by "
            "an inference engine",
        )
