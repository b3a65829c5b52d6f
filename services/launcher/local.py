"""`flywheel run` with `scheduler.type=local`: the whole system as local processes.

Order matters and is enforced by health gates: Redis, then the buffer (it needs Redis),
reward, rollout replicas (they need both), and the trainer last (it needs all of them).
The launcher then supervises: a service that dies (buffer, reward, a rollout replica, the
trainer, the local `redis-server`) is started again after a back-off, up to
`launcher.max_restarts` times per service within `launcher.restart_window_seconds`; one
more death ends the run with its last log lines. Each restart is announced, counted on the
progress line, appended to `<run_dir>/restarts.jsonl` and listed in `summary.json`. The
trainer exiting 0 (after `total_train_steps`) ends the run cleanly; a trainer that dies is
restarted and resumes from its last checkpoint (`trainer.recover: auto`). Ctrl-C stops
everything in reverse order. At the end the launcher checks the run's invariants and writes
`summary.json` and `learning_curve.png` into the run directory.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.common.redis_server import RedisServer
from services.launcher import assets, run_summary
from services.launcher.agent_eval import AgentEvalResult, AgentEvaluator
from services.launcher.evaluation import EvalResult, evaluate, resume_step
from services.launcher.metrics_log import MetricsTail
from services.launcher.processes import (
    Liveness,
    RestartBudget,
    ServiceFailed,
    ServiceProcess,
    describe_exit,
    wait_until_serving,
)
from services.launcher.progress import ProgressLine
from services.launcher.report import (
    scrape_metrics,
)
from services.launcher.restarts import GaveUp, RestartLog, say
from services.launcher.starvation_watch import StarvationWatch
from services.rollout.data.datasets import read_rows
from services.trainer.lifecycle import write_json_atomic
from services.trainer.paths import RunPaths

REDIS = "redis-server"
"""Name of the local Redis in restart records, `pids.json` and messages."""


@dataclass
class _Spec:
    """How a service process was started, so that it can be started again the same way."""

    module: str
    extra: list[str]
    address: str
    cpus: list[int] | None
    may_finish: bool


class LocalRun:
    """One local run: prepare, start, supervise, evaluate, stop, report."""

    def __init__(self, cfg: FlywheelConfig) -> None:
        self.cfg = cfg
        self.run_dir = assets.run_dir_of(cfg)
        self.secrets = assets.RunSecrets.of(cfg)
        self.trainer_paths = RunPaths.from_config(cfg)
        self.procs: list[ServiceProcess] = []
        self.redis: RedisServer | None = None
        self.evals: list[dict[str, Any]] = []
        self.scraped: dict[str, set[str]] = {}
        self.rollout_versions: list[int] = []
        self._stop = threading.Event()
        self.specs: dict[str, _Spec] = {}
        self.liveness: dict[str, Liveness] = {}
        lc = cfg.launcher
        self.budget = RestartBudget(
            lc.max_restarts,
            lc.restart_window_seconds,
            lc.restart_backoff_seconds,
            lc.restart_backoff_max_seconds,
        )
        self.restart_log = RestartLog(
            self.budget, self.run_dir, lc.max_restarts, lc.restart_window_seconds
        )
        self.restarts = self.restart_log.records  # the same list
        self._killed_because = self.restart_log.killed_because  # the same dict
        self.start_time = time.time()
        self.progress = ProgressLine(self.start_time)
        self.agent_eval: AgentEvaluator | None = None  # an agent run's, made on first use

    # ---- preparation -------------------------------------------------------------------
    def prepare(self) -> Path:
        if assets.reset_if_finished(self.run_dir):
            say(f"previous run in {self.run_dir} had finished: starting fresh")
            for name in ("restarts.jsonl", "starvation.json"):  # the supervisor's records
                (self.run_dir / name).unlink(missing_ok=True)
        elif (self.run_dir / "redis").is_dir() or self.trainer_paths.metrics_jsonl.exists():
            # Said out loud: the buffer's groups and versions carry over, so a user who
            # meant a fresh run sees why the versions do not start at 0.
            say(
                f"previous run in {self.run_dir} did not finish: resuming it "
                f"(trainer.recover: {self.cfg.trainer.recover}; the buffer's groups and "
                "versions carry over; the trainer starts from its newest checkpoint, or "
                "from actor.path when it saved none). Remove the directory to start fresh."
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Only this run's trainer may vouch for its metrics (see finish()).
        self.trainer_paths.metrics_textfile.unlink(missing_ok=True)
        assets.prepare_data(self.cfg, self.run_dir)
        assets.prepare_model(self.cfg, self.run_dir, log=say)
        if not self.cfg.buffer.redis_url:
            # Before the services' ports are picked: Redis binds its port now, so no
            # service port can be the same one.
            self.redis = RedisServer(
                dir=self.run_dir / "redis",
                password=self.secrets.redis_password,
                binary=self.cfg.buffer.redis_server,
            ).start()
            self.cfg.buffer.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
            say(f"redis-server on port {self.redis.port} (AOF in {self.run_dir / 'redis'})")
        assets.assign_ports(self.cfg)
        assets.resolve_run_paths(self.cfg, self.run_dir)
        path = assets.write_resolved_config(self.cfg, self.run_dir)
        (self.run_dir / "services.json").write_text(json.dumps(self._addresses(), indent=1))
        return path

    def _addresses(self) -> dict[str, Any]:
        s = self.cfg.services
        host = "127.0.0.1"
        out: dict[str, Any] = {
            name: {
                "grpc": f"{host}:{getattr(s, name).port}",
                "metrics": f"http://{host}:{getattr(s, name).metrics_port}/metrics",
            }
            for name in ("buffer", "reward", "trainer")
        }
        out["rollout"] = [
            {
                "grpc": f"{host}:{s.rollout.replica_port(i)}",
                "metrics": f"http://{host}:{s.rollout.replica_port(i, 'metrics_port')}/metrics",
            }
            for i in range(self.cfg.rollout.n_replicas)
        ]
        out["run_dir"] = str(self.run_dir)
        return out

    # ---- processes ---------------------------------------------------------------------
    def _python(self) -> str:
        return self.cfg.launcher.python or sys.executable

    def _start(
        self,
        name: str,
        module: str,
        config_path: Path,
        extra: list[str],
        address: str,
        cpus: list[int] | None,
        *,
        may_finish: bool = False,
    ) -> ServiceProcess:
        # Credentials through the environment only, each process its own role's token.
        env = {
            "PYTHONUNBUFFERED": "1",
            "FLYWHEEL_RUN_DIR": str(self.run_dir),
            **self.secrets.environment(module.rpartition(".")[2]),
        }
        self.specs[name] = _Spec(module, list(extra), address, cpus, may_finish)
        proc = ServiceProcess(
            name,
            [self._python(), "-m", module, "--config", str(config_path), *extra],
            self.run_dir / "logs",
            env=env,
            drop=assets.SECRET_VARIABLES,
            cpus=cpus,
            echo=os.environ.get("FLYWHEEL_ECHO_LOGS", "0") == "1",
        ).start()
        self.procs = [p for p in self.procs if p.name != name] + [proc]
        self._write_pids()
        if old := self.liveness.pop(name, None):
            old.close()
        if wait_until_serving(
            proc, address, self.cfg.launcher.startup_timeout, may_finish=may_finish
        ):
            say(f"{name} is SERVING on {address} (pid {proc.pid})")
            if self.cfg.launcher.liveness_timeout_seconds is not None:
                self.liveness[name] = Liveness(address, self.cfg.launcher.liveness_timeout_seconds)
            if may_finish:  # at once: a short-lived job may be gone by the next scrape
                self._scrape()
        else:
            say(f"{name} finished (exit 0) before its first health check (pid {proc.pid})")
        return proc

    def _write_pids(self) -> None:
        pids: dict[str, int | None] = {p.name: p.pid for p in self.procs}
        if self.redis is not None and self.redis.proc is not None:
            pids[REDIS] = self.redis.proc.pid
        # Atomic: `flywheel status`, the doctor and a relaunched launcher read it while we run.
        write_json_atomic(self.run_dir / "pids.json", dict(pids))

    def start_services(self, config_path: Path) -> None:
        s, lc = self.cfg.services, self.cfg.launcher
        self._start("buffer", "services.buffer", config_path, [], s.buffer.address, None)
        self._start("reward", "services.reward", config_path, [], s.reward.address, None)
        for i in range(self.cfg.rollout.n_replicas):
            self._start(
                f"rollout-{i}",
                "services.rollout",
                config_path,
                ["--replica-index", str(i)],
                s.rollout.replica_address(i),
                lc.rollout_cpus,
            )

    def start_trainer(self, config_path: Path) -> ServiceProcess:
        s = self.cfg.services
        return self._start(
            "trainer",
            "services.trainer",
            config_path,
            [],
            s.trainer.address,
            self.cfg.launcher.trainer_cpus,
            may_finish=True,  # a few-step run can be over before the first health check
        )

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            code = proc.stop()
            if code not in (0, None, -signal.SIGTERM):
                say(f"{proc.name} exited with {code} on stop")
        if self.redis is not None:
            self.redis.stop()
        for probe in self.liveness.values():
            probe.close()
        if self.agent_eval is not None:
            self.agent_eval.close()

    # ---- evaluation --------------------------------------------------------------------
    def evaluate(self, step: int) -> EvalResult | AgentEvalResult | None:
        if self.cfg.valid_dataset is None or not self.cfg.valid_dataset.path:
            return None
        ec = self.cfg.launcher.eval
        rows = read_rows(self.cfg.valid_dataset.path)[: ec.n_prompts]
        s = self.cfg.services
        vision: dict[str, Any] = {}
        if self.cfg.rollout.workflow == "vision_rlvr":  # the rows' images go with them
            from services.common.vision_inputs import load_vision_processor

            data = Path(self.cfg.valid_dataset.path)
            vision = {
                "processor": load_vision_processor(self.cfg.actor.path),
                "base_dir": data if data.is_dir() else data.parent,
            }
        result: EvalResult | AgentEvalResult
        if self.cfg.rollout.workflow == "agent":  # the agent itself, on the replicas' API
            if self.agent_eval is None:
                self.agent_eval = AgentEvaluator()
            result = self.agent_eval.evaluate_run(self.cfg, rows, self.secrets.launcher_token)
        else:
            result = evaluate(
                s.rollout.replica_address(0),
                s.reward.address,
                rows,
                prompt_key=self.cfg.valid_dataset.prompt_key,
                answer_key=self.cfg.valid_dataset.answer_key,
                reward_fn=self.cfg.reward.fn,
                temperature=ec.temperature,
                max_new_tokens=ec.max_new_tokens or self.cfg.gconfig.max_new_tokens,
                auth_token=self.secrets.launcher_token,
                max_message_bytes=s.max_message_bytes,
                seed=self.cfg.seed + 1000 * step,
                **vision,
            )
        record = {
            "step": step,
            "version": result.version,
            "version_min": result.version_min,
            "accuracy": result.accuracy,
            "mean_reward": result.mean_reward,
            "n": result.n,
            "failures": result.failures,
            "wall_time": time.time(),
        }
        if isinstance(result, AgentEvalResult):  # tool-call and tool-success rates
            record.update(result.record())
        self.evals.append(record)
        with open(self.run_dir / "evals.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        seen = (
            f"version {result.version}"
            if result.version_min == result.version
            else f"versions {result.version_min}-{result.version}"
        )
        say(
            f"eval at step {step} ({seen}): accuracy {result.accuracy:.3f} "
            f"over {result.n} held-out prompts"
            + (f"; {result.describe_tools()}" if isinstance(result, AgentEvalResult) else "")
        )
        return result

    # ---- the run -----------------------------------------------------------------------
    def execute(self) -> int:
        try:
            config_path = self.prepare()
            say(f"run directory {self.run_dir}")
            self.start_services(config_path)
            resumed = resume_step(self.cfg, self.trainer_paths)
            if resumed is None:
                self.evaluate(0)
            self.start_trainer(config_path)
            if resumed is not None and self._proc("trainer").alive():
                # Once SERVING the trainer has restored its checkpoint and published those
                # weights; before, the replicas serve the weights the dead trainer published last.
                self.evaluate(resumed)
            code = self.watch()
            if code != 0:
                return code
            final_version = self.tail.last.get("version")
            if not self.evals or self.evals[-1]["version"] != final_version:
                self.evaluate(self.last_step)  # unless the last periodic eval saw these weights
            self._scrape()
            summary = self.finish()
            return 0 if summary["invariants_ok"] else 1
        except (ServiceFailed, RedisFailed) as err:
            say(f"FAILED: {err}")
            return 1
        except KeyboardInterrupt:
            say("interrupted: stopping services")
            return 130
        finally:
            self.stop_all()

    @property
    def last_step(self) -> int:
        return self.tail.last.get("step", 0) if hasattr(self, "tail") else 0

    def _proc(self, name: str) -> ServiceProcess:
        return next(p for p in self.procs if p.name == name)

    def watch(self) -> int:
        self.tail = MetricsTail(self.trainer_paths.metrics_jsonl)
        freq = self.cfg.launcher.eval.freq_steps
        last_scrape = last_probe = 0.0
        starvation = StarvationWatch(
            self.cfg, self.run_dir, self.secrets.launcher_token, self._reward_up
        )
        next_eval = freq if freq > 0 else None
        total = self.cfg.total_train_steps
        while True:
            self.tail.poll()
            step = self.last_step
            if self.cfg.launcher.progress:
                self.progress.show(self.tail, step, total, self.restarts)
            trainer = self._proc("trainer")
            if next_eval is not None and step >= next_eval and trainer.alive():
                try:
                    self.evaluate(step)
                except RuntimeError as err:  # a replica or reward restarting: next one counts
                    say(f"eval at step {step} skipped: {err}")
                while next_eval <= step:
                    next_eval += freq
            if time.monotonic() - last_scrape > 5.0:
                self._scrape()  # while the trainer lives: it exits when done
                last_scrape = time.monotonic()
            # Redis first: the buffer needs it to become healthy again.
            redis_proc = self.redis.proc if self.redis is not None else None
            if redis_proc is not None and redis_proc.poll() is not None:
                self._restart_redis()
            code = trainer.poll()
            if code == 0:
                trainer.wait()
                self.tail.poll()
                if self.cfg.launcher.progress:
                    sys.stderr.write("\n")
                if total and self.last_step < total:
                    say(f"trainer stopped (exit 0) at step {self.last_step} of {total}")
                return 0
            starvation.check(self.tail, trainer)
            if time.monotonic() - last_probe >= self.cfg.launcher.liveness_period_seconds:
                self._kill_the_silent()
                last_probe = time.monotonic()
            for proc in list(self.procs):
                if not proc.alive() and not (proc is trainer and proc.poll() == 0):
                    self._restart(proc)  # a trainer done since the check above: next round
            time.sleep(1.0)

    def _reward_up(self) -> bool:
        """Whether the reward service runs and answered its last health checks."""
        reward = next((p for p in self.procs if p.name == "reward"), None)
        probe = self.liveness.get("reward")
        reward_up = reward is not None and reward.alive()
        if probe is not None:
            reward_up = (
                reward_up and probe.silent_for() < 2 * self.cfg.launcher.liveness_period_seconds
            )
        return reward_up

    def _kill_the_silent(self) -> None:
        """Probe every running service; one silent for `liveness_timeout_seconds` is killed
        (the next round restarts it like any dead service)."""
        period = self.cfg.launcher.liveness_period_seconds
        for proc in self.procs:
            probe = self.liveness.get(proc.name)
            if probe is None or not proc.alive() or probe.probe(deadline_s=period):
                continue
            if probe.hung():
                why = (
                    f"no answer to its health check for {probe.silent_for():.0f}s "
                    f"(launcher.liveness_timeout_seconds={probe.timeout_s:g})"
                )
                say(f"{proc.name} (pid {proc.pid}) gave {why}: killing it")
                self._killed_because[proc.name] = why
                proc.kill()

    def _restart(self, proc: ServiceProcess) -> None:
        """Start a dead service again the way it was first started. Its state is safe: the
        buffer's is in Redis, a rollout replica's groups already put are in the buffer (its
        reservations are released by the new replica), the trainer resumes from its last
        checkpoint and republishes its weights to replicas that do not have them. A restart
        that fails is counted and tried again on the next round, within the budget."""
        code = proc.poll()
        proc.wait()
        if proc.name == "trainer" and self.cfg.trainer.recover != "auto":
            raise ServiceFailed(
                proc,
                f"died ({describe_exit(code)}) and trainer.recover is "
                f"{self.cfg.trainer.recover!r}: a restarted trainer would start over "
                "(set trainer.recover=auto to resume from its last checkpoint)",
            )
        try:
            record = self.restart_log.died(proc.name, code)
        except GaveUp as err:
            raise ServiceFailed(proc, str(err).removeprefix(f"{proc.name} ")) from None
        spec = self.specs[proc.name]
        try:
            new = self._start(
                proc.name,
                spec.module,
                self.run_dir / "config.yaml",
                spec.extra,
                spec.address,
                spec.cpus,
                may_finish=spec.may_finish,
            )
        except ServiceFailed as err:
            self.restart_log.failed(record, str(err))
            err.proc.kill()  # never healthy: the next round counts it as another death
            return
        self.restart_log.restarted(record, new.pid)

    def _restart_redis(self) -> None:
        """The local redis-server is started again on its port and directory: it replays
        its append-only file (fsync every second), so the ledger survives; at most the last
        second of writes before a crash is lost."""
        assert self.redis is not None and self.redis.proc is not None
        code = self.redis.proc.wait()
        try:
            record = self.restart_log.died(REDIS, code)
        except GaveUp as err:
            raise RedisFailed(f"{err}; redis log:\n{self.redis.exit_reason()}") from None
        try:
            self.redis.start(timeout=self.cfg.launcher.startup_timeout)
        except (RuntimeError, TimeoutError) as err:
            self.restart_log.failed(record, str(err))
            if self.redis.proc is not None and self.redis.proc.poll() is None:
                self.redis.proc.kill()  # up but never answered: the next round retries
                self.redis.proc.wait()
            return
        self._write_pids()
        self.restart_log.restarted(record, self.redis.proc.pid if self.redis.proc else None)

    def _scrape(self) -> None:
        """Keep, per service, the series of its latest successful scrape."""
        for name, series in scrape_metrics(self._addresses()).items():
            if series:
                self.scraped[name] = series

    def finish(self) -> dict[str, Any]:
        s = self.cfg.services
        return run_summary.write(
            self.cfg,
            self.run_dir,
            records=self.tail.records,
            evals=self.evals,
            scraped=self.scraped,
            trainer_paths=self.trainer_paths,
            buffer_stats=run_summary.buffer_stats(s.buffer.address, self.secrets.launcher_token),
            restarts=[asdict(r) for r in self.restarts],
            steps=self.last_step,
            wall_seconds=round(time.time() - self.start_time, 1),
        )


def run(
    cfg: FlywheelConfig, config_path: str | None = None, overrides: list[str] | None = None
) -> int:
    if cfg.scheduler.type == "kubernetes":
        from services.launcher import kubernetes

        return kubernetes.run(cfg)
    # SIGTERM (a scheduler or `kill`) stops the run like Ctrl-C: services drain in order.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return LocalRun(cfg).execute()
    finally:
        signal.signal(signal.SIGTERM, previous)


class RedisFailed(RuntimeError):
    """The local redis-server died more often than the restart budget allows."""


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
