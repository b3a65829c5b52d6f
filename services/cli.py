"""`flywheel` console script: load a config and hand it to the launcher.

    flywheel run --config FILE [a.b.c=value ...] [--dry-run]
    flywheel eval --config FILE [--checkpoint DIR] [overrides ...]
    flywheel status [RUN_DIR | --config FILE [overrides ...]]
    flywheel sft --config FILE [overrides ...] [--dry-run]   (services.trainer.sft)
    flywheel doctor RUN_DIR [--json] | --config FILE --experiments [overrides ...]

`eval` and `status` parse their own arguments in the launcher
(`services.launcher.main.eval_main(argv)` / `status_main(argv)`); `run` validates the
config here and calls `services.launcher.main.run(config, config_path, overrides)`.
`--dry-run` also imports every dotted path the configuration names (`reward.fn`,
`reward.functions`, `rollout.workflow`, `buffer.filter`, `actor.should_accept_fn`,
`actor.gae_lambda`, `actor.surrogate`) and checks it against its contract
(`services.api`), so a typo fails here, naming the key, rather than when a service
starts; then it prints the resolved configuration as YAML and exits 0. An invalid
configuration prints the errors on stderr and exits 2, before anything starts. The
launcher (`services.launcher.main`) is imported only when it is needed, and torch only
when the configuration names a λ function or a surrogate of its own (their registries
are torch modules), so that checking a config never starts a process.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from services.common.config import ConfigError, FlywheelConfig, to_yaml
from services.common.config.loader import load_with_report

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2

# What each subcommand calls in services.launcher.main:
# run(config, config_path, overrides) -> int; eval_main(argv) -> int; status_main(argv) -> int.
_LAUNCHER_ENTRIES = {"run": "run", "eval": "eval_main", "status": "status_main"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flywheel", description="Asynchronous RL for LLMs as independent services."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "run": "train with the given config",
        "eval": "evaluate a checkpoint on valid_dataset",
        "status": "show the state of a running experiment",
        "doctor": "check a run against the RL troubleshooting playbook (RUN_DIR [--json])",
        "sft": "supervised fine-tuning of the actor (--config FILE [overrides] [--dry-run])",
    }
    for name, text in helps.items():
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", "-c", help="YAML config file (defaults only when omitted)")
        cmd.add_argument(
            "--dry-run",
            action="store_true",
            help="print the resolved config as YAML and exit",
        )
        cmd.add_argument(
            "--from",
            dest="source",
            choices=("auto", "areal", "flywheel"),
            default="auto",
            help="read the file as an AReaL config and translate it (auto: when it has "
            "AReaL-only keys)",
        )
        cmd.epilog = (
            "Any other argument is a dotted override: actor.eps_clip=0.3, "
            "+actor.new_key=1, ~key to reset a key to its default."
        )
    return parser


def _check_reward(cfg: FlywheelConfig) -> None:
    from services.reward.registry import BUILTINS, RewardRegistry, load_callable

    registry = RewardRegistry(cfg.reward.functions, default=cfg.reward.fn)
    builtin_paths = set(BUILTINS.values())
    for path in {registry.default.path, *registry.paths().values()} - builtin_paths:
        load_callable(path)


def _check_workflow(cfg: FlywheelConfig) -> None:
    from services.rollout.workflows.base import resolve_workflow_class

    resolve_workflow_class(cfg.rollout.workflow)


def _check_buffer_filter(cfg: FlywheelConfig) -> None:
    from services.buffer.filters import resolve_filter

    resolve_filter(cfg.buffer.filter)


def _check_should_accept(cfg: FlywheelConfig) -> None:
    from services.core.filters import resolve_should_accept

    resolve_should_accept(cfg.actor.should_accept_fn)


def _check_gae_lambda(cfg: FlywheelConfig) -> None:
    from services.trainer.algorithms.gae_lambda import GAE_LAMBDA_FNS

    fn = GAE_LAMBDA_FNS.get(str(cfg.actor.gae_lambda))
    kwargs = cfg.actor.gae_lambda_kwargs
    try:  # the trainer calls fn(context, **gae_lambda_kwargs)
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as exc:
        raise ValueError(f"does not take (context, **{dict(kwargs)!r}): {exc}") from exc
    except ValueError:
        pass  # no signature to read (a builtin): the trainer's call will tell


def _check_surrogate(cfg: FlywheelConfig) -> None:
    from services.trainer.algorithms.surrogates import SURROGATES

    SURROGATES.get(cfg.actor.surrogate)


# key -> (does the config name something to import there?, the check that imports it)
_DOTTED_CHECKS: dict[
    str, tuple[Callable[[FlywheelConfig], Any], Callable[[FlywheelConfig], None]]
] = {
    "reward.fn": (lambda c: True, _check_reward),
    "rollout.workflow": (lambda c: True, _check_workflow),
    "buffer.filter": (lambda c: c.buffer.filter, _check_buffer_filter),
    "actor.should_accept_fn": (lambda c: c.actor.should_accept_fn, _check_should_accept),
    "actor.gae_lambda": (lambda c: isinstance(c.actor.gae_lambda, str), _check_gae_lambda),
    "actor.surrogate": (
        lambda c: c.actor.surrogate not in ("clip", "sapo", "cispo"),
        _check_surrogate,
    ),
}


def dotted_path_problems(cfg: FlywheelConfig) -> list[str]:
    """Import what each key of `_DOTTED_CHECKS` names, as the service that uses it would
    (`services.api.load_dotted` and the key's registry); one line per key that fails,
    starting with the key and its value."""
    problems = []
    for key, (named, check) in _DOTTED_CHECKS.items():
        if not named(cfg):
            continue
        try:
            check(cfg)
        except (ValueError, TypeError) as exc:
            block, _, field = key.partition(".")
            value = getattr(getattr(cfg, block), field)
            text = str(exc)
            for prefix in (f"{key}: ", f"{key}={value!r}: ", f"{key}={value!r} "):
                text = text.removeprefix(prefix)
            problems.append(f"{key} = {value!r}: {text}")
    return problems


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # Overrides may sit anywhere among the options (`--config f a=1 --dry-run b=2`), so
    # they are collected from what argparse does not recognise.
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognised option(s): {' '.join(unknown)}")
    args.overrides = rest
    return args


def _launcher_entry(command: str):
    name = _LAUNCHER_ENTRIES[command]
    try:
        launcher = importlib.import_module("services.launcher.main")
    except ModuleNotFoundError as exc:
        if exc.name not in ("services.launcher", "services.launcher.main"):
            raise
        print(
            f"flywheel {command}: the launcher (services.launcher.main) is not installed; "
            "use --dry-run to check a config",
            file=sys.stderr,
        )
        return None
    entry = getattr(launcher, name, None)
    if entry is None:
        print(f"flywheel {command}: services.launcher.main has no {name}()", file=sys.stderr)
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flywheel` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sft":
        from services.trainer.sft import main as sft_main

        return sft_main(argv[1:])
    if argv and argv[0] == "doctor":  # its own arguments; see services/doctor/main.py
        from services.doctor.main import doctor_main

        return doctor_main(argv[1:])
    if argv and argv[0] in ("eval", "status") and "--dry-run" not in argv:
        # These parse their own arguments (checkpoint, run directory, ...).
        entry = _launcher_entry(argv[0])
        if entry is None:
            return EXIT_FAILURE
        try:
            return int(entry(argv[1:]) or EXIT_OK)
        except ConfigError as exc:
            print(f"flywheel {argv[0]}: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    args = _parse(argv)
    try:
        config, report = load_with_report(
            args.config, args.overrides, source=args.source, require_data=not args.dry_run
        )
    except ConfigError as exc:
        print(f"flywheel {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    for warning in report.warnings:
        print(f"flywheel {args.command}: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        problems = dotted_path_problems(config)
        if problems:
            lines = "".join(f"\n  {p}" for p in problems)
            print(
                f"flywheel {args.command}: cannot import what the config names:{lines}",
                file=sys.stderr,
            )
            return EXIT_BAD_CONFIG
        # The translation table and data set notes as YAML comments: stdout stays YAML.
        sys.stdout.write("".join(f"# {line}\n" for line in report.lines()))
        sys.stdout.write(to_yaml(config))
        return EXIT_OK
    entry = _launcher_entry("run")
    if entry is None:
        return EXIT_FAILURE
    return int(entry(config, args.config, list(args.overrides)) or EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
