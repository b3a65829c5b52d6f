"""Checks of vision runs (`rollout.workflow: vision_rlvr`): prompts that reach the model
without their images, and a processor that holds generation up. They read the rollout
replicas' counters, so they judge a live run (`n/a` otherwise, or for a text run).

The checks every run gets (importance weights, truncation, rewards, staleness, weight sync)
hold for a vision run as they are: the trainer recomputes log-probabilities with the
images, so its statistics mean what they mean for text."""

from __future__ import annotations

from typing import Any

from services.doctor.evidence import Evidence, sum_by

from .base import Check, Status, rounded

IMAGES_WARN = 0.5
"""Share of produced groups whose prompts were rendered with images, below which a vision
run warns: a vision data set may hold text rows, but most of its prompts should show an
image, or the policy learns to answer without looking."""

PROCESSOR_WARN_S = 0.5
"""Mean seconds the processor takes per prompt, above which it warns: the tiny demo's
processor takes milliseconds and a Qwen2-VL's a few tens of them per image of the default
`max_pixels`; half a second means oversized images or a CPU the rollout does not get."""

_NOT_VISION = "not a vision run (rollout.workflow is not vision_rlvr, no image counters)"


def _is_vision(ev: Evidence, rendered: float) -> bool:
    if ev.config is not None:
        return bool(ev.config.rollout.workflow == "vision_rlvr")
    return rendered > 0


def _histogram(ev: Evidence, name: str) -> tuple[float, float]:
    """(count, sum) of a rollout histogram over every replica."""
    ro = ev.samples("rollout")
    count = sum(sum_by(ro, f"{name}_count").values())
    return count, sum(sum_by(ro, f"{name}_sum").values())


def vision_images(ev: Evidence) -> Check:
    name = "vision_images"
    rendered, images = _histogram(ev, "flywheel_rollout_images_per_group")
    _, tokens = _histogram(ev, "flywheel_rollout_image_tokens_per_sample")
    produced = sum(sum_by(ev.samples("rollout"), "flywheel_rollout_groups_produced_total").values())
    nums: dict[str, Any] = {"groups_produced": produced, "prompts_with_images": rendered}
    if not _is_vision(ev, rendered):
        return Check(name, "n/a", _NOT_VISION, "", nums)
    if not ev.live or not produced:
        return Check(
            name, "n/a", "no groups in the rollout's counters (not live, or none yet)", "", nums
        )
    share = min(1.0, rendered / produced)
    nums["share_with_images"] = rounded(share)
    if rendered:
        nums["images_per_prompt"] = rounded(images / rendered)
        nums["image_tokens_per_prompt"] = rounded(tokens / rendered)
    if not rendered:
        return Check(
            name,
            "fail",
            f"{produced:g} groups produced, none from a prompt with images",
            "the data set's rows carry no images: check its `images` column (paths relative "
            "to the data file, bytes, or HF Image cells; docs/vision.md)",
            nums,
        )
    status: Status = "warn" if share < IMAGES_WARN else "pass"
    return Check(
        name,
        status,
        f"{rendered:g} prompts with images for {produced:g} groups ({share:.0%}), "
        f"{images / rendered:.2g} images and {tokens / rendered:.3g} image tokens each",
        ""
        if status == "pass"
        else "most prompts have no image: the policy can learn to answer without looking; "
        "filter the text rows out of the vision data set",
        nums,
    )


def processor_time(ev: Evidence) -> Check:
    name = "processor_time"
    count, total = _histogram(ev, "flywheel_rollout_processor_seconds")
    nums: dict[str, Any] = {"prompts": count, "seconds": rounded(total)}
    if not _is_vision(ev, count):
        return Check(name, "n/a", _NOT_VISION, "", nums)
    if not count:
        return Check(name, "n/a", "no prompts rendered in the rollout's counters", "", nums)
    mean = total / count
    nums["mean_seconds"] = rounded(mean)
    status: Status = "warn" if mean > PROCESSOR_WARN_S else "pass"
    return Check(
        name,
        status,
        f"the processor took {mean:.3g} s per prompt over {count:g} prompts",
        ""
        if status == "pass"
        else "generation waits on the image processor: resize the data set's images (a "
        "VLM's processor shrinks them to its max_pixels anyway) or give the rollout more CPU",
        nums,
    )


__all__ = ["IMAGES_WARN", "PROCESSOR_WARN_S", "processor_time", "vision_images"]
