"""`python -m services.trainer --config FILE [dotted.override=value ...]`: run the trainer.

With `trainer.n_ranks = N > 1` this process becomes a small supervisor that starts N rank
processes of the same command (see `launch.py` for why not torchrun or
torch.multiprocessing) and exits with the job's status. Under torchrun, or as one of those
ranks (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), it runs as that one rank. With
one rank it runs in this process.

On several machines (one Kubernetes pod per node), every node runs the same command with
`--nnodes N --node-rank I --nproc-per-node P`: its supervisor starts global ranks
I*P .. I*P+P-1 of the `trainer.n_ranks = N*P` job, which meet at `trainer.master_addr`
(node 0). This replaces torchrun as the container's main process: on SIGTERM rank 0
finishes its step and writes the final checkpoint within `--grace` seconds (the pod's
termination grace minus a margin), where torchrun kills its workers after 30 s and exits 1.

Exit codes: 0 after `total_train_steps` (or Stop / SIGTERM, after the current step);
1 on a training failure; 2 on a bad configuration. A run that is already complete for its
`total_train_steps` (`completed.json` next to the checkpoints, or a last checkpoint at that
step) exits 0 at once, before any rank starts (see `lifecycle.py`). With
`--stopped-exit-code C`, a stop that leaves the run incomplete exits C instead of 0: a
Kubernetes Job counts an exit 0 as done, so the chart's trainer Job uses C=75 (and its pod
failure policy ignores it) to be started again and resume from the final checkpoint.

`--check` loads the config, checks the model, the rank layout and the addresses, and builds
each trained model's optimizer and lr schedule over a stand-in parameter, then exits (0: it
would start; 2: it would not); see services/common/preflight.py.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="experiment YAML (defaults when omitted)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--nnodes", type=int, default=1, help="machines of the job (N)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index (I)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks on this machine (P)"
    )
    parser.add_argument(
        "--grace", type=float, default=120.0, help="seconds a stop may take before the kill"
    )
    parser.add_argument(
        "--stopped-exit-code", type=int, default=0, help="exit code of an incomplete stop"
    )
    parser.add_argument("--check", action="store_true", help="validate up to binding, exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.n_ranks=2")
    return parser.parse_args(argv)


def rank_argv(raw: list[str]) -> list[str]:
    """The command line of a rank: the supervisor's, less its own options."""
    own = {"--nnodes", "--node-rank", "--nproc-per-node", "--grace", "--stopped-exit-code"}
    out: list[str] = []
    skip = False
    for arg in raw:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in own:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _layout(cfg: object, args: argparse.Namespace) -> tuple[int, int]:
    """(ranks on this node, this node's index), checked against `trainer.n_ranks`."""
    n_ranks = cfg.trainer.n_ranks  # type: ignore[attr-defined]
    per_node = args.nproc_per_node or n_ranks // max(args.nnodes, 1)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes or per_node < 1:
        raise ValueError(f"--nnodes={args.nnodes} --node-rank={args.node_rank}: no such node")
    if per_node * args.nnodes != n_ranks:
        raise ValueError(
            f"--nnodes={args.nnodes} x --nproc-per-node={per_node} ranks, but "
            f"trainer.n_ranks={n_ranks}; set trainer.n_ranks={per_node * args.nnodes}"
        )
    return per_node, args.node_rank


def _check(cfg: object, args: argparse.Namespace) -> int:
    from services.common.preflight import PreflightError, check_bindable, failed, passed

    try:
        per_node, node = _layout(cfg, args)
        actor = cfg.actor  # type: ignore[attr-defined]
        if not actor.path and not actor.init_from_scratch:
            raise PreflightError(
                "actor.path is empty: set it to a Hugging Face model directory (on the "
                "shared volume on Kubernetes); only the local launcher writes the tiny model"
            )
        ep = cfg.services.trainer  # type: ignore[attr-defined]
        check_bindable("services.trainer", ep.host, (ep.port, ep.metrics_port))
        schedules = _build_schedules(cfg)
    except (PreflightError, ValueError) as err:
        return failed("trainer", err)
    return passed("trainer", f"node {node} of {args.nnodes}, {per_node} rank(s), {schedules}")


def _build_schedules(cfg: object) -> str:
    """Build each trained model's optimizer and lr schedule as `PPOTrainer` does at start
    (`schedule_steps`, `build_optimizer`, `build_scheduler`), over one stand-in parameter
    instead of the model: a schedule that cannot start (a warm-up proportion without
    `total_train_steps`, an unknown optimizer) fails here, not after the model loaded."""
    import torch

    from services.common.config import OptimizerConfig
    from services.trainer.optim import build_optimizer, build_scheduler
    from services.trainer.ppo import schedule_steps

    engines = [("actor", cfg.actor.optimizer or OptimizerConfig(), cfg.actor.ppo_n_minibatches)]  # type: ignore[attr-defined]
    critic = cfg.critic  # type: ignore[attr-defined]
    if critic is not None:
        if critic.optimizer is None:
            raise ValueError("critic.optimizer is null: a critic must be trained")
        engines.append(("critic", critic.optimizer, critic.ppo_n_minibatches))
    built = []
    for name, opt, n_minibatches in engines:
        total = schedule_steps(cfg, n_minibatches)  # type: ignore[arg-type]
        stand_in = torch.nn.Parameter(torch.zeros(1))
        build_scheduler(build_optimizer([stand_in], opt), opt, total)
        built.append(f"{name} {opt.lr_scheduler_type} lr over {total} optimizer steps")
    return ", ".join(built)


def _final_code(code: int, cfg: object, stopped_exit_code: int) -> int:
    """`stopped_exit_code` for a clean stop that left the run incomplete, else `code`."""
    if code != 0 or stopped_exit_code == 0:
        return code
    from services.trainer.lifecycle import completed_run

    return 0 if completed_run(cfg) is not None else stopped_exit_code  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    from services.common.config import ConfigError, load_config
    from services.common.logs import setup_logging
    from services.trainer.dist import launched_as_rank

    log = setup_logging("trainer", args.log_level)
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as err:
        if args.check:
            from services.common.preflight import failed

            return failed("trainer", err)
        print(err, file=sys.stderr)
        return 2
    if args.check:
        return _check(cfg, args)
    try:
        per_node, node_rank = _layout(cfg, args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    from services.trainer.lifecycle import completed_run

    done = completed_run(cfg)
    if done is not None:
        log.info(
            f"run already completed at step {done.get('step')} "
            f"(total_train_steps={cfg.total_train_steps}); nothing to train",
            extra={"checkpoint": done.get("checkpoint")},
        )
        return 0
    if launched_as_rank() or cfg.trainer.n_ranks == 1:
        from services.trainer.dist import finish
        from services.trainer.service import run_rank

        code = run_rank(cfg)
        if not launched_as_rank():
            code = _final_code(code, cfg, args.stopped_exit_code)
        finish(code)  # never returns: clean process-group teardown, then os._exit
    from services.trainer.launch import spawn_ranks

    log.info(
        "starting trainer ranks",
        extra={"n_ranks": cfg.trainer.n_ranks, "node_rank": node_rank, "local_ranks": per_node},
    )
    code = spawn_ranks(
        rank_argv(raw),
        cfg.trainer.n_ranks,
        nproc_per_node=per_node,
        node_rank=node_rank,
        master_addr=cfg.trainer.master_addr,
        master_port=cfg.trainer.master_port,
        grace=args.grace,
    )
    return _final_code(code, cfg, args.stopped_exit_code)


if __name__ == "__main__":
    sys.exit(main())
