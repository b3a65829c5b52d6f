"""`docker compose up` of the CPU stack on a real Docker engine, as a user runs it.

The repository's docker-compose.yml plus only deploy/docker/compose.offline.yml (no registry
here: base, Redis and Prometheus images from Debian's packages, the torch wheel from a
PEP 503 index on 127.0.0.1). One short run with overrides, then two buffer faults in the
same run, then `down -v`. The tests are steps of that one run and depend on their order.

Needs root and Debian (or a running engine with Compose v2): `make test-compose`.
"""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest

from tests.deploy.compose_secrets import stack_secrets

# Generous: a cold build on a loaded machine is the slow part (the run itself is minutes).
pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(3000)]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "flywheel-compose-test"
STATE = Path(os.environ.get("FLYWHEEL_DOCKER_STATE", "/var/tmp/flywheel-docker"))
# Enough that the faults land mid-run on a quiet machine (~1 step/s there: 60 once ended
# before the buffer outage); the finish wait below allows a slow machine too.
TOTAL_STEPS = 120
TEMPERATURE = 0.9
# Steps trained before the faults, so the healthy checks see a trainer at work.
HEALTHY_STEPS = 12
# Longer than reward.deadline_ms (15 s): the outage the trainer died of.
OUTAGE_S = 20
SERVICES = ("redis", "buffer", "reward", "rollout", "trainer", "prometheus")
METRICS_JSONL = "/data/runs/demo/latest/metrics.jsonl"
INDEX_PORT = 8765


def log(msg: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 2.0) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
            last = exc
            result = None
        else:
            result = last
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:.0f} s (last: {last!r})")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prom_metric(text: str, name: str) -> list[float]:
    """Every sample of metric `name` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ", line):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


class Stack:
    """The compose project: CLI calls, container state, files and metrics inside it."""

    def __init__(self, docker: str, env: dict[str, str], prometheus_port: int) -> None:
        self.docker = docker
        self.env = env
        self.prometheus = f"http://127.0.0.1:{prometheus_port}"
        self.timings: dict[str, float] = {}
        self.normal_reserved = 0.0

    def base_command(self) -> list[str]:
        return [
            self.docker,
            "compose",
            "-p",
            PROJECT,
            "-f",
            str(ROOT / "docker-compose.yml"),
            "-f",
            str(ROOT / "deploy" / "docker" / "compose.offline.yml"),
        ]

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = [*self.base_command(), *args]
        done = subprocess.run(
            cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def inspect(self, service: str) -> dict[str, Any]:
        ids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        out = subprocess.run(
            [self.docker, "inspect", ids[0]], capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)[0]  # type: ignore[no-any-return]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status") or state["Status"])

    def exec_python(self, code: str, service: str = "rollout") -> str:
        return self.compose("exec", "-T", service, "python", "-c", code, timeout=60).stdout

    def read(self, path: str) -> str:
        return self.exec_python(f"import sys; sys.stdout.write(open({path!r}).read())")

    def metrics_of(self, service: str) -> str:
        return self.exec_python(
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
            f"'http://{service}:9400/metrics', timeout=5).read().decode())"
        )

    def steps(self) -> list[dict[str, Any]]:
        try:
            text = self.read(METRICS_JSONL)
        except AssertionError:  # not written yet
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def trained(self) -> int:
        return max((int(r["step"]) for r in self.steps()), default=0)

    def buffer_gauge(self, name: str) -> float:
        [value] = prom_metric(self.metrics_of("buffer"), f"flywheel_buffer_{name}")
        return value

    def prom(self, path: str) -> Any:
        with urlopen(f"{self.prometheus}{path}", timeout=10) as res:
            body = json.loads(res.read())
        assert body["status"] == "success", body
        return body["data"]


def _wheel_index(python: str) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The CPU torch wheel (and its dependencies) from this machine's pip, served as a PEP 503
    index on 127.0.0.1; the images' builder reaches it through the build network `host`."""
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    wheels = STATE / "wheels"
    if not list(wheels.glob(f"torch-{pin.group(1)}*.whl")):
        subprocess.run(
            [python, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels)]
            + [f"torch=={pin.group(1)}"],
            check=True,
            timeout=900,
        )
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from wheel_index import build_index
    finally:
        sys.path.pop(0)
    index = STATE / "index"
    shutil.rmtree(index, ignore_errors=True)
    build_index(wheels, index)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

    handler = functools.partial(Quiet, directory=str(index))
    # One port run after run: the index address is a build argument, part of the cache key
    # of the torch layer (another port rebuilds it).
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:  # taken: any port, at the price of that rebuild
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def _leftovers(docker: str) -> list[str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    found = []
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        out = subprocess.run(
            [docker, *kind, "-q", "--filter", label], capture_output=True, text=True, check=True
        )
        found += [f"{kind[0]} {x}" for x in out.stdout.split()]
    return found


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    t0 = time.monotonic()
    env_out = subprocess.run(
        ["bash", str(ROOT / "tools" / "docker_env.sh")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert env_out.returncode == 0, env_out.stderr[-4000:]
    found = dict(line.split("=", 1) for line in env_out.stdout.splitlines() if "=" in line)
    docker = found["DOCKER"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLYWHEEL_", "COMPOSE_"))}
    if "DOCKER_CONFIG" in found:
        env["DOCKER_CONFIG"] = found["DOCKER_CONFIG"]
    leftovers = _leftovers(docker)
    if leftovers:  # a previous run that was killed before its teardown
        log(f"removing a previous test project: {leftovers}")
        subprocess.run(
            [docker, "compose", "-p", PROJECT, "down", "-v", "--remove-orphans"],
            env={**env, **stack_secrets()},
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )
    images = subprocess.run(
        ["bash", str(ROOT / "tools" / "offline_images.sh")],
        env={**env, "DOCKER": docker},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert images.returncode == 0, images.stderr[-4000:]
    server, index_url = _wheel_index(sys.executable)
    prometheus_port = free_port()
    env.update(stack_secrets())  # the role tokens and digests, Redis, SGLang, Grafana
    env.update(
        FLYWHEEL_TORCH_INDEX_URL=index_url,
        FLYWHEEL_PROMETHEUS_PORT=str(prometheus_port),
        FLYWHEEL_OVERRIDES=f"total_train_steps={TOTAL_STEPS} gconfig.temperature={TEMPERATURE}",
    )
    s = Stack(docker, env, prometheus_port)
    s.timings["environment_s"] = time.monotonic() - t0
    try:
        t = time.monotonic()
        build = [*s.base_command(), "build", "prepare", "buffer", "reward", "rollout", "trainer"]
        if os.environ.get("FLYWHEEL_COMPOSE_SKIP_BUILD") == "1":  # iterating on the test only
            build = [*s.base_command(), "config", "-q"]
        with (STATE / "compose-build.log").open("w") as build_log:  # follow it there
            built = subprocess.run(
                build, cwd=ROOT, env=env, stdout=build_log, stderr=subprocess.STDOUT, timeout=2400
            )
        assert built.returncode == 0, (STATE / "compose-build.log").read_text()[-4000:]
        s.timings["build_s"] = time.monotonic() - t
        log(f"images built in {s.timings['build_s']:.0f} s")
        t = time.monotonic()
        s.compose("up", "-d", "--no-build", *SERVICES, timeout=900)
        s.timings["up_s"] = time.monotonic() - t
        s.timings["up_at"] = time.monotonic()
        log(f"up -d returned after {s.timings['up_s']:.0f} s")
        yield s
    finally:
        server.shutdown()
        if os.environ.get("FLYWHEEL_COMPOSE_KEEP") != "1":
            logs = s.compose("logs", "--no-color", "--tail", "60", check=False, timeout=120)
            (STATE / "compose-test.log").write_text(logs.stdout + logs.stderr)
            s.compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        s.timings["total_s"] = time.monotonic() - t0
        log(f"timings: {json.dumps({k: round(v) for k, v in s.timings.items() if k != 'up_at'})}")


def _healthy(stack: Stack, service: str) -> bool:
    return stack.health(service) == "healthy"


def test_every_service_healthy_and_the_trainer_at_work(stack: Stack) -> None:
    """Redis, buffer, reward, rollout, trainer and Prometheus healthy (the reward service
    never was: its workers exited at start as the container's pid 1 children), the user's
    overrides in force in every service (a temperature override made them all refuse to
    start), and the trainer past its first steps."""
    for service in SERVICES:
        wait_for(f"{service} healthy", functools.partial(_healthy, stack, service), 300)
    assert stack.inspect("prepare")["State"]["ExitCode"] == 0
    config = stack.read("/data/config/flywheel.yaml")
    assert "${gconfig.temperature}" in config and "${gconfig.n_samples}" in config
    assert f"temperature: {TEMPERATURE}" in config
    wait_for(f"{HEALTHY_STEPS} steps trained", lambda: stack.trained() >= HEALTHY_STEPS, 600)
    stack.timings["first_steps_s"] = time.monotonic() - stack.timings["up_at"]


def test_prometheus_scrapes_every_target_with_real_samples_and_no_alert(stack: Stack) -> None:
    jobs = {"flywheel-buffer", "flywheel-reward", "flywheel-rollout", "flywheel-trainer"}

    def all_up() -> bool:
        targets = stack.prom("/api/v1/targets")["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        return jobs | {"prometheus"} <= set(health) and set(health.values()) == {"up"}

    wait_for("every Prometheus target up", all_up, 120)

    def sample(name: str) -> float | None:
        result = stack.prom(f"/api/v1/query?query=flywheel_trainer_{name}")["result"]
        values = [float(r["value"][1]) for r in result]
        return values[0] if values and all(math.isfinite(v) for v in values) else None

    def has_sample(name: str) -> bool:
        return sample(name) is not None

    for name in ("importance_weight", "no_eos_ratio"):
        wait_for(f"a finite sample of {name}", functools.partial(has_sample, name), 120)
    importance = sample("importance_weight")
    assert importance is not None and 0.5 < importance < 2.0

    def active_alerts() -> list[dict[str, Any]]:
        alerts = stack.prom("/api/v1/alerts")["alerts"]
        return [a for a in alerts if a["state"] in ("pending", "firing")]

    # Which group each alert is in: `flywheel.system` judges the stack's plumbing,
    # `flywheel.rl-health` the learning signals of the run.
    group_of = {
        rule["name"]: group["name"]
        for group in stack.prom("/api/v1/rules?type=alert")["groups"]
        for rule in group["rules"]
    }
    assert {"flywheel.system", "flywheel.rl-health"} <= set(group_of.values()), group_of

    def wrong_alerts() -> list[dict[str, Any]]:
        """Alerts a healthy young run must not have: any firing, and any system alert
        pending. A learning-signal alert may be pending: its `for` (10-15 minutes) is there
        to ride out what a young run does for a while (the demo's truncated share rises
        past 5 % for some steps around step 20-35, then falls back to ~2 %)."""
        return [
            a
            for a in active_alerts()
            if a["state"] == "firing"
            or group_of.get(a["labels"]["alertname"]) != "flywheel.rl-health"
        ]

    # FlywheelServiceAbsent is rightly pending while the trainer waits for its dependencies
    # (it starts last; the rule fires only after 5 minutes). Once every target is up, the
    # next evaluation (evaluation_interval 15 s) must clear it: any system alert still
    # pending, or any alert firing, after two more intervals and a margin is a real one.
    try:
        wait_for("no system alert pending, no alert firing", lambda: not wrong_alerts(), 60)
    except AssertionError:
        assert wrong_alerts() == []
        raise
    for alert in active_alerts():  # pending learning-signal alerts: backed by the run's data
        name = alert["labels"]["alertname"]
        log(f"{name} pending ({alert['annotations'].get('summary', '')})")
        if name == "FlywheelNoEosRatioHigh":  # an average above 5 % needs a step above it
            # (its line may follow the gauge by a publication: waited for, not read once)
            def truncating_step() -> bool:
                return any(float(r.get("no_eos_ratio") or 0) > 0.05 for r in stack.steps())

            wait_for("a step record above 5 % truncated", truncating_step, 60)
    # The level of outstanding reservations in a healthy run, for after the faults.
    levels = []
    for _ in range(3):
        levels.append(stack.buffer_gauge("reserved_groups"))
        time.sleep(2)
    stack.normal_reserved = max(levels)
    assert stack.buffer_gauge("invariant_ok") == 1


def _buffer_back(stack: Stack, restarts_before: int | None = None) -> None:
    if restarts_before is not None:
        wait_for(
            "buffer restarted",
            lambda: stack.inspect("buffer")["RestartCount"] > restarts_before,
            120,
        )
    wait_for("buffer healthy again", lambda: stack.health("buffer") == "healthy", 180)


def test_sigkill_of_the_buffer_process_inside_its_container(stack: Stack) -> None:
    info = stack.inspect("buffer")
    init_pid = int(info["State"]["Pid"])  # docker-init; the buffer is its only child
    [child] = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    assert "services.buffer" in Path(f"/proc/{child}/cmdline").read_text()
    before = stack.trained()
    os.kill(int(child), signal.SIGKILL)
    log(f"SIGKILL to the buffer (pid {child}) at step {before}")
    _buffer_back(stack, int(info["RestartCount"]))
    wait_for("training goes on", lambda: stack.trained() > before + 2, 300)


def test_buffer_stopped_longer_than_the_reward_deadline(stack: Stack) -> None:
    before = stack.trained()
    assert before < TOTAL_STEPS, "the run ended before the faults: raise TOTAL_STEPS"
    stack.compose("stop", "buffer", timeout=120)
    log(f"buffer stopped at step {before} for {OUTAGE_S} s")
    time.sleep(OUTAGE_S)
    assert stack.inspect("trainer")["State"]["Status"] == "running"
    stack.compose("start", "buffer", timeout=120)
    _buffer_back(stack)
    wait_for("training goes on", lambda: stack.trained() > before + 2, 300)


def test_the_run_finishes_once_and_leaves_the_buffer_as_it_was(stack: Stack) -> None:
    def trainer_exited() -> dict[str, Any] | None:
        info = stack.inspect("trainer")
        return info if info["State"]["Status"] == "exited" else None

    info = wait_for("trainer finished", trainer_exited, 1800, every=5)
    stack.timings["run_s"] = time.monotonic() - stack.timings["up_at"]
    assert info["State"]["ExitCode"] == 0
    assert info["RestartCount"] == 0  # rode through both outages, and a finished run stays ended
    time.sleep(5)
    assert stack.inspect("trainer")["State"]["Status"] == "exited"
    records = stack.steps()
    steps = [int(r["step"]) for r in records]
    assert sorted(steps) == list(range(1, TOTAL_STEPS + 1)), "a step missing or trained twice"
    rewards = [float(r["task_reward"]) for r in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    log(f"task reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last > first
    # Reservations a client could not release during the outages come back: the level of a
    # healthy run, not the leaked 32 held for reservation_timeout_s (1800 s).
    wait_for(
        f"reserved groups back to <= {stack.normal_reserved:g}",
        lambda: stack.buffer_gauge("reserved_groups") <= stack.normal_reserved,
        90,
    )
    assert stack.buffer_gauge("invariant_ok") == 1

    # The one alert the faults must raise: the buffer restarted (FlywheelServiceRestarted
    # fires for an hour after a service process starts again). Nothing else may fire.
    def firing() -> list[tuple[str, str]]:
        alerts = stack.prom("/api/v1/alerts")["alerts"]
        return sorted(
            (a["labels"]["alertname"], a["labels"].get("job", ""))
            for a in alerts
            if a["state"] == "firing"
        )

    restarted = ("FlywheelServiceRestarted", "flywheel-buffer")
    wait_for("the buffer's restart alert", lambda: restarted in firing(), 90)
    assert [a for a in firing() if a != restarted] == []


def test_a_completed_run_stays_completed(stack: Stack) -> None:
    """`docker compose up` again: the trainer finds the run completed, exits 0 at once and is
    not restarted (it resumed at its last step, exited and restarted forever)."""
    first_start = stack.inspect("trainer")["State"]["StartedAt"]
    stack.compose("up", "-d", "--no-build", "--no-deps", "trainer", timeout=300)

    def exited_again() -> dict[str, Any] | None:
        info = stack.inspect("trainer")
        started = info["State"]["StartedAt"]
        done = info["State"]["Status"] == "exited" and started != first_start
        return info if done else None

    info = wait_for("trainer exited again", exited_again, 300)
    assert (info["State"]["ExitCode"], info["RestartCount"]) == (0, 0)
    assert stack.trained() == TOTAL_STEPS
    logs = stack.compose("logs", "--no-color", "trainer").stdout
    assert f"run already completed at step {TOTAL_STEPS}" in logs
    # As an operator would: with the admin token (the rollout's own may not read the trainer).
    admin = f"FLYWHEEL_TOKEN={stack.env['FLYWHEEL_TOKEN']}"
    status = stack.compose(
        "exec",
        "-T",
        "-e",
        admin,
        "rollout",
        "flywheel",
        "status",
        "--config",
        "/data/config/flywheel.yaml",
    )
    assert json.loads(status.stdout)["run"]["state"] == "completed", status.stdout


def test_stop_ends_every_service_by_its_signal_and_down_leaves_nothing(stack: Stack) -> None:
    """With an init as pid 1 each service gets SIGTERM and ends by itself (`stop reward`
    ended in exit 137: killed after the grace period)."""
    stack.compose("stop", timeout=600)
    for service in SERVICES:
        code = stack.inspect(service)["State"]["ExitCode"]
        assert code != 137, f"{service} was killed at stop (exit {code})"
    stack.compose("down", "-v", "--remove-orphans", timeout=300)
    assert _leftovers(stack.docker) == []
