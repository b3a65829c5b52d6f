"""The vision checks of `flywheel doctor` (`services/doctor/checks/vision.py`) on the
exposition a real rollout registry writes, and every check on a vision run's directory."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from services.common.config import load_config
from services.doctor import checks
from services.doctor.checks.vision import processor_time, vision_images
from services.doctor.evidence import Evidence, gather, parse_exposition
from services.rollout.metrics import RolloutMetrics
from tests.doctor.runs import make_run
from tests.vision_fixtures import tiny_vlm_dir  # noqa: F401


def evidence(metrics: RolloutMetrics, tmp_path: Path, config=None) -> Evidence:  # noqa: ANN001
    scraped = {"rollout-0": parse_exposition(generate_latest(metrics.registry).decode())}
    return Evidence(tmp_path, config, [], live=True, scraped=scraped)


def test_text_runs_get_no_vision_verdict(tmp_path: Path) -> None:
    m = RolloutMetrics()
    m.groups_produced.inc(10)
    text_run = load_config(None, [])
    assert vision_images(evidence(m, tmp_path, text_run)).status == "n/a"
    assert processor_time(evidence(m, tmp_path, text_run)).status == "n/a"


def test_a_vision_run_without_images_fails_and_few_images_warn(
    tmp_path: Path,
    tiny_vlm_dir: Path,  # noqa: F811
) -> None:
    cfg = load_config(None, [f"actor.path={tiny_vlm_dir}", "rollout.workflow=vision_rlvr"])
    m = RolloutMetrics()
    m.groups_produced.inc(10)
    check = vision_images(evidence(m, tmp_path, cfg))
    assert check.status == "fail" and "images` column" in check.advice
    for _ in range(4):  # 4 of 10 prompts rendered with one image of 4 tokens
        m.observe_images(1, 4, 0.01)
    check = vision_images(evidence(m, tmp_path, cfg))
    assert check.status == "warn" and check.numbers["share_with_images"] == 0.4
    for _ in range(6):
        m.observe_images(2, 8, 0.01)
    check = vision_images(evidence(m, tmp_path, cfg))
    assert check.status == "pass"
    # (4 x 1 + 6 x 2) / 10 images and (4 x 4 + 6 x 8) / 10 tokens per prompt
    assert check.numbers["images_per_prompt"] == 1.6
    assert check.numbers["image_tokens_per_prompt"] == 6.4


def test_a_slow_processor_warns(tmp_path: Path) -> None:
    m = RolloutMetrics()
    m.observe_images(1, 4, 0.02)
    m.observe_images(1, 4, 0.04)
    check = processor_time(evidence(m, tmp_path))  # no config: the counters say vision
    assert check.status == "pass" and check.numbers["mean_seconds"] == 0.03
    m.observe_images(1, 4, 2.0)  # mean (0.02 + 0.04 + 2.0) / 3 = 0.687 > 0.5
    assert processor_time(evidence(m, tmp_path)).status == "warn"


def test_every_check_holds_for_a_healthy_vision_run(
    tmp_path: Path,
    tiny_vlm_dir: Path,  # noqa: F811
) -> None:
    run = make_run(
        tmp_path,
        config={"actor": {"path": str(tiny_vlm_dir)}, "rollout": {"workflow": "vision_rlvr"}},
    )
    ev = gather(run)
    assert ev.config is not None and ev.config.rollout.workflow == "vision_rlvr"
    result = checks.run_checks(ev)
    assert checks.verdict(result) == "pass", [(c.name, c.status, c.summary) for c in result]
