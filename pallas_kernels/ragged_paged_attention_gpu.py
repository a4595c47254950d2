"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), testable in interpret mode.

Same contract as the TPU kernel (`ragged_paged_attention`): rows mixing decode and chunked prefill,
GQA, sliding window, soft cap, static scale. The structure differs where the hardware does:

- Grid (row b, KV head k); one program owns the row's [R, H] query block (R = its T query tokens x
  G query heads, padded to a power of two >= 16, as the GPU dot wants) and walks the row's pages in
  a loop, reading each page's index from the page table and the [S, H] K and V tiles straight from
  the pools: no gather of the context into a contiguous buffer ever happens.
- A sliding window starts the walk at the first page that can hold a visible key.
- Online softmax in registers (running max, sum, accumulator), one write of the output at the end.

The page walk is a plain loop over `pages_per_step`-page groups (block sizes from the table in
`blocks_for`), so a Mosaic GPU (Hopper) variant can replace the loop body with TMA copies into
shared memory and a wgmma, keeping the wrapper, the grid and the masking as they are. That
variant needs an H100/H200 to be tested and is not written yet.

NOTE: so far this kernel has only run in Pallas' interpret mode (CPU); it has not been compiled
for a GPU. `attention_backend="auto"` therefore never picks it; "pallas" on a GPU does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention import _MASKED, check_call


def _kernel(
    page_table_ref,  # [B, MP] int32
    kv_lens_ref,  # [B]
    q_starts_ref,  # [B]
    q_ref,  # [R, H] (this row, this KV head)
    k_ref,  # [K, P, S, H] the whole pool
    v_ref,
    *refs,  # int8 pools: k/v scales [K, P, S]; then o_ref [R, H]
    scale: float,
    soft_cap: float | None,
    window: int | None,
    group: int,
    page_size: int,
    pages_per_step: int,
    quantized: bool,
):
    if quantized:
        k_scale_ref, v_scale_ref, o_ref = refs
    else:
        (o_ref,) = refs
    b, kh = pl.program_id(0), pl.program_id(1)
    kv_len = kv_lens_ref[b]
    q_start = q_starts_ref[b]
    q = q_ref[...]
    rows, h = q.shape
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group
    offsets = jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    v_offsets = jax.lax.broadcasted_iota(jnp.int32, (page_size, h), 0)

    n = pages_per_step
    first_page = 0 if window is None else jnp.maximum(q_start - window + 1, 0) // page_size
    last_page = (kv_len + page_size - 1) // page_size
    width = page_table_ref.shape[1]

    def page(j, carry):
        m, total, acc = carry
        p_idx = page_table_ref[b, jnp.minimum(j, width - 1)]  # j past the table: masked below
        k = k_ref[kh, p_idx]  # [S, H]
        v = v_ref[kh, p_idx]
        start = j * page_size
        # int8 pages enter the matmuls in q's dtype (exact); their scales multiply logits and weights.
        compute = q.dtype if quantized else v.dtype
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * scale
        if quantized:
            s = s * k_scale_ref[kh, p_idx][None, :]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = start + offsets
        mask = (kv_pos < kv_len) & (kv_pos <= q_pos)
        if window is not None:
            mask &= q_pos - kv_pos < window
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        if quantized:  # zero scales past the row's length: stale (even NaN) scales never count
            weights = p * jnp.where(start + offsets[:1] < kv_len, v_scale_ref[kh, p_idx][None, :], 0.0)
        else:
            v = jnp.where(start + v_offsets < kv_len, v, jnp.zeros((), v.dtype))
            weights = p
        pv = jax.lax.dot_general(
            weights.astype(compute), v.astype(compute), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return m_new, alpha * total + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

    def step(i, carry):  # n pages per loop iteration, unrolled
        for u in range(n):
            carry = page(i * n + u, carry)
        return carry

    init = (
        jnp.full((rows, 1), _MASKED, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, h), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(first_page // n, (last_page + n - 1) // n, step, init)
    o_ref[...] = (acc / jnp.where(total == 0.0, 1.0, total)).astype(o_ref.dtype)


def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    pages_per_step: int  # pages per loop iteration (unrolled): keys per online-softmax update batch
    num_warps: int
    num_stages: int


def blocks_for(*, page_size: int, head_dim: int, rows: int) -> GpuBlocks:
    """The block table: ~64 keys per loop iteration; more warps as the [R, H] tile grows.

    Educated defaults for an H100/H200 class GPU (a [rows, H] x [H, 64] tile per iteration keeps
    register pressure modest at H <= 128); not yet tuned on hardware - this kernel has only run in
    interpret mode - so every field can be overridden per call.
    """
    tile = rows * head_dim
    return GpuBlocks(
        pages_per_step=max(1, 64 // page_size),
        num_warps=4 if tile <= 64 * 128 else 8,
        num_stages=2 if head_dim <= 128 else 1,
    )


@functools.partial(jax.jit, static_argnames=("scale", "window", "soft_cap", "interpret", "blocks"))
def _call(
    q, k_pages, v_pages, page_table, kv_lens, q_lens, k_scales, v_scales, *, scale, window, soft_cap, interpret, blocks
):
    b, t, n, h = q.shape
    nk, num_pages, page_size, _ = k_pages.shape
    g = n // nk
    width = page_table.shape[1]
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, width * page_size)
    q_lens = jnp.clip(q_lens.astype(jnp.int32), 0, jnp.minimum(kv_lens, t))
    rows = t * g
    padded = _pow2_at_least(rows, 16)
    qg = q.reshape(b, t, nk, g, h).transpose(0, 2, 1, 3, 4).reshape(b, nk, rows, h)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        group=g,
        page_size=page_size,
        pages_per_step=blocks.pages_per_step,
        quantized=quantized,
    )
    whole = pl.BlockSpec()  # the whole array: the kernel indexes pages and scalars itself
    scales = (k_scales, v_scales) if quantized else ()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, nk, padded, h), q.dtype),
        grid=(b, nk),
        in_specs=[
            whole,
            whole,
            whole,
            pl.BlockSpec((None, None, padded, h), lambda bi, ki: (bi, ki, 0, 0)),
            whole,
            whole,
            *[whole for _ in scales],
        ],
        out_specs=pl.BlockSpec((None, None, padded, h), lambda bi, ki: (bi, ki, 0, 0)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="jaxinfer_ragged_paged_attention_gpu",
    )(page_table, kv_lens, kv_lens - q_lens, qg, k_pages, v_pages, *scales)
    out = out[:, :, :rows]
    return out.reshape(b, nk, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def ragged_paged_attention_gpu(
    q,
    k_pages,
    v_pages,
    page_table,
    kv_lens,
    q_lens,
    *,
    scale: float,
    window=None,
    soft_cap=None,
    interpret=False,
    k_scales=None,
    v_scales=None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """See `pallas_kernels.ragged_paged_attention.ragged_paged_attention`: same arguments, same result.

    The block sizes default to `blocks_for`'s table; `pages_per_step`, `num_warps` and `num_stages`
    override single entries.
    """
    check_call(q, k_pages, page_table, kv_lens, q_lens, scale, k_scales, v_scales)
    n, nk, h = q.shape[2], k_pages.shape[0], q.shape[3]
    blocks = blocks_for(page_size=k_pages.shape[2], head_dim=h, rows=_pow2_at_least(q.shape[1] * n // nk, 16))
    overrides = dict(pages_per_step=pages_per_step, num_warps=num_warps, num_stages=num_stages)
    for name, value in overrides.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    blocks = dataclasses.replace(blocks, **{k: v for k, v in overrides.items() if v is not None})
    return _call(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        q_lens,
        k_scales,
        v_scales,
        scale=scale,
        window=window,
        soft_cap=soft_cap,
        interpret=interpret,
        blocks=blocks,
    )
