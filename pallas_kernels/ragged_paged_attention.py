"""Ragged paged attention as a Pallas TPU (Mosaic) kernel that also runs in TPU interpret mode.

One kernel serves a batch that mixes decode rows (one query token) and chunked-prefill rows (many
query tokens, causal within the chunk and against their cached prefix): every row b carries
`q_len[b]` new tokens at positions `kv_len[b] - q_len[b] ...  kv_len[b] - 1`, whose K/V are
already in the row's pages.

Grid: (row b, KV head k, page block j). The query heads of one KV head (the GQA group, G of them)
and the row's T query tokens form one [T*G, H] block, so K/V pages are read once per group, not
once per query head. Block j holds `pages_per_block` pages (from a table keyed by page size, see
PAGES_PER_BLOCK), each fetched by its own BlockSpec whose index map reads the page table
(scalar-prefetched into SMEM); a page past the row's last maps to that last page again, and a page
before its sliding window (if any) to the window's first page, which the pipeline recognises and
does not copy again: a windowed row reads only its window. The softmax is online (running max, sum and accumulator in
VMEM scratch), updated page by page and finalised after the last block.

Masking: a key counts if it is inside the row's length, not after the query (causal), and inside
the sliding window when there is one. V is zeroed outside the row's visible range (past its length,
before its first query's window), so stale data - even NaN - left in a recycled page, or in the
scratch page that stands in for pages a windowed sequence gave back, never reaches an output. A row
with no keys (padding) outputs 0.

Off TPU it runs interpreted: `interpret="tpu"` is Pallas' TPU interpret mode (`pltpu.InterpretParams`),
the strict simulation of the TPU (the kernel-vs-reference tests use it); `interpret=True` is the
generic Pallas interpreter, which lowers the same kernel, grid, BlockSpecs and scratch to plain XLA
ops, ~100x faster. The model path on CPU uses the generic one: TPU interpret mode runs Python
callbacks that dispatch JAX ops themselves, and on a 2-core CPU that deadlocked when other JAX work
was dispatched while a kernel ran (seen once in CI; the tests now block on each kernel's output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASKED = -1e30  # finite: exp(_MASKED - m) is 0, never NaN


def _kernel(
    page_table_ref,  # scalar prefetch [B, MP] (SMEM)
    kv_lens_ref,  # [B]
    q_starts_ref,  # [B] position of each row's first query token
    q_ref,  # [1, 1, R, H] with R = T*G, row r is query token r // G, head r % G of this KV head
    *refs,  # n K pages [1, 1, S, H], n V pages, (int8: n K and n V scale tiles [1, 1, 1, S]),
    # then o_ref [1, 1, R, H] and scratch m, l [R, 1], acc [R, H]; n = pages_per_block
    scale: float,
    soft_cap: float | None,
    window: int | None,
    group: int,
    page_size: int,
    pages_per_block: int,
    quantized: bool,
):
    del page_table_ref  # used by the index maps only
    n = pages_per_block
    k_refs, v_refs = refs[:n], refs[n : 2 * n]
    ks_refs, vs_refs = (refs[2 * n : 3 * n], refs[3 * n : 4 * n]) if quantized else ((None,) * n, (None,) * n)
    o_ref, m_ref, l_ref, acc_ref = refs[4 * n :] if quantized else refs[2 * n :]
    b, j = pl.program_id(0), pl.program_id(2)
    kv_len = kv_lens_ref[b]
    q_start = q_starts_ref[b]
    lo = 0 if window is None else q_start - window + 1  # the row's first query sees no key before it

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # The block's pages one after another (unrolled), each one online-softmax update: no
    # concatenation of tiles, which Mosaic restricts for packed (bf16, int8) layouts.
    for i in range(n):
        start = (j * n + i) * page_size

        @pl.when((start < kv_len) & (start + page_size > lo))
        def _page(k_ref=k_refs[i], v_ref=v_refs[i], ks_ref=ks_refs[i], vs_ref=vs_refs[i], start=start):
            q = q_ref[0, 0]
            k = k_ref[0, 0]
            v = v_ref[0, 0]
            rows, width = q.shape[0], k.shape[0]
            # An int8 page goes into the matmuls as q's dtype (exact: |values| <= 127); its per-token
            # scales multiply the logits (K) and the probabilities (V), broadcast along the key axis.
            compute = q.dtype if quantized else v.dtype
            s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * scale
            if quantized:
                s = s * ks_ref[0, 0]  # [1, S]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
            q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0) // group
            mask = (kv_pos < kv_len) & (kv_pos <= q_pos)
            if window is not None:
                mask &= q_pos - kv_pos < window
            s = jnp.where(mask, s, _MASKED)
            m_prev = m_ref[...]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
            # Zero V (or its scales) outside the row's visible range: stale, even NaN, data never counts.
            if quantized:
                v_scale = vs_ref[0, 0]  # [1, S]
                v_pos = start + jax.lax.broadcasted_iota(jnp.int32, v_scale.shape, 1)
                weights = p * jnp.where((v_pos < kv_len) & (v_pos >= lo), v_scale, 0.0)
            else:
                v_pos = start + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where((v_pos < kv_len) & (v_pos >= lo), v, jnp.zeros((), v.dtype))
                weights = p
            pv = jax.lax.dot_general(
                weights.astype(compute), v.astype(compute), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_ref[...] = alpha * acc_ref[...] + pv
            m_ref[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        total = l_ref[...]
        o_ref[0, 0] = (acc_ref[...] / jnp.where(total == 0.0, 1.0, total)).astype(o_ref.dtype)


# Pages fetched per grid step, by page size: enough keys per step (~128) to amortise the fixed
# per-step cost of the pipeline, few enough to keep 2 x (K + V) blocks double-buffered in VMEM at
# any head_dim. Educated defaults from the TPU's (8, 128) tiling and the per-step overhead;
# not yet tuned on hardware (no TPU has run this kernel), so callers may override.
PAGES_PER_BLOCK = {8: 16, 16: 8, 32: 4, 64: 2}


def pages_per_block_for(page_size: int, table_width: int) -> int:
    """The block table's choice for one shape, never more pages than a row's table holds."""
    return max(1, min(PAGES_PER_BLOCK.get(page_size, 1), table_width))


def check_inputs(page_table, kv_lens, q_lens, *, num_pages: int, page_size: int, num_query_tokens: int) -> None:
    """Raises ValueError, naming the field and the limit, for indices that would read out of bounds.

    Works on concrete (host or device) arrays; inside a jit the wrapper clamps instead (see below).
    """
    pt = np.asarray(page_table)
    kl = np.asarray(kv_lens)
    ql = np.asarray(q_lens)
    width = pt.shape[1]
    if pt.size and (pt.min() < 0 or pt.max() >= num_pages):
        bad = np.argwhere((pt < 0) | (pt >= num_pages))[0]
        raise ValueError(f"page_table[{bad[0]}, {bad[1]}] = {pt[tuple(bad)]} is outside [0, {num_pages})")
    if (kl < 0).any() or (kl > width * page_size).any():
        i = int(np.argwhere((kl < 0) | (kl > width * page_size))[0, 0])
        raise ValueError(f"kv_lens[{i}] = {kl[i]} is outside [0, {width * page_size}] (page_table width x page_size)")
    if (ql < 0).any() or (ql > num_query_tokens).any() or (ql > kl).any():
        i = int(np.argwhere((ql < 0) | (ql > num_query_tokens) | (ql > kl))[0, 0])
        raise ValueError(f"q_lens[{i}] = {ql[i]} is outside [0, min(kv_lens[{i}] = {kl[i]}, {num_query_tokens})]")


def check_pools(k_pages, v_pages, k_scales=None, v_scales=None) -> None:
    """A layer's K/V pools as every kernel needs them: [K, P, S, H], V like K (the in-jit clamps
    only know k_pages' page count, so a smaller v pool would be read or written out of bounds),
    float or int8, and int8 pools with their [K, P, S] scales."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [K, P, S, H], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages must match k_pages ({k_pages.dtype} {k_pages.shape}), got {v_pages.dtype} {v_pages.shape}"
        )
    quantized = k_pages.dtype == jnp.int8
    if not quantized and not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"pools must be floating point or int8, got {k_pages.dtype}")
    if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("int8 pools need k_scales and v_scales ([K, P, S] float32); other pools take none")
    if quantized and (k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]):
        raise ValueError(
            f"k_scales/v_scales must have shape {k_pages.shape[:3]} (pool [K, P, S]), got "
            f"{k_scales.shape} and {v_scales.shape}"
        )
    if quantized and not (k_scales.dtype == v_scales.dtype == jnp.float32):  # integer scales gave all zeros
        raise ValueError(f"k_scales/v_scales must be float32, got {k_scales.dtype} and {v_scales.dtype}")


def check_call(
    q, k_pages, v_pages, page_table, kv_lens, q_lens, scale, k_scales=None, v_scales=None, *, window=None, soft_cap=None
) -> None:
    """What every attention kernel wrapper checks before tracing: the pools (`check_pools`), shapes
    and dtypes that agree with q (a length vector or page table of the wrong size would be read out
    of bounds), static scale, window and soft-cap, and (when the arrays are concrete) indices that
    would read out of bounds."""
    check_pools(k_pages, v_pages, k_scales, v_scales)
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens), ("q_lens", q_lens)):
        if not hasattr(x, "shape"):  # a list would fail below on `.ndim`, with an AttributeError
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H], got shape {q.shape}")
    b = q.shape[0]
    if b == 0 or q.shape[1] == 0:
        raise ValueError(f"q must hold at least one row and one token, got shape {q.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] == 0:
        raise ValueError(f"page_table must be [B={b}, pages per row >= 1], got shape {page_table.shape}")
    for name, x in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x.shape != (b,):
            raise ValueError(f"{name} must have shape [B] = ({b},), got {x.shape}")
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens), ("q_lens", q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must hold integers, got {x.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if not isinstance(scale, float):
        raise TypeError(f"scale must be a Python float (it is compiled in), got {type(scale).__name__}")
    if not 0 < scale < float("inf"):  # NaN, inf, 0 or a negative scale: non-finite or meaningless logits
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")

    def positive(x) -> bool:  # a static Python number in (0, inf): it is compiled in, never traced
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")

    if window is not None and not (isinstance(window, int) and positive(window)):
        raise ValueError(f"window must be a positive int (keys closer than it are seen) or None, got {window!r}")
    if soft_cap is not None and not positive(soft_cap):
        raise ValueError(f"soft_cap must be a positive finite Python number or None, got {soft_cap!r}")
    n, nk = q.shape[2], k_pages.shape[0]
    if n % nk:
        raise ValueError(f"query heads ({n}) must be a multiple of KV heads ({nk})")
    if q.shape[3] != k_pages.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[3]}) and of the pages ({k_pages.shape[3]}) differ")
    if not any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lens, q_lens)):
        check_inputs(
            page_table,
            kv_lens,
            q_lens,
            num_pages=k_pages.shape[1],
            page_size=k_pages.shape[2],
            num_query_tokens=q.shape[1],
        )


@functools.partial(jax.jit, static_argnames=("scale", "window", "soft_cap", "interpret", "pages_per_block"))
def _ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    kv_lens,
    q_lens,
    k_scales,
    v_scales,
    *,
    scale,
    window,
    soft_cap,
    interpret,
    pages_per_block,
):
    b, t, n, h = q.shape
    nk, num_pages, page_size, _ = k_pages.shape
    g = n // nk
    width = page_table.shape[1]
    # Safety net inside jit (check_inputs is the error path): indices can never leave the pools.
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, width * page_size)
    q_lens = jnp.clip(q_lens.astype(jnp.int32), 0, jnp.minimum(kv_lens, t))
    q_starts = kv_lens - q_lens
    rows = t * g
    qg = q.reshape(b, t, nk, g, h).transpose(0, 2, 1, 3, 4).reshape(b, nk, rows, h)

    ppb = pages_per_block or pages_per_block_for(page_size, width)

    def kv_index(i):  # the index map of the block's i-th page
        def index(bi, ki, j, pt, lens, starts):
            last = jnp.maximum((lens[bi] + page_size - 1) // page_size - 1, 0)
            first = 0 if window is None else jnp.maximum(starts[bi] - window + 1, 0) // page_size
            return ki, pt[bi, jnp.clip(j * ppb + i, jnp.minimum(first, last), last)], 0, 0

        return index

    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        group=g,
        page_size=page_size,
        pages_per_block=ppb,
        quantized=quantized,
    )
    pages = [pl.BlockSpec((1, 1, page_size, h), kv_index(i)) for i in range(ppb)]
    in_specs = [pl.BlockSpec((1, 1, rows, h), lambda bi, ki, j, *_: (bi, ki, 0, 0)), *pages, *pages]
    operands = [qg, *[k_pages] * ppb, *[v_pages] * ppb]
    if quantized:
        # Scales as [K, P, 1, S]: a page's scales are one lane-dense (1, S) tile that broadcasts
        # along the key axis of the logits, with no transpose in the kernel.
        tiles = [pl.BlockSpec((1, 1, 1, page_size), kv_index(i)) for i in range(ppb)]
        in_specs += [*tiles, *tiles]
        k_tiles, v_tiles = (x.reshape(nk, num_pages, 1, page_size) for x in (k_scales, v_scales))
        operands += [*[k_tiles] * ppb, *[v_tiles] * ppb]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, nk, rows, h), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, nk, pl.cdiv(width, ppb)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((1, 1, rows, h), lambda bi, ki, j, *_: (bi, ki, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, h), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=(pltpu.InterpretParams() if interpret == "tpu" else True) if interpret else False,
        name="jaxinfer_ragged_paged_attention",
    )(page_table, kv_lens, q_starts, *operands)
    return out.reshape(b, nk, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def ragged_paged_attention(
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
    interpret: bool | str = False,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:
    """Attention of each row's new queries over its cached pages (their own K/V already written).

    Args:
        q: [B, T, N, H] queries (RoPE applied); row b's first q_lens[b] tokens are real.
        k_pages, v_pages: [K, P, S, H] one layer's head-major page pools (float32, bfloat16, or int8
            with k_scales/v_scales).
        page_table: [B, MP] pages of each row, in order (entries past the row's length are ignored).
        kv_lens: [B] tokens in each row's context, new ones included (0: a padding row).
        q_lens: [B] new tokens per row, at positions kv_lens - q_lens ... kv_lens - 1.
        scale: softmax scale, a Python float (static; never traced).
        window: sliding-window size (a key at distance >= window is masked); None for global.
        soft_cap: logits become soft_cap * tanh(logits / soft_cap) before masking; None for none.
        interpret: False (compile for TPU), True (generic Pallas interpreter, any backend) or "tpu"
            (Pallas' TPU interpret mode; block on the result before dispatching other JAX work).
        k_scales, v_scales: [K, P, S] float32 per-token-per-head scales of int8 pools (a slot holds
            values * scale); None for float pools.
        pages_per_block: pages fetched per grid step; None takes the block table's choice
            (`pages_per_block_for`).

    Returns:
        [B, T, N, H] in q's dtype; rows past q_lens, and padding rows, are zeros or don't-care.
    """
    check_call(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, scale, k_scales, v_scales, window=window, soft_cap=soft_cap
    )
    if pages_per_block is not None and (
        not isinstance(pages_per_block, int) or isinstance(pages_per_block, bool) or pages_per_block < 1
    ):
        raise ValueError(f"pages_per_block must be a positive int or None, got {pages_per_block!r}")
    return _ragged_paged_attention(
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
        pages_per_block=pages_per_block,
    )
