"""One-shot preparation of a container run: what the local launcher does before services start.

Services only read files and one config. On one node with compose, this runs once (the
`prepare` service) before the others: it loads the user's config plus the container topology
and the user's overrides (FLYWHEEL_OVERRIDES), writes the built-in data set and the tiny demo
model (with its supervised warm start) when the config names none, and writes the config the
services then load. Overrides mean what they mean under `flywheel run`: they are applied
before `${...}` references are resolved (`gconfig.n_samples=4` moves `actor.group_size:
${gconfig.n_samples}` too), and the written file keeps the references, so an override a
service adds on top is resolved with the rest. Secrets are left out of that file on
purpose: the services read `FLYWHEEL_TOKEN` and `FLYWHEEL_REDIS_PASSWORD` from their
environment.

    python deploy/docker/prepare.py --config examples/demo.yaml --out /data/config/flywheel.yaml [overrides]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from services.common.config import (
    ConfigError,
    FlywheelConfig,
    apply_override,
    resolve_interpolations,
    validate,
)
from services.common.config.loader import read_yaml

# What preparation fills in (data, model, run paths), written into the config as values.
PREPARED_KEYS = (
    "train_dataset.path",
    "valid_dataset.path",
    "actor.path",
    "critic.path",
    "ref.path",
    "tokenizer_path",
    "trainer.checkpoint_dir",
    "trainer.weight_dir",
    "trainer.metrics_jsonl",
)


def _get(cfg: FlywheelConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def merged_raw(config: str | None, overrides: list[str]) -> dict[str, Any]:
    """The user's file with every override applied, `${...}` references left as written."""
    raw = read_yaml(config) if config is not None else {}
    for override in overrides:
        apply_override(raw, override)
    return raw


def prepared_config_data(
    raw: dict[str, Any], before: FlywheelConfig, after: FlywheelConfig
) -> dict:
    """`raw` plus what preparation filled in; secrets left out (the services read them from
    their environment). References stay unresolved, so an override a service adds on top
    (its bind host, a GPU variant's model path) is resolved with the rest, as under
    `flywheel run`."""
    data = copy.deepcopy(raw)
    for key in PREPARED_KEYS:
        value = _get(after, key)
        if value is not None and value != _get(before, key):
            apply_override(data, f"{key}={json.dumps(str(value))}")
    services = data.get("services")
    if isinstance(services, dict):
        services.pop("auth_token", None)
        services.pop("credentials", None)  # FLYWHEEL_CREDENTIALS of the servers instead
    buffer = data.get("buffer")
    if isinstance(buffer, dict):
        buffer.pop("redis_password", None)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--config", help="experiment YAML")
    parser.add_argument("--out", required=True, help="where to write the prepared config")
    parser.add_argument("--skip-model", action="store_true", help="do not write the tiny model")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        raw = merged_raw(args.config, args.overrides)
        cfg = validate(resolve_interpolations(copy.deepcopy(raw)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from services.launcher.assets import (
        prepare_data,
        prepare_model,
        resolve_run_paths,
        run_dir_of,
    )

    before = cfg.model_copy(deep=True)
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_data(cfg, run_dir)
    if not args.skip_model:
        prepare_model(cfg, run_dir)
    resolve_run_paths(cfg, run_dir)
    data = prepared_config_data(raw, before, cfg)
    # What every service will load: the same rules, checked before anything starts.
    try:
        validate(resolve_interpolations(copy.deepcopy(data)))
    except ConfigError as exc:
        print(f"error: the prepared config does not load: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(out)
    print(f"prepared {run_dir}; config at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
