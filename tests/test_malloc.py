"""jaxinfer._malloc: an engine on the CPU keeps the large blocks it frees, so each run of a program
reuses its temporaries' pages instead of faulting them in anew (checked by counting page faults)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mallopt knobs are glibc's")

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
        LLM(max_model_len=64)
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


def test_an_engine_on_the_cpu_keeps_large_freed_blocks():
    assert int(_second_round_faults("none")[-1]) > 10000  # glibc's default: a fresh mapping each time
    assert int(_second_round_faults("engine")[-1]) < 1000
    kept, faults = _second_round_faults("call", JAXINFER_MALLOC_DEFAULTS="0")  # the way out
    assert kept == "False" and int(faults) > 10000
