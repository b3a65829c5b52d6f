"""glibc malloc settings for a process whose every request is megabytes that live briefly.

Why: glibc serves a block above its mmap threshold (128 KiB at start) with fresh pages
from the kernel, and gives a freed heap top back to the kernel once it exceeds the trim
threshold. The buffer receives, copies and frees a 1.4 MB PutMany request per call, so
with the defaults most of those copies land on pages the kernel has to fault in and zero
again: copying such a request twice costs 157 us per group with the defaults and 7 us
with the thresholds below (measured on the 2-core CI machine; `tests/common/
test_malloc_tuning.py` checks the page faults themselves). The price is memory: up to
`trim_threshold` of freed heap stays mapped in the process instead of going back.

The same settings are what the `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` and
`MALLOC_TOP_PAD_` environment variables give; when any of them is set, the operator
chose, and nothing is changed here. (Setting any one of them also switches off glibc's
adaptive mmap threshold, so one alone is worse than none: measured, the buffer with only
`MALLOC_TOP_PAD_` set reached 0.21-0.30 of raw Redis, untouched 0.35-0.40, tuned 0.40-0.46.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

ENV_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

MMAP_THRESHOLD = 64 << 20
"""Blocks up to this size come from the heap (reused) instead of fresh mappings; above
64 MiB glibc's per-thread heaps cannot hold them anyway."""

TRIM_THRESHOLD = 256 << 20
"""Freed heap kept by the process before the top is returned to the kernel."""

TOP_PAD = 64 << 20
"""Extra heap asked for whenever the heap grows, so that growth is rare."""


def tune_for_large_messages() -> bool:
    """Apply the thresholds above to this process. True when applied; False when the
    environment already sets them or the C library is not glibc (no `mallopt`)."""
    if any(var in os.environ for var in ENV_VARS):
        log.info("malloc tuning left to the environment (%s set)", ", ".join(ENV_VARS))
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
