"""The paged-attention kernels under `shard_map` over the KV-head axis of a mesh.

Attention is independent per KV head, so tensor parallelism needs no communication here: each
device runs the kernel on its own KV heads and on the query heads of their groups. Query heads are
laid out KV-head-major (head kh * G + g), so splitting N and K into the same number of contiguous
chunks keeps every group on the device that holds its K/V. The page table and lengths are small
and replicated.

When the mesh axis is larger than the number of KV heads, or does not divide it, the KV heads are
replicated instead (every device computes all of them): never dropped, never split mid-group.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P


def _heads_axis(mesh, axis: str, num_kv_heads: int) -> str | None:
    """`axis` when it splits the KV heads whole, else None (replicate)."""
    size = dict(mesh.shape)[axis]
    return axis if num_kv_heads % size == 0 else None


def kv_head_sharded(kernel, mesh, axis: str = "model", rows_axis: str | None = "data"):
    """Wraps `kernel(q, k_pages, v_pages, page_table, kv_lens, q_lens, **static)` to run per device.

    q is [B, T, N, H] sharded over N; the pools [K, P, S, H] (and the scales [K, P, S] of int8 pools)
    over K; the output like q. When the mesh has `rows_axis` (data parallelism) and it divides B, the
    rows (q, page table, lengths) are split over it too; the pools are shared by all rows, so they
    are replicated over it. `mesh` may be a Mesh or the AbstractMesh of the enclosing context.
    """
    sizes = dict(mesh.shape)

    @functools.wraps(kernel)
    def call(q, k_pages, v_pages, page_table, kv_lens, q_lens, *, k_scales=None, v_scales=None, **static):
        heads = _heads_axis(mesh, axis, k_pages.shape[0])
        rows = rows_axis if rows_axis in sizes and sizes[rows_axis] > 1 and q.shape[0] % sizes[rows_axis] == 0 else None
        scales = () if k_scales is None else (k_scales, v_scales)

        def per_device(q, k_pages, v_pages, page_table, kv_lens, q_lens, *scales):
            named = dict(zip(("k_scales", "v_scales"), scales))
            return kernel(q, k_pages, v_pages, page_table, kv_lens, q_lens, **named, **static)

        f = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(
                P(rows, None, heads, None),
                P(heads),
                P(heads),
                P(rows),
                P(rows),
                P(rows),
                *[P(heads) for _ in scales],
            ),
            out_specs=P(rows, None, heads, None),
            check_vma=False,
        )
        return f(q, k_pages, v_pages, page_table, kv_lens, q_lens, *scales)

    return call


def kv_write_sharded(write, mesh, axis: str = "model"):
    """Wraps `write(k_pages, v_pages, k, v, slots, **kw)` (pallas_kernels.kv_write) to run per device.

    Pools and new K/V split over KV heads; every row's tokens go to every replica of the pools
    (rows are never split here: a pool replicated over `data` must see all writes).
    """

    def call(k_pages, v_pages, k, v, slots, *, k_scales=None, v_scales=None, **static):
        heads = _heads_axis(mesh, axis, k_pages.shape[0])
        scales = () if k_scales is None else (k_scales, v_scales)

        def per_device(k_pages, v_pages, k, v, slots, *scales):
            named = dict(zip(("k_scales", "v_scales"), scales))
            return write(k_pages, v_pages, k, v, slots, **named, **static)

        pools = [P(heads)] * (2 + len(scales))
        f = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(heads), P(heads), P(None, None, heads, None), P(None, None, heads, None), P(), *pools[2:]),
            out_specs=tuple(pools),
            check_vma=False,
        )
        return f(k_pages, v_pages, k, v, slots, *scales)

    return call
