"""jaxinfer._malloc: an engine on the CPU keeps the large blocks it frees, so each run of a program
reuses its temporaries' pages instead of faulting them in anew (checked by counting page faults),
and moves its weights and KV cache into transparent huge pages (checked in /proc's accounting)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

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


# An engine whose cache (12 pools of 16 MB) has whole huge pages to move; prints the process's huge
# pages before and after, the bytes the engine's ranges span, and whether greedy tokens made while
# the collapse may still run equal those made after it.
_ENGINE_PROBE = textwrap.dedent(
    """
    import os, re, jax
    from jaxinfer import LLM, SamplingParams, _malloc
    def anon_huge():
        text = open(f"/proc/{os.getpid()}/smaps_rollup").read()
        return int(re.search(r"AnonHugePages:\\s+(\\d+)", text).group(1)) * 1024
    before = anon_huge()
    llm = LLM(max_model_len=256, num_kv_pages=2048)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    during = [o.token_ids for o in llm.generate(["In the beginning", "And the LORD"], sp)]
    assert llm.engine.wait_for_huge_pages(timeout=120)
    after = [o.token_ids for o in llm.generate(["In the beginning", "And the LORD"], sp)]
    leaves = [*jax.tree.leaves(llm.engine.params), *jax.tree.leaves(llm.engine.cache)]
    size = _malloc.huge_page_size() or 2 << 20
    print(before, anon_huge(), sum(n for _, n in _malloc.huge_page_ranges(leaves, size)), during == after)
    """
)


def test_an_engine_on_the_cpu_moves_its_weights_and_cache_into_huge_pages():
    if why := _huge_pages_unavailable():
        pytest.skip(why)
    out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE], capture_output=True, text=True, check=True)
    before, after, spanned, same = out.stdout.split()[-4:]
    assert int(spanned) >= 150 << 20
    assert int(after) - int(before) >= 0.9 * int(spanned), out.stdout  # the kernel backs them in huge pages
    assert same == "True"  # and what they hold is what it was


def test_huge_pages_left_alone_when_asked():
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAXINFER_HUGE_PAGES": "0"},
    )
    before, after, spanned, same = out.stdout.split()[-4:]
    assert int(after) - int(before) < 0.5 * int(spanned) and same == "True"


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
