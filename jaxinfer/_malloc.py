"""glibc's malloc told to keep large freed blocks, for an engine on the CPU backend.

XLA CPU allocates each run's temporary buffer with malloc, and frees it when the run ends. glibc
serves a request above its mmap threshold - at most 32 MiB, whatever `M_MMAP_THRESHOLD` asks - with a
fresh `mmap` and unmaps it on `free`, so every run of a program whose temporaries pass 32 MiB faults
in and zeroes all their pages again: the sampler at 64 rows of a 32k vocabulary (~45 MB of [B, V]
arrays) spent ~14 of its 19 ms on that with temperature sampling (2 vCPUs, 2026-12-06;
WORKSPACE.md, "Sampler"). With `M_MMAP_MAX` = 0 such blocks come from the heap instead, and with a
high `M_TRIM_THRESHOLD` the heap keeps them once freed, so the next run reuses the same pages.

The price: memory a process frees stays mapped (reused by later allocations, not returned to the
OS), as with the jemalloc or tcmalloc `LD_PRELOAD` that CPU serving guides recommend for the same
reason. It is set once, by the first engine built on the CPU backend; `JAXINFER_MALLOC_DEFAULTS=0`
leaves malloc as it was. Only glibc has these knobs; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim the heap only past 2 GiB free at its top


@functools.cache
def keep_large_blocks() -> bool:
    """Sets the two mallopt parameters above (once per process); whether they were set."""
    if os.environ.get("JAXINFER_MALLOC_DEFAULTS", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as e:
        log.debug("mallopt unavailable: %s", e)
        return False
    if not ok:
        log.debug("mallopt refused M_MMAP_MAX or M_TRIM_THRESHOLD")
    return ok
