"""`flywheel doctor RUN_DIR [--json]` as a user runs it: the report, the exit status, and a
live run whose services are scraped over HTTP (the rollout's and reward service's own
metrics classes, served by prometheus_client on loopback)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from services.cli import main
from services.reward.metrics import RewardMetrics
from services.rollout.metrics import RolloutMetrics
from tests.doctor.runs import make_run


def test_a_healthy_run_prints_every_check_and_exits_0(tmp_path: Path, capsys):
    run = make_run(tmp_path)
    assert main(["doctor", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"flywheel doctor: {run} (finished, 30 steps)"
    for name in ("importance_weight", "behave_imp_weight", "no_eos_ratio", "reward_trend"):
        assert any(line.startswith("PASS") and name in line for line in out.splitlines()), out
    # n/a: reward_failures (finished: no live counters), the two vision checks (text run)
    # and the three agent checks (no agent workflow)
    assert out.splitlines()[-1] == "verdict: pass (11 pass, 0 warn, 0 fail, 6 n/a)"


def test_a_warning_exits_1_and_a_failure_exits_2_with_json(tmp_path: Path, capsys):
    warn = make_run(tmp_path / "w", per_step=lambda i: {"stats": {"no_eos_ratio": 0.06}})
    assert main(["doctor", str(warn)]) == 1
    fail = make_run(tmp_path / "f", per_step=lambda i: {"stats": {"no_eos_ratio": 0.5}})
    capsys.readouterr()
    assert main(["doctor", str(fail), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "fail" and report["steps"] == 30 and not report["live"]
    check = {c["name"]: c for c in report["checks"]}["no_eos_ratio"]
    assert check["status"] == "fail" and check["numbers"]["recent_mean"] == 0.5


def test_a_directory_that_is_no_run_exits_2(tmp_path: Path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "missing")]) == 2


@pytest.fixture
def live_services(tmp_path: Path) -> Iterator[tuple[RolloutMetrics, RewardMetrics, dict]]:
    rollout, reward = RolloutMetrics(), RewardMetrics(CollectorRegistry())
    servers = [
        start_http_server(0, addr="127.0.0.1", registry=m.registry) for m in (rollout, reward)
    ]
    ports = [s.server_port for s, _ in servers]
    addresses = {
        "reward": {"grpc": "127.0.0.1:1", "metrics": f"http://127.0.0.1:{ports[1]}/metrics"},
        "rollout": [{"grpc": "127.0.0.1:1", "metrics": f"http://127.0.0.1:{ports[0]}/metrics"}],
        # a trainer that does not answer: named, the rest still judged
        "trainer": {"grpc": "127.0.0.1:1", "metrics": "http://127.0.0.1:1/metrics"},
    }
    try:
        yield rollout, reward, addresses
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join()


def test_a_live_run_whose_reward_service_stalls_fails_on_timeouts(
    tmp_path: Path, live_services, capsys
):
    rollout, reward, addresses = live_services
    # 100 completions, 30 of which the reward service timed out on (30% > 10%: fail)
    for i in range(100):
        rollout.observe_completion("stop")
        status = "TIMEOUT" if i < 30 else "OK"
        reward.result("gsm8k", status)
        if status != "OK":
            rollout.reward_failures.labels(status=status).inc()
    rollout.observe_update("disk", True, 0.1, 0.01)
    run = make_run(tmp_path, summary=False)
    (run / "services.json").write_text(json.dumps(addresses))
    assert main(["doctor", str(run), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["live"] and report["unreachable"] == ["trainer"]
    check = {c["name"]: c for c in report["checks"]}["reward_failures"]
    assert check["status"] == "fail"
    assert check["numbers"]["failures_by_status"] == {"TIMEOUT": 30.0}
    assert check["numbers"]["completions"] == 100.0
    assert check["numbers"]["reward_results_by_status"] == {"TIMEOUT": 30.0, "OK": 70.0}
    assert "time out" in check["advice"]
    sync = {c["name"]: c for c in report["checks"]}["weight_sync"]
    assert sync["status"] == "pass" and sync["numbers"]["replica_updates_by_result"] == {"ok": 1.0}


def test_a_live_replica_refusing_an_update_fails_weight_sync(tmp_path: Path, live_services, capsys):
    rollout, _, addresses = live_services
    rollout.observe_update("disk", True, 0.1, 0.01)
    rollout.observe_update("disk", False, 0.1, 0.0)  # e.g. a checksum mismatch
    run = make_run(tmp_path, summary=False)
    (run / "services.json").write_text(json.dumps(addresses))
    assert main(["doctor", str(run)]) == 2
    out = capsys.readouterr().out
    assert "FAIL  weight_sync" in out and "refused 1" in out


def test_a_live_ledger_counts_each_filtered_group_once(tmp_path: Path, capsys):
    # The rollout counts a group the buffer filtered as rejected{reason="filtered"} too
    # (services/rollout/loop.py `_put`): doctor takes the buffer's count, and adds only the
    # rollout's groups that never reached the buffer (here 2 timeouts).
    from services.buffer.metrics import build_metrics
    from services.buffer.store import StatsSnapshot

    buffer = build_metrics(CollectorRegistry())
    dropped = {"filtered": 90, "stale_at_put": 0, "stale_at_claim": 0, "invalid": 0}
    buffer.snapshot.update(
        StatsSnapshot(
            version=3,
            put=100,
            admitted=10,
            acked=10,
            claimed=10,
            duplicate=0,
            redelivered=0,
            dropped=dropped,
            pending=0,
            in_flight=0,
            stored_bytes=0,
            capacity=4,
            running=0,
            accepted=10,
            retained=0,
            reservations_expired=0,
        )
    )
    rollout = RolloutMetrics()
    rollout.groups_rejected.labels(reason="filtered").inc(90)
    rollout.groups_rejected.labels(reason="timeout").inc(2)
    servers = [
        start_http_server(0, addr="127.0.0.1", registry=r)
        for r in (buffer.registry, rollout.registry)
    ]
    try:
        b, r = (f"http://127.0.0.1:{s.server_port}/metrics" for s, _ in servers)
        run = make_run(tmp_path, summary=False)
        (run / "services.json").write_text(
            json.dumps({"buffer": {"metrics": b}, "rollout": [{"metrics": r}]})
        )
        main(["doctor", str(run), "--json"])
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join()
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["dropped_groups"]
    # 90 of 100 put: above the 0.8 warning line, below the 0.95 failure line
    assert check["numbers"]["filtered_fraction"] == 0.9 and check["status"] == "warn"
    assert check["numbers"]["not_put_by_rollout"] == {"timeout": 2.0}
    assert "never put: timeout 2" in check["summary"]
