"""Native CPU kernels: C++ compiled on first use and called from jitted code as XLA FFI custom calls.

- `paged_attention.cc`, the "native" attention backend (see jaxinfer.attention): paged attention
  that reads each row's keys and values straight out of their pages, where XLA CPU would gather
  them element by element.
- `matmul.cc`, `bf16_matmul`: the bfloat16 product of few rows a bfloat16 model's decode step is
  made of (used by jaxinfer.matmul), where XLA CPU's own reads its weights at a tenth of memory speed:
  AVX-512 loops up to 8 rows; for 9-64 rows Intel's AMX tiles or AVX-512 BF16 dot products, where
  the CPU has them (`wide_path`), else the few-row loops' order in column strips: in AVX-512 where
  the CPU has it without BF16 (to 512 rows: prompt chunks too), in AVX2 (8 lanes, to 64 rows) where
  it has no AVX-512.
- `matmul.cc` also holds `f32_matmul`: a float32 model's products, at any number of rows, on
  weights laid out once in column strips (jaxinfer.matmul.to_strips), where the CPU has AVX-512 or AVX2 (see
  jaxinfer.matmul for when a model's weights are).
- `kv_write.cc`, `kv_write`: a step's new keys and values written into a 16-bit pool in place, where
  XLA CPU converts the whole pool to float32 and back.
- `cut.cc`, `cut_thresholds`: the sampler's top-k and top-p cuts (jaxinfer.sampling.keep_mask) by
  radix select, two passes over each row, where the pure-JAX search takes 32 over a row whose
  nucleus the candidate blocks cannot hold.

All are built into one library with the machine's C++ compiler against the FFI headers jaxlib
ships (`jax.ffi.include_dir()`), once per source, jaxlib and CPU, into a cache directory
(`$JAXINFER_CACHE_DIR`, default `~/.cache/jaxinfer`). Where there is no compiler, or the build
fails, `available()` is False, `why_unavailable()` says why, and "auto" keeps the pure-JAX tiled
attention ("xla") and XLA's own products and scatters; asking for "native" attention explicitly
then raises that reason. `JAXINFER_NATIVE=0` turns it off. `JAXINFER_NATIVE_CXXFLAGS` adds compiler
flags after the defaults (its own library in the cache): `-mno-amx-tile -mno-avx512bf16` builds, on a
CPU with AMX, the paths a CPU with plain AVX-512 takes, so one machine can test every path its
instruction set covers (WORKSPACE.md, "Run, test, benchmark").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("paged_attention.cc", "matmul.cc", "kv_write.cc", "cut.cc")
)
_TARGET = "jaxinfer_paged_attention"
_MATMUL_TARGET = "jaxinfer_bf16_matmul"
_F32_MATMUL_TARGET = "jaxinfer_f32_matmul"
_KV_WRITE_TARGET = "jaxinfer_kv_write"
_CUT_TARGET = "jaxinfer_cut"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def extra_flags() -> tuple[str, ...]:
    """The compiler flags `$JAXINFER_NATIVE_CXXFLAGS` adds after the defaults (none by default)."""
    return tuple(os.environ.get("JAXINFER_NATIVE_CXXFLAGS", "").split())


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: `$CXX`, else the first of g++, c++, clang++."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


class NativeUnavailableError(RuntimeError):
    """The native kernels could not be built or loaded here; the message says why."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    parts = [source.read_bytes() for source in _SOURCES]
    flags = " ".join((*_FLAGS, *extra_flags()))
    for part in (*parts, flags.encode(), compiler.encode(), jax.lib.__version__.encode()):
        key.update(part)
    key.update(_cpu_model().encode())  # -march=native: a library built for one CPU may not run on another
    root = Path(os.environ.get("JAXINFER_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer")
    return root / "native" / key.hexdigest()[:16] / "libjaxinfer_native.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes (test workers) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, *extra_flags(), f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            names = " and ".join(source.name for source in _SOURCES)
            raise NativeUnavailableError(f"compiling {names} failed:\n{result.stderr[-2000:]}")
        os.replace(out, target)


@functools.cache
def _load() -> ctypes.CDLL | NativeUnavailableError:
    if os.environ.get("JAXINFER_NATIVE", "1") == "0":
        return NativeUnavailableError("turned off by JAXINFER_NATIVE=0")
    compiler = find_compiler()
    if compiler is None:
        return NativeUnavailableError("no C++ compiler found (set CXX, or install g++)")
    try:
        target = _library_path(compiler)
        if not target.exists():
            log.info("building the native CPU kernels into %s", target.parent)
            _build(compiler, target)
        lib = ctypes.cdll.LoadLibrary(str(target))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxinferPagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxinferBf16Matmul), platform="cpu")
        jax.ffi.register_ffi_target(_F32_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxinferF32Matmul), platform="cpu")
        jax.ffi.register_ffi_target(_KV_WRITE_TARGET, jax.ffi.pycapsule(lib.JaxinferKvWrite), platform="cpu")
        jax.ffi.register_ffi_target(_CUT_TARGET, jax.ffi.pycapsule(lib.JaxinferCut), platform="cpu")
    except (OSError, NativeUnavailableError) as e:
        log.warning("native CPU kernels unavailable: %s", e)
        return e if isinstance(e, NativeUnavailableError) else NativeUnavailableError(str(e))
    return lib


def available() -> bool:
    """Whether the native kernels are built and registered (builds them on the first call)."""
    return not isinstance(_load(), NativeUnavailableError)


def runs_here() -> bool:
    """Whether the trace being built may call the matmul and cache-write kernels: the CPU backend,
    outside any multi-device mesh (the custom calls have no partitioning rule, so XLA would gather
    their operands), and the library built. (The attention kernel runs per device under shard_map.)"""
    if jax.default_backend() != "cpu":
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (mesh.empty or mesh.size == 1) and available()


def why_unavailable() -> str | None:
    loaded = _load()
    return str(loaded) if isinstance(loaded, NativeUnavailableError) else None


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Paged attention on the CPU by the C++ kernel, with the Pallas kernels' signature
    (pallas_kernels.ragged_paged_attention): q [B, T, N, H]; pools [K, P, S, H] as plain arrays
    (int8 pools with their `k_scales` / `v_scales` [K, P, S]); page_table [B, MP]; kv_lens and q_lens
    [B], a row's q_lens new tokens being the last of its kv_lens cached ones. Query tokens past a
    row's q_lens are padding and come back as zeros, as does a query that sees no key.

    Raises NativeUnavailableError when the kernel could not be built here.
    """
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        raise loaded
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q: the native kernel takes float32 or bfloat16, got {q.dtype}")
    # The kernel trusts every shape: a v pool smaller than k's, or a lengths vector shorter than the
    # batch, was read out of bounds (a segfault, or attention over whatever memory followed).
    from pallas_kernels.ragged_paged_attention import check_call

    check_call(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, scale, k_scales, v_scales, window=window, soft_cap=soft_cap
    )
    if k_scales is None:
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    i32 = jnp.int32
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        k_scales.astype(jnp.float32),
        v_scales.astype(jnp.float32),
        page_table.astype(i32),
        kv_lens.astype(i32),
        q_lens.astype(i32),
        scale=np.float32(scale),
        window=np.int64(window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


_WIDE_PATHS = {1: "amx", 2: "avx512_bf16", 3: "avx2", 4: "avx512"}


@functools.cache
def wide_path() -> tuple[str, int, int] | None:
    """(name, from, to): the path `bf16_matmul` takes here for from..to rows of x (matmul.cc) -
    "amx", Intel's AMX tiles, where the CPU has them and the OS grants them, else "avx512_bf16", the
    AVX-512 BF16 dot products (AMD Zen 4 and later), else "avx2" on a CPU without AVX-512 (AMD Zen 3:
    the few-row loops' 8-lane form, in column strips, the few-row path's bits), else "avx512" on one
    with AVX-512 but without its BF16 instructions (the same strips in 16 lanes) - or None where none
    applies, or when the library is unavailable."""
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        return None
    lo, hi = ctypes.c_int64(), ctypes.c_int64()
    kind = loaded.JaxinferMatmulWidePath(ctypes.byref(lo), ctypes.byref(hi))
    return (_WIDE_PATHS[kind], lo.value, hi.value) if kind else None


def matmul_max_rows() -> int:
    """Rows up to which jaxinfer.matmul sends a bfloat16 product to `bf16_matmul`: the wide path's
    last where there is one (a decode step's largest bucket; prompt chunks of up to 512 tokens on the
    "avx512" path, where XLA's own bfloat16 dot has no bfloat16 instructions either), else
    MATMUL_MAX_ROWS."""
    wide = wide_path()
    return wide[2] if wide else MATMUL_MAX_ROWS


# Rows up to which `bf16_matmul`'s AVX-512 loops beat XLA CPU's own bfloat16 dot. On an Intel Xeon with AMX
# (2 cores, 2026-12-01, [M, 1024] x [1024, 5632], 24 weights chained, 277 MB that this CPU's 300 MB
# L3 partly holds: the crossover, not the bandwidth, is the figure to read) the C++ product
# took 12.7 ms at one row against 192 ms for XLA's bfloat16 dot with YNNPACK on and 19.9 ms for its
# float32 dot of the same shape; it was 2.3x XLA's bfloat16 dot at 4 rows and level at 8 (28.5
# against 27.1 ms), and behind from 16 rows on, where YNNPACK's AMX GEMM pays. (Without AMX, XLA's
# bfloat16 dot is Eigen's, which was slower still here.) WORKSPACE.md has the table.
MATMUL_MAX_ROWS = 8


def bf16_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x [M, K] bfloat16 times w [K, N] bfloat16 (or w [N, K] with `transposed`, e.g. a tied LM
    head) -> [M, N] float32, products summed in float32 in an order that depends on neither M nor the
    thread count, so a row's result is the same whatever else is in its batch. Meant for the few rows
    of a decode step (`MATMUL_MAX_ROWS`); it works at any M, slower than XLA's dot past that.

    Raises NativeUnavailableError when the kernel could not be built here.
    """
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        raise loaded
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x [M, K] and w must be 2-D bfloat16, got {x.dtype}{list(x.shape)}, {w.dtype}{list(w.shape)}")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if k != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but w {'[N, K]' if transposed else '[K, N]'} has K = {k}")
    call = jax.ffi.ffi_call(_MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, kn=not transposed)


@functools.cache
def _f32_strips() -> tuple[int, str | None]:
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        return 0, None
    loaded.JaxinferF32Strips.restype = ctypes.c_int64
    isa = ctypes.c_int64()
    cols = int(loaded.JaxinferF32Strips(ctypes.byref(isa)))
    return cols, {2: "avx512", 1: "avx2"}.get(isa.value)


def f32_strip_cols() -> int:
    """The width of `f32_matmul`'s column strips (64), or 0 where this build has none (no AVX-512 or
    AVX2 with FMA) or the library is unavailable."""
    return _f32_strips()[0]


def f32_strips_isa() -> str | None:
    """ "avx512" or "avx2": the vectors `f32_matmul` runs in here (the same bits either way); None
    where it has none."""
    return _f32_strips()[1]


def f32_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] float32 times the [K, N] matrix whose strips of `f32_strip_cols()` columns w holds
    (jaxinfer.matmul.to_strips) -> [M, N] float32, each element one chain of fused multiply-adds in
    k order: a row's result is the same bits whatever else is in its batch, at any M.

    Raises NativeUnavailableError when the kernel could not be built here.
    """
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        raise loaded
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(
            f"x [M, K] and w [K, N] must be 2-D float32, got {x.dtype}{list(x.shape)}, {w.dtype}{list(w.shape)}"
        )
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but w [K, N] has K = {w.shape[0]}")
    if not (cols := f32_strip_cols()) or w.shape[1] % cols:
        raise ValueError(f"w [K, N] = {list(w.shape)}: the float32 strips need N a multiple of 64 and AVX-512 or AVX2")
    call = jax.ffi.ffi_call(_F32_MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(x, w)


def kv_write(pool: jax.Array, values: jax.Array, page: jax.Array, offset: jax.Array) -> jax.Array:
    """pool [K, P, S, H] with values [K, N, H] (the pool's dtype) written at pool[:, page[n],
    offset[n]] ([N] int32 each), in place when the pool is donated (the output aliases it). A slot
    outside the pool fails the call and writes nothing.

    Raises NativeUnavailableError when the kernel could not be built here.
    """
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        raise loaded
    if jax.dtypes.itemsize_bits(pool.dtype) < 8:  # XLA packs these: the kernel's byte rows would overrun
        raise ValueError(f"pool: the native KV write takes whole-byte dtypes, got {pool.dtype}")
    call = jax.ffi.ffi_call(_KV_WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0})
    return call(pool, values.astype(pool.dtype), page.astype(jnp.int32), offset.astype(jnp.int32))


def cut_thresholds(keys: jax.Array, target: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Per row of `keys` ([B, V] uint32, jaxinfer.sampling's order keys), the largest key m such that
    the row's tokens with key >= m weigh at least `target` ([B]): count k of them where `weights` is
    None (top-k), else sum `weights` ([B, V] float32, the probabilities: top-p) to p, in float64.
    0 where even the whole row falls short; 0xFFFFFFFF, without reading the row, where the target is
    not positive (how a caller skips rows that do not use the cut). [B] uint32.

    Raises NativeUnavailableError when the kernel could not be built here.
    """
    loaded = _load()
    if isinstance(loaded, NativeUnavailableError):
        raise loaded
    if keys.ndim != 2 or keys.dtype != jnp.uint32:
        raise ValueError(f"keys must be [B, V] uint32, got {keys.dtype}{list(keys.shape)}")
    counts = weights is None
    if counts:
        weights = jnp.zeros((1,), jnp.float32)
    elif weights.shape != keys.shape:
        raise ValueError(f"weights {list(weights.shape)} must have the keys' shape {list(keys.shape)}")
    call = jax.ffi.ffi_call(_CUT_TARGET, jax.ShapeDtypeStruct(keys.shape[:1], jnp.uint32))
    return call(keys, weights.astype(jnp.float32), target.astype(jnp.float32), counts=counts)
