"""Credentials never show in a config dump: `to_yaml` (and so `flywheel run --dry-run`)
masks the tokens and the Redis password (`to_yaml` once printed `redis_password`)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config, to_yaml

SECRETS = {
    "services.auth_token": "shared-token-1",
    "buffer.redis_password": "redis-password-2",
    "services.credentials.trainer": "trainer-token-3",
    "services.credentials.rollout": "rollout-token-4",
}


def test_to_yaml_masks_every_credential() -> None:
    cfg = load_config(None, [f"{k}={v}" for k, v in SECRETS.items()])
    text = to_yaml(cfg)
    for value in SECRETS.values():
        assert value not in text
    assert "redis_password: '***'" in text and "auth_token: '***'" in text
    assert "trainer: '***'" in text and "rollout: '***'" in text
    # The unredacted dump keeps them (the launchers need the values).
    raw = to_yaml(cfg, redact=False)
    assert all(value in raw for value in SECRETS.values())


def test_credentials_name_known_roles_only() -> None:
    with pytest.raises(ConfigError, match="unknown roles"):
        load_config(None, ["services.credentials.reward=x"])


def test_tls_needs_cert_and_key_and_mtls_a_ca() -> None:
    with pytest.raises(ConfigError, match="both cert_file and key_file"):
        load_config(None, ["services.tls.cert_file=/tls/tls.crt"])
    with pytest.raises(ConfigError, match="mTLS needs"):
        load_config(
            None,
            [
                "services.tls.cert_file=/tls/tls.crt",
                "services.tls.key_file=/tls/tls.key",
                "services.tls.require_client_cert=true",
            ],
        )


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:the%20pw-5ecret@10.0.0.7:6380/2", "redis://:***@10.0.0.7:6380/2"),
        ("rediss://default:pw-5ecret@[::1]:6379/0", "rediss://default:***@[::1]:6379/0"),
        ("redis://10.0.0.7:6380/2", "redis://10.0.0.7:6380/2"),  # nothing to mask
    ],
)
def test_a_password_inside_the_redis_url_is_masked_like_redis_password(
    url: str, masked: str, capsys: pytest.CaptureFixture
) -> None:
    # `flywheel run --dry-run` printed buffer.redis_url with its password in clear.
    from services import cli

    cfg = load_config(None, [f"buffer.redis_url={url}"])
    assert f"redis_url: {masked}" in to_yaml(cfg)
    assert cfg.buffer.redis_url == url  # only the dump is masked
    assert f"redis_url: {url}" in to_yaml(cfg, redact=False)
    code = cli.main(
        ["run", "--config", "examples/grpo.yaml", f"buffer.redis_url={url}", "--dry-run"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "5ecret" not in out and f"redis_url: {masked}" in out
