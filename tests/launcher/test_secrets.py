"""Secrets of a local run: never on disk in a readable file, never on a command line, and
each process holding only its own role's token.

What a local user (or a compromised process of the run) can read is checked where they
would read it: `/proc/<pid>/cmdline` of every process the launcher starts (the real
redis-server and each service), every file of the run directory, and what a rollout
process's own token lets it do against the real buffer as the launcher starts it."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
import yaml

from services.common.config import FlywheelConfig
from services.common.config.loader import validate
from services.launcher.assets import RunSecrets, token_digest, write_resolved_config
from tests.run_configs import tiny_run_config

OPERATOR_TOKEN = "operator-tok-5ecret"
REDIS_PASSWORD = "redis-pw-5ecret"
ROLLOUT_TOKEN = "rollout-tok-5ecret"


def _config(tmp_path: Path, **services: object) -> FlywheelConfig:
    raw = tiny_run_config(tmp_path / "runs", experiment="secrets", steps=1000)
    raw["services"] = {"auth_token": OPERATOR_TOKEN, **services}
    raw["buffer"] = {"redis_password": REDIS_PASSWORD}
    return validate(raw)


def test_the_resolved_config_holds_no_credential(tmp_path: Path) -> None:
    cfg = _config(tmp_path, credentials={"rollout": ROLLOUT_TOKEN})
    cfg.buffer.redis_url = "redis://default:url-pw-5ecret@10.0.0.7:6380/2"
    path = write_resolved_config(cfg, tmp_path)
    text = path.read_text()
    assert "5ecret" not in text
    data = yaml.safe_load(text)
    assert "auth_token" not in data["services"] and "credentials" not in data["services"]
    assert "redis_password" not in data["buffer"]
    assert data["buffer"]["redis_url"] == "redis://default@10.0.0.7:6380/2"
    # What was left out reaches the services through their environment instead.
    secrets = RunSecrets.of(cfg)
    assert secrets.redis_password == REDIS_PASSWORD  # the field wins over the URL's


def test_each_process_gets_only_its_own_role_s_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLYWHEEL_REDIS_PASSWORD", raising=False)
    cfg = _config(tmp_path, credentials={"rollout": ROLLOUT_TOKEN})
    secrets = RunSecrets.of(cfg)
    # A plain token given for a role is used; the others are made for this run.
    assert secrets.tokens["rollout"] == ROLLOUT_TOKEN
    assert len({secrets.tokens[r] for r in ("trainer", "rollout", "launcher")}) == 3
    assert OPERATOR_TOKEN not in secrets.tokens.values()
    accepted = {
        "trainer": token_digest(secrets.tokens["trainer"]),
        "rollout": token_digest(ROLLOUT_TOKEN),
        "launcher": token_digest(secrets.tokens["launcher"]),
        "admin": token_digest(OPERATOR_TOKEN),  # the operator keeps what it had: everything
    }
    assert secrets.accepted == accepted
    servers = ",".join(f"{r}={d}" for r, d in accepted.items())  # digests only
    env = {name: secrets.environment(name) for name in ("buffer", "reward", "rollout", "trainer")}
    assert env["buffer"] == {
        "FLYWHEEL_CREDENTIALS": servers,
        "FLYWHEEL_REDIS_PASSWORD": REDIS_PASSWORD,
    }
    assert env["reward"] == {"FLYWHEEL_CREDENTIALS": servers}
    assert env["rollout"] == {"FLYWHEEL_CREDENTIALS": servers, "FLYWHEEL_TOKEN": ROLLOUT_TOKEN}
    assert env["trainer"]["FLYWHEEL_TOKEN"] == secrets.tokens["trainer"]
    assert secrets.launcher_token == secrets.tokens["launcher"]
    # Auth off stays off: no token is made up, and only the buffer hears of Redis.
    plain = RunSecrets.of(validate(tiny_run_config(tmp_path, experiment="x", steps=1)))
    assert (plain.tokens, plain.accepted, plain.environment("rollout")) == ({}, {}, {})


def _cmdline(pid: int) -> bytes:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes()


def _environ(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _code(address: str, token: str | None, call: str) -> grpc.StatusCode:
    from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
    from services.common.grpc_client import make_sync_channel

    ch = make_sync_channel(address, auth_token=token)
    stub = buffer_pb2_grpc.BufferServiceStub(ch)
    # 60 s: the buffer answers while the rest of the run starts on two busy cores; a late
    # answer must not read as DEADLINE_EXCEEDED where a status is asserted.
    try:
        if call == "SetVersion":
            stub.SetVersion(buffer_pb2.SetVersionRequest(request_id="probe", version=1), timeout=60)
        elif call == "Put":
            stub.Put(buffer_pb2.PutRequest(request_id="probe"), timeout=60)
        else:
            stub.Stats(common_pb2.Empty(), timeout=60)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    finally:
        ch.close()
    return grpc.StatusCode.OK


@pytest.mark.integration
@pytest.mark.slow
def test_a_launched_run_keeps_secrets_off_argv_and_disk_and_rollout_cannot_set_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local launcher starts redis-server, buffer, reward, a rollout replica and the
    trainer as in `flywheel run`, the operator's token in the config file and the Redis
    password in the launcher's environment."""
    from services.launcher import run_summary
    from services.launcher.local import LocalRun

    monkeypatch.setenv("FLYWHEEL_REDIS_PASSWORD", REDIS_PASSWORD)
    raw = tiny_run_config(tmp_path / "runs", experiment="secrets", steps=1000)
    raw["services"] = {"auth_token": OPERATOR_TOKEN}
    run = LocalRun(validate(raw))
    try:
        config_path = run.prepare()
        run.start_services(config_path)
        run.start_trainer(config_path)
        secrets = [OPERATOR_TOKEN, REDIS_PASSWORD, *run.secrets.tokens.values()]
        assert run.redis is not None and run.redis.proc is not None
        pids = {"redis-server": run.redis.proc.pid, **{p.name: p.pid for p in run.procs}}
        assert set(pids) == {"redis-server", "buffer", "reward", "rollout-0", "trainer"}
        for name, pid in pids.items():
            assert pid is not None
            cmdline = _cmdline(pid)
            assert not [s for s in secrets if s.encode() in cmdline], (name, cmdline)
        for path in run.run_dir.rglob("*"):
            if path.is_file() and not path.is_symlink():
                body = path.read_bytes()
                if any(s.encode() in body for s in secrets):
                    assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

        env = {name: _environ(pid) for name, pid in pids.items() if name != "redis-server"}
        assert env["buffer"].get("FLYWHEEL_REDIS_PASSWORD") == REDIS_PASSWORD
        for name in ("reward", "rollout-0", "trainer"):
            assert "FLYWHEEL_REDIS_PASSWORD" not in env[name], name  # the buffer's alone
        for name in ("buffer", "reward"):
            assert "FLYWHEEL_TOKEN" not in env[name], name  # servers hold digests only
            assert OPERATOR_TOKEN not in env[name]["FLYWHEEL_CREDENTIALS"]
        rollout_token = env["rollout-0"]["FLYWHEEL_TOKEN"]
        trainer_token = env["trainer"]["FLYWHEEL_TOKEN"]
        assert len({rollout_token, trainer_token, OPERATOR_TOKEN}) == 3

        address = run.cfg.services.buffer.address
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert _code(address, rollout_token, "SetVersion") == denied  # only the trainer may
        assert _code(address, rollout_token, "Stats") == grpc.StatusCode.OK
        assert _code(address, trainer_token, "Put") == denied
        assert _code(address, run.secrets.launcher_token, "SetVersion") == denied
        assert _code(address, OPERATOR_TOKEN, "Stats") == grpc.StatusCode.OK  # admin
        assert _code(address, None, "Stats") == grpc.StatusCode.UNAUTHENTICATED
        # The launcher's own clients still work.
        stats = run_summary.buffer_stats(address, run.secrets.launcher_token)
        assert stats["invariant_ok"]
    finally:
        run.stop_all()


# `flywheel run` as a user starts it with `FLYWHEEL_TOKEN` set (every call within its role,
# the held-out evaluation with the launcher's token, the operator's token in no file of the
# run) is checked by the end-to-end run of tests/launcher/test_e2e_run.py, which runs with
# auth on: one run of the whole system instead of two.
