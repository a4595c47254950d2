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

Huge pages (`back_with_huge_pages`). The weights and the KV cache live in memory XLA allocated, and
where the kernel's transparent huge pages are on "madvise" (a common default) that memory comes in
4 KiB pages: a decode step that streams 600 MB of weights then misses the TLB some 150,000 times,
and the hardware prefetcher stops at every 4 KiB boundary. A streaming read of such memory ran
30.4-31.0 GB/s against 34.5-34.9 GB/s once in 2 MiB pages, and the 150M model's batch-1 `generate`
1.09x faster (2 vCPUs of an AMD EPYC Zen 4 under Firecracker, 2026-12-07; WORKSPACE.md). So an
engine on the CPU asks the kernel (`madvise`: MADV_HUGEPAGE, then Linux 6.1's MADV_COLLAPSE) to move
its parameters into huge pages, in a background thread: the collapse copies at ~0.5 GB/s, too slow
to make a user wait for, and it never changes what the memory holds, so steps run on while it works
(before 6.1 the memory is only advised, for the kernel's khugepaged to collapse in its own time). A
new KV cache is all zeros: its pages are given back at once (MADV_DONTNEED; anonymous memory reads
back as zeros), advised, and come again as huge pages when the steps write them - ~0.3 s for a 1 GB
cache instead of ~2 s of copying. Where the kernel cannot (huge pages off), the memory stays as it
was. `JAXINFER_HUGE_PAGES=0` leaves it so.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

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


_MADV_DONTNEED = 4  # <linux/mman.h>
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+
_THP = Path("/sys/kernel/mm/transparent_hugepage")


@functools.cache
def huge_page_size() -> int | None:
    """The size of a transparent huge page here (2 MiB on x86-64), None where there are none to be
    had: not Linux, THP set to "never", or `JAXINFER_HUGE_PAGES=0`."""
    if os.environ.get("JAXINFER_HUGE_PAGES", "1") == "0" or platform.system() != "Linux":
        return None
    try:
        if "[never]" in (_THP / "enabled").read_text():
            return None
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return None


def huge_page_ranges(arrays, size: int) -> list[tuple[int, int]]:
    """(start, length) of the `size`-aligned spans lying wholly inside the host buffers of `arrays`
    (jax arrays on the CPU; others are skipped): the memory a huge page can back without reaching
    into a neighbouring allocation."""
    ranges = []
    for a in arrays:
        try:
            shards = [s.data for s in getattr(a, "addressable_shards", ())]
        except RuntimeError:  # deleted (donated): nothing of it to move
            continue
        for data in shards:
            if data.device.platform != "cpu" or data.nbytes < size:
                continue
            start = data.unsafe_buffer_pointer()
            lo, hi = -(-start // size) * size, (start + data.nbytes) // size * size
            if hi > lo:
                ranges.append((lo, hi - lo))
    return ranges


def _madvise():
    """libc's madvise(addr, length, advice), errno kept; None where there is none to call."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _collapse(ranges: list[tuple[int, int]]) -> tuple[int, str | None]:
    """madvise each range into huge pages; (bytes the kernel collapsed, why it did not, or None)."""
    if (madvise := _madvise()) is None:
        return 0, "no madvise in this C library"
    done, why, collapse = 0, None, True
    for start, length in ranges:
        # Neither call changes what the memory holds, so a range whose array has been freed (and its
        # memory reused) since it was listed comes to no harm: it is merely backed differently.
        if madvise(start, length, _MADV_HUGEPAGE) != 0:
            why = os.strerror(ctypes.get_errno())
            continue
        if not collapse:
            continue
        if madvise(start, length, _MADV_COLLAPSE) != 0:
            why = os.strerror(ctypes.get_errno())
            # EINVAL: a kernel before 6.1, without MADV_COLLAPSE; the ranges stay advised, for its
            # khugepaged to collapse in its own time. EAGAIN / ENOMEM: no huge page free just now.
            collapse = ctypes.get_errno() != errno.EINVAL
            continue
        done += length
    return done, why


def _drop_zero_ranges(ranges: list[tuple[int, int]], madvise) -> list[tuple[int, int]]:
    """Gives back, advised MADV_HUGEPAGE, the ranges that hold only zeros (MADV_DONTNEED: private
    anonymous memory reads back as zeros, so nothing changes), to be faulted in again as huge pages
    when written; returns the others."""
    left = []
    for start, length in ranges:
        words = np.frombuffer((ctypes.c_char * length).from_address(start), np.uint64)
        zero = not any(words[i : i + (1 << 21)].any() for i in range(0, words.size, 1 << 21))
        if not zero or madvise(start, length, _MADV_HUGEPAGE) != 0 or madvise(start, length, _MADV_DONTNEED) != 0:
            left.append((start, length))
    return left


def back_with_huge_pages(arrays, *, what: str = "arrays", background: bool = True, zeros=()) -> threading.Thread | None:
    """Moves the host memory of `arrays` (jax arrays on the CPU) into transparent huge pages, in a
    daemon thread, which it returns started (None: nothing to do here, or `background=False`: done
    before returning). Only addresses are kept, not the arrays, so none of them lives longer for it.

    `zeros`: further arrays, fresh and not in use by anything else until this returns (a new KV
    cache), whose whole huge pages that hold only zeros are given back at once instead of copied:
    they come back as huge pages when first written (~0.4 s of copying saved per 200 MB)."""
    size = huge_page_size()
    if size is None:
        return None
    ranges = huge_page_ranges(arrays, size)
    if zero_ranges := huge_page_ranges(zeros, size):
        madvise = _madvise()
        ranges += zero_ranges if madvise is None else _drop_zero_ranges(zero_ranges, madvise)
    if not ranges:
        return None

    def run():
        t0 = time.perf_counter()
        done, why = _collapse(ranges)
        total = sum(n for _, n in ranges)
        log.debug(
            "%s: %.0f of %.0f MB moved into huge pages in %.2f s%s",
            what,
            done / 1e6,
            total / 1e6,
            time.perf_counter() - t0,
            f" (the rest: {why})" if why else "",
        )

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name=f"jaxinfer-huge-pages-{what}", daemon=True)
    thread.start()
    return thread
