"""What a local run prepares before any service starts: run directory, model, data, ports.

Services only ever read files and a resolved config, so everything generated (the tiny
model, its warm start, the arithmetic data set, free ports) is produced here once and
written down in `<run_dir>/config.yaml` for every service to load. Credentials are not
written down: `RunSecrets` holds them in the launcher's memory and hands each child only
its own, through its environment.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port

PREVIOUS_RUN_LEFTOVERS = (
    "checkpoints",
    "logs",
    "redis",
    "weights",
    "metrics.jsonl",
    "summary.json",
    "learning_curve.png",
    "evals.jsonl",
    "services.json",
    "metrics.lost.jsonl",
    "trainer_claim.json",
    "ledger.json",
)


def run_dir_of(cfg: FlywheelConfig) -> Path:
    return (Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name).resolve()


def reset_if_finished(run_dir: Path) -> bool:
    """A finished run (summary written) is cleared so the next one starts fresh; an
    unfinished one is kept so `trainer.recover: auto` can resume it. The model cache stays."""
    if not (run_dir / "summary.json").exists():
        return False
    for name in PREVIOUS_RUN_LEFTOVERS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    return True


def prepare_data(cfg: FlywheelConfig, run_dir: Path) -> None:
    """Generate the built-in splits (arithmetic, or the counting images of a vision run)
    when the datasets name no file."""
    from services.rollout.data import arithmetic
    from services.rollout.data.arithmetic import write_jsonl

    if cfg.train_dataset.builtin == "counting" or (
        cfg.valid_dataset is not None and cfg.valid_dataset.builtin == "counting"
    ):
        _prepare_counting(cfg, run_dir)
        return
    if cfg.train_dataset.path is None:
        path = run_dir / "data" / "train.jsonl"
        if not path.exists():
            write_jsonl(
                path,
                arithmetic.generate_split("train", cfg.train_dataset.builtin_size, seed=cfg.seed),
            )
        cfg.train_dataset.path = str(path)
    if cfg.valid_dataset is not None and cfg.valid_dataset.path is None:
        path = run_dir / "data" / "valid.jsonl"
        if not path.exists():
            write_jsonl(
                path,
                arithmetic.generate_split("valid", cfg.valid_dataset.builtin_size, seed=cfg.seed),
            )
        cfg.valid_dataset.path = str(path)


def _prepare_counting(cfg: FlywheelConfig, run_dir: Path) -> None:
    """The counting splits (rows, and PNGs beside them) of a vision run's built-in data."""
    from services.rollout.data import counting

    if cfg.rollout.workflow != "vision_rlvr":
        raise ValueError(
            "train_dataset.builtin: counting holds images: set rollout.workflow: vision_rlvr"
        )
    size = cfg.launcher.tiny_vlm.image_size
    splits: tuple[tuple[counting.Split, Any], ...] = (
        ("train", cfg.train_dataset),
        ("valid", cfg.valid_dataset),
    )
    for split, ds in splits:
        if ds is None or ds.path is not None:
            continue
        path = run_dir / "data" / f"{split}.jsonl"
        if not path.exists():  # written last, after its images
            counting.write_split(path.parent, split, ds.builtin_size, seed=cfg.seed, size=size)
        ds.path = str(path)


def prepare_model(cfg: FlywheelConfig, run_dir: Path, log: Any = print) -> None:
    """Write the tiny model (and its supervised warm start) when `actor.path` is empty: the
    tiny Qwen2-VL (`launcher.tiny_vlm`) for a vision run, else the tiny Qwen2."""
    from services.common.tiny_model import write_tiny_model

    if cfg.actor.path:
        from services.common.model_source import resolve_config_sources

        resolve_config_sources(cfg)  # GGUF sources: converted once, before any service starts
        ws = cfg.launcher.warm_start
        if ws.enabled and ws.steps > 0 and ws.rows_fn:  # a given model's own warm start
            from services.launcher.warmstart_given import warm_start_given

            given = str(cfg.actor.path)
            tuned = str(warm_start_given(cfg, run_dir, log=log))
            for sub in (cfg.actor, cfg.ref, cfg.critic):
                if sub is not None and sub.path in ("", given):
                    sub.path = tuned
        return
    vision = cfg.rollout.workflow == "vision_rlvr"
    if vision:
        from services.common.tiny_vlm import write_tiny_vlm

        tv = cfg.launcher.tiny_vlm
        base = write_tiny_vlm(
            run_dir / "model" / "base",
            image_size=tv.image_size,
            hidden_size=tv.hidden_size,
            num_layers=tv.num_layers,
            vision_dim=tv.vision_dim,
            vision_depth=tv.vision_depth,
            seed=tv.seed,
        )
    else:
        tm = cfg.launcher.tiny_model
        base = write_tiny_model(
            run_dir / "model" / "base",
            hidden_size=tm.hidden_size,
            num_layers=tm.num_layers,
            num_heads=tm.num_heads,
            seed=tm.seed,
        )
    path = base
    ws = cfg.launcher.warm_start
    if ws.enabled and ws.steps > 0:
        sft = run_dir / "model" / "sft"
        if not (sft / "warm_start.json").exists():
            from services.launcher.warmstart import warm_start
            from services.rollout.data.datasets import read_rows

            rows = read_rows(cfg.train_dataset.path)  # type: ignore[arg-type]
            log(f"warm start: {ws.steps} supervised steps on {len(rows)} prompts")
            stats = warm_start(
                base,
                sft,
                rows,
                ws,
                prompt_key=cfg.train_dataset.prompt_key,
                device=cfg.trainer.device,
                log=log,
                images_dir=Path(cfg.train_dataset.path).parent if vision else None,  # type: ignore[arg-type]
            )
            log(
                f"warm start done in {stats['warm_start_seconds']:.1f}s, loss {stats['warm_start_loss']:.4f}"
            )
        path = sft
    cfg.actor.path = str(path)
    if cfg.critic is not None and not cfg.critic.path:
        cfg.critic.path = str(path)
    if cfg.ref is not None and not cfg.ref.path:
        cfg.ref.path = str(path)
    if not cfg.tokenizer_path:
        cfg.tokenizer_path = str(path)


def _free_block(n: int, taken: set[int]) -> int:
    """A port p with p..p+n-1 all free (rollout replicas use consecutive ports) and none of
    them in `taken`, which it then joins: a port picked free is not bound until its
    service starts, so the OS may hand it out again for the next endpoint."""
    for _ in range(100):
        p = free_port()
        block = range(p, p + n)
        if taken.isdisjoint(block) and all(_is_free(q) for q in block[1:]):
            taken.update(block)
            return p
    raise RuntimeError(f"no block of {n} free ports")


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def assign_ports(cfg: FlywheelConfig) -> None:
    """Concrete ports for every endpoint left at 0, all distinct (from each other and from
    the ports the config already names)."""
    replicas = cfg.rollout.n_replicas
    names = ("buffer", "reward", "rollout", "trainer")
    taken: set[int] = set()
    for name in names:
        ep = getattr(cfg.services, name)
        n = replicas if name == "rollout" else 1
        stride = ep.port_stride if name == "rollout" else 1
        for port in (ep.port, ep.metrics_port):
            if port:
                taken.update(port + stride * i for i in range(n))
    for name in names:
        ep = getattr(cfg.services, name)
        n = replicas if name == "rollout" else 1
        if name == "rollout":
            ep.port_stride = 1
        if ep.port == 0:
            ep.port = _free_block(n, taken)
        if ep.metrics_port == 0:
            ep.metrics_port = _free_block(n, taken)


def resolve_run_paths(cfg: FlywheelConfig, run_dir: Path) -> None:
    """Write the run directory's default paths into the config, so every service (not only
    the one that owns a path) finds checkpoints, published weights and metrics in one place:
    a restarted rollout replica loads the newest published weights from `weight_dir`."""
    t = cfg.trainer
    t.checkpoint_dir = t.checkpoint_dir or str(run_dir / "checkpoints")
    t.weight_dir = t.weight_dir or str(run_dir / "weights")
    t.metrics_jsonl = t.metrics_jsonl or str(run_dir / "metrics.jsonl")


SECRET_VARIABLES = (
    "FLYWHEEL_TOKEN",
    "FLYWHEEL_CREDENTIALS",
    "FLYWHEEL_REDIS_PASSWORD",
    "REDISCLI_AUTH",
)
"""Credential variables of the launcher's environment that no child inherits: each gets
only what its role needs from `RunSecrets.environment`."""

LAUNCHED_ROLES = ("trainer", "rollout", "launcher")
"""The roles of `services.credentials` that a local run's own processes play."""

SERVICE_ROLE: dict[str, str | None] = {
    "buffer": None,
    "reward": None,
    "rollout": "rollout",
    "trainer": "trainer",
}
"""The role each service calls the others as (the buffer and reward call no service)."""


def token_digest(token: str) -> str:
    """`sha256:<hex>` of `token` (a token already written as a digest stays as it is)."""
    if token.startswith("sha256:"):
        return token
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def url_without_password(url: str | None) -> tuple[str | None, str | None]:
    """`redis://user:pw@host/0` -> (`redis://user@host/0`, `pw`); a URL without one stays.
    The password comes back decoded (`the%20password` -> `the password`), as Redis clients
    decode it from a URL: it is sent to Redis as it is."""
    if not url:
        return url, None
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    user = parts.netloc.rpartition("@")[0].partition(":")[0]  # as written (still encoded)
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


@dataclass(frozen=True)
class RunSecrets:
    """The credentials of one local run, kept in the launcher's memory, never on disk.

    With auth on (`services.auth_token` or `services.credentials` set) every role a local
    process plays (trainer, rollout, launcher) has its own token: one given in
    `services.credentials` as a plain token, otherwise a random one made for this run. The
    servers accept only their digests, plus `admin`: `services.credentials.admin` when set,
    else the operator's `services.auth_token` (`$FLYWHEEL_TOKEN`), so that `flywheel status`
    and other tools keep working with the token they were given."""

    tokens: dict[str, str] = field(default_factory=dict)
    """role -> the token the processes of that role send; empty: auth off."""

    accepted: dict[str, str] = field(default_factory=dict)
    """role -> `sha256:<digest>` the servers accept (`services.credentials` of servers)."""

    redis_password: str | None = None
    """The Redis password, for the buffer and the local redis-server only."""

    @classmethod
    def of(cls, cfg: FlywheelConfig) -> RunSecrets:
        s = cfg.services
        password = (
            cfg.buffer.redis_password
            or os.environ.get("FLYWHEEL_REDIS_PASSWORD")
            or url_without_password(cfg.buffer.redis_url)[1]
            or None
        )
        if not (s.auth_token or s.credentials):
            return cls(redis_password=password)
        tokens: dict[str, str] = {}
        for role in LAUNCHED_ROLES:
            given = s.credentials.get(role)
            usable = given and not given.startswith("sha256:")
            tokens[role] = given if given and usable else secrets.token_urlsafe(32)
        accepted = {role: token_digest(token) for role, token in tokens.items()}
        admin = s.credentials.get("admin") or s.auth_token
        if admin and admin not in tokens.values():
            accepted["admin"] = token_digest(admin)
        return cls(tokens, accepted, password)

    def environment(self, service: str | None) -> dict[str, str]:
        """The credential variables of one child: the servers' digests for every service,
        the token of the service's role (`service=None`: the launcher's own clients), the
        Redis password for the buffer alone."""
        env: dict[str, str] = {}
        if self.accepted:
            env["FLYWHEEL_CREDENTIALS"] = ",".join(f"{r}={d}" for r, d in self.accepted.items())
        role = SERVICE_ROLE.get(service) if service is not None else "launcher"
        if role is not None and role in self.tokens:
            env["FLYWHEEL_TOKEN"] = self.tokens[role]
        if service == "buffer" and self.redis_password:
            env["FLYWHEEL_REDIS_PASSWORD"] = self.redis_password
        return env

    @property
    def launcher_token(self) -> str | None:
        """The token the launcher's own clients (evaluation, status probes) send."""
        return self.tokens.get("launcher")


def resolved_config_data(cfg: FlywheelConfig) -> dict[str, Any]:
    """`cfg` as the services load it, without credentials: the token, the per-caller
    credentials and the Redis password (also one inside `buffer.redis_url`) are left out,
    so each service reads its own from the environment (`RunSecrets.environment`)."""
    data = cfg.model_dump(mode="json")
    data["services"].pop("auth_token", None)
    data["services"].pop("credentials", None)
    data["buffer"].pop("redis_password", None)
    data["buffer"]["redis_url"] = url_without_password(cfg.buffer.redis_url)[0]
    return data


def write_resolved_config(cfg: FlywheelConfig, run_dir: Path) -> Path:
    """`<run_dir>/config.yaml`: the resolved config, holding no credential."""
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(resolved_config_data(cfg), sort_keys=False))
    return path
