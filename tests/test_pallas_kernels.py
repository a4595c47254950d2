"""The Pallas ragged paged-attention kernel for TPU (in TPU interpret mode on CPU) and the tiled
pure-JAX attention (the "xla" backend), against the plain pure-JAX reference; the kernels in the
model, on a mesh, in the bench. The GPU kernel's tests are in test_pallas_kernels_gpu.py; the
random ragged batches both use are in kernel_cases.py.
"""

from __future__ import annotations

import argparse
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    CASES_PER_STATIC,
    PAGE,
    PAGE_STATICS,
    POOL,
    STATICS,
    WIDTH,
    Static,
    check_kernel_against_reference,
    check_under_shard_map,
    engine_outputs_by_backend,
    kernel_args,
    random_batch,
    static_id,
)

from jaxinfer import LLM, InvalidRequestError
from jaxinfer.attention import (
    paged_attention,
    reference_paged_attention,
    resolve_backend,
    tiled_paged_attention,
    write_kv,
)
from jaxinfer.config import GlobalAttention, SlidingWindow
from jaxinfer.kv_cache import QuantizedPages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu


@pytest.mark.parametrize("st", STATICS + PAGE_STATICS, ids=static_id)
def test_kernel_matches_reference(st):
    """The TPU kernel under the strict TPU simulation. Block sizes: the table's choice, one page per
    block, and a block that straddles the table's end."""
    blocks = [{}, dict(pages_per_block=1), dict(pages_per_block=3)]
    check_kernel_against_reference(ragged_paged_attention, st, blocks, interpret="tpu")


# Jitted once per static configuration and tiling (eagerly, every call would trace its while loop anew).
_tiled = jax.jit(
    tiled_paged_attention, static_argnames=("scale", "kind", "soft_cap", "rows_per_tile", "tokens_per_tile")
)


# Decode (t = 1) takes its own path in the tiled attention (multiply-and-sum contractions, inputs
# widened to float32): also in bfloat16, plain and with int8 pools, which STATICS cover at t > 1 only.
TILED_STATICS = [
    *STATICS,
    *PAGE_STATICS,
    Static(group=4, head_dim=64, t=1, dtype="bfloat16", window=6, soft_cap=20.0),
    Static(group=2, head_dim=128, t=1, dtype="bfloat16", int8=True),
]


@pytest.mark.parametrize("st", TILED_STATICS, ids=static_id)
def test_tiled_xla_attention_matches_reference(st):
    """The "xla" backend: tiles of R rows x T tokens with an online softmax; row groups that do not
    divide the batch (padded), tiles that do not divide the table (padded with scratch pages), tiles
    smaller than a page (one page per tile), and the default (one tile covers the table)."""
    rng = np.random.default_rng(zlib.crc32(static_id(st).encode()) + 1)
    scale = st.softmax_scale
    kind = SlidingWindow(st.window) if st.window else GlobalAttention()
    tol = 2e-2 if st.dtype == "bfloat16" else 2e-5
    tiles = [dict(), dict(rows_per_tile=3, tokens_per_tile=3 * PAGE), dict(rows_per_tile=1, tokens_per_tile=2)]
    for case in range(CASES_PER_STATIC):
        q, k, v, table, kv, ql = random_batch(rng, st)
        positions = (kv - ql)[:, None] + jnp.arange(st.t)[None, :]
        ref = reference_paged_attention(q, k, v, table, positions, kv, scale=scale, kind=kind, soft_cap=st.soft_cap)
        tiling = tiles[case % len(tiles)]
        out = _tiled(q, k, v, table, positions, kv, scale=scale, kind=kind, soft_cap=st.soft_cap, **tiling)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        for row in range(q.shape[0]):
            n = int(ql[row])
            got, want = out[row, :n], ref[row, :n]
            assert np.isfinite(got).all(), (case, row, tiling, "stale NaN leaked")
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"case {case} row {row} {tiling}")


@pytest.mark.parametrize("kind", [GlobalAttention(), SlidingWindow(6)], ids=["global", "window"])
def test_tiled_xla_attention_row_does_not_depend_on_its_neighbours(kind):
    """Bitwise: a row attended alone and inside a batch of longer and shorter rows (so its tile
    group visits tiles past its own length, or before its window) gives the same output; continuous
    batching relies on it."""
    rng = np.random.default_rng(7)
    st = Static(group=4, head_dim=64, t=1)
    q, k, v, table, kv, ql = random_batch(rng, st)
    kv = jnp.asarray([WIDTH * PAGE, 3, PAGE + 1, 0], jnp.int32)
    ql = jnp.minimum(kv, 1)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    positions = (kv - ql)[:, None]
    args = dict(scale=0.125, kind=kind, rows_per_tile=4, tokens_per_tile=PAGE)
    together = np.asarray(tiled_paged_attention(q, k, v, table, positions, kv, **args))
    for row in range(3):
        sl = slice(row, row + 1)
        alone = np.asarray(tiled_paged_attention(q[sl], k, v, table[sl], positions[sl], kv[sl], **args))
        np.testing.assert_array_equal(alone[0], together[row])


@pytest.mark.parametrize("t", [4, 1], ids=["chunk", "decode"])
@pytest.mark.parametrize("attend", [reference_paged_attention, tiled_paged_attention])
def test_int8_pools_are_dequantized_in_float32_whatever_the_query_dtype(attend, t):
    """The pure-JAX forms over int8 pools give with bfloat16 queries what they give with the same
    queries in float32, rounded once at the end: value x scale is not rounded to bfloat16 first (that
    moved outputs by up to ~0.05 at softmax scale 1), nor are the products summed in bfloat16 (the
    tiled form's decode path)."""
    rng = np.random.default_rng(3)
    st = Static(group=2, head_dim=64, t=t, dtype="bfloat16", int8=True)
    q, k, v, table, kv, ql = random_batch(rng, st)
    positions = (kv - ql)[:, None] + jnp.arange(st.t)[None, :]
    args = (k, v, table, positions, kv)
    kw = dict(scale=1.0, kind=GlobalAttention())
    low = np.asarray(attend(q, *args, **kw), np.float32)
    high = np.asarray(attend(q.astype(jnp.float32), *args, **kw).astype(jnp.bfloat16), np.float32)
    for row in range(q.shape[0]):
        n = int(ql[row])
        np.testing.assert_allclose(low[row, :n], high[row, :n], rtol=2**-7, atol=1e-6)


def test_out_of_range_inputs_are_refused_by_every_backend():
    """The dispatch point refuses, by name, indices the pure-JAX forms would wrap (-1 read the pool's
    last page: another sequence's) or clamp, as the kernels do; write_kv the slots its scatter would
    wrap or drop. (Inside a jit nothing can be refused: there the engine's own tables are the guard.)"""
    rng = np.random.default_rng(0)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=1, head_dim=64, t=2))
    positions = (kv - ql)[:, None] + jnp.arange(2)[None, :]
    for backend in ("reference", "xla", "pallas"):
        call = lambda backend=backend, **kw: paged_attention(  # noqa: E731
            q, k, v, kw.get("table", table), positions, kw.get("kv", kv),
            q_lens=kw.get("ql", ql), scale=0.125, kind=GlobalAttention(), backend=backend,
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"page_table\[0, 0\] = -1 is outside \[0, 24\)"):
            call(table=table.at[0, 0].set(-1))
        with pytest.raises(ValueError, match=r"kv_lens\[3\] = 33 is outside \[0, 32\]"):
            call(kv=kv.at[3].set(WIDTH * PAGE + 1))
        with pytest.raises(ValueError, match=r"q_lens\[1\] = -1"):
            call(ql=ql.at[1].set(-1))
        new = jnp.zeros((1, 2, k.shape[0], 64), jnp.float32)
        for bad in (-1, POOL * PAGE):
            with pytest.raises(ValueError, match=rf"slots\[0, 1\] = {bad} is outside \[0, {POOL * PAGE}\)"):
                write_kv(k, v, new, new, jnp.asarray([[0, bad]], jnp.int32), backend=backend)


def test_out_of_range_inputs_are_refused():
    rng = np.random.default_rng(0)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=1, head_dim=64, t=2))
    call = lambda **kw: ragged_paged_attention(  # noqa: E731
        kw.get("q", q), k, v, kw.get("table", table), kw.get("kv", kv), kw.get("ql", ql), scale=0.125, interpret=True
    )
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 24 is outside \[0, 24\)"):
        call(table=table.at[1, 2].set(POOL))
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = -1"):
        call(table=table.at[0, 0].set(-1))
    with pytest.raises(ValueError, match=r"kv_lens\[3\] = 33 is outside \[0, 32\]"):
        call(kv=kv.at[3].set(WIDTH * PAGE + 1))
    with pytest.raises(ValueError, match=r"q_lens\[2\] = 5"):
        call(kv=kv.at[2].set(9), ql=ql.at[2].set(5))
    with pytest.raises(TypeError, match="scale must be a Python float"):
        ragged_paged_attention(q, k, v, table, kv, ql, scale=jnp.float32(0.1), interpret=True)
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 24 is outside"):
        ragged_paged_attention_gpu(q, k, v, table.at[1, 2].set(POOL), kv, ql, scale=0.125, interpret=True)


@pytest.mark.parametrize("kernel", [ragged_paged_attention, ragged_paged_attention_gpu])
def test_inputs_of_the_wrong_shape_or_kind_are_refused(kernel):
    """Shapes the in-jit clamps cannot save: they only know k_pages' page count, so a shorter v pool or
    length vector, or a page table with fewer rows, was read out of bounds (seen with Pallas' strict
    TPU interpreter, and as NaN from the GPU kernel's)."""
    rng = np.random.default_rng(0)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=2, head_dim=64, t=2))

    def call(**kw):
        args = dict(q=q, k=k, v=v, table=table, kv=kv, ql=ql)
        static = {key: kw.pop(key) for key in ("window", "soft_cap") if key in kw}
        args.update(kw)
        a = args
        return kernel(a["q"], a["k"], a["v"], a["table"], a["kv"], a["ql"], scale=0.125, interpret=True, **static)

    for kw, message in [
        (dict(v=v[:, : POOL // 2]), r"v_pages must match k_pages"),
        (dict(v=v[:1]), r"v_pages must match k_pages"),
        (dict(v=v.astype(jnp.bfloat16)), r"v_pages must match k_pages"),
        (dict(kv=kv[:1]), r"kv_lens must have shape \[B\] = \(4,\), got \(1,\)"),
        (dict(ql=jnp.concatenate([ql, ql])), r"q_lens must have shape \[B\] = \(4,\)"),
        (dict(table=table[:2]), r"page_table must be \[B=4, pages per row >= 1\], got shape \(2, 4\)"),
        (dict(table=table[0]), r"page_table must be \[B=4"),
        (dict(kv=kv.astype(jnp.float32)), r"kv_lens must hold integers, got float32"),
        (dict(q=q.astype(jnp.int32)), r"q must be floating point"),
        (dict(q=q[:0], table=table[:0], kv=kv[:0], ql=ql[:0]), r"q must hold at least one row"),
        (dict(window=0), r"window must be a positive int"),
        (dict(window=2.0), r"window must be a positive int"),
        (dict(soft_cap=0.0), r"soft_cap must be a positive finite Python number"),
        (dict(soft_cap=float("nan")), r"soft_cap must be a positive finite"),
        (dict(kv=[int(x) for x in kv]), r"kv_lens must be an array, got list"),  # an AttributeError before
    ]:
        with pytest.raises(ValueError, match=message):
            call(**kw)
    # A scale that is not a positive finite float made every output NaN or meaningless.
    for scale in (float("nan"), float("inf"), 0.0, -0.125):
        with pytest.raises(ValueError, match="scale must be a positive finite float"):
            kernel(q, k, v, table, kv, ql, scale=scale, interpret=True)
    # int8 pools with integer scales ran, and every output was 0.
    st = Static(group=2, head_dim=64, t=2, int8=True)
    q8, k8, v8, table8, kv8, ql8 = random_batch(rng, st)
    kp, vp, kwargs = kernel_args(k8, v8)
    kwargs = {name: x.astype(jnp.int32) for name, x in kwargs.items()}
    with pytest.raises(ValueError, match="k_scales/v_scales must be float32, got int32 and int32"):
        kernel(q8, kp, vp, table8, kv8, ql8, scale=0.125, interpret=True, **kwargs)


def test_block_tables_choose_per_shape_and_refuse_bad_overrides():
    from pallas_kernels.ragged_paged_attention import pages_per_block_for
    from pallas_kernels.ragged_paged_attention_gpu import blocks_for

    assert [pages_per_block_for(s, 64) for s in (8, 16, 32, 64, 128)] == [16, 8, 4, 2, 1]
    assert pages_per_block_for(16, 3) == 3  # never more pages than a row's table holds
    assert blocks_for(page_size=16, head_dim=128, rows=16).pages_per_step == 4
    assert blocks_for(page_size=16, head_dim=256, rows=64).num_warps == 8
    assert blocks_for(page_size=16, head_dim=128, rows=16, int8=True).pages_per_step == 8  # same bytes per step
    # Decode at batch 8 x 8 KV heads splits the pages 8 ways (~512 programs); batch 64 needs no split,
    # and a prefill chunk of 64 tokens x 4 heads is 4 row blocks of 64 rows.
    assert blocks_for(page_size=16, head_dim=128, rows=16, programs=64, table_pages=256).kv_splits == 8
    assert blocks_for(page_size=16, head_dim=128, rows=16, programs=512, table_pages=256).kv_splits == 1
    prefill = blocks_for(page_size=16, head_dim=128, rows=256, programs=8, table_pages=256)
    assert (prefill.rows_per_block, prefill.kv_splits) == (64, 16)
    assert blocks_for(page_size=16, head_dim=128, rows=16, programs=1, table_pages=4).kv_splits == 1  # 1 step
    # Shapes the compiled GPU kernel cannot tile: "auto" keeps the reference for them on a GPU.
    from pallas_kernels.ragged_paged_attention_gpu import supports

    assert supports(page_size=16, head_dim=128) and supports(page_size=8, head_dim=64)
    assert not supports(page_size=16, head_dim=80) and not supports(page_size=12, head_dim=128)
    assert not supports(page_size=16, head_dim=8)  # a dot of fewer than 16 columns: Triton refuses it
    q, k, v, table, kv, ql = random_batch(np.random.default_rng(0), Static(group=1, head_dim=64, t=1))
    for bad in (0, True):  # (True was taken for 1)
        with pytest.raises(ValueError, match="pages_per_block must be a positive int"):
            ragged_paged_attention(q, k, v, table, kv, ql, scale=0.125, interpret=True, pages_per_block=bad)
    with pytest.raises(ValueError, match="num_warps must be a positive int"):
        ragged_paged_attention_gpu(q, k, v, table, kv, ql, scale=0.125, interpret=True, num_warps=-1)


def test_backend_resolution():
    assert resolve_backend("auto", "tpu") == "pallas"
    assert resolve_backend("auto", "cpu") in ("native", "xla")  # "native" where it builds: test_native.py
    assert resolve_backend("auto", "gpu") == "pallas"
    assert resolve_backend("auto", "gpu", compute_capability="9.0") == "pallas"
    assert resolve_backend("auto", "gpu", compute_capability="8.0") == "pallas"
    # Before Ampere (a T4, Colab's free GPU: 7.5) Triton has no bfloat16 tensor-core dot.
    assert resolve_backend("auto", "gpu", compute_capability="7.5") == "reference"
    assert resolve_backend("pallas", "gpu", compute_capability="7.5") == "pallas"  # asked for by name
    assert resolve_backend("xla", "gpu") == "xla"
    assert resolve_backend("pallas", "cpu") == "pallas"
    assert resolve_backend("pallas", "gpu") == "pallas"
    assert resolve_backend("reference", "tpu") == "reference"


def test_model_with_the_pallas_backend_matches_reference():
    """End to end: greedy tokens and log-probabilities with the kernel == with the reference,
    through chunked prefill, decode, a sliding-window layer and a soft cap. (The backends meet
    transformers itself in test_hf_parity.py's random configurations, each drawing its backend.)"""
    outs, lps, _ = engine_outputs_by_backend(("reference", "pallas"))
    assert outs["pallas"] == outs["reference"]
    assert all(len(t) == 6 for t in outs["pallas"])
    assert len({tuple(t) for t in outs["reference"]}) == 3  # distinct, so agreement means something
    for a, b in zip(lps["pallas"], lps["reference"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_llm_takes_the_backend_by_name():
    with pytest.raises(Exception, match="attention_backend must be one of"):
        LLM(attention_backend="triton")


@pytest.mark.parametrize("group,soft_cap,int8", [(1, None, False), (2, 20.0, False), (4, None, False), (2, None, True)])
def test_decode_agrees_with_upstream_paged_attention(group, soft_cap, int8):
    """A second opinion from code nobody here wrote: jax.experimental.pallas.ops.tpu.paged_attention
    (decode only, H = 128), forced into TPU interpret mode. It computes at reduced precision there
    (a one-key softmax already differs from V by ~5e-3), hence the looser tolerance. Its int8 pools
    (QuantizedTensor) also carry one scale per token and head, as absmax: ours times 127.5."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as upstream
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

    rng = np.random.default_rng(group)
    st = Static(group=group, head_dim=128, t=1, soft_cap=soft_cap, int8=int8)
    scale = 128**-0.5
    for _ in range(6):
        q, k, v, table, kv, ql = random_batch(rng, st)
        kv = jnp.maximum(kv, 1)  # upstream has no notion of an empty row
        # nor of stale pages (it reads whole compute blocks): no NaN for it
        if int8:
            k, v = (QuantizedPages(values=x.values, scales=jnp.nan_to_num(x.scales)) for x in (k, v))
            theirs_k, theirs_v = (QuantizedTensor(x.values, x.scales[..., None] * MAX_INT8) for x in (k, v))
        else:
            k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
            theirs_k, theirs_v = k, v
        kp, vp, scales = kernel_args(k, v)
        ours = ragged_paged_attention(
            q, kp, vp, table, kv, jnp.ones_like(kv), scale=scale, soft_cap=soft_cap, interpret=True, **scales
        )[:, 0]
        jax.block_until_ready(ours)
        with pltpu.force_tpu_interpret_mode():
            theirs = upstream(
                q[:, 0] * scale, theirs_k, theirs_v, kv, table, pages_per_compute_block=2, attn_logits_soft_cap=soft_cap
            )
            jax.block_until_ready(theirs)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-2, rtol=2e-2)


def test_kernel_bench_smoke(capsys):
    from jaxinfer import cli

    args = ["bench", "kernels", "--batch", "2", "--contexts", "32", "--heads", "2,1", "--head-dim", "128"]
    assert cli.main([*args, "--repeats", "1", "--variants", "reference,xla,ours"]) == 0
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "reference" in out and "sim." in out  # CPU: the kernel is simulated
    xla_row = next(line for line in out.splitlines() if " xla " in line)
    assert "sim." not in xla_row and "%" in xla_row  # the tiled pure-JAX form is a real CPU speed
    from pallas_kernels import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    int8 = [*args[2:], "--repeats", "1", "--variants", "reference,ours,upstream", "--kv-dtype", "int8", "--window", "8"]
    rows = bench.run(p.parse_args(int8))
    out = capsys.readouterr().out
    assert "int8 KV cache" in out and "no sliding window; skipped" in out  # upstream has no window
    # K and V of 2 rows x the window's 8 of 32 tokens x 1 KV head: 128 int8 + one float32 scale each;
    # q read and written (bf16).
    assert [(r["variant"], r["bytes"]) for r in rows] == [
        (v, 2 * 2 * 8 * (128 + 4) + 2 * (2 * 2 * 128 * 2)) for v in ("reference", "ours")
    ]
    # Unasked, CPU runs only the real speeds: interpret mode takes minutes per realistic shape.
    # The C++ kernel, what the model runs on CPU, is among them where it is built.
    from jaxinfer import native

    rows = bench.run(p.parse_args([*args[2:], "--repeats", "1"]))
    expected = ["copy", "reference", "xla"] + (["native"] if native.available() else [])
    assert [r["variant"] for r in rows] == expected and "--variants ours" in capsys.readouterr().out


def test_kernel_bench_figures_on_made_up_times(monkeypatch):
    """Bandwidth and MBU against hand counts, on made-up times (the smoke test above can only check
    the figures' form: a CPU's speeds vary from run to run)."""
    from pallas_kernels import bench

    monkeypatch.setattr(bench, "_time_rounds", lambda calls, repeats: {name: 0.5 for name in calls})
    assert bench.copy_bandwidth(nbytes=4096) == 2 * 4096 / 0.5  # each byte read once and written once
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = ["--batch", "2", "--contexts", "32", "--heads", "4,2", "--head-dim", "64", "--layers", "4"]
    rows = bench.run(p.parse_args([*argv, "--variants", "reference,xla", "--repeats", "1"]))
    # One layer: K and V of 2 rows x 32 tokens x 2 KV heads of 64 (bfloat16), queries read and
    # outputs written (2 rows x 4 heads of 64); four layers per 0.5 s call. The ceiling: a 512 MiB
    # copy (read and written) in 0.5 s, timed in the same rounds.
    moved = 2 * 2 * 32 * 2 * 64 * 2 + 2 * 2 * 4 * 64 * 2
    assert [r["variant"] for r in rows] == ["reference", "xla"]
    for r in rows:
        assert (r["bytes"], r["seconds"], r["bandwidth"]) == (moved, 0.5 / 4, moved / (0.5 / 4))
        assert r["mbu"] == moved / (0.5 / 4) / (2 * 512 * 2**20 / 0.5)


def test_the_copy_ceiling_copies_into_the_same_buffers_every_call():
    """A fresh output per call is faulted in page by page on a CPU: the ceiling measured page faults
    (3-4 GB/s where the memory reads and writes at 22-26), and MBU came out several times too high."""
    from pallas_kernels import bench

    x = jnp.ones((1 << 20,), jnp.float32)
    where = x.unsafe_buffer_pointer()
    call = bench._copier([x])
    for _ in range(3):
        jax.block_until_ready(call())
    (buf,) = call.buffers()
    assert buf.unsafe_buffer_pointer() == where and float(buf[0]) == float(buf[-1]) == 4.0


def test_kernel_bench_samples_its_variants_in_interleaved_rounds(monkeypatch):
    """Each round times every call once, in a rotating order, and each call's median is its own:
    a machine that slows down mid-run slows every variant alike instead of the last ones timed."""
    from pallas_kernels import bench

    order = []
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    monkeypatch.setattr(bench, "_calls_per_sample", lambda fn: 1)
    medians = bench._time_rounds(calls, repeats=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert medians == {"a": 1.0, "b": 1.0, "c": 1.0}  # each sample: one tick of the made-up clock


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "0,0"], "--heads: expected comma-separated positive integers"),  # was a ZeroDivisionError
        (["--heads", "4,-2"], "--heads: expected comma-separated positive integers"),
        (["--contexts", ","], "--contexts: expected comma-separated positive integers"),  # an empty table, exit 0
    ],
)
def test_kernel_bench_flags_are_usage_errors(capsys, argv, message):
    from pallas_kernels import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_kernel_bench_refuses_a_zero_window_and_no_variants():
    from pallas_kernels import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(InvalidRequestError, match="--window must be positive, got 0"):  # ran as a 0-byte, 0.1% MBU row
        bench.run(p.parse_args(["--window", "0"]))
    with pytest.raises(InvalidRequestError, match="--batch must be positive, got 0"):
        bench.run(p.parse_args(["--batch", "0"]))
    with pytest.raises(InvalidRequestError, match="--variants names none"):
        bench.run(p.parse_args(["--variants", ""]))
    with pytest.raises(InvalidRequestError, match=r"--batch 100000 x --contexts 100000 .* GiB, more than the"):
        bench.run(p.parse_args(["--batch", "100000", "--contexts", "100000"]))  # was a MemoryError mid-run


@pytest.mark.parametrize(
    "model_axis,kv_heads,int8", [(2, 2, False), (4, 4, True), (4, 2, False), (8, 2, True), (2, 3, False)]
)
def test_kernel_under_shard_map_over_kv_heads(model_axis, kv_heads, int8):
    """Sharded over the mesh's `model` axis (replicated when KV heads are fewer, or not a multiple of
    it: 3 over 2): same output."""
    check_under_shard_map(ragged_paged_attention, model_axis, kv_heads, int8)


@pytest.mark.parametrize("rows,width", [(1, 8), (4, 8), (16, 8), (1, 16), (64, 32)])
def test_tiled_xla_attention_never_copies_the_page_pool(rows, width):
    """A compiled decode step with the "xla" attention needs tile-sized temporaries only. (With one
    tile per row XLA once hoisted the tile's gather out of the loop and copied every layer's pool:
    a batch-1 step went from 18 to 130 ms.)"""
    from jaxinfer.config import ModelConfig
    from jaxinfer.kv_cache import Batch, KVCache
    from jaxinfer.model import decode_step, init_params

    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=1024, attention_backend="xla",
    )  # fmt: skip
    cache = KVCache.create(cfg, num_pages=1024, page_size=16)
    batch = Batch(
        tokens=jnp.ones((rows, 1), jnp.int32),
        q_lens=jnp.ones((rows,), jnp.int32),
        kv_lens=jnp.full((rows,), 100, jnp.int32),
        page_table=jnp.zeros((rows, width), jnp.int32),
    )
    compiled = decode_step.lower(init_params(cfg, 0), cache, batch, cfg=cfg).compile()
    pool_bytes = cache.k[0].nbytes
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes / 4


def test_kernel_bench_prefill_chunks_time_the_same_attention_in_every_variant(capsys):
    """`--query-len T` times chunks of prefill: each row's last T tokens attend causally to their
    context. Every variant's chained call computes the same numbers (the kernel in interpret mode),
    the bytes count T queries and outputs per row, and the FLOPs each query's visible keys."""
    from pallas_kernels import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = ["--batch", "2", "--heads", "4,2", "--head-dim", "64", "--layers", "2", "--query-len", "5"]
    args = p.parse_args([*argv, "--dtype", "float32"])
    from jaxinfer import native

    others = ["xla", "ours"] + (["native"] if native.available() else [])
    moved, calls = bench._variants(args, 21, ["reference", *others], np.random.default_rng(0), "cpu")
    outs = {name: np.asarray(fn()) for name, fn in calls.items()}
    assert outs["reference"].shape == (2, 5, 4, 64) and set(outs) == {"reference", *others}
    for name in others:
        np.testing.assert_allclose(outs[name], outs["reference"], atol=2e-5, rtol=2e-5)
    assert moved == 2 * 2 * 21 * 2 * 64 * 4 + 2 * (2 * 5) * 4 * 64 * 4
    # Query i of 5 (positions 16..20) sees 17 + i keys: 17+18+19+20+21 = 95 per row and head.
    assert bench.attention_flops(args, 21) == 4 * 2 * 4 * 64 * 95
    windowed = p.parse_args([*argv, "--window", "18"])  # the last three see 18 keys, not 19-21
    assert bench.attention_flops(windowed, 21) == 4 * 2 * 4 * 64 * (17 + 18 + 18 + 18 + 18)
    assert bench.main([*argv, "--contexts", "4,32"]) == 2
    assert "--query-len 5 is longer than the shortest of --contexts (4)" in capsys.readouterr().err
