"""Paged-attention kernels timed against a copy bandwidth measured in the same run.

    python -m pallas_kernels.bench [--batch 8] [--contexts 1024,4096] [--heads 32,8] [--head-dim 128]
    jaxinfer bench kernels ...        (the same)

Decode attention reads every cached K/V byte of every row once per step and does ~G FLOPs per byte,
so its yardstick is memory bandwidth: for each variant we report the median time, the bytes it must
move (the rows' K/V pages + queries + outputs), the achieved bandwidth, and MBU = achieved / the
bandwidth of a plain device copy (read + write of a large buffer) timed in the same process.

Variants: `reference` (plain pure JAX, jitted), `xla` (the tiled pure-JAX attention, CPU's default),
`ours` (pallas_kernels.ragged_paged_attention), and
`upstream` (jax.experimental.pallas.ops.tpu.paged_attention, decode only) where it applies. Off
TPU the two kernels can only run in TPU interpret mode: their times are then a simulation's, printed
for completeness and marked, never a speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=8, help="decode rows")
    p.add_argument("--contexts", type=_ints, default=[1024, 4096], help="tokens of context per row")
    p.add_argument("--heads", type=_ints, default=[32, 8], help="query heads,KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--kv-dtype", default="auto", choices=["auto", "int8"], help="cache pools in --dtype, or int8 + scales"
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--variants",
        default="reference,xla,ours,upstream",
        help="comma-separated subset of reference,xla,ours,upstream",
    )


def _time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Bytes/s of a device copy (each byte read once and written once, counted twice)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)
    return 2 * x.nbytes / _time(lambda: copy(x), repeats)


def _variants(args, ctx: int, variants: list[str], rng, on_tpu: bool):
    """(bytes a decode step must move, {variant: a call}) for one context length."""
    from jaxinfer.attention import reference_paged_attention, tiled_paged_attention
    from jaxinfer.config import GlobalAttention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    dtype = jnp.dtype(args.dtype)
    pages_per_row = -(-ctx // s)
    num_pages = b * pages_per_row + 1
    k = jnp.asarray(rng.standard_normal((nk, num_pages, s, h)), dtype)
    v = jnp.asarray(rng.standard_normal((nk, num_pages, s, h)), dtype)
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), dtype)
    table = jnp.asarray(1 + rng.permutation(b * pages_per_row).reshape(b, pages_per_row), jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)
    ones = jnp.ones((b,), jnp.int32)
    scale = float(h**-0.5)
    per_token_head = h * dtype.itemsize
    # Each variant gets the pools in its own form: `k`/`v` for the reference, `kernel_kv` for
    # ours, `upstream_kv` for the upstream kernel; all hold the same numbers.
    kernel_kv, upstream_kv = (k, v, {}), (k, v)
    if args.kv_dtype == "int8":
        from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

        from jaxinfer.kv_cache import QuantizedPages, quantize_int8

        k, v = (QuantizedPages(*quantize_int8(x)) for x in (k, v))
        kernel_kv = (k.values, v.values, dict(k_scales=k.scales, v_scales=v.scales))
        upstream_kv = tuple(QuantizedTensor(x.values, x.scales[..., None] * MAX_INT8) for x in (k, v))
        per_token_head = h + 4
    moved = 2 * b * ctx * nk * per_token_head + 2 * q.nbytes
    calls = {}
    if "reference" in variants:
        ref = jax.jit(
            lambda q, k, v, t, ln: reference_paged_attention(
                q, k, v, t, (ln - 1)[:, None], ln, scale=scale, kind=GlobalAttention()
            )
        )
        calls["reference"] = lambda: ref(q, k, v, table, lens)
    if "xla" in variants:
        tiled = jax.jit(
            lambda q, k, v, t, ln: tiled_paged_attention(
                q, k, v, t, (ln - 1)[:, None], ln, scale=scale, kind=GlobalAttention()
            )
        )
        calls["xla"] = lambda: tiled(q, k, v, table, lens)
    if "ours" in variants:
        kp, vp, scales = kernel_kv
        calls["ours"] = lambda: ragged_paged_attention(
            q, kp, vp, table, lens, ones, scale=scale, interpret=not on_tpu, **scales
        )
    if "upstream" in variants:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as upstream

        block = max(d for d in (1, 2, 4, 8, 16) if pages_per_row % d == 0)

        def up():
            if on_tpu:
                return upstream(q[:, 0] * scale, *upstream_kv, lens, table, pages_per_compute_block=block)
            with pltpu.force_tpu_interpret_mode():
                return upstream(q[:, 0] * scale, *upstream_kv, lens, table, pages_per_compute_block=block)

        calls["upstream"] = up
    return moved, calls


def run(args) -> list[dict]:
    platform = jax.default_backend()
    on_tpu = platform == "tpu"
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        raise SystemExit("error: --heads takes N,K with N a multiple of K")
    if min(args.batch, args.head_dim, args.page_size, args.repeats, *args.contexts) < 1:
        raise SystemExit("error: --batch, --head-dim, --page-size, --repeats and --contexts must be positive")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"reference", "xla", "ours", "upstream"}
    if unknown:
        raise SystemExit(f"error: unknown --variants {sorted(unknown)}")
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    ceiling = copy_bandwidth()
    print(
        f"{platform} ({jax.devices()[0].device_kind}): copy bandwidth {ceiling / 1e9:.1f} GB/s; decode, batch {b}, "
        f"{n} query / {nk} KV heads, head_dim {h}, page {s}, {args.dtype}"
        + (", int8 KV cache (+ float32 scales)" if args.kv_dtype == "int8" else "")
    )
    if not on_tpu:
        print("  (not a TPU: 'ours' and 'upstream' run in TPU interpret mode - simulated, not a speed)")
    print(f"{'context':>8} {'variant':>10} {'time':>10} {'MB moved':>9} {'GB/s':>7} {'MBU':>6}")
    rows = []
    rng = np.random.default_rng(0)
    for ctx in args.contexts:
        moved, calls = _variants(args, ctx, variants, rng, on_tpu)
        for name, fn in calls.items():
            seconds = _time(fn, args.repeats)
            bw = moved / seconds
            simulated = name in ("ours", "upstream") and not on_tpu
            row = dict(context=ctx, variant=name, seconds=seconds, bytes=moved, bandwidth=bw, mbu=bw / ceiling)
            row["simulated"] = simulated
            rows.append(row)
            mbu = "  sim." if simulated else f"{100 * bw / ceiling:5.1f}%"
            print(f"{ctx:>8} {name:>10} {seconds * 1e3:>8.3f}ms {moved / 1e6:>9.1f} {bw / 1e9:>7.1f} {mbu:>6}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pallas_kernels.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
