"""XLA CPU defaults jaxinfer sets before JAX starts its backend (only where the user has not).

`--xla_cpu_experimental_ynn_fusion_type=-individual_dot` sends CPU matrix products to Eigen instead of
YNNPACK. Measured on the 2-core development machine, 150M Llama, float32 decode step:
batch 4: 47.7 -> 40.6 ms, batch 16: 87.9 -> 66.4 ms, batch 1 unchanged (18.5 vs 18.3 ms).
The flag only affects the CPU backend; it is read once, when the backend starts, so setting it after
JAX has already run a computation is harmless and has no effect.

A bfloat16 model's steps are the exception, on CPUs with bfloat16 instructions (AMX or AVX-512
BF16): `bf16_dot_options` gives them back to YNNPACK, whose bfloat16 kernels Eigen has no
counterpart for (per program, through `jax.jit`'s compiler_options, so float32 programs in the same
process keep Eigen).
"""

import functools
import os

_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_DEFAULTS = {_YNN_FLAG: "-individual_dot"}


def apply_defaults() -> None:
    """Appends each default flag the user has not set; JAXINFER_XLA_DEFAULTS=0 turns this off."""
    if os.environ.get("JAXINFER_XLA_DEFAULTS", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in _DEFAULTS.items():
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    os.environ["XLA_FLAGS"] = flags


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def bf16_dot_options() -> dict[str, str] | None:
    """compiler_options for a bfloat16 model's jitted steps on this CPU, or None (XLA's flags as set).

    On a CPU with bfloat16 instructions - AMX tiles (`amx_bf16`) or AVX-512 dot products
    (`avx512_bf16`: AMD Zen 4 and later, Intel Cooper Lake) - every dot of the program goes to
    YNNPACK, whose bfloat16 GEMMs Eigen has no counterpart for. On an Intel Xeon with AMX (2 cores,
    150M Llama, 2026-12-01; WORKSPACE.md) they took the bfloat16 steps from 364 to 91 ms for a
    128-token prompt and from 284 to 43 ms for a 48-row decode step (float32: 175 and 109 ms); on an
    AMD Zen 5 without AMX, [M, 1024] x [1024, 5632] products ran at 377 against Eigen's 51 GFLOP/s
    at 48 rows and 455 against 223 at 512 (Eigen's float32: 296 and 247; 2026-12-02). Not where the
    user set the YNNPACK flag or JAXINFER_XLA_DEFAULTS=0, and not on CPUs with neither, where it was
    not measured (Eigen's bfloat16 GEMM stays).
    """
    if os.environ.get("JAXINFER_XLA_DEFAULTS", "1") == "0":
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    if _YNN_FLAG in flags and f"{_YNN_FLAG}={_DEFAULTS[_YNN_FLAG]}" not in flags:
        return None
    if not {"amx_bf16", "avx512_bf16"} & _cpu_flags():
        return None
    return {_YNN_FLAG.removeprefix("--"): "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
