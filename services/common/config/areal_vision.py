"""Vision runs: recognise a vision-language model or a data set with images, and hold the
workflow to it.

A run whose model reads images, or whose prompts carry them, must generate with them:
`rollout.workflow: vision_rlvr`. The text workflows would drop every image and train a text
policy on questions about pictures it never saw, silently. So:

- an AReaL file (its `examples/vlm/*.yaml` name a Qwen2-VL / Qwen2.5-VL checkpoint and the
  `clevr_count_70k` or `geometry3k` data set; AReaL's example scripts pick
  `VisionRLVRWorkflow` in Python, not in the YAML) is translated to `vision_rlvr`
  (`translate_vision`, one row of the translation table saying why);
- any config whose model or data set is a vision one and whose workflow is a text one
  (`rlvr`, `multi_turn`) is refused at load with the fix (`vision_problems`); so is
  `vision_rlvr` on a local checkpoint that has no vision tower.

What counts as vision: a local checkpoint whose `config.json` has a `vision_config` (every
Hugging Face VLM architecture has one: Qwen2-VL, Qwen2.5-VL, LLaVA, Idefics3, ...); a hub
id not on this machine, by its name (`-VL`, `llava`, `idefics`, ...); a data set known to
carry images (AReaL's two, by id), or a local file whose first row has an `images` column.
Torch-free: only `config.json` and the first row of a data file are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigIssue

VISION_WORKFLOW = "vision_rlvr"
TEXT_WORKFLOWS = ("rlvr", "multi_turn")

#: Parts of a checkpoint name that mark a vision-language model (compared lower-case).
VISION_MODEL_MARKERS = (
    "-vl",
    "_vl",
    "vl-",
    "llava",
    "idefics",
    "smolvlm",
    "paligemma",
    "pixtral",
    "internvl",
    "minicpm-v",
)

#: Data sets whose rows carry images, by a part of their id (AReaL's `examples/vlm`:
#: `BUAADreamer/clevr_count_70k`, `hiyouga/geometry3k`; AReaL's NPU example: `virl39k`).
VISION_DATASETS = ("clevr_count_70k", "geometry3k", "virl39k")

IMAGE_COLUMNS = ("images", "image")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def model_has_vision(path: str | None) -> bool | None:
    """True/False for a local checkpoint (its `config.json` has a `vision_config` or not);
    for a name with no local copy, True when the name marks a VLM, else None (unknown)."""
    if not path:
        return None
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        try:
            return "vision_config" in json.loads(config.read_text())
        except (OSError, ValueError):
            return None
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    return True if any(m in name for m in VISION_MODEL_MARKERS) else None


def _first_row_columns(path: Path) -> set[str]:
    """The columns of the first row of a `.jsonl`/`.json`/`.parquet` file or folder of them
    (empty when unreadable: the data set loader reports that with its own message)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _DATA_SUFFIXES)
        return _first_row_columns(files[0]) if files else set()
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        with path.open() as fh:
            if path.suffix == ".json":
                head = fh.read(1 << 20).lstrip()
                if head.startswith("["):
                    rows = json.loads(head) if head.rstrip().endswith("]") else []
                    return set(rows[0]) if rows and isinstance(rows[0], dict) else set()
                fh.seek(0)
            for line in fh:
                if line.strip():
                    row = json.loads(line)
                    return set(row) if isinstance(row, dict) else set()
    except (OSError, ValueError, ImportError):
        return set()
    return set()


def dataset_has_images(path: str | None) -> bool:
    """True when the data set at `path` (a local file or folder, or a hub id) has images."""
    if not path:
        return False
    local = Path(path).expanduser()
    if local.exists():
        if local.suffix in _DATA_SUFFIXES or local.is_dir():
            return bool(_first_row_columns(local) & set(IMAGE_COLUMNS))
        return False
    lowered = path.lower()
    return any(part in lowered for part in VISION_DATASETS)


def vision_reason(model: str | None, datasets: dict[str, str | None]) -> str | None:
    """Why a run with this model and these data sets (`{"train_dataset.path": ...}`) is a
    vision run, or None."""
    if model_has_vision(model):
        return f"actor.path {model} is a vision-language model"
    for key, path in datasets.items():
        if dataset_has_images(path):
            return f"{key} {path} has images"
    return None


def translate_vision(tree: dict[str, Any]) -> tuple[str, str] | None:
    """For an AReaL tree: set `rollout.workflow: vision_rlvr` when its model or data set is
    a vision one and it names no workflow; returns (AReaL key, why) for the table."""
    rollout = tree.get("rollout")
    if isinstance(rollout, dict) and rollout.get("workflow") not in (None, VISION_WORKFLOW):
        return None
    reason = vision_reason(tree_get(tree, "actor.path"), _datasets(tree))
    if reason is None:
        return None
    tree.setdefault("rollout", {})["workflow"] = VISION_WORKFLOW
    return (
        "actor.path" if model_has_vision(tree_get(tree, "actor.path")) else "train_dataset.path",
        f"rollout.workflow: {VISION_WORKFLOW} ({reason}; AReaL's examples/vlm scripts run "
        "VisionRLVRWorkflow: prompts with images through the model's processor)",
    )


def vision_sft_text(kind: Any) -> str:
    """What the translation table says of `train_dataset.type: sft` in a vision run."""
    return (
        f"AReaL trains {kind!r} with another entry point; `flywheel run` trains with RL "
        f"({VISION_WORKFLOW}) on these prompts; `flywheel sft` fine-tunes the VLM on them, "
        "images included"
    )


def vision_problems(tree: dict[str, Any]) -> list[ConfigIssue]:
    """The refusals of a resolved tree: a vision model or data set under a text workflow,
    or `vision_rlvr` on a local checkpoint without a vision tower."""
    workflow = tree_get(tree, "rollout.workflow") or "rlvr"
    model = tree_get(tree, "actor.path")
    if workflow in TEXT_WORKFLOWS:
        reason = vision_reason(model, _datasets(tree))
        if reason is not None:
            return [
                ConfigIssue(
                    "rollout.workflow",
                    workflow,
                    f"{reason}: the {workflow} workflow would drop its images; set "
                    f"rollout.workflow: {VISION_WORKFLOW} (or use a text model and data set)",
                )
            ]
    if workflow == VISION_WORKFLOW and model_has_vision(model) is False:
        return [
            ConfigIssue(
                "actor.path",
                model,
                f"rollout.workflow: {VISION_WORKFLOW} needs a vision-language model, and "
                f"{model}/config.json has no vision_config; point actor.path at a VLM "
                "checkpoint (Qwen2-VL, Qwen2.5-VL, ...)",
            )
        ]
    return []


def tree_get(tree: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key of a raw tree (None when absent)."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _datasets(tree: dict[str, Any]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for block in ("train_dataset", "valid_dataset"):
        path = tree_get(tree, f"{block}.path")
        out[f"{block}.path"] = path if isinstance(path, str) else None
    return out


__all__ = [
    "VISION_WORKFLOW",
    "dataset_has_images",
    "model_has_vision",
    "translate_vision",
    "vision_problems",
    "vision_reason",
    "vision_sft_text",
]
