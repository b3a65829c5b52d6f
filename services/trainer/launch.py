"""Start the N ranks of one trainer job on this machine and supervise them.

Why our own small supervisor rather than torchrun or torch.multiprocessing:
- `torch.multiprocessing.spawn` pickles the target and its arguments into the children;
  Flywheel sends nothing pickled across a process boundary, and fresh interpreters
  (`python -m services.trainer`, like any other service) import only what they use.
- torchrun's elastic agent restarts failed workers and rendezvouses through its own
  store; a trainer rank dying mid-step must instead fail the job so `recover: auto`
  resumes from the last checkpoint, and the exit status must be the failing rank's.
- The children get exactly torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same entry runs unchanged under
  `torchrun --nnodes ...` on a cluster: `python -m services.trainer` acts as a rank
  whenever that environment is present.

Several machines: each runs this supervisor for its own ranks (`nproc_per_node`,
`node_rank`), as torchrun's `--nnodes/--node-rank` would, without its elastic agent.

Signals: the children run in their own sessions so a terminal Ctrl-C reaches only this
supervisor, which forwards SIGTERM to its first local rank alone (global rank 0 on node 0;
on other nodes that rank ignores it and follows rank 0's stop); rank 0 finishes the step, checkpoints
if configured and tells the other ranks to stop (a rank killed mid-collective would hang
the rest). If the job has not ended within `grace` seconds, every rank is killed.
If any rank exits non-zero, the others are terminated and that code is returned.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from services.trainer.dist import free_port

log = logging.getLogger(__name__)


def rank_env(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> dict[str, str]:
    """The environment of one rank (torchrun's variable names); local rank and local
    world size default to the global ones (every rank on this machine)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank if local_rank is None else local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size if local_world_size is None else local_world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    return env


def spawn_ranks(
    argv: Sequence[str],
    world_size: int,
    *,
    nproc_per_node: int | None = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    grace: float = 120.0,
    module: str = "services.trainer",
    command: Sequence[str] | None = None,
) -> int:
    """Run `python -m <module> <argv>` (or `command`) as this node's ranks of a
    `world_size`-rank job: all of them by default, else global ranks
    `node_rank * nproc_per_node` onwards (one node of several; `master_port` must then
    be fixed). Return the node's exit code."""
    local = nproc_per_node or world_size
    port = master_port or free_port(master_addr)
    cmd = list(command) if command is not None else [sys.executable, "-m", module, *argv]
    procs: list[subprocess.Popen] = []
    for i in range(local):
        env = rank_env(
            node_rank * local + i,
            world_size,
            master_addr,
            port,
            local_rank=i,
            local_world_size=local,
        )
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    log.info("trainer ranks started", extra={"world_size": world_size, "master_port": port})

    stop_at: list[float] = []

    def _forward(signum: int, _frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + grace)
            if procs[0].poll() is None:
                procs[0].send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, _forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(procs, stop_at)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _supervise(procs: list[subprocess.Popen], stop_at: list[float]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error(
                "trainer rank failed; stopping the others", extra={"rank": rank, "code": code}
            )
            _terminate(procs)
            return int(code) if code > 0 else 128 - int(code)  # signal -N -> 128 + N
        if all(c == 0 for c in codes):
            return 0
        if stop_at and time.monotonic() > stop_at[0]:
            log.error("trainer ranks did not stop within the grace period; killing them")
            _terminate(procs, grace=0.0)
            return 1
        time.sleep(0.1)


def _terminate(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        left = max(0.0, deadline - time.monotonic())
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
