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
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def kv_head_sharded(kernel, mesh: Mesh, axis: str = "model"):
    """Wraps `kernel(q, k_pages, v_pages, page_table, kv_lens, q_lens, **static)` to run per device.

    q is [B, T, N, H] sharded over N; the pools [K, P, S, H] (and the scales [K, P, S] of int8 pools)
    over K; the output like q.
    """
    size = mesh.shape[axis]

    @functools.wraps(kernel)
    def call(q, k_pages, v_pages, page_table, kv_lens, q_lens, *, k_scales=None, v_scales=None, **static):
        nk = k_pages.shape[0]
        heads = axis if nk % size == 0 else None  # replicate what cannot be split whole
        scales = () if k_scales is None else (k_scales, v_scales)

        def per_device(q, k_pages, v_pages, page_table, kv_lens, q_lens, *scales):
            named = dict(zip(("k_scales", "v_scales"), scales))
            return kernel(q, k_pages, v_pages, page_table, kv_lens, q_lens, **named, **static)

        f = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(None, None, heads, None), P(heads), P(heads), P(), P(), P(), *[P(heads) for _ in scales]),
            out_specs=P(None, None, heads, None),
            check_vma=False,
        )
        return f(q, k_pages, v_pages, page_table, kv_lens, q_lens, *scales)

    return call
