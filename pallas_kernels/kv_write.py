"""Writing new K/V into their cache pages: a small Pallas kernel (TPU; runs interpreted anywhere).

The XLA scatter in `jaxinfer.attention.write_kv` is the reference. This kernel does the same
update in place (the pools are aliased to the outputs, and donated upstream), quantizing on the
fly for int8 pools, so the write can run next to the attention kernel on the accelerator.

Grid: one step per new token (B*T of them, in row order). Scalar-prefetched slots drive the index
maps: step i brings in the page `slots[i] // S` of every pool as one [K, 1, S, H] block (the
scales of an int8 pool as [K, 1, 1, S]) and replaces the row `slots[i] % S`. Consecutive tokens of
one page reuse the resident block (the pipeline neither refetches nor writes back while the block
index stays the same), so a prefill chunk costs one read and one write per page it touches, and a
decode step one per row. The kernel copies a page in only at the first of its run of steps;
tokens of one page must therefore be consecutive, which the engine's batches guarantee (a row's
tokens are contiguous and no two rows write the same page). Padding tokens all point at the
scratch page, whose contents are never read unmasked.

Rows are replaced with a select on an iota rather than a dynamic slice: Mosaic handles that on
every layout (packed bf16/int8 tiles included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import check_pools


def _kernel(slots_ref, *refs, page_size: int, quantized: bool):
    n_pools = 4 if quantized else 2
    new_k_ref, new_v_ref = refs[:2]
    pools_in, pools_out = refs[2 : 2 + n_pools], refs[2 + n_pools :]
    i = pl.program_id(0)
    page = slots_ref[i] // page_size
    offset = slots_ref[i] % page_size
    first = (i == 0) | (page != slots_ref[jnp.maximum(i - 1, 0)] // page_size)

    @pl.when(first)
    def _bring_in():
        for src, dst in zip(pools_in, pools_out):
            dst[...] = src[...]

    for j, new_ref in enumerate((new_k_ref, new_v_ref)):
        x = new_ref[0].astype(jnp.float32)  # [K, H]
        out = pools_out[j]
        nk, _, s, h = out.shape
        if quantized:  # the same arithmetic as jaxinfer.kv_cache.quantize_int8
            scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0  # [K, 1]
            safe = jnp.where(scale == 0.0, 1.0, scale)
            x = jnp.clip(jnp.round(x / safe), -127, 127)
            scales_out = pools_out[2 + j]
            lane = jax.lax.broadcasted_iota(jnp.int32, (nk, s), 1)
            scales_out[:, 0, 0, :] = jnp.where(lane == offset, scale, scales_out[:, 0, 0, :])
        row = jax.lax.broadcasted_iota(jnp.int32, (nk, s, h), 1)
        out[:, 0] = jnp.where(row == offset, x[:, None, :].astype(out.dtype), out[:, 0])


def _write_pools(pools, new_k, new_v, slots, *, interpret):
    quantized = len(pools) == 4
    nk, num_pages, page_size, h = pools[0].shape
    n = new_k.shape[0]
    slots = jnp.clip(slots.astype(jnp.int32), 0, num_pages * page_size - 1)  # never out of the pools
    page_block = pl.BlockSpec((nk, 1, page_size, h), lambda i, s: (0, s[i] // page_size, 0, 0))
    specs = [page_block, page_block]
    if quantized:
        scale_block = pl.BlockSpec((nk, 1, 1, page_size), lambda i, s: (0, s[i] // page_size, 0, 0))
        specs += [scale_block, scale_block]
        pools = (*pools[:2], *(x.reshape(nk, num_pages, 1, page_size) for x in pools[2:]))
    token = pl.BlockSpec((1, nk, h), lambda i, s: (i, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, quantized=quantized),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n,),
            in_specs=[token, token, *specs],
            out_specs=specs,
        ),
        # Operand indices count the scalar-prefetched slots: pool j is operand 3 + j.
        input_output_aliases={3 + j: j for j in range(len(pools))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=(pltpu.InterpretParams() if interpret == "tpu" else True) if interpret else False,
        name="jaxinfer_kv_write",
    )(slots, new_k, new_v, *pools)
    if quantized:
        out = (*out[:2], *(x.reshape(nk, num_pages, page_size) for x in out[2:]))
    return tuple(out)


# Called eagerly, the first updates the pools in place (the caller's arrays are deleted); the second
# leaves them as they were. Inside a jit both are the same program: the enclosing jit's donation decides.
_write = jax.jit(_write_pools, static_argnames=("interpret",), donate_argnames=("pools",))
_write_keeping = jax.jit(_write_pools, static_argnames=("interpret",))


def check_slots(slots, *, num_pages: int, page_size: int, scratch_page: int = 0) -> None:
    """ValueError naming the first slot outside the pools, or the first token of a page whose tokens
    are not consecutive (the kernel copies a page in at the start of each run: a second run would
    overwrite the first run's writes; the scratch page, written by padding and never read, is exempt),
    for concrete `slots` [B, T]; nothing for a tracer (inside a jit, where no value can be refused)."""
    if isinstance(slots, jax.core.Tracer):
        return
    flat = np.asarray(slots).reshape(-1)
    where = lambda i: f"slots[{i // slots.shape[1]}, {i % slots.shape[1]}] = {flat[i]}"  # noqa: E731
    if flat.size and (flat.min() < 0 or flat.max() >= num_pages * page_size):
        i = int(np.argwhere((flat < 0) | (flat >= num_pages * page_size))[0, 0])
        raise ValueError(f"{where(i)} is outside [0, {num_pages * page_size}) (pages x page_size)")
    pages = flat // page_size
    starts = np.flatnonzero(np.diff(pages, prepend=-1))  # the first token of each run of one page
    run_pages = pages[starts]
    real = run_pages != scratch_page
    seen, first = np.unique(run_pages[real], return_index=True)
    if len(seen) < real.sum():
        again = np.setdiff1d(np.arange(len(run_pages))[real], np.flatnonzero(real)[first])[0]
        raise ValueError(
            f"{where(int(starts[again]))} returns to page {run_pages[again]} after other pages: a page's tokens "
            "must be consecutive"
        )


def kv_write(
    k_pages, v_pages, k, v, slots, *, k_scales=None, v_scales=None, interpret: bool | str = False, donate: bool = True
):
    """Writes new keys/values into their slots; same contract as `jaxinfer.attention.write_kv`.

    Args:
        k_pages, v_pages: [K, P, S, H] pools (called eagerly with donate=True, updated in place: do
            not use them after the call); int8 pools come with k_scales/v_scales [K, P, S] float32
            and are quantized into.
        k, v: [B, T, K, H] new keys/values (any float dtype).
        slots: [B, T] flat slot page * S + offset per token (padding: the scratch page); the
            tokens of one page must be consecutive in row-major order (see the module docstring).
        interpret: False (compile for TPU), True (generic Pallas interpreter) or "tpu" (TPU
            interpret mode).

    Returns:
        (k_pages, v_pages) for float pools; (k_pages, v_pages, k_scales, v_scales) for int8 ones.
    """
    check_pools(k_pages, v_pages, k_scales, v_scales)
    quantized = k_pages.dtype == jnp.int8
    nk, num_pages, page_size, h = k_pages.shape
    if k.ndim != 4 or k.shape[-2:] != (nk, h) or v.shape != k.shape or slots.shape != k.shape[:2]:
        raise ValueError(
            f"k and v must be [B, T, {nk}, {h}] with slots [B, T]; got k {k.shape}, v {v.shape}, slots {slots.shape}"
        )
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must hold integers, got {slots.dtype}")
    check_slots(slots, num_pages=num_pages, page_size=page_size)  # inside a jit the kernel clamps instead
    pools = (k_pages, v_pages, k_scales, v_scales) if quantized else (k_pages, v_pages)
    write = _write if donate else _write_keeping
    return write(pools, k.reshape(-1, nk, h), v.reshape(-1, nk, h), slots.reshape(-1), interpret=interpret)
