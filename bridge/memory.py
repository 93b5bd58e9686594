"""How a bridge process manages its memory: freed memory given back to the system after a burst (a restore's
batches), and the cyclic garbage collector's pace (`tune_gc`).

glibc keeps what a process frees for its next allocations: after a restore of 30,000 tasks the bridge's RSS
stayed at 215 MiB with 1.4 MiB of Python objects alive, and fell to 100 MiB once the free pages were returned
(`malloc_trim`, measured with bench/bench_changelog.py restore). Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _find_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _find_trim()


def give_back_freed_memory() -> bool:
    """Return the free pages of the heap to the system; True when there is a way to (glibc)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


# The cyclic GC's young-generation threshold in a bridge process (Python's default: 700). Nearly everything a
# record allocates is freed by reference counting as it goes; the default still ran a young collection every few
# records on the failure path, and each one walked whatever was in flight (a batch's tasks on their way to the
# store), moving it on to older generations that are walked again later: 10-14 % of a process's CPU there
# (bench/RESULTS.md, "diagnostic: the cyclic GC on the failure path"). A higher threshold lets that work finish
# first; what is really cyclic garbage is still collected, a few thousand records later.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> tuple[int, int, int]:
    """Set this process's GC thresholds to GC_THRESHOLDS (a bridge process: `rdq run` and each child); returns
    the ones before. Left to the process's entry point: a library call must not change its host's GC."""
    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    return before
