"""Paged-attention kernels timed against a copy bandwidth measured in the same run.

    python -m pallas_kernels.bench [--batch 8] [--contexts 1024,4096] [--heads 32,8] [--head-dim 128]
    jaxinfer bench kernels ...        (the same)

Decode attention reads every cached K/V byte of every row once per step and does ~G FLOPs per byte,
so its yardstick is memory bandwidth: for each variant we report the median time, the bytes it must
move (the rows' K/V pages + queries + outputs), the achieved bandwidth, and MBU = achieved / the
bandwidth of a plain device copy (read + write of a 512 MiB buffer) timed in the same rounds.

Variants: `reference` (plain pure JAX, jitted), `xla` (the tiled pure-JAX attention), `native` (CPU
only: the C++ kernel of jaxinfer.native, what the model runs on CPU by default), `ours` (on TPU and
CPU pallas_kernels.ragged_paged_attention, on GPU pallas_kernels.ragged_paged_attention_gpu),
`mosaic` (GPU only: the Mosaic GPU variant, pallas_kernels.ragged_paged_attention_mgpu,
bfloat16/float16 pools; a compile failure is printed and the other variants still run), and
`upstream` (jax.experimental.pallas.ops.tpu or .gpu paged_attention, decode only). On CPU the Pallas
kernels can only run in TPU interpret mode: their times are then a simulation's, printed for
completeness and marked, never a speed.

Timing: each variant is jitted (the kernels' eager input checks run once, outside the clock), and
when one call is short, several are queued back to back per sample so launch gaps do not count.
A context's variants and the ceiling's copy are sampled in interleaved rounds (`--repeats` of them,
medians reported), so a drift of the machine during the run moves them all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import InvalidRequestError, JaxinferError


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return out


_BLOCK_FIELDS = ("pages_per_step", "rows_per_block", "kv_splits", "num_warps", "num_stages")


def _blocks(s: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (x.strip() for x in s.split(","))):
        name, _, value = item.partition("=")
        if name not in _BLOCK_FIELDS or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"expected NAME=POSITIVE_INT pairs with NAME in {', '.join(_BLOCK_FIELDS)}; got {item!r}"
            )
        out[name] = int(value)
    return out


VARIANTS = ("copy", "reference", "xla", "native", "ours", "mosaic", "upstream")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=8, help="decode rows")
    p.add_argument("--contexts", type=_ints, default=[1024, 4096], help="tokens of context per row")
    p.add_argument(
        "--query-len",
        type=int,
        default=1,
        help="query tokens per row, the last of its context: 1 decodes, more is a chunk of prefill",
    )
    p.add_argument("--heads", type=_ints, default=[32, 8], help="query heads,KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="dimension of each head")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="queries' and K/V pools' dtype")
    p.add_argument(
        "--kv-dtype", default="auto", choices=["auto", "int8"], help="cache pools in --dtype, or int8 + scales"
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window of W keys (a Mistral/Gemma local layer); default global",
    )
    p.add_argument("--repeats", type=int, default=10, help="timed samples per variant (the median is reported)")
    p.add_argument("--layers", type=int, default=1, help="attention layers per timed call (one jit); time is per layer")
    p.add_argument(
        "--gpu-blocks",
        dest="kernel_blocks",
        type=_blocks,
        default={},
        help="GPU kernel block overrides, e.g. pages_per_step=4,kv_splits=8,num_warps=4,num_stages=2",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {','.join(VARIANTS)} (copy: a plain copy of the same bytes); "
        "default all, on CPU all but the interpret-mode kernels (ours, mosaic, upstream)",
    )


def _calls_per_sample(fn) -> int:
    """Compiles and warms `fn`; how many calls one sample queues: a call under ~5 ms is queued
    several times (up to 50) and the sample divided, so that an accelerator runs them back to back,
    without the host's dispatch gap between them."""
    jax.block_until_ready(fn())  # compile + warm
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return max(1, min(50, int(5e-3 / max(time.perf_counter() - t, 1e-9))))


def _time_rounds(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each of `calls` ({name: fn}), sampled in `repeats` rounds: each
    round times every call once, in an order that rotates from round to round, so that a drift of
    the clocks or the temperature during the run moves all of them alike. Timed one after another
    instead, each in a block of its own, the same kernel setting read 165 us first and 175-186 us
    later in one process on an H200 (2026-11-30, WORKSPACE.md)."""
    inner = {name: _calls_per_sample(fn) for name, fn in calls.items()}
    names, times = list(calls), {name: [] for name in calls}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            jax.block_until_ready([calls[name]() for _ in range(inner[name])])
            times[name].append((time.perf_counter() - t) / inner[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def _time(fn, repeats: int) -> float:
    """Median seconds per call of `fn` alone (see `_time_rounds`)."""
    return _time_rounds({"fn": fn}, repeats)["fn"]


def _copier(bufs: list):
    """A call that copies `bufs` into themselves, each byte read once and written once: the buffers are
    donated back to every call. A fresh output per call is faulted in page by page on a CPU (3-4 GB/s
    for 512 MiB against 22-26 GB/s reused, AMD Zen 4, 2026-12-07): the ceiling measured the page
    faults, and MBU came out several times too high. Returns a one-value array of the call's, to wait on."""
    # The second output is what a caller waits on: ready when the program is, as every output of one
    # run is. (A slice of the input or of the copy kept XLA from writing into the donated buffer.)
    step = jax.jit(lambda bs: ([b + 1.0 for b in bs], jnp.zeros((1,), jnp.float32)), donate_argnums=0)
    state = [bufs]

    def call():
        state[0], done = step(state[0])
        return done

    call.buffers = lambda: state[0]
    return call


def _copy(nbytes: int):
    """The ceiling's call: a copy of an `nbytes` buffer (`_copier`)."""
    return _copier([jnp.ones((nbytes // 4,), jnp.float32)])  # the values do not matter; random ones took seconds


CEILING_BYTES = 512 * 2**20


def copy_bandwidth(nbytes: int = CEILING_BYTES, repeats: int = 10) -> float:
    """Bytes/s of a device copy (each byte read once and written once, counted twice)."""
    return 2 * nbytes / _time(_copy(nbytes), repeats)


def _pools(args, ctx: int, rng) -> dict:
    """One layer's K/V pools, in the form each variant takes (all holding the same numbers)."""
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    dtype = jnp.dtype(args.dtype)
    num_pages = b * -(-ctx // s) + 1
    # Drawn on the device: float64 draws on the host took tens of seconds for a 16k-token batch.
    kk, vk = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    k = jax.random.normal(kk, (nk, num_pages, s, h), dtype)
    v = jax.random.normal(vk, (nk, num_pages, s, h), dtype)
    forms = dict(reference=(k, v), kernel=(k, v, {}), upstream=(k, v))
    if args.kv_dtype == "int8":
        from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

        from jaxinfer.kv_cache import QuantizedPages, quantize_int8

        k, v = (QuantizedPages(*quantize_int8(x)) for x in (k, v))
        forms["reference"] = (k, v)
        forms["kernel"] = (k.values, v.values, dict(k_scales=k.scales, v_scales=v.scales))
        forms["upstream"] = tuple(QuantizedTensor(x.values, x.scales[..., None] * MAX_INT8) for x in (k, v))
    return forms


def _check_pools_fit(args) -> None:
    """The largest context's pools (every layer's, in --dtype, drawn on the device; a pool's float32
    draw beside them while it is made) must fit: refused by flag, not an out-of-memory error mid-run."""
    from jaxinfer.capacity import free_device_bytes

    n, nk = args.heads
    ctx = max(args.contexts)
    elements = nk * (args.batch * -(-ctx // args.page_size) + 1) * args.page_size * args.head_dim
    need = 2 * args.layers * elements * jnp.dtype(args.dtype).itemsize + 4 * elements
    free = free_device_bytes()
    if need > free:
        raise InvalidRequestError(
            f"--batch {args.batch} x --contexts {ctx} ({nk} KV heads of --head-dim {args.head_dim}, "
            f"--layers {args.layers}): the K/V pools would take {need / 2**30:.1f} GiB, more than the "
            f"{free / 2**30:.1f} GiB free on {jax.devices()[0]}"
        )


def attention_bytes(args, ctx: int) -> int:
    """Bytes one layer's attention must move: every row's K and V (int8: + a float32 scale per token
    and head) read once - with --window only the last W keys - its queries read and outputs written
    once (--query-len of each per row)."""
    n, nk = args.heads
    itemsize = jnp.dtype(args.dtype).itemsize
    per_token_head = (args.head_dim + 4) if args.kv_dtype == "int8" else args.head_dim * itemsize
    keys = ctx if args.window is None else min(ctx, args.window)
    queries = args.batch * args.query_len
    return 2 * args.batch * keys * nk * per_token_head + 2 * queries * n * args.head_dim * itemsize


def attention_flops(args, ctx: int) -> int:
    """Multiply-adds x 2 of one layer's attention (QK^T and PV): each query token against the keys
    it sees (causal within the chunk, the window's last W with --window)."""
    n, t = args.heads[0], args.query_len
    seen = sum(min(ctx - t + 1 + i, args.window or ctx) for i in range(t))
    return 4 * args.batch * n * args.head_dim * seen


def _variants(args, ctx: int, variants: list[str], rng, platform: str):
    """(bytes one layer's decode attention must move, {variant: a call running all layers}).

    With --layers L the call runs L attention layers, each over its own pools, in one jitted
    function, each layer's output feeding the next layer's query (as in a model, so nothing can be
    skipped or reordered); the reported time is per layer. That is how a decode step runs them: one
    dispatch for the step, not one per attention call.
    """
    from jaxinfer.attention import reference_paged_attention, tiled_paged_attention
    from jaxinfer.config import GlobalAttention, SlidingWindow
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu

    on_tpu, on_gpu = platform == "tpu", platform == "gpu"
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    dtype = jnp.dtype(args.dtype)
    pages_per_row = -(-ctx // s)
    layers = [_pools(args, ctx, rng) for _ in range(args.layers)]
    t = args.query_len
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    table = jnp.asarray(1 + rng.permutation(b * pages_per_row).reshape(b, pages_per_row), jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)
    ones = jnp.full((b,), t, jnp.int32)  # each row's query tokens
    positions = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    scale = float(h**-0.5)
    moved = attention_bytes(args, ctx)
    kind = GlobalAttention() if args.window is None else SlidingWindow(args.window)
    attn = {}  # variant -> (form of the pools it takes, fn(q, *pools) -> [B, 1, N, H])
    if "reference" in variants:
        attn["reference"] = (
            "reference",
            lambda q, k, v: reference_paged_attention(q, k, v, table, positions, lens, scale=scale, kind=kind),
        )
    if "xla" in variants:
        attn["xla"] = (
            "reference",
            lambda q, k, v: tiled_paged_attention(q, k, v, table, positions, lens, scale=scale, kind=kind),
        )
    if "native" in variants:
        from jaxinfer import native

        if platform != "cpu" or not native.available():
            why = f"a CPU kernel, not run on {platform}" if platform != "cpu" else "not built here"
            print(f"  (native: {why}; skipped)")
        else:
            window = args.window  # `static` below is the Pallas kernels' own

            def run_native(q, kp, vp, sc):
                return native.paged_attention(q, kp, vp, table, lens, ones, scale=scale, window=window, **sc)

            attn["native"] = "kernel", run_native
    if "ours" in variants:
        kernel = ragged_paged_attention_gpu if on_gpu else ragged_paged_attention
        static = dict(scale=scale, window=args.window, interpret=not (on_tpu or on_gpu))
        static.update({k: v for k, v in (args.kernel_blocks or {}).items() if on_gpu})
        kp, vp, sc = layers[0]["kernel"]
        kernel(q, kp, vp, table, lens, ones, **static, **sc)  # the eager input checks, once
        attn["ours"] = "kernel", lambda q, kp, vp, sc: kernel(q, kp, vp, table, lens, ones, **static, **sc)
    if "mosaic" in variants and not on_gpu:
        print(f"  (mosaic: a Hopper GPU kernel, not run on {platform}; skipped)")
    elif "mosaic" in variants:
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu, supports

        kp, vp, sc = layers[0]["kernel"]
        static = dict(scale=scale, window=args.window)
        mosaic = lambda q, kp, vp, sc: ragged_paged_attention_mgpu(q, kp, vp, table, lens, ones, **static, **sc)  # noqa: E731
        if not supports(dtype=kp.dtype, page_size=s, head_dim=h, int8=bool(sc)):
            pools = "int8" if sc else str(kp.dtype)
            print(f"  (mosaic: not for {pools} pools of page {s}, head_dim {h}; skipped)")
        else:
            try:  # never compiled before a GPU session: a failure is a finding, not the end of the bench
                jax.block_until_ready(mosaic(q, kp, vp, sc))
                attn["mosaic"] = "kernel", mosaic
            except Exception as e:  # noqa: BLE001 - any compile or launch error, reported by name
                first = (str(e).strip().splitlines() or [""])[0][:300]
                print(f"  (mosaic: failed: {type(e).__name__}: {first})")
    if "upstream" in variants and t > 1:
        print("  (upstream: its paged attention decodes one token per row; skipped)")
    elif "upstream" in variants and args.window is not None:
        print("  (upstream: its paged attention has no sliding window; skipped)")
    elif "upstream" in variants and on_gpu:
        import warnings

        with warnings.catch_warnings():  # upstream marks its GPU paged attention deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as upstream_gpu

        # Its defaults (16 KV splits, 8 pages per block), cut to what this table divides into.
        splits = max(d for d in (1, 2, 4, 8, 16) if pages_per_row % d == 0)
        block = max(d for d in (1, 2, 4, 8) if (pages_per_row // splits) % d == 0)
        attn["upstream"] = "kernel", lambda q, kp, vp, sc: upstream_gpu(
            q[:, 0] * scale, kp, vp, table, lens, sc.get("k_scales"), sc.get("v_scales"),
            k_splits=splits, pages_per_compute_block=block,
        )  # fmt: skip
    elif "upstream" in variants:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as upstream

        block = max(d for d in (1, 2, 4, 8, 16) if pages_per_row % d == 0)

        def up(q, k, v):
            with contextlib.ExitStack() as stack:
                if not on_tpu:
                    stack.enter_context(pltpu.force_tpu_interpret_mode())
                return upstream(q[:, 0] * scale, k, v, lens, table, pages_per_compute_block=block)

        attn["upstream"] = "upstream", up

    calls = {}
    if "copy" in variants:  # a plain copy moving the same bytes per layer, with the same per-call costs
        calls["copy"] = _copier(
            [jax.random.normal(jax.random.key(i), (moved // 8,), jnp.float32) for i in range(args.layers)]
        )
    for name, (form, fn) in attn.items():
        pools = [layer[form] for layer in layers]

        def chain(q, pools, fn=fn):
            for pool in pools:
                q = fn(q, *pool).reshape(q.shape).astype(q.dtype)
            return q

        # CPU: the kernels run in TPU interpret mode, where nothing else may be dispatched: no jit.
        interpreted = platform == "cpu" and name in ("ours", "upstream")
        run_chain = chain if interpreted else jax.jit(chain)
        calls[name] = functools.partial(run_chain, q, pools)
    return moved, calls


def run(args) -> list[dict]:
    platform = jax.default_backend()
    simulated_kernels = platform == "cpu"
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        raise InvalidRequestError("--heads takes N,K with N a multiple of K")
    window = 1 if args.window is None else args.window  # None: global
    for flag, value in (
        ("--batch", args.batch),
        ("--head-dim", args.head_dim),
        ("--page-size", args.page_size),
        ("--repeats", args.repeats),
        ("--layers", args.layers),
        ("--window", window),
        ("--query-len", args.query_len),
    ):
        if value < 1:
            raise InvalidRequestError(f"{flag} must be positive, got {value}")
    if args.query_len > min(args.contexts):
        raise InvalidRequestError(
            f"--query-len {args.query_len} is longer than the shortest of --contexts ({min(args.contexts)}): "
            "a row's query tokens are the last of its context"
        )
    _check_pools_fit(args)
    named = args.variants
    if named is None:  # CPU: the kernels only as a simulation, so only when asked for
        named = "copy,reference,xla,native" if simulated_kernels else ",".join(v for v in VARIANTS if v != "native")
    variants = [v.strip() for v in named.split(",") if v.strip()]
    if not variants:
        raise InvalidRequestError(f"--variants names none; pick from {', '.join(VARIANTS)}")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise InvalidRequestError(f"unknown --variants {sorted(unknown)}")
    n, nk = args.heads
    h, s, b = args.head_dim, args.page_size, args.batch
    print(
        f"{platform} ({jax.devices()[0].device_kind}): "
        + ("decode" if args.query_len == 1 else f"prefill chunks of {args.query_len} tokens")
        + f", batch {b}, "
        f"{n} query / {nk} KV heads, head_dim {h}, page {s}, {args.dtype}"
        + (", int8 KV cache (+ float32 scales)" if args.kv_dtype == "int8" else "")
        + (f"; {args.layers} layers per call, time per layer" if args.layers > 1 else "")
        + (f"; sliding window {args.window} (bytes: the window's K/V)" if args.window else "")
    )
    print(
        f"  (each context's variants and a {CEILING_BYTES // 2**20} MiB copy, the MBU ceiling, are timed in "
        f"{args.repeats} interleaved rounds; medians)"
    )
    if simulated_kernels and {"ours", "upstream"} & set(variants):
        print("  (CPU: 'ours' and 'upstream' run in TPU interpret mode - simulated, not a speed)")
    elif simulated_kernels:
        print("  (CPU: the Pallas kernels would run in TPU interpret mode, a simulation taking minutes per shape;")
        print("   --variants ours,upstream runs them anyway)")
    print(f"{'context':>8} {'variant':>10} {'time':>10} {'MB moved':>9} {'GB/s':>7} {'MBU':>6} {'TFLOP/s':>8}")
    rows = []
    rng = np.random.default_rng(0)
    for ctx in args.contexts:
        moved, calls = _variants(args, ctx, variants, rng, platform)
        timed = _time_rounds({**calls, "(ceiling)": _copy(CEILING_BYTES)}, args.repeats)
        ceiling = 2 * CEILING_BYTES / timed.pop("(ceiling)")
        print(f"{ctx:>8} {'(ceiling)':>10} copy bandwidth {ceiling / 1e9:.1f} GB/s")
        flops = attention_flops(args, ctx)
        for name, call_seconds in timed.items():
            seconds = call_seconds / args.layers
            bw = moved / seconds
            simulated = name in ("ours", "upstream") and simulated_kernels
            row = dict(context=ctx, variant=name, seconds=seconds, bytes=moved, bandwidth=bw, mbu=bw / ceiling)
            row["simulated"] = simulated
            rows.append(row)
            mbu = "  sim." if simulated else f"{100 * bw / ceiling:5.1f}%"
            tflops = ""
            if name != "copy":  # the copy moves the bytes and does no attention
                row["flops"] = flops
                tflops = f"{flops / seconds / 1e12:8.2f}"
            print(
                f"{ctx:>8} {name:>10} {seconds * 1e3:>8.3f}ms {moved / 1e6:>9.1f} {bw / 1e9:>7.1f} {mbu:>6} {tflops:>8}"
            )
    if any(r["mbu"] > 1 and not r["simulated"] for r in rows):
        print(
            "  (MBU above 100%: those shapes' K/V fit in the processor's caches, so they were not read from "
            "memory; the copy ceiling streams 512 MB. Longer --contexts or a larger --batch measure memory.)"
        )
    return rows


def main(argv: list[str] | None = None, prog: str = "python -m pallas_kernels.bench") -> int:
    from jaxinfer.cli import HelpFormatter

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run(args)
    except JaxinferError as e:  # as `jaxinfer bench kernels` answers it (jaxinfer.cli.main)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
