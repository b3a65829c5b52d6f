"""Data sets named as AReaL names them (`services/common/config/dataset.py`, the loader).

`openai/gsm8k` with a split resolves to the local cache (`FLYWHEEL_DATASETS_DIR`, laid out
as `hf download openai/gsm8k --repo-type dataset --local-dir DIR/openai/gsm8k` leaves it),
or fails at load with that command; GSM8K brings the GSM8K reward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services import cli
from services.common.config import ConfigError
from services.common.config.loader import load_with_report


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "datasets"
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(root))
    return root


def _config(tmp_path: Path, **blocks: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(blocks))
    return path


def _shard(cache: Path, rel: str) -> Path:
    file = cache / "openai" / "gsm8k" / rel
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return file


def test_hub_id_and_split_resolve_to_the_local_copy(cache: Path, tmp_path: Path) -> None:
    train = _shard(cache, "main/train-00000-of-00001.jsonl")
    test = _shard(cache, "main/test-00000-of-00001.jsonl")
    _shard(cache, "socratic/test-00000-of-00001.jsonl")  # another HF config: not chosen
    path = _config(
        tmp_path,
        train_dataset={"path": "openai/gsm8k"},
        valid_dataset={"path": "openai/gsm8k"},  # split: AReaL's default for valid, test
    )
    config, report = load_with_report(path)
    assert config.train_dataset.path == str(train)
    assert config.valid_dataset is not None and config.valid_dataset.path == str(test)
    assert config.reward.fn == "gsm8k"
    actions = {(r.key, r.action) for r in report.data}
    assert {("train_dataset.path", "resolved"), ("reward.fn", "chosen")} <= actions


def test_an_explicit_split_is_used(cache: Path, tmp_path: Path) -> None:
    _shard(cache, "main/train-00000-of-00001.jsonl")
    test = _shard(cache, "main/test-00000-of-00001.jsonl")
    path = _config(tmp_path, train_dataset={"path": "openai/gsm8k", "split": "test"})
    config, _ = load_with_report(path)
    assert config.train_dataset.path == str(test)


def test_absent_copy_fails_at_load_with_the_fetch_command(cache: Path, tmp_path: Path) -> None:
    path = _config(tmp_path, train_dataset={"path": "openai/gsm8k"})
    with pytest.raises(ConfigError) as err:
        load_with_report(path)
    command = (
        f"hf download openai/gsm8k --repo-type dataset --local-dir {cache / 'openai' / 'gsm8k'}"
    )
    assert err.value.paths == ["train_dataset.path"]
    assert command in str(err.value)


def test_dry_run_reports_the_absent_copy_and_the_reward(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, train_dataset={"path": "openai/gsm8k"})
    assert cli.main(["run", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "# train_dataset.path = openai/gsm8k (split train): missing:" in out.out
    assert "hf download openai/gsm8k" in out.err
    assert "# reward.fn = gsm8k: chosen" in out.out
    assert yaml.safe_load(out.out)["reward"]["fn"] == "gsm8k"
    # Without --dry-run the same file stops before anything starts.
    assert cli.main(["run", "--config", str(path)]) == 2


def test_explicit_paths_and_rewards_are_kept(cache: Path, tmp_path: Path) -> None:
    data = tmp_path / "gsm8k-train.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    path = _config(tmp_path, train_dataset={"path": str(data)}, reward={"fn": "math_verify"})
    config, report = load_with_report(path)
    assert config.train_dataset.path == str(data)
    assert config.reward.fn == "math_verify"  # set by the user: not replaced
    assert not report.data


def test_several_shards_of_a_split_ask_for_an_explicit_path(cache: Path, tmp_path: Path) -> None:
    _shard(cache, "main/train-00000-of-00002.parquet")
    _shard(cache, "main/train-00001-of-00002.parquet")
    path = _config(tmp_path, train_dataset={"path": "openai/gsm8k"})
    with pytest.raises(ConfigError, match="has 2 files"):
        load_with_report(path)


def test_valid_dataset_defaults_follow_areal(tmp_path: Path) -> None:
    # areal/api/cli_args.py: ValidDatasetConfig sets shuffle=False, drop_last=False, split
    # "test"; TrainDatasetConfig keeps _DatasetConfig's shuffle=True, drop_last=True.
    path = _config(tmp_path, valid_dataset={"builtin": "arithmetic"})
    config, _ = load_with_report(path)
    assert config.valid_dataset is not None
    assert (config.valid_dataset.shuffle, config.valid_dataset.drop_last) == (False, False)
    assert (config.train_dataset.shuffle, config.train_dataset.drop_last) == (True, True)
