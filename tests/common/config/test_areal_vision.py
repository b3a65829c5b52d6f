"""Vision runs at load (`services/common/config/areal_vision.py`): AReaL's VLM files run as
vision, and a vision model or data set under a text workflow is refused.

Two kinds of input, as in `test_areal_compat.py`:
- AReaL's own `examples/vlm/*.yaml` (`clevr_count_70k_grpo`, `geometry3k_grpo`,
  `clevr_count_70k_sft`), read from the AReaL checkout named by `AREAL_SRC` (no registry
  package ships them and nothing of AReaL is copied here; skipped without it);
- AReaL-style VLM files written for these tests (AReaL's key names, values chosen here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import ConfigError, load_config
from services.common.config.areal_compat import areal_markers
from services.common.config.areal_vision import dataset_has_images, model_has_vision
from services.common.config.loader import load_with_report
from tests.common.config.test_areal_compat import _dry_run, _has_key
from tests.vision_fixtures import tiny_vlm_dir  # noqa: F401  (session-wide tiny Qwen2-VL)

AREAL_SRC = os.environ.get("AREAL_SRC", "")
_VLM = Path(AREAL_SRC) / "examples" / "vlm" if AREAL_SRC else None
_AREAL_VLM_FILES = sorted(_VLM.glob("*.yaml")) if _VLM and _VLM.is_dir() else []
NO_AREAL_SRC = (
    "AReaL's examples/vlm/*.yaml are in no registry package and are not copied here: set "
    "AREAL_SRC to an AReaL checkout to load them"
)

# The reward of each AReaL VLM data set, as AReaL's example scripts pair them
# (examples/vlm/clevr_count_70k_grpo.py: clevr_count_70k_reward_fn; geometry3k_grpo.py:
# geometry3k_reward_fn).
_REWARD = {"clevr_count_70k": "clevr_count", "geometry3k": "geometry3k"}


@pytest.mark.skipif(not _AREAL_VLM_FILES, reason=NO_AREAL_SRC)
@pytest.mark.parametrize("path", _AREAL_VLM_FILES, ids=lambda p: p.name)
def test_areals_own_vlm_examples_load_with_dry_run_as_vision(
    path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(tmp_path))  # no local copy of the data
    raw = yaml.safe_load(path.read_text())
    code, out, err = _dry_run(capsys, "--config", str(path))
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["rollout"]["workflow"] == "vision_rlvr"
    assert "mapped: rollout.workflow: vision_rlvr" in out
    assert resolved["actor"]["path"] == raw["actor"]["path"]
    # Every AReaL-only key of the file has a row (mapped, or ignored with a reason).
    rows = [line[2:].split(" ", 1)[0] for line in out.splitlines() if line.startswith("# ")]
    for marker in areal_markers(raw):
        assert any(r == marker or r.startswith(marker + ".") for r in rows), marker
    for line in (x for x in err.splitlines() if ": warning: " in x):
        key = line.split(": warning: ", 1)[1].split(":", 1)[0]
        assert _has_key(raw, key), f"the warning names a key of the file: {line}"
    hub_id = raw["train_dataset"]["path"]
    assert f"train_dataset.path = {hub_id} (split train): missing" in out  # a hub id
    assert resolved["reward"]["fn"] == _REWARD[hub_id.rsplit("/", 1)[-1]]
    if raw["train_dataset"].get("type") == "sft":  # clevr_count_70k_sft.yaml
        assert "`flywheel sft` fine-tunes the VLM on them, images included" in out
    if raw.get("sglang", {}).get("enable_multimodal"):
        assert resolved["rollout"]["sglang"]["launch_args"]["enable_multimodal"] is True


# An AReaL-style VLM GRPO file as a user writes it (AReaL's key names; not copied).
_AREAL_VLM: dict[str, Any] = {
    "experiment_name": "vlm-written-for-test",
    "trial_name": "t0",
    "cluster": {"n_nodes": 1, "n_gpus_per_node": 2, "fileroot": "/tmp/exp"},
    "gconfig": {"n_samples": 4, "max_new_tokens": 64},
    "rollout": {"backend": "sglang:d1", "max_head_offpolicyness": 2},
    "actor": {"backend": "fsdp:d1", "path": "Qwen/Qwen2.5-VL-3B-Instruct"},
    "sglang": {"enable_multimodal": True},
    "train_dataset": {"path": "BUAADreamer/clevr_count_70k", "batch_size": 4, "type": "rl"},
}


def _write(tmp_path: Path, tree: dict[str, Any], name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


def _clevr_copy(root: Path) -> Path:
    """A local copy of a data set with images, laid out as `hf download` leaves a parquet
    export (images as HF Image cells: {"bytes", "path"})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.image_samples import encoded

    folder = root / "BUAADreamer" / "clevr_count_70k" / "data"
    folder.mkdir(parents=True)
    rows = [
        {
            "problem": "<image>How many?",
            "answer": "3",
            "images": [{"bytes": encoded(32, 32), "path": None}],
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train-00000-of-00001.parquet")
    return folder / "train-00000-of-00001.parquet"


def test_an_areal_vlm_file_runs_vision_from_the_local_copy_of_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(tmp_path / "datasets"))
    local = _clevr_copy(tmp_path / "datasets")
    cfg, report = load_with_report(_write(tmp_path, _AREAL_VLM))
    assert cfg.rollout.workflow == "vision_rlvr" and cfg.rollout.engine == "sglang"
    assert cfg.train_dataset.path == str(local)
    assert cfg.reward.fn == "clevr_count"
    rows = {r.key: r for r in report.translations}
    assert "vision-language model" in rows["actor.path"].flywheel
    assert cfg.rollout.sglang.launch_args["enable_multimodal"] is True


def test_an_areal_file_with_a_text_model_and_image_data_runs_vision(tmp_path: Path) -> None:
    tree = {**_AREAL_VLM, "actor": {"backend": "fsdp:d1", "path": "Qwen/Qwen2.5-3B"}}
    cfg, report = load_with_report(_write(tmp_path, tree), require_data=False)
    assert cfg.rollout.workflow == "vision_rlvr"
    rows = {r.key: r for r in report.translations}
    assert (
        "train_dataset.path BUAADreamer/clevr_count_70k has images"
        in rows["train_dataset.path"].flywheel
    )


def test_an_areal_vlm_sft_file_says_what_each_entry_point_does(tmp_path: Path) -> None:
    tree = {**_AREAL_VLM, "train_dataset": {**_AREAL_VLM["train_dataset"], "type": "sft"}}
    _, report = load_with_report(_write(tmp_path, tree), require_data=False)
    row = {r.key: r for r in report.translations}["train_dataset.type"]
    assert "`flywheel run` trains with RL (vision_rlvr)" in row.flywheel
    assert "`flywheel sft` fine-tunes the VLM on them, images included" in row.flywheel


def test_a_vision_model_under_a_text_workflow_is_refused(tiny_vlm_dir: Path) -> None:  # noqa: F811
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"actor.path={tiny_vlm_dir}", "rollout.workflow=rlvr"])
    text = str(err.value)
    assert "rollout.workflow" in text and "is a vision-language model" in text
    assert "set rollout.workflow: vision_rlvr" in text
    cfg = load_config(None, [f"actor.path={tiny_vlm_dir}", "rollout.workflow=vision_rlvr"])
    assert cfg.rollout.workflow == "vision_rlvr"


def test_image_data_under_a_text_workflow_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "How many?", "answer": "2", "images": ["a.png"]}))
    with pytest.raises(ConfigError, match="train.jsonl has images: the multi_turn workflow"):
        load_config(None, [f"train_dataset.path={data}", "rollout.workflow=multi_turn"])
    text_data = tmp_path / "text.jsonl"
    text_data.write_text(json.dumps({"question": "1+1?", "answer": "2"}))
    cfg = load_config(None, [f"train_dataset.path={text_data}"])
    assert cfg.rollout.workflow == "rlvr"


def test_vision_rlvr_on_a_text_checkpoint_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="has no vision_config"):
        load_config(None, [f"actor.path={tiny_model_dir}", "rollout.workflow=vision_rlvr"])


@pytest.mark.parametrize(
    ("name", "vision"),
    [
        ("Qwen/Qwen2.5-VL-3B-Instruct", True),
        ("Qwen/Qwen2-VL-7B", True),
        ("llava-hf/llava-1.5-7b-hf", True),
        ("HuggingFaceTB/SmolVLM-256M-Instruct", True),
        ("Qwen/Qwen2.5-3B-Instruct", None),  # a name that says nothing: not refused
        ("", None),
    ],
)
def test_vision_models_are_recognised_by_name(name: str, vision: bool | None) -> None:
    assert model_has_vision(name) is vision


def test_local_checkpoints_are_recognised_by_their_config(
    tiny_vlm_dir: Path,  # noqa: F811
    tiny_model_dir: Path,
) -> None:
    assert model_has_vision(str(tiny_vlm_dir)) is True
    assert model_has_vision(str(tiny_model_dir)) is False


def test_data_sets_with_images_are_recognised(tmp_path: Path) -> None:
    assert dataset_has_images("hiyouga/geometry3k")
    assert not dataset_has_images("openai/gsm8k")
    assert dataset_has_images(str(_clevr_copy(tmp_path)))
    text = tmp_path / "t.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), text)
    assert not dataset_has_images(str(text))
