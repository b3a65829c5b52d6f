"""`python -m services.trainer --config FILE [dotted.override=value ...]`: run the trainer.

With `trainer.n_ranks = N > 1` this process becomes a small supervisor that starts N rank
processes of the same command (see `launch.py` for why not torchrun or
torch.multiprocessing) and exits with the job's status. Under torchrun, or as one of those
ranks (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), it runs as that one rank. With
one rank it runs in this process.

Exit codes: 0 after `total_train_steps` (or Stop / SIGTERM, after the current step);
1 on a training failure; 2 on a bad configuration. A run that is already complete for its
`total_train_steps` (`completed.json` next to the checkpoints, or a last checkpoint at that
step) exits 0 at once, before any rank starts (see `lifecycle.py`).
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
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.n_ranks=2")
    return parser.parse_args(argv)


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
        finish(code)  # never returns: clean process-group teardown, then os._exit
    from services.trainer.launch import spawn_ranks

    log.info("starting trainer ranks", extra={"n_ranks": cfg.trainer.n_ranks})
    return spawn_ranks(
        raw,
        cfg.trainer.n_ranks,
        master_addr=cfg.trainer.master_addr,
        master_port=cfg.trainer.master_port,
    )


if __name__ == "__main__":
    sys.exit(main())
