"""Block-size search for the GPU kernel on one decode shape: which table entries to write.

    python -m pallas_kernels.tune_gpu [--batch 8] [--contexts 4096] [--heads 32,8] [--kv-dtype int8]

Times `ragged_paged_attention_gpu` over pages per step x KV splits (the table's warps and
stages), then the best of those over warps x pipeline stages, and prints each setting's time and
MBU against the copy bandwidth measured in the same run. Needs a GPU (on CPU the kernel only runs
interpreted, which says nothing about speed).
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


def _tune_context(args, ctx: int, ceiling: float, rng) -> list[dict]:
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    pages = -(-ctx // s)
    k, v, scales = bench._pools(args, ctx, rng)["kernel"]
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), args.dtype)
    table = jnp.asarray(1 + rng.permutation(b * pages).reshape(b, pages), jnp.int32)
    lens, ones = jnp.full((b,), ctx, jnp.int32), jnp.ones((b,), jnp.int32)
    moved = bench.decode_bytes(args, ctx)
    results, first_out = [], []

    def measure(**blocks):
        fn = jax.jit(
            lambda q, k, v, t, ln, o, sc: ragged_paged_attention_gpu(q, k, v, t, ln, o, scale=0.1, **blocks, **sc)
        )
        try:
            out = np.asarray(fn(q, k, v, table, lens, ones, scales), np.float32)
            first_out[:] = first_out or [out]  # every setting must compute the same thing
            np.testing.assert_allclose(out, first_out[0], atol=2e-2, rtol=2e-2)
            seconds = bench._time(lambda: fn(q, k, v, table, lens, ones, scales), args.repeats)
        except Exception as e:  # a setting the compiler refuses (shared memory, registers): report, go on
            print(f"{ctx:>6} {blocks}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return None
        row = dict(context=ctx, seconds=seconds, mbu=moved / seconds / ceiling, **blocks)
        results.append(row)
        print(f"{ctx:>6} {blocks}: {seconds * 1e6:9.1f} us  {moved / seconds / 1e9:7.1f} GB/s  MBU {row['mbu']:.1%}")
        return row

    picked = blocks_for(page_size=s, head_dim=h, rows=16, programs=b * nk, table_pages=pages, int8=bool(scales))
    print(f"context {ctx}: the table picks {picked}")
    measure()
    # Where the time goes at the table's choice: the kernel alone (inputs already in its layout, no
    # merge), and a plain copy of the same bytes (the same per-call costs, no attention).
    qg = _query_blocks(q, nk, picked.rows_per_block)
    static = dict(scale=0.1, soft_cap=None, window=None, group=n // nk)
    alone = jax.jit(lambda *a: _partials(*a, q_tokens=1, blocks=picked, interpret=False, **static))
    buf = jax.random.normal(jax.random.key(1), (moved // 8,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    kernel_alone = lambda: alone(qg, table, lens, ones, k, v, *scales.values())  # noqa: E731
    for name, fn in (("kernel alone", kernel_alone), ("copy", lambda: copy(buf))):
        seconds = bench._time(fn, args.repeats)
        bw = moved / seconds
        print(f"{ctx:>6} {name}: {seconds * 1e6:9.1f} us  {bw / 1e9:7.1f} GB/s  MBU {bw / ceiling:.1%}")
    first = [
        measure(pages_per_step=p, kv_splits=k_)
        for p, k_ in itertools.product((2, 4, 8, 16), (1, 2, 4, 8, 16))
        if 16 <= p * s <= 256
    ]
    best = min((r for r in first if r), key=lambda r: r["seconds"])
    fixed = dict(pages_per_step=best["pages_per_step"], kv_splits=best["kv_splits"])
    for w, st in itertools.product((4, 8), (1, 2, 3)):
        measure(**fixed, num_warps=w, num_stages=st)
    print(f"context {ctx}: best settings")
    for r in sorted(results, key=lambda r: r["seconds"])[:5]:
        print(f"   {r['seconds'] * 1e6:9.1f} us  MBU {r['mbu']:.1%}  {r}")
    return results


def tune(args) -> list[dict]:
    if jax.default_backend() != "gpu":
        raise SystemExit(f"error: tune_gpu needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    ceiling = bench.copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {ceiling / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    return [row for ctx in args.contexts for row in _tune_context(args, ctx, ceiling, rng)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.tune_gpu", description=__doc__)
    bench.add_arguments(p)
    tune(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
