"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), testable in interpret mode.

Same contract as the TPU kernel (`ragged_paged_attention`): rows mixing decode and chunked prefill,
GQA, sliding window, soft cap, static scale, int8 pools with per-token-per-head scales. The
structure is the GPU's own:

- Grid (row b, KV head k, row block x KV split). A row's query block is its T tokens x G query
  heads ([R, H], R padded to a power of two >= 16 for the tensor cores), cut into `rows_per_block`
  blocks so a prefill chunk never needs a [T*G, H] accumulator in registers; row blocks past the
  row's real query tokens do nothing.
- Each program walks its share of the row's visible pages `pages_per_step` at a time: one vector
  load of that many page indices, one gathered [n, S, H] load of K (and V) straight from the pools
  (the context is never copied into a contiguous buffer), one [R, H] x [H, n*S] dot. The visible
  pages are the causal and sliding-window range of the row block, so prefill skips what its
  tokens cannot see.
- Decode has one short row block per (row, KV head): too few programs to fill a GPU's
  multiprocessors at small batch, so the visible pages are split `kv_splits` ways (flash-decoding):
  each split writes its unnormalised accumulator, running max and sum, and a small pure-JAX step
  merges them. With one split the kernel normalises and writes the output itself.

Block sizes come from the table in `blocks_for` (per page size, head dim, rows and programs) and
every entry can be overridden per call. The loop body is the part the Mosaic GPU (Hopper) variant,
`ragged_paged_attention_mgpu`, replaces with TMA copies into shared memory and wgmma; the grid, the
visible-range arithmetic, the masking and the split merge are the same.

Run compiled on an H100 (2026-11-23, jax 0.11.2): the tests in tests/test_pallas_kernels.py that
need a GPU pass, and decode reaches 87-90% of copy bandwidth at 16k x 8 and 4k x 32 there; on an
H200 64-77% at 4k-16k tokens (2026-11-30), where Hopper runs the Mosaic GPU variant instead for the
shapes it was timed faster on (jaxinfer.attention._gpu_kernel; WORKSPACE.md).
JAX 0.11 marks the Triton backend of Pallas deprecated (a DeprecationWarning at each compile); the
kernel runs unchanged until it is removed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention import _MASKED, check_call

# Programs worth launching at once: ~4 per multiprocessor of an H100/H200 (132 SMs), so the KV
# splits of a small decode batch still keep every multiprocessor streaming. Measured on an H100
# (WORKSPACE.md, 2026-11-23): batch 32 x 8 KV heads at 4k context ran at 79% MBU with 256 programs
# (no split) and 92% with 2 splits; batch 8 at 16k, 82% with 4 splits and 87% with 16.
TARGET_PROGRAMS = 512


def _visible_steps(
    kv_len, q_len, *, row_block, split, rows, group, width, page_size, pages_per_step, splits, q_tokens, window
):
    """Inside a kernel: which pages one program (row block x KV split) of a row reads.

    Returns (kv_len, q_start, lo, steps, lo_pos): the row's length and first query position, clamped
    here, not in XLA before the call (a launch each), so that whatever the inputs no read leaves the
    table or the pool (the wrappers refuse out-of-range values when they can see them); the program's
    first page-table slot and its number of steps of `pages_per_step` pages; and the first key any
    query of the block sees. The visible keys are causal up to the block's last real token and
    windowed from its first; a split gets whole steps, and splits past the row's pages get none. The
    first page read may start before `lo_pos` (a window's start inside a page): values there, like
    those past `kv_len`, are zeroed before they meet the weights. Shared by the Triton and Mosaic GPU
    kernels.
    """
    s_, n = page_size, pages_per_step
    kv_len = jnp.clip(kv_len, 0, width * s_)
    q_start = kv_len - jnp.clip(q_len, 0, jnp.minimum(kv_len, q_tokens))
    first_tok = row_block * rows // group
    last_tok = jnp.minimum(((row_block + 1) * rows - 1) // group, kv_len - q_start - 1)
    hi_pos = jnp.minimum(kv_len, q_start + last_tok + 1)
    lo_pos = 0 if window is None else jnp.maximum(q_start + first_tok - window + 1, 0)
    first = lo_pos // s_
    last = jnp.where(first_tok <= last_tok, (hi_pos + s_ - 1) // s_, first)
    per_split = ((last - first + splits - 1) // splits + n - 1) // n * n
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, last)
    return kv_len, q_start, lo, jnp.maximum((hi - lo + n - 1) // n, 0), lo_pos


def _kernel(
    page_table_ref,  # [W] int32 (this row)
    kv_lens_ref,  # [B]
    q_lens_ref,  # [B]
    q_ref,  # [R, H] (this row, this KV head, this row block)
    k_ref,  # [P, S, H] (this KV head's pool)
    v_ref,
    *refs,  # int8 pools: k/v scales [P, S]; then o_ref [R, H], and m_ref, l_ref [R] when split
    scale: float,
    soft_cap: float | None,
    window: int | None,
    group: int,
    page_size: int,
    pages_per_step: int,
    splits: int,
    q_tokens: int,
    quantized: bool,
):
    if quantized:
        k_scale_ref, v_scale_ref, *refs = refs
    o_ref, *stats = refs
    b, j = pl.program_id(0), pl.program_id(2)
    row_block, split = j // splits, j % splits
    q = q_ref[...]
    rows, h = q.shape
    n, s_ = pages_per_step, page_size
    keys = n * s_
    width, num_pages = page_table_ref.shape[0], k_ref.shape[0]
    kv_len, q_start, lo, steps, lo_pos = _visible_steps(
        kv_lens_ref[b], q_lens_ref[b], row_block=row_block, split=split, rows=rows, group=group, width=width,
        page_size=s_, pages_per_step=n, splits=splits, q_tokens=q_tokens, window=window,
    )  # fmt: skip

    q_pos = q_start + (row_block * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 0)) // group
    offsets = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
    v_offsets = jax.lax.broadcasted_iota(jnp.int32, (keys, h), 0)
    # float32 caches are the checking path: exact products, not the tensor cores' tf32.
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    pages = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    key_offsets = jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)

    def step(i, carry):
        m, total, acc = carry
        page0 = lo + i * n
        # [n] page indices; a last step running past the table repeats its last entry (masked below).
        idx = jnp.clip(page_table_ref[jnp.minimum(page0 + pages, width - 1)], 0, num_pages - 1)
        k = k_ref[idx].reshape(keys, h)
        v = v_ref[idx].reshape(keys, h)
        start = page0 * s_
        # int8 pages enter the matmuls in q's dtype (exact); their scales multiply logits and weights.
        compute = q.dtype if quantized else v.dtype
        s = jax.lax.dot_general(
            q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * scale
        if quantized:
            s = s * k_scale_ref[idx].reshape(1, keys)
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
        # Zero what no query sees: past the row's length (stale slots may hold anything, NaN included,
        # and 0 * NaN is NaN) and before the window of the block's first query (on the first page).
        if quantized:  # the scales, then: int8 values are finite
            v_scale = v_scale_ref[idx].reshape(1, keys)
            seen = (start + key_offsets < kv_len) & (start + key_offsets >= lo_pos)
            weights = p * jnp.where(seen, v_scale, 0.0)
        else:
            v = jnp.where((start + v_offsets < kv_len) & (start + v_offsets >= lo_pos), v, jnp.zeros((), v.dtype))
            weights = p
        pv = jax.lax.dot_general(
            weights.astype(compute),
            v.astype(compute),
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return m_new, alpha * total + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

    init = (
        jnp.full((rows, 1), _MASKED, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, h), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(0, steps, step, init)
    if stats:  # one of several splits: the merge normalises
        m_ref, l_ref = stats
        o_ref[...] = acc
        m_ref[...] = m.reshape(rows)
        l_ref[...] = total.reshape(rows)
    else:
        o_ref[...] = (acc / jnp.where(total == 0.0, 1.0, total)).astype(o_ref.dtype)


def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    pages_per_step: int  # pages per loop step (a power of two): n * page_size keys per dot
    rows_per_block: int  # query rows (tokens x heads of a group) per program, a power of two >= 16
    kv_splits: int  # programs sharing one row block's pages (flash-decoding); 1 = no merge step
    num_warps: int
    num_stages: int


def supports(*, page_size: int, head_dim: int) -> bool:
    """Whether the compiled kernel can tile these pools: Triton tiles are powers of two, and a dot
    needs at least 16 keys per step (the table takes enough pages per step for that)."""
    pow2 = lambda x: x > 0 and not x & (x - 1)  # noqa: E731
    return pow2(page_size) and pow2(head_dim) and head_dim >= 16


def blocks_for(
    *, page_size: int, head_dim: int, rows: int, programs: int = 1, table_pages: int = 1, int8: bool = False
) -> GpuBlocks:
    """The block table, per shape.

    - ~64 keys per step (fewer pages per step as pages grow; at least 16 keys for the dot); 128 for
      int8 pools, whose steps carry half the bytes (on an H100, 64 -> 128 keys took an int8 batch
      of 8 at 16k tokens from 926 to 1315 GB/s; 256 keys fell back to 949);
    - row blocks of up to 64 rows ([64, H] float32 accumulator + [64, 64] logits in registers);
    - KV splits until ~TARGET_PROGRAMS programs run, never more splits than the table has steps;
    - 4 warps for a [16, H] decode block, 8 for larger tiles; 2 pipeline stages (1 at H = 256).

    `rows` is the padded query rows of one (row, KV head); `programs` the (row, KV head, row block)
    count before splitting; `table_pages` the page table's width. Splits and pages per step were
    searched on an H100 (`python -m pallas_kernels.tune_gpu`, WORKSPACE.md); warps and stages
    moved times by less than the run-to-run spread there. Every field can be overridden per call.
    """
    pages_per_step = _pow2_at_least(max(1, (128 if int8 else 64) // page_size), 1)
    rows_per_block = min(rows, 64)
    programs *= rows // rows_per_block
    steps = -(-table_pages // pages_per_step)
    kv_splits = max(1, min(-(-TARGET_PROGRAMS // programs), steps))
    return GpuBlocks(
        pages_per_step=pages_per_step,
        rows_per_block=rows_per_block,
        kv_splits=kv_splits,
        num_warps=4 if rows_per_block * head_dim <= 16 * 128 else 8,
        num_stages=2 if head_dim <= 128 else 1,
    )


def _merge(acc, m, sums, dtype):
    """Combine split partials: acc [..., S, R, H], m and sums [..., S, R] -> normalised [..., R, H]."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - top)  # splits that saw no key: m = _MASKED, weight 0 (unless none saw any)
    total = jnp.sum(sums * w, axis=-2)
    out = jnp.sum(acc * w[..., None], axis=-3)
    return (out / jnp.where(total == 0.0, 1.0, total)[..., None]).astype(dtype)


def _partials(qg, page_table, kv_lens, q_lens, k_pages, v_pages, *scales, q_tokens, blocks, interpret, **static):
    """The kernel alone: qg [B, K, row blocks, R, H] -> per split partials (or, with one split, the
    normalised output) [B, K, row blocks, splits, R(, H)]."""
    b, nk, rb, r, h = qg.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    splits = blocks.kv_splits
    kernel = functools.partial(
        _kernel,
        page_size=page_size,
        pages_per_step=blocks.pages_per_step,
        splits=splits,
        q_tokens=q_tokens,
        quantized=bool(scales),
        **static,
    )
    whole = pl.BlockSpec()  # the whole array: the kernel indexes scalars itself
    pool = pl.BlockSpec((None, num_pages, page_size, h), lambda bi, ki, j: (ki, 0, 0, 0))
    scale_pool = pl.BlockSpec((None, num_pages, page_size), lambda bi, ki, j: (ki, 0, 0))
    part = lambda bi, ki, j: (bi, ki, j // splits, j % splits, 0)  # noqa: E731
    out_block = pl.BlockSpec((None, None, None, None, r, h), lambda bi, ki, j: (*part(bi, ki, j), 0))
    if splits == 1:
        out_shape, out_specs = jax.ShapeDtypeStruct((b, nk, rb, 1, r, h), qg.dtype), out_block
    else:
        out_shape = [
            jax.ShapeDtypeStruct((b, nk, rb, splits, r, h), jnp.float32),
            jax.ShapeDtypeStruct((b, nk, rb, splits, r), jnp.float32),
            jax.ShapeDtypeStruct((b, nk, rb, splits, r), jnp.float32),
        ]
        stat_block = pl.BlockSpec((None, None, None, None, r), part)
        out_specs = [out_block, stat_block, stat_block]
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, nk, rb * splits),
        in_specs=[
            pl.BlockSpec((None, page_table.shape[1]), lambda bi, ki, j: (bi, 0)),
            whole,
            whole,
            pl.BlockSpec((None, None, None, r, h), lambda bi, ki, j: (bi, ki, j // splits, 0, 0)),
            pool,
            pool,
            *[scale_pool for _ in scales],
        ],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="jaxinfer_ragged_paged_attention_gpu",
    )(page_table, kv_lens, q_lens, qg, k_pages, v_pages, *scales)


def _query_blocks(q, num_kv_heads: int, rows_per_block: int):
    """q [B, T, N, H] -> [B, K, row blocks, R, H]: each KV head's T x G query rows, zero-padded to
    whole blocks of R = rows_per_block."""
    b, t, n, h = q.shape
    g = n // num_kv_heads
    padded = -(-t * g // rows_per_block) * rows_per_block
    qg = q.reshape(b, t, num_kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, h)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - t * g), (0, 0)))
    return qg.reshape(b, num_kv_heads, padded // rows_per_block, rows_per_block, h)


def _query_rows(out, t: int, n: int):
    """[B, K, row blocks, R, H] -> [B, T, N, H]: `_query_blocks` undone, padding dropped."""
    b, nk, _, _, h = out.shape
    g = n // nk
    out = out.reshape(b, nk, -1, h)[:, :, : t * g]
    return out.reshape(b, nk, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


@functools.partial(jax.jit, static_argnames=("scale", "window", "soft_cap", "interpret", "blocks"))
def _call(
    q, k_pages, v_pages, page_table, kv_lens, q_lens, k_scales, v_scales, *, scale, window, soft_cap, interpret, blocks
):
    b, t, n, h = q.shape
    nk = k_pages.shape[0]
    g = n // nk
    qg = _query_blocks(q, nk, blocks.rows_per_block)
    scales = (k_scales, v_scales) if k_scales is not None else ()
    int32 = lambda x: x if x.dtype == jnp.int32 else x.astype(jnp.int32)  # noqa: E731
    out = _partials(
        qg, int32(page_table), int32(kv_lens), int32(q_lens), k_pages, v_pages, *scales,
        q_tokens=t, blocks=blocks, interpret=interpret, scale=scale, soft_cap=soft_cap, window=window, group=g,
    )  # fmt: skip
    out = out[:, :, :, 0] if blocks.kv_splits == 1 else _merge(*out, q.dtype)  # [b, nk, rb, r, h]
    return _query_rows(out, t, n)


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
    rows_per_block: int | None = None,
    kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """See `pallas_kernels.ragged_paged_attention.ragged_paged_attention`: same arguments, same result.

    The block sizes default to `blocks_for`'s table; `pages_per_step`, `rows_per_block`,
    `kv_splits`, `num_warps` and `num_stages` override single entries.
    """
    check_call(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, scale, k_scales, v_scales, window=window, soft_cap=soft_cap
    )
    b, t, n, h = q.shape
    nk, page_size = k_pages.shape[0], k_pages.shape[2]
    rows = _pow2_at_least(t * n // nk, 16)
    overrides = dict(
        pages_per_step=pages_per_step,
        rows_per_block=rows_per_block,
        kv_splits=kv_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    for name, value in overrides.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    for name in ("pages_per_step", "rows_per_block"):
        value = overrides[name]
        if value is not None and value & (value - 1):
            raise ValueError(f"{name} must be a power of two (a GPU tile dimension), got {value}")
    if rows_per_block is not None and rows_per_block < 16:
        raise ValueError(f"rows_per_block must be at least 16 (the tensor cores' tile), got {rows_per_block}")
    blocks = blocks_for(
        page_size=page_size,
        head_dim=h,
        rows=rows if rows_per_block is None else max(rows, rows_per_block),
        programs=b * nk,
        table_pages=page_table.shape[1],
        int8=k_scales is not None,
    )
    blocks = dataclasses.replace(blocks, **{k: v for k, v in overrides.items() if v is not None})
    if not interpret and (blocks.pages_per_step * page_size < 16 or not supports(page_size=page_size, head_dim=h)):
        raise ValueError(
            f"the GPU kernel needs power-of-two page_size and head_dim (>= 16) and at least 16 keys per step; "
            f"got page_size {page_size}, head_dim {h}, pages_per_step {blocks.pages_per_step}"
        )
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
