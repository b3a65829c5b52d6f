"""The entry module (services/buffer/__main__.py): arguments and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.buffer.__main__ import main, parse_args


def test_arguments() -> None:
    a = parse_args(["--config", "x.yaml", "buffer.max_stored_groups=8", "--replay", "f.jsonl"])
    assert (a.config, a.overrides, a.replay, a.export) == (
        "x.yaml",
        ["buffer.max_stored_groups=8"],
        "f.jsonl",
        None,
    )
    assert (a.min_version, a.max_version) == (0, -1)


def test_a_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("actor: {kl_ctl: 0.0}\nbuffer: {max_stored_groups: 0}\n")
    assert main(["--config", str(cfg)]) == 2
    assert "buffer.max_stored_groups" in capsys.readouterr().err


def test_check_masks_a_password_inside_the_redis_url(capsys: pytest.CaptureFixture) -> None:
    # docs/security.md: credentials are masked in dumps; `--check` printed the URL whole.
    url = "redis://default:url-pw-5ecret@127.0.0.1:1/0"
    code = main(["--check", f"buffer.redis_url={url}", "services.buffer.port=0"])
    out = capsys.readouterr()
    assert code == 0, out
    assert "5ecret" not in out.out + out.err
    assert "redis://default:***@127.0.0.1:1/0" in out.out + out.err
