"""Service processes: logs prefixed and kept, failures reported with their last lines, no
orphans when the launcher itself is killed, and the restart budget with its back-off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.launcher.processes import (
    Liveness,
    RestartBudget,
    ServiceFailed,
    ServiceProcess,
    describe_exit,
    wait_until_serving,
)


def test_logs_go_to_file_and_tail_and_exit_code_is_reported(tmp_path):
    code = "import sys\nfor i in range(50): print('line', i)\nsys.exit(3)"
    proc = ServiceProcess("demo", [sys.executable, "-c", code], tmp_path, echo=False).start()
    assert proc.wait(timeout=30) == 3
    assert (tmp_path / "demo.log").read_text().count("line") == 50
    assert proc.last_lines(2) == "line 48\nline 49"
    with pytest.raises(ServiceFailed, match="exited with code 3 before it was healthy") as err:
        wait_until_serving(proc, "127.0.0.1:1", timeout=5)
    assert "line 49" in str(err.value)  # the failure carries the service's last words


def test_a_job_that_finished_before_its_health_check_is_not_a_failure(tmp_path):
    # A trainer with a few steps can be done before the launcher first asks for its health:
    # a clean exit then reads as finished (False), any other exit still fails.
    done = ServiceProcess("job", [sys.executable, "-c", "print('done')"], tmp_path, echo=False)
    done.start().wait(timeout=30)
    assert wait_until_serving(done, "127.0.0.1:1", timeout=5, may_finish=True) is False
    with pytest.raises(ServiceFailed, match="exited with code 0 before it was healthy"):
        wait_until_serving(done, "127.0.0.1:1", timeout=5)
    crash = "import sys; sys.exit(3)"
    bad = ServiceProcess("bad", [sys.executable, "-c", crash], tmp_path, echo=False).start()
    bad.wait(timeout=30)
    with pytest.raises(ServiceFailed, match="exited with code 3"):
        wait_until_serving(bad, "127.0.0.1:1", timeout=5, may_finish=True)


def test_stop_sends_sigterm_then_the_process_exits(tmp_path):
    code = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print('draining', flush=True), sys.exit(0)))
        print('ready', flush=True)
        time.sleep(60)
        """
    )
    proc = ServiceProcess("svc", [sys.executable, "-c", code], tmp_path, echo=False).start()
    deadline = time.monotonic() + 120  # a guard; a SIGTERM before the handler is no test
    while "ready" not in proc.last_lines() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ready" in proc.last_lines()
    assert proc.stop(timeout=20) == 0
    assert "draining" in (tmp_path / "svc.log").read_text()


def test_a_child_inherits_the_environment_less_the_credentials_it_is_not_given(
    tmp_path, monkeypatch
):
    # The launcher's own credentials stay with it: a child sees only the ones it is handed.
    monkeypatch.setenv("FLYWHEEL_REDIS_PASSWORD", "launcher-pw")
    monkeypatch.setenv("FLYWHEEL_TOKEN", "launcher-token")
    monkeypatch.setenv("KEPT_VARIABLE", "kept")
    names = ("FLYWHEEL_REDIS_PASSWORD", "FLYWHEEL_TOKEN", "KEPT_VARIABLE")
    code = f"import os; print(sorted((k, os.environ[k]) for k in {names!r} if k in os.environ))"
    proc = ServiceProcess(
        "child",
        [sys.executable, "-c", code],
        tmp_path,
        env={"FLYWHEEL_TOKEN": "own-token"},
        drop=("FLYWHEEL_REDIS_PASSWORD", "FLYWHEEL_TOKEN"),
        echo=False,
    ).start()
    assert proc.wait(timeout=30) == 0
    assert proc.last_lines(1) == "[('FLYWHEEL_TOKEN', 'own-token'), ('KEPT_VARIABLE', 'kept')]"


def test_children_die_when_the_launcher_is_killed(tmp_path):
    """The launcher is SIGKILLed (no cleanup runs): its service must not outlive it."""
    pid_file = tmp_path / "child.pid"
    launcher = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from services.launcher.processes import ServiceProcess
        p = ServiceProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
                           Path({str(tmp_path)!r}), echo=False).start()
        Path({str(pid_file)!r}).write_text(str(p.pid))
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 120  # a guard for two Python starts on a busy machine
    # write_text creates the file before it writes: wait for the pid, not for the name.
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive while the launcher lives
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60  # a guard: the kill is at once, a loaded machine is slow
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("service process outlived its killed launcher")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restart_budget_backs_off_exponentially_and_gives_up_within_the_window():
    clock = _Clock()
    budget = RestartBudget(3, window_s=600.0, backoff_s=1.0, backoff_max_s=3.0, clock=clock)
    # 1 * 2**0, 1 * 2**1, then 1 * 2**2 = 4 capped at 3; a fourth death in the window: no.
    delays = []
    for _ in range(3):
        delays.append(budget.next_delay("buffer"))
        budget.record("buffer")
        clock.now += 10.0
    assert delays == [1.0, 2.0, 3.0]
    assert budget.next_delay("buffer") is None
    assert budget.next_delay("reward") == 1.0  # counted per service
    # 600 s after the first restart it leaves the window: one restart is allowed again,
    # with the back-off of the two still inside it (1 * 2**2, capped).
    clock.now = 1000.0 + 600.0
    assert budget.recent("buffer") == 2
    assert budget.next_delay("buffer") == 3.0


def test_restart_budget_of_zero_never_restarts():
    assert RestartBudget(0, 60.0, 1.0, 30.0).next_delay("trainer") is None


def test_exit_description_names_the_signal(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = ServiceProcess("victim", sleeper, tmp_path, echo=False).start()
    proc.kill()
    code = proc.wait(timeout=30)
    assert code == -9 and describe_exit(code) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "running"


_HEALTH_SERVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining still answers
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print("port", port, flush=True)
    time.sleep(600)
    """
)


def all_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped by a signal (proc(5) state T)."""
    states = [
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        for task in Path(f"/proc/{pid}/task").iterdir()
    ]
    return all(state == "T" for state in states)


def test_liveness_counts_any_answer_and_finds_a_stopped_service_hung(tmp_path):
    proc = ServiceProcess(
        "svc", [sys.executable, "-c", _HEALTH_SERVER], tmp_path, echo=False
    ).start()
    try:
        deadline = time.monotonic() + 60
        while "port" not in proc.last_lines() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(proc.last_lines(1).split()[1])
        probe = Liveness(f"127.0.0.1:{port}", timeout_s=2.0)
        # NOT_SERVING is an answer; the first probe also connects (generous on a busy machine)
        assert probe.probe(deadline_s=30.0) and not probe.hung()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGSTOP)  # alive to waitpid, silent to everyone
        deadline = time.monotonic() + 60  # its own guard: the start may have used the first
        # kill() returns before every thread has stopped: on a busy machine one answered
        # the first probe. Probe once all of them are (state T in proc(5)).
        while not all_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        while not probe.hung() and time.monotonic() < deadline:
            assert not probe.probe(deadline_s=0.5)
        assert probe.hung() and proc.alive()
        os.kill(proc.pid, signal.SIGCONT)
        assert probe.probe(deadline_s=60.0) and not probe.hung()
        probe.close()
    finally:
        proc.kill()
