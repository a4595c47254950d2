"""Test setup: CPU only, 8 virtual devices (for sharding tests), set before JAX is imported."""

import os
import signal

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
# On CPU the tests compile XLA's LLVM backend at -O0: the suite compiles thousands of small programs
# and runs each a few times, so LLVM's optimisation cost more than it saved. What the tests check is
# the HLO's semantics, which no LLVM level changes (fast-math is off; the matmuls are library calls
# either way); at most the rounding of a fused multiply-add differs, inside every tolerance here.
# The whole suite went from 15m31s to 10m50s wall (CPU 28m49s -> 19m40s) on the 2-core machine, both
# runs green (2026-11-23; WORKSPACE.md has the command). Only the tests' processes get the flag: the
# library and its benchmarks keep XLA's default, and a caller's own setting wins.
# With LLVM at -O0, most of what is left of a compile is XLA's MLIR fusion emitters, which run their
# own pipelines whatever LLVM's level: its older elemental emitters compile the same HLO in ~40% less
# time (one randomized engine test's compiles 21.8-23.3 -> 13.8-14.3 s; the 4x2 pallas mesh 28.8 ->
# 17.1 s; 2026-12-06). Tests only: at XLA's default level the older emitters compiled slower (a
# warmed LLM: 57-71 against 75-77 s), and the programs' speed was the same within the noise.
# And one LLVM module per program, not split for parallel codegen: two workers already share the two
# cores (the same engine test's compiles, alternating runs: 12.4-13.1 -> 9.7-10.6 s; 2026-12-06).
_TEST_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
if os.environ["JAX_PLATFORMS"] == "cpu":
    for flag in _TEST_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = os.environ["XLA_FLAGS"] = f"{flags} {flag}"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A shell without job control starts a background command with SIGINT ignored (`(pytest &)`), and
# Python then installs no KeyboardInterrupt handler: the Ctrl-C tests (test_llm.py, which raise a
# real SIGINT) would fail for the way the suite was launched, not for the code. Each process of the
# run (the xdist workers import this file too) gets the handler a terminal's Python has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Every process the tests start (servers, multi-host jobs, notebook kernels, the CLI) imports this
# checkout, whatever else is installed: a stale installed copy must not be what gets tested (and
# notebooks in an environment without jaxinfer would otherwise pip-install one from their first cell).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

# One persistent XLA compilation cache for the whole run: the xdist workers and every process the
# tests start (servers, multi-host jobs, notebook kernels, the CLI) inherit it, so a program the
# suite has compiled once (the default model's steps, above all) is loaded rather than compiled again.
# Made by the controlling process, before the workers start, and removed when it exits; a directory
# set by the caller is used as it is and kept. `engine.num_compiles` counts cache loads as compiles,
# so the no-recompile tests are as strict with the cache as without it.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


def _host_callbacks_take_numpy_arrays() -> None:
    """Hands `io_callback`'s Python functions the host's NumPy arrays, not JAX arrays made of them.

    Pallas' interpreters (TPU interpret mode, and Mosaic GPU's) run every load, store, DMA and
    semaphore of a kernel as an `io_callback`, and JAX's implementation first `device_put`s each
    argument, a JAX array the interpreter then reads straight back with `int()` and `np.array()`:
    that round trip was ~85% of an interpreted kernel call here (one TPU-kernel call on 4 rows: 0.38
    -> 0.05 s; 2026-12-06). The interpreter copies every value it keeps (`np.array`), so nothing
    holds on to XLA's buffers. Only on the CPU platform and only where the function is the one this
    replaces (its keyword arguments); elsewhere JAX's own stays. Tests only: the library makes no
    callbacks.
    """
    import inspect
    import logging

    import numpy as np

    try:
        from jax._src import callback, tree_util
    except ImportError:  # JAX's private layout moved: its own implementation stays
        return
    impl = getattr(callback, "io_callback_impl", None)
    replaces = ("args", "result_avals", "callback", "sharding", "ordered")
    if impl is None or tuple(inspect.signature(impl).parameters) != replaces:
        return

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        try:
            return tree_util.tree_map(np.asarray, callback(*args))
        except BaseException:
            logging.getLogger(impl.__module__).exception("jax.io_callback failed")
            raise

    callback.io_callback_impl = io_callback_impl


if os.environ["JAX_PLATFORMS"] == "cpu":
    _host_callbacks_take_numpy_arrays()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    Every XLA CPU executable keeps about 14 memory mappings while a jit cache holds it. One pytest
    process compiles thousands of programs; kept all session, they passed Linux's default
    vm.max_map_count (65,530) late in the suite, and XLA then segfaulted inside a compile (seen
    here, always in the same test; each half of the suite alone stayed under the limit).
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


# Files in order of their cost on the 2-core machine, heaviest first (measured 2026-11-23, seconds of
# one worker in a full run: the notebooks ~130, kernels ~300, sharding ~185, ...). xdist hands whole
# files to whichever worker is free (`--dist loadfile --no-loadscope-reorder`), so the long ones start
# first and no worker is left alone with one at the end. Unlisted files follow in their usual order.
_HEAVY_FIRST = (
    "test_pallas_kernels.py",
    "test_pallas_kernels_gpu.py",
    "test_notebooks.py",
    "test_multihost.py",
    "test_sharding.py",
    "test_engine.py",
    "test_serving.py",
    "test_default_model.py",
    "test_gemma.py",
    "test_hf_parity.py",
    "test_llm.py",
    "test_kv_cache_int8.py",
    "test_streaming.py",
    "test_checkpoint.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order
