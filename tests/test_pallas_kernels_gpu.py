"""The Pallas ragged paged-attention kernels for GPUs: in interpret mode on CPU against the pure-JAX
reference on the random ragged batches of kernel_cases.py, under shard_map, against upstream's GPU
paged attention; and, where a GPU is present, compiled by Triton (those tests skip without one).
The Mosaic GPU (Hopper) variant runs in Pallas' GPU interpret mode here, compiled where a Hopper GPU is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    PAGE_STATICS,
    STATICS,
    Static,
    check_kernel_against_reference,
    check_under_shard_map,
    engine_outputs_by_backend,
    greedy_agreement,
    kernel_args,
    random_batch,
    static_id,
)

from jaxinfer.attention import reference_paged_attention
from jaxinfer.config import GlobalAttention, SlidingWindow
from jaxinfer.kv_cache import QuantizedPages
from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention_mgpu import SMEM_BYTES, ragged_paged_attention_mgpu, smem_bytes

# Interpret mode: the table's choice, one page per step with more KV splits than a row has pages,
# and row blocks.
INTERPRET_BLOCKS = [
    {},
    dict(pages_per_step=1, kv_splits=3),
    dict(pages_per_step=8, kv_splits=1, rows_per_block=16),
    dict(pages_per_step=2, kv_splits=8, rows_per_block=32),
]


@pytest.mark.parametrize("st", STATICS + PAGE_STATICS, ids=static_id)
def test_kernel_matches_reference(st):
    check_kernel_against_reference(ragged_paged_attention_gpu, st, INTERPRET_BLOCKS, interpret=True)


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
@pytest.mark.parametrize("sign", [1, -1], ids=["high", "low"])
def test_kernels_keep_softmax_exact_at_extreme_logits(kernel, sign):
    """Logits near +160 (exp overflows float32 unless each split's and the merge's sums are taken
    from their running max) and near -160 (exp underflows to 0 unless the max starts below every
    logit), over several steps and KV splits."""
    rng = np.random.default_rng(7)
    b, n, nk, h, s, width = 2, 2, 1, 64, 8, 32
    kv, ql = jnp.asarray([200, 130], jnp.int32), jnp.asarray([1, 1], jnp.int32)
    dtype = jnp.float32 if kernel == "triton" else jnp.float16
    k = jnp.asarray(1 + 0.1 * rng.standard_normal((nk, b * width + 1, s, h)), dtype)
    v = jnp.asarray(rng.standard_normal((nk, b * width + 1, s, h)), dtype)
    q = jnp.full((b, 1, n, h), sign * 20.0, dtype)  # q.k / 8 = 160 +- ~16
    table = jnp.asarray(1 + rng.permutation(b * width).reshape(b, width), jnp.int32)
    if kernel == "triton":
        out = ragged_paged_attention_gpu(
            q, k, v, table, kv, ql, scale=0.125, interpret=True, pages_per_step=2, kv_splits=4
        )
    else:
        out = ragged_paged_attention_mgpu(q, k, v, table, kv, ql, scale=0.125, interpret=True, kv_splits=2)
    ref = reference_paged_attention(q, k, v, table, (kv - ql)[:, None], kv, scale=0.125, kind=GlobalAttention())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-3, rtol=2e-3)


def test_kernel_under_shard_map_over_kv_heads():
    """Its block table then sees the per-device batch and heads."""
    check_under_shard_map(ragged_paged_attention_gpu, 4, 4, True)


@pytest.mark.skip(
    reason="Pallas' GPU interpret mode (jax 0.11.2) deadlocks when two CPU devices interpret the kernel at "
    "once: this test hung in 1 of 3 runs on 2026-11-30 (py-spy: waiting on the sharded result, every thread "
    "idle), past pytest-timeout's reach; on jax 0.10.2 (2026-12-06) it hung in 4 of 6 runs, and with conftest's "
    "NumPy callbacks it failed 1 of 6 on the interpreter's own 'Barrier remains allocated' assertion (its "
    "shared state is not safe for two devices at once); the kernel's shard_map wrapper is the Triton kernel's, "
    "tested above"
)
def test_mosaic_kernel_under_shard_map_over_kv_heads():
    """In GPU interpret mode, as the "pallas" backend runs it inside a mesh with a model axis."""
    check_under_shard_map(ragged_paged_attention_mgpu, 2, 4, False, dtype="bfloat16")


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


needs_gpu = pytest.mark.skipif(not _gpus(), reason="no GPU present: the compiled GPU kernel needs one")


def test_the_tuner_says_it_needs_a_gpu(capsys, monkeypatch):
    """Without one it stops before timing anything (it would time interpret mode, or fail in Triton).
    The backend is pinned to the CPU's, so on a GPU machine too this checks the refusal, not a sweep."""
    from pallas_kernels import tune_gpu

    monkeypatch.setattr(tune_gpu.jax, "default_backend", lambda: "cpu")
    with pytest.raises(SystemExit, match=r"error: tune_gpu needs a GPU \(jax.default_backend\(\) is 'cpu'\)"):
        tune_gpu.main(["--contexts", "64"])
    assert capsys.readouterr().out == ""


# On a GPU: the block settings the table picks and ones it does not (the compiled kernel needs >= 16 keys
# per step, so PAGE = 8 takes at least 2 pages per step), all compiled by Triton, none interpreted.
GPU_COMPILED_BLOCKS = [
    {},
    dict(pages_per_step=2, kv_splits=3),
    dict(pages_per_step=8, kv_splits=1, rows_per_block=16, num_warps=4),
    dict(pages_per_step=2, kv_splits=8, rows_per_block=32, num_stages=3),
]


@needs_gpu
@pytest.mark.parametrize("st", STATICS, ids=static_id)
def test_gpu_kernel_compiled_matches_reference(st):
    """The same kind of random ragged batches as in interpret mode, through the Triton-compiled
    kernel; float32 compares at full precision (the reference too: no tf32)."""
    with jax.default_matmul_precision("highest"):
        check = check_kernel_against_reference
        check(ragged_paged_attention_gpu, st, GPU_COMPILED_BLOCKS, interpret=None, seed_offset=2)


@needs_gpu
@pytest.mark.parametrize("int8,window", [(False, None), (True, None), (False, 700)])
def test_gpu_kernel_long_mixed_batch_matches_reference(int8, window):
    """Production-like shapes on the GPU: 16-token pages, 32 query / 8 KV heads, head_dim 128, bfloat16;
    decode rows with 1-4k tokens of context beside 64- and 200-token prefill chunks with a prefix."""
    rng = np.random.default_rng(11)
    b, t, n, nk, h, s, width = 8, 256, 32, 8, 128, 16, 256
    kv = np.array([4096, 1, 2049, 1000, 3000, 64, 512 + 200, 17])
    ql = np.array([1, 1, 1, 1, 1, 64, 200, 17])
    pool = b * width + 1
    k = jnp.asarray(rng.standard_normal((nk, pool, s, h)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((nk, pool, s, h)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(b * width).reshape(b, width), jnp.int32)
    kv, ql = jnp.asarray(kv, jnp.int32), jnp.asarray(ql, jnp.int32)
    if int8:
        from jaxinfer.kv_cache import quantize_int8

        k, v = (QuantizedPages(*quantize_int8(x)) for x in (k, v))
    kind = SlidingWindow(window) if window else GlobalAttention()
    kp, vp, scales = kernel_args(k, v)
    out = ragged_paged_attention_gpu(q, kp, vp, table, kv, ql, scale=h**-0.5, window=window, **scales)
    positions = (kv - ql)[:, None] + jnp.arange(t)[None, :]
    ref = reference_paged_attention(q, k, v, table, positions, kv, scale=h**-0.5, kind=kind)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    for row in range(b):
        m = int(ql[row])
        np.testing.assert_allclose(out[row, :m], ref[row, :m], atol=2e-2, rtol=2e-2, err_msg=f"row {row}")


@pytest.mark.parametrize("group,soft_cap,int8", [(4, None, False), (2, 20.0, False), (1, None, True)])
def test_gpu_kernel_agrees_with_upstream_gpu_paged_attention(group, soft_cap, int8):
    """A second opinion for the GPU kernel: jax.experimental.pallas.ops.gpu.paged_attention (decode
    only), in interpret mode on CPU and compiled on a GPU. It takes pre-scaled queries and no empty
    rows, and multiplies the same per-token scales into int8 logits and weights as ours does."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as upstream

    rng = np.random.default_rng(group + 10)
    on_gpu = jax.default_backend() == "gpu"
    st = Static(group=group, head_dim=64, t=1, soft_cap=soft_cap, int8=int8, kv_heads=2)
    for _ in range(3):
        q, k, v, table, kv, ql = random_batch(rng, st)
        kv = jnp.maximum(kv, 1)
        if int8:
            k, v = (QuantizedPages(values=x.values, scales=jnp.nan_to_num(x.scales)) for x in (k, v))
        else:
            k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
        kp, vp, scales = kernel_args(k, v)
        blocks = {} if on_gpu else dict(pages_per_step=2)
        ours = ragged_paged_attention_gpu(
            q, kp, vp, table, kv, jnp.ones_like(kv), scale=0.125, soft_cap=soft_cap, interpret=not on_gpu, **scales,
            **blocks,
        )[:, 0]  # fmt: skip
        theirs = upstream(
            q[:, 0] * 0.125, kp, vp, table, kv, scales.get("k_scales"), scales.get("v_scales"),
            k_splits=2, pages_per_compute_block=2, attn_logits_soft_cap=soft_cap, interpret=not on_gpu,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-3, rtol=2e-3)


# The Mosaic GPU variant takes bfloat16/float16 pools only (wgmma's operand types): every non-int8
# static in 16 bits, plus 96 query rows (two 64-row blocks, the second mostly padding) and float16.
MOSAIC_STATICS = [dataclasses.replace(st, dtype="bfloat16") for st in STATICS if not st.int8] + [
    Static(group=8, head_dim=64, t=12, kv_heads=1, dtype="bfloat16"),
    Static(group=2, head_dim=128, t=1, window=5, dtype="float16"),
]
# The default 64 keys per step (8 pages of 8), more KV splits than a row has steps, 128 keys per step.
MOSAIC_BLOCKS = [{}, dict(kv_splits=3), dict(keys_per_step=128), dict(keys_per_step=128, kv_splits=8)]
MOSAIC_BLOCKS += [dict(trim_partials=True), dict(kv_splits=3, trim_partials=True)]  # only the query rows' partials


def _mosaic_blocks(st: Static) -> list[dict]:
    """MOSAIC_BLOCKS but those whose tiles would not fit a Hopper GPU's shared memory (128 keys at head_dim 256)."""
    fits = lambda keys: smem_bytes(keys=keys, head_dim=st.head_dim, itemsize=2) <= SMEM_BYTES  # noqa: E731
    return [b for b in MOSAIC_BLOCKS if fits(b.get("keys_per_step", 64))]


def _spread_blocks() -> dict[str, list[dict]]:
    """Per static (by id): the table's choice and the two settings of `_mosaic_blocks` that the
    statics before it in MOSAIC_STATICS ran least, so that every setting meets several statics. Each
    setting is a compile of its own (~2 s interpreted, as long as two cases run), so a static's cases
    spread over three of them, not all six: the nine statics took 129 s before, 77 s after (alone,
    2-core Zen 4, 2026-12-03). Each static runs the other kernels' 16 cases again since the
    interpreter's callbacks take NumPy arrays (conftest): 6 cases took 42 s, 16 take 71 (alone, 2-core
    Xeon, 2026-12-06)."""
    used = {str(b): 0 for b in MOSAIC_BLOCKS}
    spread = {}
    for st in MOSAIC_STATICS:
        others = sorted(_mosaic_blocks(st)[1:], key=lambda b: used[str(b)])[:2]  # stable: ties in order
        for b in others:
            used[str(b)] += 1
        spread[static_id(st)] = [{}, *others]
    return spread


INTERPRETED_BLOCKS = _spread_blocks()


def test_every_mosaic_setting_is_interpreted_on_several_statics():
    runs = [b for blocks in INTERPRETED_BLOCKS.values() for b in blocks]
    assert all(runs.count(b) >= 3 for b in MOSAIC_BLOCKS), runs


@pytest.mark.parametrize("st", MOSAIC_STATICS, ids=static_id)
def test_mosaic_kernel_matches_reference(st):
    """In Pallas' GPU interpret mode: the TMA copies of single pages into shared-memory tiles, the
    barriers, both wgmmas and the KV-split merge, on the same random ragged batches (NaN in every
    page a row does not own) as the other kernels; every block setting runs on the GPU (below)."""
    check_kernel_against_reference(ragged_paged_attention_mgpu, st, INTERPRETED_BLOCKS[static_id(st)], interpret=True)


@pytest.mark.parametrize("blocks", [dict(kv_splits=1), dict(kv_splits=2, keys_per_step=128)], ids=["one", "split"])
def test_mosaic_kernel_carries_its_softmax_across_steps(blocks):
    """The random batches above fit one 64-key step; rows of several steps (up to 300 keys, with a
    40-token prefill chunk, rows ending one key into a step and one key short of a step's end) check
    the running max and sum the kernel rescales from step to step, within a KV split and across the
    splits' merge. Slots past a row's end hold NaN, as stale pages do."""
    rng = np.random.default_rng(5)
    b, t, n, nk, h, s, width = 4, 40, 4, 2, 64, 8, 40
    kv, ql = np.array([300, 63, 200, 127]), np.array([1, 1, 40, 1])
    pool = b * width + 1
    table = 1 + rng.permutation(b * width).reshape(b, width)
    k = rng.standard_normal((nk, pool, s, h)) * 2  # spread logits: the running max moves
    v = rng.standard_normal((nk, pool, s, h))
    for row in range(b):
        for slot in range(kv[row], width * s):
            k[:, table[row, slot // s], slot % s] = v[:, table[row, slot // s], slot % s] = np.nan
    k, v = jnp.asarray(k, jnp.float16), jnp.asarray(v, jnp.float16)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float16)
    table = jnp.asarray(table, jnp.int32)
    kv, ql = jnp.asarray(kv, jnp.int32), jnp.asarray(ql, jnp.int32)
    out = ragged_paged_attention_mgpu(q, k, v, table, kv, ql, scale=h**-0.5, interpret=True, **blocks)
    positions = (kv - ql)[:, None] + jnp.arange(t)[None, :]
    ref = reference_paged_attention(q, k, v, table, positions, kv, scale=h**-0.5, kind=GlobalAttention())
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    for row in range(b):
        m = int(ql[row])
        np.testing.assert_allclose(out[row, :m], ref[row, :m], atol=2e-3, rtol=2e-3, err_msg=f"row {row}")


def test_mosaic_kernel_refuses_what_it_cannot_run():
    """float32 and int8 pools, head dims off wgmma's tiles, pages that do not divide a step: named errors."""
    rng = np.random.default_rng(3)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=2, head_dim=64, t=1, dtype="bfloat16"))
    kp, vp, _ = kernel_args(k, v)

    def call(q, kp, vp, **kw):
        return ragged_paged_attention_mgpu(q, kp, vp, table, kv, ql, scale=0.125, interpret=True, **kw)

    with pytest.raises(ValueError, match="bfloat16 or float16 pools .* got float32 pools"):
        call(q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32))
    q8, k8, v8, *_ = random_batch(rng, Static(group=2, head_dim=64, t=1, dtype="bfloat16", int8=True))
    kp8, vp8, scales = kernel_args(k8, v8)
    with pytest.raises(ValueError, match=r"\(int8\)"):
        call(q8, kp8, vp8, **scales)
    with pytest.raises(ValueError, match="keys_per_step must be 64 or 128"):
        call(q, kp, vp, keys_per_step=32)
    with pytest.raises(ValueError, match="q in the pools' dtype"):
        call(q.astype(jnp.float16), kp, vp)
    with pytest.raises(ValueError, match="kv_splits must be a positive int"):
        call(q, kp, vp, kv_splits=0)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=1, head_dim=256, t=1, dtype="bfloat16"))
    kp, vp, _ = kernel_args(k, v)
    with pytest.raises(ValueError, match="keys_per_step 128 at head_dim 256 needs 304 KiB of shared memory"):
        call(q, kp, vp, keys_per_step=128)


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(head_dim=64),
        dict(head_dim=256),
        dict(keys=128),
        dict(t=12, kv_heads=1),  # 96 query rows: two row blocks
        dict(window=100, soft_cap=30.0),
        dict(page=8),
        dict(page=64),
        dict(dtype="float16", kv_splits=1),
        dict(trim=True),  # 8 partial rows per program: TMA copies of a slice of the shared-memory tiles
        dict(t=3, group=8, trim=True, kv_splits=1),  # 24 rows
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default",
)
def test_mosaic_kernel_lowers_for_hopper_without_a_gpu(shape):
    """Pallas lowers the kernel for CUDA on any machine: the Mosaic GPU lowering checks the hardware's
    rules that the interpreter does not (register layouts of every value, wgmma operand shapes and
    dtypes, shared-memory transforms and TMA slices) and serialises the kernel. Without the layout
    casts this failed ("Failed to infer the output layout of the iota"). Compiling to machine code
    and running still need a GPU."""
    d = dict(t=1, kv_heads=2, group=4, head_dim=128, page=16, keys=64, kv_splits=2, window=None, soft_cap=None)
    d["trim"] = False
    d = {**d, "dtype": "bfloat16", **shape}
    dtype, b = jnp.dtype(d["dtype"]), 2
    q = jax.ShapeDtypeStruct((b, d["t"], d["kv_heads"] * d["group"], d["head_dim"]), dtype)
    pool = jax.ShapeDtypeStruct((d["kv_heads"], 64, d["page"], d["head_dim"]), dtype)
    table, lens = jax.ShapeDtypeStruct((b, 16), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)

    def attend(q, k, v, table, kv_lens, q_lens):
        return mgpu._call(
            q, k, v, table, kv_lens, q_lens, scale=0.1, window=d["window"], soft_cap=d["soft_cap"],
            interpret=False, keys=d["keys"], splits=d["kv_splits"], trim=d["trim"],
        )  # fmt: skip

    lowered = jax.jit(attend).trace(q, pool, pool, table, lens, lens).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()  # the kernel, as a Mosaic GPU custom call


@pytest.mark.parametrize(
    "dtype,t,int8,window,soft_cap",
    [("bfloat16", 1, False, None, None), ("float32", 12, False, 100, 30.0), ("bfloat16", 1, True, None, None)],
)
def test_triton_kernel_lowers_for_cuda_without_a_gpu(dtype, t, int8, window, soft_cap):
    """The Triton-lowered kernel (compiled on an H100 on 2026-11-23) still lowers for CUDA here, in CI:
    what a change to it breaks at lowering time shows without a GPU."""
    b, nk, g, h, s = 2, 2, 4, 128, 16
    q = jax.ShapeDtypeStruct((b, t, nk * g, h), jnp.dtype(dtype))
    pool = jax.ShapeDtypeStruct((nk, 64, s, h), jnp.int8 if int8 else jnp.dtype(dtype))
    scale_pool = jax.ShapeDtypeStruct((nk, 64, s), jnp.float32) if int8 else None
    table, lens = jax.ShapeDtypeStruct((b, 16), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)
    rows = max(16, 1 << (t * g - 1).bit_length())
    blocks = gpu.blocks_for(page_size=s, head_dim=h, rows=rows, programs=b * nk, table_pages=16, int8=int8)

    def attend(q, k, v, table, kv_lens, q_lens, *scales):
        k_scales, v_scales = scales or (None, None)
        return gpu._call(
            q, k, v, table, kv_lens, q_lens, k_scales, v_scales, scale=0.1, window=window, soft_cap=soft_cap,
            interpret=False, blocks=blocks,
        )  # fmt: skip

    args = (q, pool, pool, table, lens, lens) + ((scale_pool, scale_pool) if int8 else ())
    lowered = jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()  # the kernel, as a Triton custom call


def test_triton_row_blocks_are_at_least_the_tensor_cores_tile(monkeypatch):
    """A decode step has 1-8 query rows per KV head; a Triton dot needs 16, so the blocks the wrapper
    hands the kernel pad them to 16 (the lowering above takes its blocks as given)."""
    seen = []
    monkeypatch.setattr(gpu, "_call", lambda *args, blocks, **kw: seen.append(blocks.rows_per_block))
    for g in (1, 2, 8):
        q, k, v, table, kv, ql = random_batch(np.random.default_rng(g), Static(group=g, head_dim=64, t=1))
        ragged_paged_attention_gpu(q, k, v, table, kv, ql, scale=0.125, interpret=True)
    assert seen == [16, 16, 16]


def _hopper() -> bool:
    return any(getattr(d, "compute_capability", None) == "9.0" for d in _gpus())


@pytest.mark.skipif(not _hopper(), reason="no Hopper GPU present: the Mosaic GPU kernel compiles for sm_90a only")
@pytest.mark.parametrize("st", MOSAIC_STATICS, ids=static_id)
def test_mosaic_kernel_compiled_matches_reference(st):
    check_kernel_against_reference(ragged_paged_attention_mgpu, st, _mosaic_blocks(st), interpret=None, seed_offset=2)


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="interprets the GPU kernels on the CPU; a GPU compiles them (below)"
)
def test_mosaic_kernel_interpreted_in_a_bfloat16_model_matches_the_triton_kernel(monkeypatch):
    """The model's "pallas" path at head_dim 128 in bfloat16 - chunked prefill steps mixed with decode
    rows, decode steps, a sliding window and a soft cap - run through each GPU kernel in interpret
    mode: the Mosaic variant generates the Triton kernel's tokens with its log-probabilities. (Against
    the reference both part at the third request's first token, where the reference's leader is
    ahead by 0.2: bfloat16 noise, which the compiled test below allows for.)"""
    import pallas_kernels.ragged_paged_attention as tpu_module

    runs = {}
    for name, kernel in (("triton", gpu.ragged_paged_attention_gpu), ("mosaic", mgpu.ragged_paged_attention_mgpu)):
        query_lens = []
        monkeypatch.setattr(  # the kernel "pallas" runs on a CPU
            tpu_module,
            "ragged_paged_attention",
            lambda q, *a, k=kernel, ql=query_lens, **kw: ql.append(q.shape[1]) or k(q, *a, **kw),
        )
        jax.clear_caches()  # the engine's steps are jitted per config: a cached step would not trace the kernel
        outs, lps, _ = engine_outputs_by_backend(("pallas",), head_dim=128, dtype="bfloat16")
        assert 1 in query_lens and max(query_lens) > 1  # decode and prefill steps went through it
        runs[name] = outs["pallas"], lps["pallas"]
    assert runs["mosaic"][0] == runs["triton"][0]
    for a, b in zip(runs["mosaic"][1], runs["triton"][1], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2)


def test_greedy_runs_may_part_only_at_a_near_tie_of_the_reference():
    """`greedy_agreement` on made-up runs: one prompt of 3 tokens (2 logprobs) and 3 generated ones."""
    ref = ([[5, 6, 7]], [[-1.0, -2.0, -0.1, -0.2, -0.3]], [[2.0, 0.1, 3.0]])  # leads 2.0, 0.1, 3.0
    # Parts at the second generated token, a lead of 0.1: compared up to it (2 prompt + 1 generated).
    assert greedy_agreement([[5, 9, 9]], [[-1.2, -2.0, -0.15, -9.0, -9.0]], *ref, tie=0.5) == pytest.approx(0.2)
    assert greedy_agreement([[5, 6, 7]], [[-1.0, -2.0, -0.1, -0.2, -0.9]], *ref, tie=0.5) == pytest.approx(0.6)
    with pytest.raises(AssertionError):  # parts at the first, where the reference led by 2.0
        greedy_agreement([[8, 6, 7]], ref[1], *ref, tie=0.5)
    with pytest.raises(AssertionError):  # ... and at the last, by 3.0
        greedy_agreement([[5, 6, 8]], ref[1], *ref, tie=0.5)


@pytest.mark.skipif(not _hopper(), reason="no Hopper GPU present: the Mosaic GPU kernel compiles for sm_90a only")
def test_mosaic_kernel_compiled_in_a_bfloat16_model_matches_the_reference(monkeypatch):
    """End to end on Hopper: a bfloat16 model with head_dim 128 runs its "pallas" attention - the
    chunked prefill's steps and the decode steps - through the Mosaic GPU kernel (the dispatch
    below), with a sliding window and a soft cap, and agrees with the reference.

    bfloat16 lets two correct implementations differ by a fraction of a nat on these 6x-scaled
    weights, and this random model's greedy choice is sometimes a near tie (its leader ahead by
    0.2), so the yardstick is the Triton kernel run on the same steps: the Mosaic kernel's
    log-probabilities may differ from the reference's by at most twice as much as the Triton
    kernel's do (never less than 0.5), and its greedy tokens may part from the reference's only
    where the reference's leader was ahead by less than twice that (`greedy_agreement`). On an H200
    (2026-11-30) the Triton kernel's prompt logprobs differed by up to 0.51, and the Mosaic run parted
    at the second request's first token, a lead of 0.21. A wrong softmax, mask or page moves the
    log-probabilities by nats."""
    from jaxinfer import attention

    jax.clear_caches()  # the engine's steps are jitted per config: a cached step would skip the dispatch
    query_lens = []
    kernel = mgpu.ragged_paged_attention_mgpu
    monkeypatch.setattr(
        mgpu, "ragged_paged_attention_mgpu", lambda q, *a, **kw: query_lens.append(q.shape[1]) or kernel(q, *a, **kw)
    )
    outs, lps, leads = engine_outputs_by_backend(("reference", "pallas"), head_dim=128, dtype="bfloat16")
    assert 1 in query_lens and max(query_lens) > 1  # decode and prefill steps traced through the Mosaic kernel
    monkeypatch.setattr(attention, "_gpu_kernel", lambda *a: gpu.ragged_paged_attention_gpu)
    jax.clear_caches()
    query_lens.clear()
    triton_outs, triton_lps, _ = engine_outputs_by_backend(("pallas",), head_dim=128, dtype="bfloat16")
    assert not query_lens
    reference = (outs["reference"], lps["reference"], leads["reference"])
    triton_err = greedy_agreement(triton_outs["pallas"], triton_lps["pallas"], *reference, tie=1.0)
    tolerance = max(0.5, 2 * triton_err)
    mosaic_err = greedy_agreement(outs["pallas"], lps["pallas"], *reference, tie=2 * tolerance)
    print(f"logprobs vs the reference: Mosaic {mosaic_err:.3f}, Triton {triton_err:.3f}")
    assert mosaic_err <= tolerance


@pytest.mark.parametrize(
    "capability,t,head_dim,dtype,q_dtype,int8,picked",
    [
        ("9.0", 1, 128, "bfloat16", "bfloat16", False, "mosaic"),
        ("9.0", 1, 128, "float16", "float16", False, "mosaic"),
        ("9.0", 1, 64, "bfloat16", "bfloat16", False, "triton"),  # measured slower there
        ("9.0", 1, 256, "bfloat16", "bfloat16", False, "triton"),  # measured slower there
        ("9.0", 16, 128, "bfloat16", "bfloat16", False, "mosaic"),  # prefill: 2.7x faster
        ("9.0", 16, 256, "bfloat16", "bfloat16", False, "mosaic"),  # 1.7x
        ("9.0", 16, 64, "bfloat16", "bfloat16", False, "triton"),  # not timed
        ("9.0", 1, 128, "float32", "float32", False, "triton"),
        ("9.0", 1, 128, "bfloat16", "float32", False, "triton"),
        ("9.0", 1, 128, "int8", "bfloat16", True, "triton"),
        ("8.0", 1, 128, "bfloat16", "bfloat16", False, "triton"),  # no wgmma / TMA before Hopper
    ],
)
def test_gpu_dispatch_takes_the_mosaic_kernel_where_it_was_measured_faster(
    monkeypatch, capability, t, head_dim, dtype, q_dtype, int8, picked
):
    from jaxinfer import attention

    class Device:
        compute_capability = capability

    monkeypatch.setattr(attention.jax, "devices", lambda *a: [Device()])
    q = jnp.zeros((2, t, 8, head_dim), q_dtype)
    pool = jnp.zeros((2, 4, 16, head_dim), dtype)
    kernel = attention._gpu_kernel(q, pool, int8)
    assert kernel is {"mosaic": ragged_paged_attention_mgpu, "triton": ragged_paged_attention_gpu}[picked]


def test_mosaic_kv_splits_fill_one_wave_of_programs():
    """On an H200 (132 multiprocessors) 4k tokens x 8 rows x 8 KV heads ran fastest at 4 splits: two
    88 KiB programs per multiprocessor, 264 at once, so 64 (row, KV head) programs split 4 ways fill
    one wave. Never more splits than a row has steps; at least one when the grid needs several waves."""
    splits = functools.partial(mgpu.kv_splits_for, keys=64, itemsize=2, sm_count=132)
    assert smem_bytes(keys=64, head_dim=128, itemsize=2) == 88 * 1024
    assert splits(programs=64, steps=64, head_dim=128) == 4
    assert splits(programs=64, steps=3, head_dim=128) == 3
    assert splits(programs=256, steps=64, head_dim=128) == 1
    assert splits(programs=1024, steps=64, head_dim=128) == 1
    assert splits(programs=64, steps=64, head_dim=64) == 8  # 48 KiB: four programs per multiprocessor
    assert splits(programs=64, steps=64, head_dim=256) == 2  # 168 KiB: one


def test_the_tuner_times_every_setting_on_the_same_answer(capsys):
    """The sweep a GPU lease runs (`tune_gpu`), here with both kernels interpreted on a tiny shape:
    every setting it times computes what the table's choice computes, through chained layers."""
    import argparse

    from pallas_kernels import bench, tune_gpu

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--batch", "2", "--heads", "4,2", "--head-dim", "64", "--layers", "2", "--repeats", "1"])
    rng = np.random.default_rng(0)  # 2 rounds: interpreted kernels time nothing real, the code path is the same
    rows = tune_gpu._tune_context(args, 64, 1e9, rng, interpret=True, mosaic=True, min_rounds=2)
    kernels = [r["kernel"] for r in rows]
    assert kernels.count("triton") >= 3 and kernels.count("mosaic") >= 2
    assert all(r["err"] <= 2e-2 for r in rows), rows
    out = capsys.readouterr().out
    assert "DIFFERS" not in out and "re-timed in 2 interleaved rounds" in out
    retimed = [r for r in rows if "rounds_seconds" in r]
    defaults = [r["kernel"] for r in retimed if not tune_gpu._blocks(r)]
    assert sorted(defaults) == ["mosaic", "triton"] and 6 <= len(retimed) <= 8
    assert any(tune_gpu._blocks(r) == {"trim_partials": True} for r in retimed)


def test_mosaic_programs_write_only_the_rows_that_hold_queries(monkeypatch):
    """A decode row's G heads write 8 partial rows, not the row block's 64 (8.4 MB of float32 round
    trip at 4k tokens x 8 rows, 13% on top of the K/V); rows spanning several blocks write whole blocks."""
    assert [mgpu._out_rows(r) for r in (1, 4, 8, 9, 12, 63, 64, 65, 512)] == [8, 8, 8, 16, 16, 64, 64, 64, 64]
    merged = []
    merge = mgpu._merge
    monkeypatch.setattr(mgpu, "_merge", lambda acc, *a: merged.append(acc.shape) or merge(acc, *a))
    jax.clear_caches()  # `_call` is jitted: a step traced before would not reach the patched merge
    static = dict(scale=0.1, window=None, soft_cap=None, interpret=True, keys=64, splits=2, trim=True)
    for t in (1, 20):  # decode: 4 query rows; prefill: 80, two row blocks
        q, k, v, table, kv, ql = random_batch(np.random.default_rng(t), Static(group=4, head_dim=64, t=t))
        out = jax.eval_shape(
            functools.partial(mgpu._call, **static),
            q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table, kv, ql,
        )  # fmt: skip
        assert out.shape == q.shape
    b, nk = q.shape[0], k.shape[0]
    assert merged[0][1:] == (nk, 1, 2, 8, 64) and merged[1] == (b, nk, 2, 2, 64, 64)
