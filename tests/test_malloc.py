"""jaxinfer._malloc: an engine on the CPU keeps the large blocks it frees, so each run of a program
reuses its temporaries' pages instead of faulting them in anew (checked by counting page faults),
and moves its weights and KV cache into transparent huge pages (checked in /proc's accounting)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mallopt knobs are glibc's")

# Allocates, touches and frees a 64 MB block twice and prints the minor page faults of the second
# round: with glibc's defaults the block is a fresh mmap each time (16384 4 KB pages faulted in).
_PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    if sys.argv[1] == "engine":
        from jaxinfer import LLM
        # Once its memory has settled: while the kernel gathers huge pages for the engine it may
        # migrate other pages of the process, and a page being migrated faults when touched.
        LLM(max_model_len=64).engine.wait_for_huge_pages()
    elif sys.argv[1] == "call":
        from jaxinfer import _malloc
        print(_malloc.keep_large_blocks())
    size = 64 << 20
    for round in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        libc.memset(block, 1, size)
        libc.free(block)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _second_round_faults(mode: str, **env) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    return out.stdout.split()


@glibc_only
def test_an_engine_on_the_cpu_keeps_large_freed_blocks():
    assert int(_second_round_faults("none")[-1]) > 10000  # glibc's default: a fresh mapping each time
    assert int(_second_round_faults("engine")[-1]) < 1000
    kept, faults = _second_round_faults("call", JAXINFER_MALLOC_DEFAULTS="0")  # the way out
    assert kept == "False" and int(faults) > 10000


def test_huge_page_ranges_lie_inside_each_buffer_on_whole_pages():
    import jax.numpy as jnp

    from jaxinfer import _malloc

    size = 2 << 20
    arrays = [jnp.ones((n,), jnp.float32) for n in (3 << 20, 1 << 18, (5 << 20) + 7)]  # 12 MB, 1 MB, 20 MB
    ranges = _malloc.huge_page_ranges(arrays, size)
    assert len(ranges) == 2  # the 1 MB array holds no whole huge page
    for (start, length), a in zip(ranges, (arrays[0], arrays[2])):
        lo, hi = a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes
        assert start % size == 0 and length % size == 0 and length > 0
        assert lo <= start and start + length <= hi  # never a byte of a neighbour
        assert (hi - lo) - length < 2 * size  # and all of it but the two partial ends
    arrays[0].delete()  # a donated array has nothing to move
    assert _malloc.huge_page_ranges(arrays, size) == ranges[1:]


def _huge_pages_unavailable() -> str | None:
    from jaxinfer import _malloc

    if _malloc.huge_page_size() is None:
        return "this kernel has no transparent huge pages (not Linux, or set to never)"
    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if release < (6, 1):
        return f"MADV_COLLAPSE needs Linux 6.1, this is {platform.release()}"
    return None


# An engine whose cache (12 pools of 16 MB) spans whole huge pages. Prints, as JSON: the share of
# the cache's huge-page ranges resident right after the engine is built (a new cache is all zeros,
# given back), the cache's huge pages after a generate (written pages come back huge), the weights'
# ranges and their huge pages once moved, and whether greedy tokens made while the move may still run
# equal those made after it.
_ENGINE_PROBE = textwrap.dedent(
    """
    import ctypes, json, re, jax
    from jaxinfer import LLM, SamplingParams, _malloc
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    def resident(ranges):
        pages = total = 0
        for start, length in ranges:
            vec = (ctypes.c_ubyte * (length // 4096))()
            assert libc.mincore(start, length, vec) == 0
            pages += sum(b & 1 for b in vec); total += len(vec)
        return pages / max(total, 1)
    def huge(ranges):  # AnonHugePages of the mappings lying within the ranges
        out, lo = 0, None
        for line in open("/proc/self/smaps"):
            if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                inside = any(s <= lo and hi <= s + n for s, n in ranges)
            elif line.startswith("AnonHugePages:") and inside:
                out += int(line.split()[1]) * 1024
        return out
    size = _malloc.huge_page_size() or 2 << 20
    llm = LLM(max_model_len=256, num_kv_pages=2048)
    cache = _malloc.huge_page_ranges(jax.tree.leaves(llm.engine.cache), size)
    params = _malloc.huge_page_ranges(jax.tree.leaves(llm.engine.params), size)
    given_back = 1 - resident(cache)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    during = [o.token_ids for o in llm.generate(["In the beginning", "And the LORD"], sp)]
    assert llm.engine.wait_for_huge_pages(timeout=120)
    after = [o.token_ids for o in llm.generate(["In the beginning", "And the LORD"], sp)]
    print(json.dumps({
        "cache_spanned": sum(n for _, n in cache), "cache_given_back": given_back, "cache_huge": huge(cache),
        "params_spanned": sum(n for _, n in params), "params_huge": huge(params), "same": during == after,
    }))
    """
)


def _engine_probe(**env) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROBE], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_an_engine_on_the_cpu_puts_its_weights_and_cache_in_huge_pages():
    if why := _huge_pages_unavailable():
        pytest.skip(why)
    got = _engine_probe()
    assert got["cache_spanned"] >= 150 << 20 and got["params_spanned"] >= 2 << 20
    assert got["cache_given_back"] > 0.95  # the new cache's zeros given back, not copied
    assert got["cache_huge"] >= 2 << 20  # what the steps wrote came back in huge pages
    assert got["params_huge"] >= 0.9 * got["params_spanned"]  # the weights moved
    assert got["same"]  # and what they hold is what it was


def test_huge_pages_left_alone_when_asked():
    got = _engine_probe(JAXINFER_HUGE_PAGES="0")
    assert got["cache_given_back"] < 0.05 and got["cache_huge"] == 0 and got["params_huge"] == 0 and got["same"]


def test_only_zeros_are_given_back_and_they_come_back_as_huge_pages_when_written():
    if why := _huge_pages_unavailable():
        pytest.skip(why)
    import jax
    import jax.numpy as jnp

    from jaxinfer import _malloc

    n = 16 << 20  # 64 MB of float32
    zeros, ones = jnp.zeros((n,), jnp.float32), jnp.ones((n,), jnp.float32)
    _malloc.back_with_huge_pages([], zeros=[zeros, ones], background=False)
    assert not np.asarray(zeros).any() and np.asarray(ones).all()  # what each held, it holds
    ptr = zeros.unsafe_buffer_pointer()
    written = jax.jit(lambda a: a + 2.0, donate_argnums=0)(zeros)
    assert written.unsafe_buffer_pointer() == ptr  # written in place, into the pages given back
    assert (np.asarray(written) == 2.0).all()


def test_a_kernel_without_madv_collapse_still_gets_every_range_advised(monkeypatch):
    """Before Linux 6.1 MADV_COLLAPSE is EINVAL: each range is still marked MADV_HUGEPAGE (khugepaged
    then collapses it in its own time), and the refused call is not tried again range after range."""
    import ctypes
    import errno

    from jaxinfer import _malloc

    calls = []

    def madvise(start, length, advice):
        calls.append((start, advice))
        if advice == _malloc._MADV_COLLAPSE:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return 0

    class Libc:
        pass

    libc = Libc()
    libc.madvise = madvise
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda *a, **k: libc)
    done, why = _malloc._collapse([(0, 2 << 20), (4 << 20, 2 << 20), (8 << 20, 4 << 20)])
    assert done == 0 and why == os.strerror(errno.EINVAL)
    assert [a for s, a in calls if a == _malloc._MADV_HUGEPAGE] == [_malloc._MADV_HUGEPAGE] * 3
    assert [s for s, a in calls if a == _malloc._MADV_COLLAPSE] == [0]
