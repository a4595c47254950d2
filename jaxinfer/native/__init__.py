"""Native CPU kernels: C++ compiled on first use and called from jitted code as XLA FFI custom calls.

`paged_attention.cc` is the "native" attention backend (see jaxinfer.attention): paged attention
that reads each row's keys and values straight out of their pages, where XLA CPU would gather them
element by element. It is built with the machine's C++ compiler against the FFI headers jaxlib
ships (`jax.ffi.include_dir()`), once per source, jaxlib and CPU, into a cache directory
(`$JAXINFER_CACHE_DIR`, default `~/.cache/jaxinfer`). Where there is no compiler, or the build
fails, `available()` is False, `why_unavailable()` says why, and "auto" keeps the pure-JAX tiled
attention ("xla"); asking for "native" explicitly then raises that reason. `JAXINFER_NATIVE=0`
turns it off.
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

_SOURCE = Path(__file__).with_name("paged_attention.cc")
_TARGET = "jaxinfer_paged_attention"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


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
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(), jax.lib.__version__.encode()):
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
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeUnavailableError(f"compiling {_SOURCE.name} failed:\n{result.stderr[-2000:]}")
        os.replace(out, target)


@functools.cache
def _load() -> ctypes.CDLL | NativeUnavailableError:
    if os.environ.get("JAXINFER_NATIVE", "1") == "0":
        return NativeUnavailableError("turned off by JAXINFER_NATIVE=0")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        return NativeUnavailableError("no C++ compiler found (set CXX, or install g++)")
    try:
        target = _library_path(compiler)
        if not target.exists():
            log.info("building the native CPU kernels into %s", target.parent)
            _build(compiler, target)
        lib = ctypes.cdll.LoadLibrary(str(target))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxinferPagedAttention), platform="cpu")
    except (OSError, NativeUnavailableError) as e:
        log.warning("native CPU kernels unavailable: %s", e)
        return e if isinstance(e, NativeUnavailableError) else NativeUnavailableError(str(e))
    return lib


def available() -> bool:
    """Whether the native kernels are built and registered (builds them on the first call)."""
    return not isinstance(_load(), NativeUnavailableError)


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
    if (k_pages.dtype == jnp.int8) != (k_scales is not None):
        raise ValueError("k_scales must be given exactly when the pools are int8")
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
