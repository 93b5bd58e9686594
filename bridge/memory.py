"""Memory freed by Python given back to the system after a burst (a restore's batches).

glibc keeps what a process frees for its next allocations: after a restore of 30,000 tasks the bridge's RSS
stayed at 215 MiB with 1.4 MiB of Python objects alive, and fell to 100 MiB once the free pages were returned
(`malloc_trim`, measured with bench/bench_changelog.py restore). Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
