"""The model's weight products: where they run on the CPU.

Every projection of the model (and the LM head) is an einsum of activations x [..., C] with a
weight whose contracted letters C lead (`"BTD,DNH->BTNH"`) or, for a tied head, trail
(`"BD,VD->BV"`). On accelerators that einsum goes to XLA as it is. On the CPU
a bfloat16 product of few rows - a decode step's: up to 8, or 64 where the kernel has a wide path
(AMX tiles, AVX-512 BF16 or, without AVX-512, AVX2), or 512, prompt chunks too, on AVX-512 without
BF16 (`native.matmul_max_rows`) - goes to the C++
kernel of jaxinfer.native (`bf16_matmul`), since XLA CPU's own bfloat16 matrix-vector product reads
its weights at ~1.4 GB/s (a float32 one at ~25 GB/s) and its YNNPACK GEMM is slower than the
kernel's AMX path at 9-64 rows (WORKSPACE.md, 2026-12-01, 2026-12-02); every other bfloat16 product
on the CPU is asked for in float32 and rounded once, the form XLA hands to its GEMM libraries (YNNPACK's bfloat16
kernels, where `jaxinfer._xla_flags.bf16_dot_options` turns them on for the steps).

A float32 model an LLM runs on the CPU, on one device, where jaxinfer.native has its float32
strips in AVX-512 (AVX2 too with `JAXINFER_F32_STRIPS=1`), keeps each projection's weight in column
strips (`to_strips`, done once by jaxinfer.llm as the model loads; the config's `weight_strips` says
so), and every product with it, at any number of rows, goes to `native.f32_matmul`: XLA CPU's
float32 dot streams a [K, N] weight at ~23 GB/s at one row and runs ~150 GFLOP/s at a batched
decode step's rows; the strips were ~1.2x that at one row and 1.2-1.6x at 8-48 (WORKSPACE.md,
design decisions, 2026-12-06). One kernel for every M keeps a row's logits the same bits alone and
in any batch. A small weight (`STRIPS_MIN_WEIGHTS`), one whose N is not a multiple of the strip
width and a tied head stay as they are and go to XLA; float32 products elsewhere go to XLA as
written.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer import native


def native_layout(spec: str) -> tuple[int, bool] | None:
    """(how many letters are contracted, whether the weight is [N..., C...]) when `spec` is a
    product the 2-D kernel can run - x's trailing letters contracted with the weight's leading ones
    (or trailing ones, transposed) in the same order, the rest kept in order - else None."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = [c for c in xs if c in ws and c not in out]
    n = len(contracted)
    if n == 0 or xs[len(xs) - n :] != "".join(contracted):
        return None
    batch = xs[: len(xs) - n]
    if ws[:n] == xs[len(xs) - n :] and out == batch + ws[n:]:
        return n, False
    if ws[len(ws) - n :] == xs[len(xs) - n :] and out == batch + ws[: len(ws) - n]:
        return n, True
    return None


def _native_rows(spec: str, x: jax.Array, w: jax.Array) -> tuple[int, bool] | None:
    """native_layout(spec) when this product should run in jaxinfer.native.bf16_matmul."""
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or (layout := native_layout(spec)) is None:
        return None
    if math.prod(x.shape[: x.ndim - layout[0]]) > native.matmul_max_rows() or not native.runs_here():
        return None
    return layout


def to_strips(w: jax.Array, cols: int) -> jax.Array:
    """w [K, N] laid out in strips of `cols` columns: the same shape, holding w's columns [cols s,
    cols s + cols) of every row one strip after another ([N / cols][K][cols] in memory)."""
    k, n = w.shape
    return w.reshape(k, n // cols, cols).transpose(1, 0, 2).reshape(k, n)


def from_strips(w: jax.Array, cols: int) -> jax.Array:
    """The [K, N] matrix whose strips of `cols` columns `w` holds (to_strips' inverse)."""
    k, n = w.shape
    return w.reshape(n // cols, k, cols).transpose(1, 0, 2).reshape(k, n)


# The fewest elements a weight kept in strips has. Below it a product is a few microseconds, where
# XLA's dot on [K, N] was as fast or faster at some row counts (a custom call's fixed cost, one strip
# per thread): [256, 128] 0.63x and [256, 1536] 0.66x at 32 and 8 rows, [1024, 256] 0.77x at 8, while
# [1024, 1024] was 1.12-2.28x at 1-32 rows (2026-12-06; the 5.8M default model's steps were ~15%
# slower with all of its weights in strips).
STRIPS_MIN_WEIGHTS = 1 << 20


def stored_in_strips(contracted: int, shape: tuple[int, ...], dtype, strips: int) -> bool:
    """Whether a weight of this shape and dtype, its first `contracted` axes contracted, is kept in
    strips of `strips` columns (0: none are): a float32 one of at least STRIPS_MIN_WEIGHTS elements
    whose kept axes hold a whole number of strips. jaxinfer.model lays the weights out by this rule,
    and `einsum_f32` reads them by it."""
    return (
        bool(strips)
        and jnp.dtype(dtype) == jnp.float32
        and math.prod(shape) >= STRIPS_MIN_WEIGHTS
        and math.prod(shape[contracted:]) % strips == 0
    )


def einsum_f32(spec: str, x: jax.Array, w: jax.Array, *, strips: int = 0) -> jax.Array:
    """einsum(spec, x, w) with products summed and returned in float32 (see the module docstring
    for where it runs). `strips`: the model's `weight_strips` (w may be stored in strips of that
    many columns: `stored_in_strips`)."""
    layout = native_layout(spec)
    if layout is not None and not layout[1] and stored_in_strips(layout[0], w.shape, w.dtype, strips):
        n = layout[0]
        lead, kept = x.shape[: x.ndim - n], w.shape[n:]
        x2 = x.reshape(math.prod(lead), math.prod(w.shape[:n]))
        w2 = w.reshape(x2.shape[1], math.prod(kept))
        if native.runs_here() and native.f32_strip_cols() == strips:
            out = native.f32_matmul(x2.astype(jnp.float32), w2)
        else:  # not where the strips were laid out for: the plain product, slowly but right
            out = jnp.dot(x2, from_strips(w2, strips), preferred_element_type=jnp.float32)
        return out.reshape(*lead, *kept)
    layout = _native_rows(spec, x, w)
    if layout is None:
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    n, transposed = layout
    lead = x.shape[: x.ndim - n]
    k = math.prod(x.shape[x.ndim - n :])
    kept = w.shape[: w.ndim - n] if transposed else w.shape[n:]
    w2 = w.reshape(math.prod(kept), k) if transposed else w.reshape(k, math.prod(kept))
    out = native.bf16_matmul(x.reshape(math.prod(lead), k), w2, transposed=transposed)
    return out.reshape(*lead, *kept)


def project(spec: str, x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, strips: int = 0) -> jax.Array:
    """A projection `einsum(spec, x, w)` in x's dtype, with an optional bias. The bias joins the
    float32 sum before the one rounding to x's dtype, as torch's addmm in nn.Linear does: added after
    a bfloat16 product it rounded twice (1 bfloat16 step off HF's K/V in ~30% of a Qwen2's values;
    float32 unchanged). `strips`: as in einsum_f32."""
    if bias is None and not strips and (x.dtype != jnp.bfloat16 or jax.default_backend() != "cpu"):
        return jnp.einsum(spec, x, w)
    y = einsum_f32(spec, x, w, strips=strips)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
