"""The Pallas KV-write kernel against the XLA scatter reference (`jaxinfer.attention.write_kv`).

Batches are shaped like the engine's: rows of prefill chunks and decode tokens whose pages are
their own, chunks starting mid-page and crossing page boundaries, padding tokens pointed at the
scratch page. Every page except the scratch page must come out bit-identical (int8 pools: values
and scales), in both the generic interpreter and TPU interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import write_kv
from jaxinfer.kv_cache import QuantizedPages
from pallas_kernels.kv_write import kv_write

NK, POOL, PAGE, H = 2, 20, 4, 16


def _batch(rng, rows: int, t: int, page: int = PAGE):
    """slots [rows, t] like Batch.slots(): each row's new tokens in its own pages, padding -> page 0."""
    owned = rng.permutation(np.arange(1, POOL))[: rows * 4].reshape(rows, 4)
    slots = np.zeros((rows, t), np.int64)
    for r in range(rows):
        q_len = int(rng.integers(0, t + 1))
        start = int(rng.integers(0, 4 * page - q_len + 1))  # a chunk may start mid-page
        for i in range(q_len):
            pos = start + i
            slots[r, i] = owned[r, pos // page] * page + pos % page
    return jnp.asarray(slots, jnp.int32)


def _pools(rng, kind: str, page: int = PAGE):
    if kind == "int8":
        return tuple(
            QuantizedPages(
                values=jnp.asarray(rng.integers(-127, 128, (NK, POOL, page, H)), jnp.int8),
                scales=jnp.asarray(rng.uniform(0.01, 1, (NK, POOL, page)), jnp.float32),
            )
            for _ in range(2)
        )
    return tuple(jnp.asarray(rng.standard_normal((NK, POOL, page, H)), kind) for _ in range(2))


def _leaves(pools):
    return [np.asarray(x)[:, 1:] for x in jax.tree.leaves(pools)]  # all but the scratch page


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int8-from-bfloat16"])
@pytest.mark.parametrize("interpret", [True, "tpu"], ids=["generic", "tpu-interpret"])
def test_kv_write_matches_the_scatter(kind, interpret):
    """int8 pools take float32 K/V, or bfloat16 (a bfloat16 model's), quantized in float32 as the
    reference does. Pages of 4 tokens, and of 16 (the engine's default) with a chunk longer than one."""
    kind, _, source = kind.partition("-from-")
    rng = np.random.default_rng(len(kind) + len(source))
    for rows, t, page in [(1, 1, 4), (4, 1, 4), (3, 7, 4), (2, 12, 4), (3, 1, 16), (2, 21, 16)]:
        k_pages, v_pages = _pools(rng, kind, page)
        dtype = source or (jnp.float32 if kind == "int8" else kind)
        k = jnp.asarray(rng.standard_normal((rows, t, NK, H)) * 3, dtype)
        v = jnp.asarray(rng.standard_normal((rows, t, NK, H)), dtype)
        k = k.at[0, 0, 1].set(0.0)  # an all-zero vector: scale 0
        slots = _batch(rng, rows, t, page)
        want = write_kv(k_pages, v_pages, k, v, slots)
        if kind == "int8":
            args = (k_pages.values, v_pages.values, k, v, slots)
            got = kv_write(*args, k_scales=k_pages.scales, v_scales=v_pages.scales, interpret=interpret)
            got = (QuantizedPages(values=got[0], scales=got[2]), QuantizedPages(values=got[1], scales=got[3]))
        else:
            got = kv_write(k_pages, v_pages, k, v, slots, interpret=interpret)
        jax.block_until_ready(got)
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"rows {rows} t {t} page {page}")


def test_kv_write_refuses_mismatched_inputs():
    rng = np.random.default_rng(0)
    k_pages, v_pages = _pools(rng, "float32")
    k = jnp.zeros((1, 2, NK, H))
    with pytest.raises(ValueError, match=r"k and v must be \[B, T, 2, 16\]"):
        kv_write(k_pages, v_pages, k, k[:, :1], jnp.zeros((1, 2), jnp.int32), interpret=True)
    q = _pools(rng, "int8")[0]
    with pytest.raises(ValueError, match="int8 pools need k_scales and v_scales"):
        kv_write(q.values, q.values, k, k, jnp.zeros((1, 2), jnp.int32), interpret=True)
    # A smaller v pool was written out of bounds; slots outside the pools were clamped onto its last
    # slot (or, at -1, its first) instead of refused.
    with pytest.raises(ValueError, match="v_pages must match k_pages"):
        kv_write(k_pages, v_pages[:, :3], k, k, jnp.zeros((1, 2), jnp.int32), interpret=True)
    slots_total = k_pages.shape[1] * k_pages.shape[2]
    for bad in (slots_total, -1, 10**6):
        slots = jnp.asarray([[0, bad]], jnp.int32)
        with pytest.raises(ValueError, match=rf"slots\[0, 1\] = {bad} is outside \[0, {slots_total}\)"):
            kv_write(k_pages, v_pages, k, k, slots, interpret=True)
    with pytest.raises(ValueError, match="slots must hold integers"):
        kv_write(k_pages, v_pages, k, k, jnp.zeros((1, 2), jnp.float32), interpret=True)
    # A page's tokens must be consecutive (the kernel copies a page in at the start of each run: the
    # first run's write was lost); the scratch page, padding's, may come back.
    k3 = jnp.zeros((1, 3, NK, H))
    with pytest.raises(ValueError, match=rf"slots\[0, 2\] = {3 * PAGE + 1} returns to page 3 after other pages"):
        kv_write(k_pages, v_pages, k3, k3, jnp.asarray([[3 * PAGE, 1 * PAGE, 3 * PAGE + 1]], jnp.int32), interpret=True)
    kv_write(k_pages, v_pages, k3, k3, jnp.asarray([[0, 3 * PAGE, 1]], jnp.int32), interpret=True, donate=False)


def test_kv_write_inside_a_jit_clamps_a_slot_past_the_pools_onto_the_last_slot():
    """Traced slots cannot be refused: one past the end lands on the pools' last slot, never beyond."""
    rng = np.random.default_rng(1)
    k_pages, v_pages = _pools(rng, "float32")
    before = np.asarray(k_pages)
    k = jnp.asarray(rng.standard_normal((1, 1, NK, H)), jnp.float32)
    write = jax.jit(lambda kp, vp, slots: kv_write(kp, vp, k, k, slots, interpret=True))
    got = np.asarray(write(k_pages, v_pages, jnp.asarray([[POOL * PAGE]], jnp.int32))[0])
    want = before.copy()
    want[:, POOL - 1, PAGE - 1] = np.asarray(k)[0, 0]
    np.testing.assert_array_equal(got, want)


def test_write_kv_called_eagerly_keeps_the_callers_pools_on_every_backend():
    """The Pallas write donated its pools: an eager `forward()` with the pallas backend whose batch
    was then refused (a kv_len past the page table, checked by the attention after the write) left
    the caller's cache deleted. write_kv now keeps its inputs as the scatter does; kv_write still
    updates in place when asked (donate=True, its default)."""
    import dataclasses

    from jaxinfer import default_model
    from jaxinfer.kv_cache import Batch, KVCache
    from jaxinfer.model import forward, init_params

    rng = np.random.default_rng(2)
    new = jnp.asarray(rng.standard_normal((1, 1, NK, H)), jnp.float32)
    for backend in ("reference", "pallas"):
        k_pages, v_pages = _pools(rng, "float32")
        write_kv(k_pages, v_pages, new, new, jnp.asarray([[5]], jnp.int32), backend=backend)
        assert not k_pages.is_deleted() and not v_pages.is_deleted(), backend
    k_pages, v_pages = _pools(rng, "float32")
    kv_write(k_pages, v_pages, new, new, jnp.asarray([[5]], jnp.int32), interpret=True)
    assert k_pages.is_deleted()

    cfg = dataclasses.replace(default_model.CONFIG, attention_backend="pallas")
    cache = KVCache.create(cfg, num_pages=8, page_size=4)
    refused = Batch(
        tokens=jnp.full((1, 1), 5, jnp.int32),
        q_lens=jnp.asarray([1], jnp.int32),
        kv_lens=jnp.asarray([9], jnp.int32),  # past the table's 2 pages of 4
        page_table=jnp.asarray([[1, 2]], jnp.int32),
    )
    with pytest.raises(ValueError, match=r"kv_lens\[0\] = 9 is outside \[0, 8\]"):
        forward(init_params(cfg, 0), cache, refused, cfg=cfg)
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))
