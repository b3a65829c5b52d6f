"""Each service checks only the blocks it reads (`load_config(..., service=...)`,
`root.SERVICE_BLOCKS`): a trainer-only mistake does not stop the reward, buffer or rollout
service, and the trainer's view (`service=None`, what `flywheel run` and the trainer load)
still refuses it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli
from services.common.config import ConfigError, load_config
from services.common.config.loader import load_with_report

# `actor.kl_ctl > 0` without `ref`: the trainer would take the KL against zeros.
_KL_WITHOUT_REF: dict[str, Any] = {"actor": {"kl_ctl": 0.1}}


def write(tmp_path: Path, tree: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("service", ["reward", "buffer", "rollout"])
def test_a_trainer_rule_does_not_stop_the_other_services(service: str, tmp_path: Path) -> None:
    path = write(tmp_path, _KL_WITHOUT_REF)
    cfg, report = load_with_report(path, service=service)
    assert cfg.actor.kl_ctl == 0.1  # kept as written: only the check is skipped
    assert report.unchecked and report.unchecked[0].path == "actor.kl_ctl"
    (line,) = report.unchecked_lines()
    assert line.startswith(f"actor.kl_ctl: not checked for the {service} service")
    with pytest.raises(ConfigError) as err:
        load_config(path)  # the trainer's view
    assert err.value.paths == ["actor.kl_ctl"]


def test_flywheel_run_still_refuses_the_trainer_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, _KL_WITHOUT_REF)
    assert cli.main(["run", "--config", str(path), "--dry-run"]) == 2
    assert "actor.kl_ctl = 0.1: a KL penalty needs a reference model" in capsys.readouterr().err


def test_the_unchecked_problem_is_logged_by_the_service(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flywheel.reward"):
        load_config(write(tmp_path, _KL_WITHOUT_REF), service="reward")
    (record,) = [r for r in caplog.records if r.name == "flywheel.reward"]
    assert "actor.kl_ctl: not checked for the reward service" in record.getMessage()


@pytest.mark.parametrize(
    ("tree", "path"),
    [
        ({"gconfig": {"temperature": 0.7}}, "actor.temperature"),  # actor's stays 1.0
        ({"trainer": {"backend": "nccl", "device": "cpu"}}, "trainer.backend"),
        ({"teacher": {"path": ""}, "actor": {"path": "/m"}}, "teacher.path"),
    ],
)
def test_the_trainers_other_rules_stop_only_the_trainer(
    tree: dict[str, Any], path: str, tmp_path: Path
) -> None:
    file = write(tmp_path, tree)
    for service in ("reward", "buffer", "rollout"):
        load_config(file, service=service)
    with pytest.raises(ConfigError) as err:
        load_config(file)
    assert err.value.paths == [path]


def test_an_invalid_block_stops_only_the_services_that_read_it(tmp_path: Path) -> None:
    # eps_clip < 0 is an actor error: the reward and buffer services never read the actor,
    # the rollout does (actor.path).
    path = write(tmp_path, {"actor": {"eps_clip": -1}})
    for service in ("reward", "buffer"):
        cfg, report = load_with_report(path, service=service)
        assert cfg.actor.eps_clip == 0.2  # the unread block falls back to its defaults
        assert [i.path for i in report.unchecked] == ["actor.eps_clip"]
    for service in ("rollout", None):
        with pytest.raises(ConfigError) as err:
            load_config(path, service=service)
        assert err.value.paths == ["actor.eps_clip"]


@pytest.mark.parametrize(
    ("tree", "path"),
    [
        ({"reward": {"num_workers": 0}}, "reward.num_workers"),  # its own block
        ({"experiment_name": "bad name"}, "experiment_name"),  # a root key
        ({"reard": {"fn": "gsm8k"}}, "reard"),  # an unknown top-level key
        (  # two services on one port: the address rule holds for every service
            {"services": {"reward": {"port": 50123}, "buffer": {"port": 50123}}},
            "services.buffer.port",
        ),
    ],
)
def test_what_the_reward_service_reads_is_still_checked(
    tree: dict[str, Any], path: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, tree), service="reward")
    assert err.value.paths == [path]


def test_a_missing_data_set_stops_the_rollout_not_the_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(tmp_path / "none"))
    path = write(tmp_path, {"train_dataset": {"path": "openai/gsm8k"}})
    cfg = load_config(path, service="reward")
    assert cfg.reward.fn == "gsm8k"  # the data set's reward still follows from its name
    with pytest.raises(ConfigError) as err:
        load_config(path, service="rollout")
    assert err.value.paths == ["train_dataset.path"]


def test_an_unknown_service_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, service="rewards")
    assert "use one of reward, buffer, rollout" in str(err.value)
