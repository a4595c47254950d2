"""Ragged paged attention for Hopper GPUs on Pallas' Mosaic GPU backend (TMA + wgmma).

The Triton-lowered kernel (`ragged_paged_attention_gpu`) is the one the model runs on GPUs other
than Hopper, and on Hopper where this one is not faster (see "Status" below); this is its Mosaic GPU
variant, written because Pallas' Triton lowering is deprecated upstream. It keeps
that kernel's contract, wrapper, grid and masking, and swaps the loop body:

- Grid (row b, KV head k, row block x KV split), one warpgroup per program. A row block is 64
  query rows (T tokens x G heads of one KV head, zero-padded): wgmma's M is 64, so a decode row's
  G <= 8 heads use 1/8 or more of the tensor cores' work, which is free - decode is bound by the
  bytes of K and V, not by the multiplies.
- Each loop step covers `keys_per_step` keys (64 or 128): one TMA copy per page of K and of V,
  straight from the pools into a shared-memory tile, so the context is never gathered in global
  memory. Two tiles alternate: the copies for step i + 1 are in flight while step i multiplies.
- Logits come from one wgmma ([64, H] x [H, keys]), the online softmax runs in registers, and the
  probabilities, stored in the cache dtype to a shared-memory tile, are the second wgmma's A operand
  against the V tile. (Pallas' GPU interpreter reads wgmma operands only from shared memory and
  without transposed views, so in interpret mode K^T is written out to a scratch tile first; and it
  has no rule for register-layout casts, which change no value, so it skips them. Those two are the
  only differences between what the interpreter runs and what the GPU would.)
- V rows past the row's length are zeroed in the tile before they meet the probabilities: a
  recycled page may hold anything, NaN included, and 0 x NaN is NaN inside a matmul too.
- Every program writes float32 partials (accumulator, running max, running sum) for its 64 rows, or
  with `trim_partials` only for those that hold queries (`_out_rows`: 8 in decode); the KV splits
  (flash-decoding, as in the Triton kernel) and the normalisation are merged by `_merge`.

Scope: bfloat16 / float16 caches (wgmma's operand types; float32 caches, the checking path, and int8
pools stay on the Triton kernel), head_dim a multiple of 64, page_size a multiple of 8 dividing
`keys_per_step`.

Status: tested in Pallas' GPU interpret mode on CPU (tests/test_pallas_kernels_gpu.py), which runs
the kernel's TMA copies, barriers and wgmmas against simulated shared memory but checks neither the
hardware's layout rules nor its timing (it completes each copy at once, so a missing barrier wait
would pass there too); lowered for CUDA on CPU, which checks those rules as far as Pallas' Mosaic GPU
lowering does; and compiled and run on an H200 (2026-11-29, jax 0.11.2): the same random ragged
batches as the interpreter's, NaN in stale pages, against the reference. There, in decode, it moved
2.5-3.1 TB/s at head_dim 128 (16k tokens x 8 rows, 4k x 32, 4k x 8), level with the Triton kernel at
8 rows and 11% ahead at 32, and behind it at head_dims 64 and 256; in chunks of prefill it was 2.7x
faster at head_dim 128 and 1.7x at 256 (2026-11-30, WORKSPACE.md). So the "pallas" backend runs
Hopper steps with prefill chunks at head_dim 128 or 256, and decode steps at 128, through it
(jaxinfer.attention._gpu_kernel); a bfloat16 model run through it there agrees with the reference
as closely as the Triton kernel does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import _MASKED, check_call
from pallas_kernels.ragged_paged_attention_gpu import (
    _merge,
    _query_blocks,
    _query_rows,
    _visible_steps,
)

ROWS = 64  # wgmma's M: query rows per program
SMEM_BYTES = 227 * 1024  # shared memory one block may use on an H100 / H200
_SWIZZLE = 128  # bytes: the widest shared-memory swizzle, a row of 64 16-bit elements per tile
_LOG2E = math.log2(math.e)
_MMA = plgpu.Layout.WGMMA


def supports(*, dtype, page_size: int, head_dim: int, int8: bool = False) -> bool:
    """Whether this variant can run these pools (see the module docstring's scope)."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and not int8
        and head_dim % 64 == 0
        and head_dim <= 256
        and page_size in (8, 16, 32, 64, 128)
    )


def smem_bytes(*, keys: int, head_dim: int, itemsize: int) -> int:
    """Shared memory of the loop: the query tile, two K and two V tiles, the probabilities' tile."""
    return (ROWS * head_dim + 4 * keys * head_dim + ROWS * keys) * itemsize


def kv_splits_for(*, programs: int, steps: int, keys: int, head_dim: int, itemsize: int, sm_count: int) -> int:
    """KV splits so that the grid fills the GPU in one wave: as many programs as its multiprocessors
    hold at once (shared memory bounds that to 1-4 per multiprocessor), never more splits than a row
    has steps. A second, partial wave leaves most multiprocessors idle while its programs run: on an
    H200 (132 multiprocessors, two 88 KiB programs each), 4k tokens x 8 rows x 8 KV heads took 51 us
    per layer at 4 splits (256 programs) and 58-78 us at 8-16 (2026-11-29, WORKSPACE.md)."""
    per_sm = max(1, SMEM_BYTES // smem_bytes(keys=keys, head_dim=head_dim, itemsize=itemsize))
    return max(1, min(sm_count * per_sm // programs, steps))


def _sm_count() -> int:
    """Multiprocessors of the first device (132 on an H100 or H200 SXM, also the answer off a GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def _interpret_params():
    """Pallas' GPU interpret mode (simulated shared memory, barriers and TMA on the CPU). Private in
    jax 0.10: the class lives under jax._src, so its absence is a clear error, not an AttributeError."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the installed jax
        raise RuntimeError(f"this jax ({jax.__version__}) has no Pallas GPU interpret mode: {e}") from e
    return InterpretGPUParams()


def _kernel(
    table_ref,  # [B, W] int32 (GMEM)
    kv_lens_ref,  # [B]
    q_lens_ref,  # [B]
    q_ref,  # [B, K, row blocks, 64, H]
    k_ref,  # [K, P, S, H]
    v_ref,
    o_ref,  # [B, K, row blocks, splits, R, H] float32: R = `_out_rows`, the rows that hold queries
    m_ref,  # [B, K, row blocks, splits, R] float32
    l_ref,
    *,
    scale: float,
    soft_cap: float | None,
    window: int | None,
    group: int,
    splits: int,
    q_tokens: int,
    keys: int,
    interpret: bool,
):
    b, kh, j = jax.lax.axis_index("b"), jax.lax.axis_index("k"), jax.lax.axis_index("j")
    row_block, split = j // splits, j % splits
    width, num_pages, s_, h = table_ref.shape[1], k_ref.shape[1], k_ref.shape[2], k_ref.shape[3]
    n = keys // s_  # pages per step
    dtype = q_ref.dtype

    kv_len, q_start, lo, steps, lo_pos = _visible_steps(
        kv_lens_ref[b], q_lens_ref[b], row_block=row_block, split=split, rows=ROWS, group=group, width=width,
        page_size=s_, pages_per_step=n, splits=splits, q_tokens=q_tokens, window=window,
    )  # fmt: skip

    tile = plgpu.TilingTransform((8, _SWIZZLE // jnp.dtype(dtype).itemsize))
    swizzle = plgpu.SwizzleTransform(_SWIZZLE)

    def attend(q_smem, k_smem, v_smem, p_smem, kt_smem, q_bar, k_bars, v_bars):
        plgpu.copy_gmem_to_smem(q_ref.at[b, kh, row_block], q_smem, q_bar)

        def fetch(i, slot):
            page0 = lo + i * n
            for p in range(n):  # one TMA copy per page; the barrier expects n arrivals
                page = jnp.clip(table_ref[b, jnp.minimum(page0 + p, width - 1)], 0, num_pages - 1)
                rows = pl.ds(p * s_, s_)
                plgpu.copy_gmem_to_smem(k_ref.at[kh, page], k_smem.at[slot, rows], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[kh, page], v_smem.at[slot, rows], v_bars.at[slot])

        @pl.when(steps > 0)
        def _():
            fetch(0, 0)

        plgpu.barrier_wait(q_bar)
        # Register layouts as the wgmma results have them: the hardware's rule. The interpreter has no
        # rule for layout casts (they change no value), so it skips them.
        layout = (lambda x, _: x) if interpret else plgpu.layout_cast  # noqa: E731
        mma = None if interpret else _MMA
        q_pos = q_start + (row_block * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 0, layout=mma)) // group
        key_offsets = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 1, layout=mma)
        v_offsets = plgpu.broadcasted_iota(jnp.int32, (keys, h), 0, layout=mma)

        def step(i, carry):
            acc, m, total = carry
            slot = i % 2

            @pl.when(i + 1 < steps)  # the other tile was last read by step i - 1's wgmma, which has ended
            def _():
                fetch(i + 1, 1 - slot)

            start = (lo + i * n) * s_
            plgpu.barrier_wait(k_bars.at[slot])

            if interpret:  # the interpreter's wgmma reads no transposed view: it gets K^T written out
                kt_smem[...] = k_smem[slot].T
                k_t = kt_smem
            else:
                k_t = plgpu.transpose_ref(k_smem.at[slot], (1, 0))

            def logits(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_t)
                return acc_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((ROWS, keys), jnp.float32)) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = start + key_offsets
            mask = (kv_pos < kv_len) & (kv_pos <= q_pos)
            if window is not None:
                mask &= q_pos - kv_pos < window
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(mask, jnp.exp2((s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])) * _LOG2E), 0.0)
            alpha = jnp.exp2((m - m_new) * _LOG2E)
            total = alpha * total + jnp.sum(p, axis=1)

            plgpu.barrier_wait(v_bars.at[slot])

            # The steps that hold the row's end or its window's start: zero what no query sees (stale
            # slots, or the sequence's own keys before the window, may hold NaN, and 0 * NaN is NaN).
            @pl.when((start + keys > kv_len) | (start < lo_pos))
            def _():
                v = v_smem[slot]
                seen = (start + v_offsets < kv_len) & (start + v_offsets >= lo_pos)
                v_smem[slot] = jnp.where(seen, v, jnp.zeros((), dtype))
                plgpu.commit_smem()

            p_smem[...] = p.astype(dtype)  # wgmma's A operand from shared memory
            plgpu.commit_smem()

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            pv = pl.run_scoped(values, plgpu.ACC((ROWS, h), jnp.float32))
            return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, total

        init = (
            layout(jnp.zeros((ROWS, h), jnp.float32), _MMA),
            layout(jnp.full((ROWS,), _MASKED, jnp.float32), _MMA.reduce(1)),
            layout(jnp.zeros((ROWS,), jnp.float32), _MMA.reduce(1)),
        )
        return jax.lax.fori_loop(0, steps, step, init)

    acc, m, total = pl.run_scoped(
        attend,
        plgpu.SMEM((ROWS, h), dtype, transforms=(tile, swizzle)),
        plgpu.SMEM((2, keys, h), dtype, transforms=(tile, swizzle)),
        plgpu.SMEM((2, keys, h), dtype, transforms=(tile, swizzle)),
        plgpu.SMEM((ROWS, keys), dtype, transforms=(tile, swizzle)),
        plgpu.SMEM((h, keys) if interpret else (8, 64), dtype),  # K^T, for the interpreter only
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=n, num_barriers=2),
        plgpu.Barrier(num_arrivals=n, num_barriers=2),
    )

    def store(o_smem, m_smem, l_smem):  # after the loop's tiles are freed: their shared memory is reused
        o_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = total
        plgpu.commit_smem()
        r = o_ref.shape[-2]  # `trim_partials`: the rows that hold queries (a decode row's G heads: 8)
        rows = (lambda ref: ref) if r == ROWS else (lambda ref: ref.at[pl.ds(0, r)])  # all 64: as compiled
        plgpu.copy_smem_to_gmem(rows(o_smem), o_ref.at[b, kh, row_block, split])
        plgpu.copy_smem_to_gmem(rows(m_smem), m_ref.at[b, kh, row_block, split])
        plgpu.copy_smem_to_gmem(rows(l_smem), l_ref.at[b, kh, row_block, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        store,
        plgpu.SMEM((ROWS, h), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
    )


def _out_rows(query_rows: int) -> int:
    """Partial rows each program writes with `trim_partials`: all 64 of its row block when a row's
    T x G query rows span several blocks, else those rows, rounded up to 8 (32 bytes of float32 per
    row of m and l, twice TMA's 16-byte minimum). A decode step's G <= 8 heads write 8 rows, not 64:
    at 4 KV splits of 8 rows x 8 KV heads that is 1 MB of float32 partials, written and read back by
    the merge, where 64 rows were 8.4 MB, whose round trip added 13% to the 134 MB of K/V a 4k-token
    step reads. So the prediction is up to ~10% off decode's time at 4k x 8 (60 us, 64% MBU on an
    H200), ~3% at 16k."""
    return ROWS if query_rows > ROWS else -(-query_rows // 8) * 8


@functools.partial(jax.jit, static_argnames=("scale", "window", "soft_cap", "interpret", "keys", "splits", "trim"))
def _call(
    q, k_pages, v_pages, page_table, kv_lens, q_lens, *, scale, window, soft_cap, interpret, keys, splits, trim=False
):
    b, t, n, h = q.shape
    nk = k_pages.shape[0]
    qg = _query_blocks(q, nk, ROWS)
    rb = qg.shape[2]
    r = _out_rows(t * (n // nk)) if trim else ROWS
    int32 = lambda x: x if x.dtype == jnp.int32 else x.astype(jnp.int32)  # noqa: E731
    kernel = functools.partial(
        _kernel,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        group=n // nk,
        splits=splits,
        q_tokens=t,
        keys=keys,
        interpret=interpret,
    )
    acc, m, total = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((b, nk, rb, splits, r, h), jnp.float32),
            jax.ShapeDtypeStruct((b, nk, rb, splits, r), jnp.float32),
            jax.ShapeDtypeStruct((b, nk, rb, splits, r), jnp.float32),
        ],
        grid=(b, nk, rb * splits),
        grid_names=("b", "k", "j"),
        # Lane semantics (explicit layouts, as written here): jax 0.10's default, no longer 0.11's.
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params() if interpret else None,
    )(int32(page_table), int32(kv_lens), int32(q_lens), qg, k_pages, v_pages)
    return _query_rows(_merge(acc, m, total, q.dtype), t, n)  # merged: [b, nk, rb, r, h]


def ragged_paged_attention_mgpu(
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
    keys_per_step: int | None = None,
    kv_splits: int | None = None,
    trim_partials: bool = False,
):
    """See `pallas_kernels.ragged_paged_attention.ragged_paged_attention`: same arguments, same result,
    for the pools `supports` accepts. `interpret=True` runs Pallas' GPU interpret mode on the CPU.

    `keys_per_step` (64 or 128, a multiple of the page size; default 64) and `kv_splits` (default:
    `kv_splits_for`, one wave of programs) override the defaults. `trim_partials=True` writes only the
    partial rows that hold queries (`_out_rows`); it is off until a GPU has compiled and timed it:
    tested in interpret mode and lowered for CUDA on CPU (2026-11-30), when no H200 was left to run it.
    """
    check_call(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, scale, k_scales, v_scales, window=window, soft_cap=soft_cap
    )
    b, t, n, h = q.shape
    nk, page_size = k_pages.shape[0], k_pages.shape[2]
    if not supports(dtype=k_pages.dtype, page_size=page_size, head_dim=h, int8=k_scales is not None):
        raise ValueError(
            "the Mosaic GPU kernel needs bfloat16 or float16 pools (not int8), head_dim a multiple of 64 "
            f"up to 256, and page_size a multiple of 8 dividing 128; got {k_pages.dtype} pools"
            f"{' (int8)' if k_scales is not None else ''}, head_dim {h}, page_size {page_size}"
        )
    if q.dtype != k_pages.dtype:
        raise ValueError(f"the Mosaic GPU kernel needs q in the pools' dtype ({k_pages.dtype}), got {q.dtype}")
    keys = keys_per_step if keys_per_step is not None else max(64, page_size)
    if keys not in (64, 128) or keys % page_size:
        raise ValueError(f"keys_per_step must be 64 or 128 and a multiple of page_size {page_size}, got {keys}")
    need = smem_bytes(keys=keys, head_dim=h, itemsize=k_pages.dtype.itemsize)
    if need > SMEM_BYTES:
        raise ValueError(
            f"keys_per_step {keys} at head_dim {h} needs {need // 1024} KiB of shared memory per block, "
            f"more than the {SMEM_BYTES // 1024} KiB a Hopper GPU has; use 64"
        )
    for name, value in (("kv_splits", kv_splits),):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if kv_splits is None:
        kv_splits = kv_splits_for(
            programs=b * nk * -(-t * (n // nk) // ROWS),
            steps=-(-page_table.shape[1] * page_size // keys),
            keys=keys,
            head_dim=h,
            itemsize=k_pages.dtype.itemsize,
            sm_count=_sm_count(),
        )
    return _call(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        q_lens,
        scale=scale,
        window=window,
        soft_cap=soft_cap,
        interpret=bool(interpret),
        keys=keys,
        splits=kv_splits,
        trim=bool(trim_partials),
    )
