"""`python -m services.buffer --config FILE [key=value ...]`: run the buffer service.

Also:
  `--replay FILE`            serve an exported JSONL file to a trainer (train-only debugging);
  `--export OUT [--min-version A] [--max-version B]`
                             write stored groups to JSONL and exit (no server).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.buffer.export import export_jsonl
from services.buffer.service import BufferParts, BufferService, redis_password, store_settings
from services.buffer.store import RedisStore, connect
from services.common.config import ConfigError, load_config
from services.common.logs import setup_logging
from services.common.malloc_tuning import tune_for_large_messages


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = setup_logging("buffer", args.log_level)
    overrides = list(args.overrides)
    if args.replay:
        overrides.append(f"buffer.replay_path={args.replay}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
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
