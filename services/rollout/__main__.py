"""`python -m services.rollout --config FILE [--replica-index I] [--eval-only] [key=value ...]`.

Serves `flywheel.v1.RolloutService` for replica I (`services.rollout.replica_port(I)`, rollout_id
`rollout-I`) and runs the data loop (reserve capacity, generate, score, put) unless
`--eval-only` (Generate and weight updates only: no buffer or reward needed, used by
`flywheel eval`). SIGTERM: NOT_SERVING, groups in flight finish and are put, exit 0.
`--check`: load the config, check the model, data and replica I's addresses, build the
sampling parameters and resolve the workflow, then exit (0: it would start; 2: it would
not); see services/common/preflight.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from services.common.config import ConfigError, load_config
from services.common.logs import setup_logging
from services.common.preflight import failed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="experiment YAML (defaults when omitted)")
    parser.add_argument("--replica-index", type=int, default=0, help="replica number I (>= 0)")
    parser.add_argument("--eval-only", action="store_true", help="serve generation only")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--check", action="store_true", help="validate up to binding, exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.engine=torch")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("rollout", args.log_level)
    if args.replica_index < 0:
        print(f"--replica-index={args.replica_index}: must be >= 0", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, list(args.overrides), service="rollout")
        from services.rollout.service import model_path

        if cfg.rollout.engine == "torch" or not cfg.rollout.sglang.url:
            model_path(cfg)  # fail now, with exit code 2, when no model is configured
        if args.check:
            return _check(cfg, args.replica_index, args.eval_only)
    except (ConfigError, ValueError) as err:
        if args.check:
            return failed("rollout", err)
        print(err, file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(cfg.rollout.torch_num_threads)
    asyncio.run(_serve(cfg, args.replica_index, args.eval_only))
    return 0


def _check(cfg: Any, index: int, eval_only: bool) -> int:
    from services.common.preflight import check_bindable, passed

    if index >= cfg.rollout.n_replicas:
        raise ValueError(
            f"--replica-index={index}: rollout.n_replicas={cfg.rollout.n_replicas} has "
            f"replicas 0..{cfg.rollout.n_replicas - 1}"
        )
    if not eval_only and cfg.train_dataset.path is None:
        raise ValueError(
            "train_dataset.path is null: a rollout replica reads its prompts from a "
            "JSONL/parquet file (only the local launcher writes the built-in data set)"
        )
    # What the replica builds before its model: the sampling parameters of every request
    # and, unless it only evaluates, the workflow class its loop runs.
    from services.core.types import SamplingParams
    from services.rollout.workflows.base import resolve_workflow_class

    SamplingParams.from_gconfig(cfg.gconfig)
    if not eval_only:
        resolve_workflow_class(cfg.rollout.workflow)
    ep = cfg.services.rollout
    ports = (ep.replica_port(index), ep.replica_port(index, "metrics_port"))
    check_bindable(f"services.rollout (replica {index})", ep.replica_host(index), ports)
    return passed(f"rollout-{index}", f"engine={cfg.rollout.engine}")


async def _serve(cfg: object, replica_index: int, eval_only: bool) -> None:
    # Built inside the running loop: gRPC aio servers bind to the loop that creates them.
    from services.rollout.service import RolloutService

    service = RolloutService(cfg, replica_index=replica_index, eval_only=eval_only)
    await service.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
