"""One-shot preparation of a container run: what the local launcher does before services start.

Services only read files and one resolved config. On one node with compose, this runs
once (the `prepare` service) before the others: it loads the user's config plus the
container topology overrides, writes the built-in data set and the tiny demo model (with
its supervised warm start) when the config names none, and writes the resolved config the
services then load. Secrets are left out of that file on purpose: the services read
`FLYWHEEL_TOKEN` and `FLYWHEEL_REDIS_PASSWORD` from their environment.

    python deploy/docker/prepare.py --config examples/demo.yaml --out /data/config/flywheel.yaml [overrides]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from services.common.config import ConfigError, load_config


def resolved_config_data(cfg) -> dict:  # type: ignore[no-untyped-def]
    data = cfg.model_dump(mode="json")
    data["services"].pop("auth_token", None)
    data["buffer"]["redis_password"] = None
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="experiment YAML")
    parser.add_argument("--out", required=True, help="where to write the resolved config")
    parser.add_argument("--skip-model", action="store_true", help="do not write the tiny model")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from services.launcher.assets import prepare_data, prepare_model, run_dir_of

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_data(cfg, run_dir)
    if not args.skip_model:
        prepare_model(cfg, run_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(resolved_config_data(cfg), sort_keys=False))
    tmp.replace(out)
    print(f"prepared {run_dir}; resolved config at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
