"""Block-size search for the GPU kernels on one decode shape: which table entries to write.

    python -m pallas_kernels.tune_gpu [--batch 8] [--contexts 4096] [--heads 32,8] [--layers 8] [--kv-dtype int8]
                                      [--variants ours,mosaic]   (ours: the Triton kernel)

Times the Triton kernel (`ragged_paged_attention_gpu`) over pages per step x KV splits, then the
best of those over warps x pipeline stages; and, on a Hopper GPU with 16-bit pools, the Mosaic GPU
variant (`ragged_paged_attention_mgpu`) over keys per step x KV splits, and its default with
`trim_partials` (partials of the query rows only: off by default until timed). Each setting's time and MBU
are printed against the copy bandwidth measured in the same run. As in `pallas_kernels.bench`,
`--layers L` chains L attention layers, each over its own pools, in one jitted call and reports the
time per layer: one dispatch per decode step, as a model runs them (a single short call measures
the dispatch, not the kernel). The five fastest settings and each kernel's default are then timed
again in interleaved rounds (`bench._time_rounds`): the sweep times each setting in a block of its
own, and a drift of the machine during it moved one setting's time by 5-12%, so the rounds' figures
are the ones to pick by. Needs a GPU (on CPU the kernels only run interpreted, which says
nothing about speed).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench
from pallas_kernels.ragged_paged_attention_gpu import _partials, _query_blocks, blocks_for, ragged_paged_attention_gpu

TRITON_GRID = dict(pages_per_step=(2, 4, 8, 16), kv_splits=(2, 4, 8, 16, 32))
MOSAIC_GRID = dict(keys_per_step=(64, 128), kv_splits=(1, 2, 4, 8, 16))


_ROW_KEYS = {"context", "kernel", "seconds", "mbu", "err"}


def _blocks(row: dict) -> dict:
    """The block settings a result row was timed with (none: the kernel's own choice)."""
    return {k: v for k, v in row.items() if k not in _ROW_KEYS | {"rounds_seconds"}}


def _grid(grid: dict) -> list[dict]:
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def _tune_context(
    args,
    ctx: int,
    ceiling: float,
    rng,
    *,
    interpret: bool = False,
    triton: bool = True,
    mosaic: bool = False,
    min_rounds: int = 20,
) -> list[dict]:
    """Times every block setting at context `ctx`, then the leaders and each kernel's default again in
    max(args.repeats, min_rounds) interleaved rounds (`min_rounds`: fewer where nothing is timed for
    real, as in interpret mode)."""
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    pages = -(-ctx // s)
    layers = [bench._pools(args, ctx, rng)["kernel"] for _ in range(args.layers)]
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), args.dtype)
    table = jnp.asarray(1 + rng.permutation(b * pages).reshape(b, pages), jnp.int32)
    lens, ones = jnp.full((b,), ctx, jnp.int32), jnp.ones((b,), jnp.int32)
    moved = bench.attention_bytes(args, ctx)
    results, first_out, fns = [], [], []

    def measure(kernel, name: str, **blocks):
        def chain(q, layers):  # each layer's output is the next one's query: nothing can be skipped
            for k, v, scales in layers:
                out = kernel(q, k, v, table, lens, ones, scale=0.1, interpret=interpret, **blocks, **scales)
                q = out.reshape(q.shape).astype(q.dtype)
            return q

        fn = jax.jit(chain)
        try:
            out = np.asarray(fn(q, layers), np.float32)
            seconds = bench._time(lambda: fn(q, layers), args.repeats) / args.layers
        except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory, registers): go on
            print(f"{ctx:>6} {name} {blocks}: failed: {type(e).__name__}: {str(e).strip()[:300]!r}")
            return None
        first_out[:] = first_out or [out]  # every setting and kernel must compute the same thing
        err = float(np.max(np.abs(out - first_out[0])))
        row = dict(context=ctx, kernel=name, seconds=seconds, mbu=moved / seconds / ceiling, err=err, **blocks)
        results.append(row)
        fns.append(lambda: fn(q, layers))
        flag = "" if err <= 5e-2 else f"  DIFFERS from the first setting by {err:.3g}"
        print(
            f"{ctx:>6} {name} {blocks}: {seconds * 1e6:9.1f} us  {moved / seconds / 1e9:7.1f} GB/s  "
            f"MBU {row['mbu']:.1%}{flag}"
        )
        return row

    if triton:
        picked = blocks_for(
            page_size=s, head_dim=h, rows=16, programs=b * nk, table_pages=pages, int8=bool(layers[0][2])
        )
        print(f"context {ctx}: the table picks {picked}")
        measure(ragged_paged_attention_gpu, "triton")
        # Where the time goes at the table's choice: the kernel alone (inputs already in its layout, no
        # merge), and a plain copy of the same bytes (the same per-call costs, no attention).
        k, v, scales = layers[0]
        qg = _query_blocks(q, nk, picked.rows_per_block)
        static = dict(scale=0.1, soft_cap=None, window=None, group=n // nk)
        alone = jax.jit(lambda *a: _partials(*a, q_tokens=1, blocks=picked, interpret=interpret, **static))
        buf = jax.random.normal(jax.random.key(1), (moved // 8,), jnp.float32)
        copy = jax.jit(lambda a: a + 1.0)
        kernel_alone = lambda: alone(qg, table, lens, ones, k, v, *scales.values())  # noqa: E731
        for name, fn in (("kernel alone, 1 layer", kernel_alone), ("copy, 1 layer", lambda: copy(buf))):
            seconds = bench._time(fn, args.repeats)
            bw = moved / seconds
            print(f"{ctx:>6} {name}: {seconds * 1e6:9.1f} us  {bw / 1e9:7.1f} GB/s  MBU {bw / ceiling:.1%}")
        first = [
            measure(ragged_paged_attention_gpu, "triton", **blocks)
            for blocks in _grid(TRITON_GRID)
            if 16 <= blocks["pages_per_step"] * s <= 256
            and blocks["kv_splits"] <= -(-pages // blocks["pages_per_step"])
        ]
        best = min((r for r in first if r), key=lambda r: r["seconds"], default=None)
        if best is not None:
            fixed = dict(pages_per_step=best["pages_per_step"], kv_splits=best["kv_splits"])
            for w, st in itertools.product((4, 8), (2, 3)):
                measure(ragged_paged_attention_gpu, "triton", **fixed, num_warps=w, num_stages=st)
    if mosaic:
        from pallas_kernels.ragged_paged_attention_mgpu import SMEM_BYTES, ragged_paged_attention_mgpu, smem_bytes

        measure(ragged_paged_attention_mgpu, "mosaic")
        measure(ragged_paged_attention_mgpu, "mosaic", trim_partials=True)  # off by default until timed
        for blocks in _grid(MOSAIC_GRID):
            keys = blocks["keys_per_step"]
            fits = smem_bytes(keys=keys, head_dim=h, itemsize=2) <= SMEM_BYTES
            if keys % s == 0 and fits and blocks["kv_splits"] <= -(-pages * s // keys):
                measure(ragged_paged_attention_mgpu, "mosaic", **blocks)
    # The sweep times each setting in a block of its own, so a drift of the machine during it favours
    # some; the leaders and each kernel's default are timed again in interleaved rounds to pick.
    defaults = [i for i, r in enumerate(results) if _blocks(r) in ({}, {"trim_partials": True})]
    leaders = sorted(range(len(results)), key=lambda i: results[i]["seconds"])[:5]
    picked = list(dict.fromkeys(leaders + defaults))
    label = {i: f"{results[i]['kernel']} {_blocks(results[i]) or '(default)'}" for i in picked}
    n_rounds = max(args.repeats, min_rounds)
    rounds = bench._time_rounds({label[i]: fns[i] for i in picked}, n_rounds)
    for i in picked:
        results[i]["rounds_seconds"] = rounds[label[i]] / args.layers
    print(f"context {ctx}: the leaders and the defaults, re-timed in {n_rounds} interleaved rounds")
    for i in sorted(picked, key=lambda i: results[i]["rounds_seconds"]):
        seconds = results[i]["rounds_seconds"]
        print(f"   {seconds * 1e6:9.1f} us  MBU {moved / seconds / ceiling:.1%}  {label[i]}")
    return results


def tune(args) -> list[dict]:
    if jax.default_backend() != "gpu":
        raise SystemExit(f"error: tune_gpu needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    from pallas_kernels.ragged_paged_attention_mgpu import supports

    hopper = getattr(jax.devices()[0], "compute_capability", None) == "9.0"
    named = set((args.variants or "ours,mosaic").split(","))
    mosaic = (
        "mosaic" in named
        and hopper
        and supports(dtype=args.dtype, page_size=args.page_size, head_dim=args.head_dim, int8=args.kv_dtype == "int8")
    )
    ceiling = bench.copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {ceiling / 1e9:.1f} GB/s; {args.layers} layers per call")
    rng = np.random.default_rng(0)
    return [
        row
        for ctx in args.contexts
        for row in _tune_context(args, ctx, ceiling, rng, triton="ours" in named, mosaic=mosaic)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.tune_gpu", description=__doc__)
    bench.add_arguments(p)
    tune(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
