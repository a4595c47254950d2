"""Paged attention: writing new K/V into their pages, and attending over a sequence's pages.

`paged_attention` is the single dispatch point: the plain pure-JAX reference below (the oracle every
other implementation is tested against), its tiled pure-JAX form, the C++ CPU kernel (jaxinfer.native,
the fast one on CPU), or the Pallas ragged paged-attention kernel (pallas_kernels/), behind one
signature, so the model never knows which ran. `resolve_backend` decides what "auto" means on this platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import AttentionKind, SlidingWindow
from jaxinfer.kv_cache import Pool, QuantizedPages, quantize_int8
from jaxinfer.numerics import sum_last_axis

# Finite, so a row whose keys are all masked (a padding row) gives a uniform softmax, not NaN.
_MASKED = -1e30


def write_kv(
    k_pages: Pool, v_pages: Pool, k: jax.Array, v: jax.Array, slots: jax.Array, *, backend: str = "reference"
) -> tuple[Pool, Pool]:
    """Scatters new keys/values into their cache slots (quantizing them for an int8 pool).

    With the "pallas" backend on TPU (or interpreted on CPU) the Pallas write kernel
    (pallas_kernels.kv_write) does it; elsewhere, and as the reference, an XLA scatter.

    Args:
        k_pages, v_pages: [K, P, S, H] page pools of one layer, arrays or QuantizedPages (donated
            upstream: updated in place).
        k, v: [B, T, K, H] new keys/values.
        slots: [B, T] flat slot index page * S + offset; padding tokens point into the scratch page.

    Returns:
        The updated (k_pages, v_pages), of the same types.
    """
    if resolve_backend(backend) == "pallas" and jax.default_backend() in ("tpu", "cpu"):
        from pallas_kernels.kv_write import kv_write
        from pallas_kernels.sharded import kv_write_sharded

        if (mesh := context_mesh()) is not None:
            kv_write = kv_write_sharded(kv_write, mesh)
        interpret = jax.default_backend() == "cpu"
        # No donation of its own: inside the model's jitted steps theirs applies, and called eagerly
        # (a forward() whose batch is then refused) the caller's cache must survive, as with the scatter.
        kv_write = functools.partial(kv_write, donate=False)
        if isinstance(k_pages, QuantizedPages):
            kv, vv, ks, vs = kv_write(
                k_pages.values,
                v_pages.values,
                k,
                v,
                slots,
                k_scales=k_pages.scales,
                v_scales=v_pages.scales,
                interpret=interpret,
            )
            return QuantizedPages(values=kv, scales=ks), QuantizedPages(values=vv, scales=vs)
        return kv_write(k_pages, v_pages, k, v, slots, interpret=interpret)
    nk, num_pages, s, h = k_pages.shape
    if not isinstance(slots, jax.core.Tracer):  # called eagerly: refuse what the scatter would wrap or drop
        from pallas_kernels.kv_write import check_slots

        check_slots(slots, num_pages=num_pages, page_size=s)
    # Index pages and offsets separately: reshaping the pool to [K, P*S, H] first makes XLA copy
    # the whole pool around the scatter instead of updating the donated buffer in place.
    page = (slots // s).reshape(-1)
    offset = (slots % s).reshape(-1)

    def write(pool: Pool, new: jax.Array) -> Pool:
        new = new.reshape(-1, nk, h).transpose(1, 0, 2)  # [K, B*T, H]
        if isinstance(pool, QuantizedPages):
            values, scales = quantize_int8(new)
            return QuantizedPages(
                values=pool.values.at[:, page, offset].set(values), scales=pool.scales.at[:, page, offset].set(scales)
            )
        from jaxinfer import native

        if pool.dtype.itemsize == 2 and native.runs_here():
            # XLA CPU would scatter into a 16-bit float pool in float32, converting the whole pool
            # there and back every step: the C++ write updates the donated pool in place.
            return native.kv_write(pool, new, page, offset)
        return pool.at[:, page, offset].set(new.astype(pool.dtype))

    return write(k_pages, k), write(v_pages, v)


def reference_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    kind: AttentionKind,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of new queries over each row's cached pages (new K/V already written).

    The pools are head-major, so gathering a row's pages yields [K, B, S_ctx, H] with the KV-head and
    batch axes already leading: both contractions are plain batched matmuls, no transposes of the
    gathered context (the large operand in decode).

    Args:
        q: [B, T, N, H] queries (RoPE applied).
        k_pages, v_pages: [K, P, S, H] one layer's page pools: arrays, or QuantizedPages (int8 with
            per-token-per-head scales, dequantized to float32 after the gather whatever q's dtype,
            as the kernels apply them: rounded to bfloat16, value x scale moves logits by ~0.05 at
            a softmax scale of 1).
        page_table: [B, MP] pages of each row.
        q_positions: [B, T] absolute position of each query.
        kv_lens: [B] valid cached tokens per row (0 for a padding row).
        scale: softmax scale, a Python float.
        kind: GlobalAttention or SlidingWindow(window).
        soft_cap: logits become soft_cap * tanh(logits / soft_cap) before masking; None for none.

    Returns:
        [B, T, N, H] attention output in q's dtype.
    """
    b, t, n, h = q.shape
    nk = k_pages.shape[0]
    g = n // nk

    def gather(pool: Pool) -> jax.Array:  # [K, B, S_ctx, H] in the pool's dtype (int8: float32)
        if isinstance(pool, QuantizedPages):
            pool = QuantizedPages(values=pool.values[:, page_table], scales=pool.scales[:, page_table])
            return pool.dequantize(jnp.float32).reshape(nk, b, -1, h)  # not rounded again to q's dtype
        return pool[:, page_table].reshape(nk, b, -1, h)

    k, v = gather(k_pages), gather(v_pages)
    kv_pos = jnp.arange(k.shape[2], dtype=jnp.int32)  # [S_ctx]

    in_context = _visible(kv_pos[None, :], kv_lens[:, None], q_positions[:, :1], kind)  # [B, S_ctx]
    mask = in_context[:, None, :] & (kv_pos[None, None, :] <= q_positions[:, :, None])  # [B, T, S_ctx]
    if isinstance(kind, SlidingWindow):
        mask &= q_positions[:, :, None] - kv_pos[None, None, :] < kind.window
    # Slots outside a row's visible range may hold another request's stale data (even NaN): zero V
    # there so a zero probability times garbage cannot leak into the output.
    v = jnp.where(in_context[None, :, :, None], v, jnp.zeros((), v.dtype))

    qg = q.reshape(b, t, nk, g, h).transpose(2, 0, 3, 1, 4).reshape(nk, b, g * t, h)  # [K, B, G*T, H]
    logits = jnp.einsum("KBQH,KBSH->KBQS", qg, k, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = logits.reshape(nk, b, g, t, -1)
    logits = jnp.where(mask[None, :, None, :, :], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).reshape(nk, b, g * t, -1)
    out = jnp.einsum("KBQS,KBSH->KBQH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(nk, b, g, t, h).transpose(1, 3, 0, 2, 4)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def _visible(kv_pos, kv_lens, first_q_pos, kind: AttentionKind):
    """Context slots some query of the row can see: inside its length and, with a sliding window,
    not before its first query's window. Pages wholly before that window may have been given back
    (the scheduler drops them for all-window models; the table then points at the scratch page)."""
    visible = kv_pos < kv_lens
    if isinstance(kind, SlidingWindow):
        visible &= kv_pos > first_q_pos - kind.window
    return visible


def _decode_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [K, R, G, H] . k [K, R, S, H] -> [K, R, G, S] float32, as a multiply and a sum over H.

    Decode's G (query heads per KV head) is 1-8 rows, and XLA CPU runs a batched dot of such small
    matrices as one Eigen call per (KV head, row): ~95 us per 8-row x 128-token tile. With K read as
    [.., H, S], the sum runs down a non-minor axis with S vectorised: ~15 us, the transpose fused
    into the tile's gather. The ~150M model at 48 rows (lengths 16-480), 8 layers of decode attention:
    34.5 -> 28.7 ms; its whole decode step 73 -> 68 ms (2-core CPU, /tmp A/B scripts).
    """
    f32 = jnp.float32
    return jnp.sum(q.astype(f32)[..., None] * jnp.swapaxes(k, -1, -2).astype(f32)[:, :, None], axis=-2)


def _decode_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """p [K, R, G, S] . v [K, R, S, H] -> [K, R, G, H] float32, as a multiply and a sum over S (H
    vectorised), for the reason `_decode_scores` gives: ~35 -> ~14 us per tile."""
    f32 = jnp.float32
    return jnp.sum(p.astype(f32)[..., None] * v.astype(f32)[:, :, None], axis=-2)


def tiled_paged_attention(
    q: jax.Array,
    k_pages: Pool,
    v_pages: Pool,
    page_table: jax.Array,
    q_positions: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    kind: AttentionKind,
    soft_cap: float | None = None,
    rows_per_tile: int = 8,
    tokens_per_tile: int = 128,
) -> jax.Array:
    """The reference's maths in tiles of (rows_per_tile rows x tokens_per_tile context), with an
    online softmax across a row's tiles, skipping tiles past every row's length: the "xla" backend.

    Why: the reference gathers every row's whole page-table width at once ([K, B, S_ctx, H], 33 MB
    per layer for K alone at batch 64 x 512 tokens) and then reads it back for two batched matmuls.
    Those temporaries miss every cache and are freshly faulted-in memory each step. Tiles of 8 rows x
    128 tokens (1 MB) stay in cache, and a row group's tiles stop at its longest row instead of the
    width bucket. Measured on the 2-core CPU (8 layers, batch 64, width 512, mean length 267):
    300-320 ms -> 67-79 ms. Same contract as `reference_paged_attention`, to which the tests compare it.

    Rows come in groups of rows_per_tile (the engine orders decode rows longest first, so a group's
    rows have similar lengths); a tile past the group's longest row, or before the sliding window of
    every row in it, is never visited (a while loop over the tiles that exist), and a tile that is
    visited but masked for a row leaves that row's softmax state exactly unchanged, so a row's result
    does not depend on its neighbours.
    """
    b, t, n, h = q.shape
    nk, _, s, _ = k_pages.shape
    g = n // nk
    # Decode keeps whole groups of rows_per_tile rows even for a smaller batch, so that every tile is
    # computed at one shape whatever the batch: XLA CPU rounds a reduction by its operand's shape
    # (a row's scores summed over H in a [K, 1, G, 8] tile and a [K, 4, G, 8] one differed in the
    # last bit on an AVX2 CPU, AMD Zen 3, 2026-12-02). A chunk's rows, whose tiles are larger, keep
    # the batch's size.
    rows = rows_per_tile if t == 1 else min(rows_per_tile, b)
    pages_per_tile = max(1, tokens_per_tile // s)
    tile = pages_per_tile * s
    # Pad rows to whole row groups (padding rows: length 0) and the table to whole tiles (scratch
    # pages past every length, masked), plus one tile never visited: with a single tile per row,
    # XLA sees the tile's page slice as loop-invariant, hoists the gather out of the loop and then
    # copies every layer's whole page pool (measured: batch-1 decode step 18 -> 130 ms).
    pad_b = -b % rows
    pad_p = -page_table.shape[1] % pages_per_tile + pages_per_tile
    page_table = jnp.pad(page_table, ((0, pad_b), (0, pad_p)))
    kv_lens = jnp.pad(kv_lens, (0, pad_b))
    q_positions = jnp.pad(q_positions, ((0, pad_b), (0, 0)))
    q = jnp.pad(q, ((0, pad_b), (0, 0), (0, 0), (0, 0)))
    bp = b + pad_b
    groups, tiles_per_row = bp // rows, page_table.shape[1] // pages_per_tile - 1

    qg = q.reshape(bp, t, nk, g, h).transpose(2, 0, 3, 1, 4).reshape(nk, bp, g * t, h)  # [K, B, G*T, H]
    # Tiles each row group visits: from the first its window reaches (0 without a window) to the
    # last its longest row reaches; tile i of the flattened (group, tile) list.
    last_tile = jnp.minimum((kv_lens.reshape(groups, rows).max(axis=1) + tile - 1) // tile, tiles_per_row)
    first_tile = jnp.zeros_like(last_tile)
    if isinstance(kind, SlidingWindow):
        lo = jnp.where(kv_lens > 0, jnp.maximum(q_positions[:, 0] - kind.window + 1, 0), jnp.iinfo(jnp.int32).max)
        first_tile = jnp.minimum(lo.reshape(groups, rows).min(axis=1) // tile, last_tile)
    need = last_tile - first_tile
    ends = jnp.cumsum(need)

    def gather(pool: Pool, pages: jax.Array) -> jax.Array:  # [K, R, tile, H] in q's dtype (int8: float32)
        if isinstance(pool, QuantizedPages):
            pool = QuantizedPages(values=pool.values[:, pages], scales=pool.scales[:, pages])
            return pool.dequantize(jnp.float32).reshape(nk, rows, tile, h)
        return pool[:, pages].reshape(nk, rows, tile, h).astype(q.dtype)

    def body(carry):
        i, acc, m, denom = carry
        grp = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        first = grp * rows
        start = (first_tile[grp] + i - (ends[grp] - need[grp])) * tile  # first context position of this tile
        pages = jax.lax.dynamic_slice(page_table, (first, start // s), (rows, pages_per_tile))
        k, v = gather(k_pages, pages), gather(v_pages, pages)
        lens = jax.lax.dynamic_slice(kv_lens, (first,), (rows,))
        qpos = jax.lax.dynamic_slice(q_positions, (first, 0), (rows, t))
        kv_pos = start + jnp.arange(tile, dtype=jnp.int32)
        in_context = _visible(kv_pos[None, :], lens[:, None], qpos[:, :1], kind)  # [R, tile]
        mask = in_context[:, None, :] & (kv_pos[None, None, :] <= qpos[:, :, None])  # [R, T, tile]
        if isinstance(kind, SlidingWindow):
            mask &= qpos[:, :, None] - kv_pos[None, None, :] < kind.window
        v = jnp.where(in_context[None, :, :, None], v, jnp.zeros((), v.dtype))  # stale slots may hold NaN

        qt = jax.lax.dynamic_slice(qg, (0, first, 0, 0), (nk, rows, g * t, h))
        if t == 1:
            logits = _decode_scores(qt, k) * scale
        else:
            logits = jnp.einsum("KRQH,KRSH->KRQS", qt, k, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = logits.reshape(nk, rows, g, t, tile)
        logits = jnp.where(mask[None, :, None, :, :], logits, _MASKED).reshape(nk, rows, g * t, tile)

        m_old = jax.lax.dynamic_slice(m, (0, first, 0), (nk, rows, g * t))
        l_old = jax.lax.dynamic_slice(denom, (0, first, 0), (nk, rows, g * t))
        acc_old = jax.lax.dynamic_slice(acc, (0, first, 0, 0), (nk, rows, g * t, h))
        m_new = jnp.maximum(m_old, logits.max(axis=-1))
        p = jnp.exp(logits - m_new[..., None])
        alpha = jnp.exp(m_old - m_new)
        l_new = alpha * l_old + sum_last_axis(p)[..., 0]  # batch-invariant: see jaxinfer.numerics
        if t == 1:
            pv = _decode_values(p.astype(v.dtype), v)
        else:
            pv = jnp.einsum("KRQS,KRSH->KRQH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_new = alpha[..., None] * acc_old + pv
        return (
            i + 1,
            jax.lax.dynamic_update_slice(acc, acc_new, (0, first, 0, 0)),
            jax.lax.dynamic_update_slice(m, m_new, (0, first, 0)),
            jax.lax.dynamic_update_slice(denom, l_new, (0, first, 0)),
        )

    init = (
        jnp.int32(0),
        jnp.zeros((nk, bp, g * t, h), jnp.float32),
        jnp.full((nk, bp, g * t), -jnp.inf, jnp.float32),
        jnp.zeros((nk, bp, g * t), jnp.float32),
    )
    _, acc, _, denom = jax.lax.while_loop(lambda c: c[0] < ends[-1], body, init)
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # a group never visited (all padding) gives 0
    out = out.reshape(nk, bp, g, t, h).transpose(1, 3, 0, 2, 4)[:b]  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def context_mesh():
    """The mesh the step is traced under (`jax.set_mesh`, see Engine), when it has a `model` axis;
    the kernels then run per device under shard_map. None outside any mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or "model" not in mesh.axis_names else mesh


# The GPU kernel's "auto" floor: Ampere. Its dots run on tensor cores in the cache's dtype, and
# Triton has no bfloat16 tensor-core dot before compute capability 8.0 (a T4, Colab's free GPU, is
# 7.5). It was compiled and timed only on Hopper (8.0 and 8.9 are untested).
MIN_GPU_KERNEL_CAPABILITY = (8, 0)


def resolve_backend(backend: str, platform: str | None = None, *, compute_capability: str | None = None) -> str:
    """ "auto" -> "pallas" on TPU (the Mosaic kernel) and on GPUs from Ampere on (the Triton-lowered
    kernel, or its Mosaic GPU variant on Hopper where it is faster: `_gpu_kernel`), "native" on CPU (the
    C++ kernel of jaxinfer.native; "xla", the tiled pure-JAX attention, where it cannot be built),
    "reference" elsewhere (older GPUs too).

    The GPU kernel is the GPU default since it was checked and timed on an H100 (WORKSPACE.md,
    2026-11-23: same tokens as the reference end to end; decode attention 2.1-3.5x faster than the
    reference's gather in bfloat16, ~2x with int8 pools). On CPU "pallas" runs the TPU kernel in
    interpret mode: slow, but the code path the accelerator runs. `compute_capability` ("7.5"):
    the GPU's, read from the first device when not given.
    """
    platform = platform or jax.default_backend()
    if backend != "auto":
        return backend
    if platform == "gpu":
        if compute_capability is None and platform == jax.default_backend():
            compute_capability = getattr(jax.devices()[0], "compute_capability", None)
        if compute_capability is not None and _capability(compute_capability) < MIN_GPU_KERNEL_CAPABILITY:
            return "reference"
    if platform == "cpu":
        from jaxinfer import native

        return "native" if native.available() else "xla"
    return {"tpu": "pallas", "gpu": "pallas"}.get(platform, "reference")


def _call_kernel(kernel, q, k_pages, v_pages, page_table, kv_lens, q_lens, *, scale, kind, soft_cap, **extra):
    """Calls a kernel of the Pallas kernels' signature: per device under shard_map over KV heads
    inside a mesh, an int8 pool's scales as arguments of their own, the window from `kind`."""
    if (mesh := context_mesh()) is not None:
        from pallas_kernels.sharded import kv_head_sharded

        kernel = kv_head_sharded(kernel, mesh)
    scales = {}
    if isinstance(k_pages, QuantizedPages):
        scales = dict(k_scales=k_pages.scales, v_scales=v_pages.scales)
        k_pages, v_pages = k_pages.values, v_pages.values
    window = kind.window if isinstance(kind, SlidingWindow) else None
    return kernel(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        q_lens,
        scale=scale,
        window=window,
        soft_cap=soft_cap,
        **scales,
        **extra,
    )


def _gpu_kernel(q, pool, int8: bool):
    """The GPU kernel for this call: on Hopper with 16-bit pools (and queries in their dtype), the
    Mosaic GPU (TMA + wgmma) variant where it was measured faster - steps with prefill chunks at
    head_dim 128 and 256, and decode steps at head_dim 128 - and the Triton-lowered kernel otherwise.

    Timed on an H200 (2026-11-30, interleaved rounds, per layer; WORKSPACE.md): prefill chunks of 64
    tokens x 8 rows over 4k of context 178 us against Triton's 488, of 512 tokens x 4 rows 592 against
    1603, at head_dim 256 684 against 1181; decode at head_dim 128 176 against 198 us at 4k tokens x
    32 rows and level at 8 rows (60 against 60 at 4k, 211 against 204 at 16k); decode at head_dim 256
    (125 against 110 us at 4k) and head_dim 64 (152 against 132) slower, so those stay on Triton, as
    do prefill at head_dim 64 (not timed), float32 and int8 pools and other GPUs."""
    from pallas_kernels import ragged_paged_attention_gpu as gpu
    from pallas_kernels import ragged_paged_attention_mgpu as mgpu

    hopper = getattr(jax.devices()[0], "compute_capability", None) == "9.0"
    page_size, head_dim = pool.shape[-2], pool.shape[-1]
    faster = head_dim == 128 or (head_dim == 256 and q.shape[1] > 1)
    if (
        hopper
        and faster
        and q.dtype == pool.dtype
        and mgpu.supports(dtype=pool.dtype, page_size=page_size, head_dim=head_dim, int8=int8)
    ):
        return mgpu.ragged_paged_attention_mgpu
    return gpu.ragged_paged_attention_gpu


def _capability(text: str) -> tuple[int, int]:
    """ "8.6" -> (8, 6); an unreadable one counts as new (the kernel is tried)."""
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (99, 0)


def paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    q_positions,
    kv_lens,
    *,
    scale: float,
    kind: AttentionKind,
    q_lens=None,
    soft_cap: float | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Dispatch point for paged attention (see module docstring); same contract as the reference.

    `q_lens` ([B] new tokens per row) is needed by the kernel; the reference reads positions.
    """
    resolved = resolve_backend(backend)
    if not any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lens, q_lens)):
        # Called eagerly (the engine's jitted steps are traced): indices every backend would wrap or
        # clamp into another sequence's pages are refused here, by name, as the kernels refuse them.
        from pallas_kernels.ragged_paged_attention import check_inputs

        num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
        lens = q_lens if q_lens is not None else np.zeros(q.shape[0], np.int32)
        check_inputs(page_table, kv_lens, lens, num_pages=num_pages, page_size=page_size, num_query_tokens=q.shape[1])
    if resolved in ("reference", "xla"):
        fn = reference_paged_attention if resolved == "reference" else tiled_paged_attention
        return fn(q, k_pages, v_pages, page_table, q_positions, kv_lens, scale=scale, kind=kind, soft_cap=soft_cap)
    extra = {}
    if resolved == "native":  # the C++ CPU kernel; queries sit at the end of each row's context
        from jaxinfer import native

        if jax.default_backend() != "cpu":
            raise ValueError(f'attention_backend="native" is the CPU kernel; this platform is {jax.default_backend()}')
        if q_lens is None:
            q_lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        kernel = native.paged_attention
    else:
        from pallas_kernels import ragged_paged_attention_gpu as gpu
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        on_gpu = jax.default_backend() == "gpu"
        pool = k_pages.values if isinstance(k_pages, QuantizedPages) else k_pages
        page_size, head_dim = pool.shape[-2], pool.shape[-1]
        if on_gpu and backend == "auto" and not gpu.supports(page_size=page_size, head_dim=head_dim):
            return reference_paged_attention(
                q, k_pages, v_pages, page_table, q_positions, kv_lens, scale=scale, kind=kind, soft_cap=soft_cap
            )
        if q_lens is None:
            raise ValueError("the Pallas backend needs q_lens")
        kernel = _gpu_kernel(q, pool, k_pages is not pool) if on_gpu else ragged_paged_attention
        extra = dict(interpret=jax.default_backend() == "cpu")
    return _call_kernel(
        kernel, q, k_pages, v_pages, page_table, kv_lens, q_lens, scale=scale, kind=kind, soft_cap=soft_cap, **extra
    )
