"""`python -m services.reward --config FILE [key=value ...]`: run the reward service.

Binds gRPC on `services.reward.host:port` and `/healthz`, `/readyz`, `/metrics` on
`services.reward.metrics_port`; scores with `reward.fn` in `reward.num_workers` worker
processes. SIGTERM: NOT_SERVING, drain, stop the workers, exit 0.
`--check`: load the config, resolve the reward functions, check the addresses, exit
(0: it would start; 2: it would not, with the reason); see services/common/preflight.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.config import ConfigError, load_config
from services.common.logs import setup_logging
from services.common.preflight import check_bindable, failed, passed
from services.reward.registry import RewardRegistry, UnknownFunctionError
from services.reward.service import RewardParts, RewardService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.reward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="experiment YAML (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.fn=gsm8k")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--check", action="store_true", help="validate up to binding, exit")
    return parser.parse_args(argv)


async def _serve(parts: RewardParts) -> None:
    await RewardService(parts).serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("reward", args.log_level)
    try:
        cfg = load_config(args.config, list(args.overrides), service="reward")
        r = cfg.reward
        # Fail at start, with exit code 2, on a function name the registry cannot resolve.
        RewardRegistry(r.functions, default=r.fn, allow_dotted_paths=r.allow_dotted_paths)
        if args.check:
            ep = cfg.services.reward
            check_bindable("services.reward", ep.host, (ep.port, ep.metrics_port))
            return passed("reward", f"fn={r.fn}")
    except (ConfigError, UnknownFunctionError, ValueError) as err:
        if args.check:
            return failed("reward", err)
        print(err, file=sys.stderr)
        return 2
    asyncio.run(_serve(RewardParts.from_config(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
