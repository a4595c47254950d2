"""A bfloat16 model on the CPU: the C++ product of few rows (jaxinfer.native.bf16_matmul) and the
in-place 16-bit cache write (native.kv_write) against NumPy and XLA, where jaxinfer.matmul sends
which product, the YNNPACK options of a bfloat16 model's steps, and a bfloat16 model end to end with
and without the native parts."""

from __future__ import annotations

import dataclasses
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import _xla_flags, native
from jaxinfer import matmul as matmul_lib
from jaxinfer import model as model_lib

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable (no C++ compiler?): {native.why_unavailable()}"
)

_matmul = jax.jit(native.bf16_matmul, static_argnames=("transposed",))


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _bound(x, w):
    """float32 summation error bound for x @ w: a few ulps of the sum of |products| (K <= 3000)."""
    return 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))) + 1e-30


# M in 1..9, K on and off the 8-row passes and 64-row chunks, N on and off the 16-lane vectors and
# 512-column blocks; then
# the wide path's rows (9..64, where the CPU has AMX or AVX-512 BF16): M on and off the 16-row tiles
# and 6-row register tiles, K odd, on and off the 32-deep steps and past one 1024- and 2048-row
# block, N on and off the 16-column vectors, 64-column register tiles and 256-column strips.
SHAPES = [(1, 1024, 5632), (2, 64, 16), (3, 65, 17), (4, 7, 1), (5, 1, 33), (8, 130, 48), (9, 257, 31), (1, 3000, 3)]
SHAPES += [(6, 70, 1100)]  # past two 512-column blocks, a ragged last vector
SHAPES += [(16, 32, 16), (17, 65, 600), (40, 100, 300), (33, 2100, 40), (64, 1024, 256), (48, 31, 17), (12, 1, 513)]
SHAPES += [(13, 1025, 70), (64, 1030, 1000)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_bf16_matmul_matches_numpy(m, k, n, transposed):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (k, n))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(_matmul(x, w.T if transposed else w, transposed=transposed))
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert (np.abs(got - ref) <= _bound(x, w)).all(), np.abs(got - ref).max()


@pytest.mark.parametrize("k", [300, 320], ids=["k300", "k320"])  # 320: "nk" takes 4 rows of w at a time for <= 4 rows
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(transposed, k):
    """The engine's batch invariance rests on it: every output is summed in an order that depends
    on neither M nor the row's place in the batch."""
    rng = np.random.default_rng(7)
    w = _bf16(rng, (k, 70))
    w = w.T if transposed else w
    x = _bf16(rng, (8, k))
    whole = np.asarray(_matmul(x, w, transposed=transposed))
    for row in range(8):
        alone = np.asarray(_matmul(x[row : row + 1], w, transposed=transposed))
        np.testing.assert_array_equal(alone[0], whole[row])
    for lo, hi in ((1, 3), (3, 6), (2, 6)):
        np.testing.assert_array_equal(np.asarray(_matmul(x[lo:hi], w, transposed=transposed)), whole[lo:hi])


@pytest.mark.skipif(
    native.wide_path() is None, reason="no wide path here: no AMX, AVX-512 or AVX2 (or no native library)"
)
@pytest.mark.parametrize("k", [2101, 2112], ids=["k2101", "k2112"])  # 2112: the AVX2 "nk" loops (K a multiple of 16)
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_a_row_is_the_same_bits_in_any_batch_of_the_wide_path(transposed, k):
    """From wide_path()[1] rows on, the tiles or dot products sum each output alone: a row of a
    batch of the most rows that path takes is the same bits in one of the fewest, whatever the other
    rows hold. The AVX2 and AVX-512 strips sum in the few-row loops' order: there a row is also the
    same bits alone."""
    name, lo, hi = native.wide_path()
    rng = np.random.default_rng(8)
    w = _bf16(rng, (k, 300))  # past one 2048-row block of w, and one 256-column strip
    w = w.T if transposed else w
    x = _bf16(rng, (hi, k))
    whole = np.asarray(_matmul(x, w, transposed=transposed))
    for row in (0, 17, hi - 1):
        others = _bf16(rng, (lo - 1, k))
        few = np.asarray(_matmul(jnp.concatenate([others, x[row : row + 1]]), w, transposed=transposed))
        np.testing.assert_array_equal(few[-1], whole[row])
        if name in ("avx2", "avx512"):
            alone = np.asarray(_matmul(x[row : row + 1], w, transposed=transposed))
            np.testing.assert_array_equal(alone[0], whole[row])


# /proc/cpuinfo's names of the features the wide paths hang on, and the compiler's macros for them.
_FEATURE_MACROS = {
    "amx_bf16": "__AMX_BF16__",
    "avx512_bf16": "__AVX512BF16__",
    "avx512f": "__AVX512F__",
    "avx2": "__AVX2__",
    "fma": "__FMA__",
}


def _targeted(flags: list[str]) -> list[str]:
    """The CPU's feature flags less those $JAXINFER_NATIVE_CXXFLAGS turned off for the build (say
    `-mno-avx512bf16`), as the compiler's predefined macros under the same flags say."""
    if not native.extra_flags():
        return flags
    cmd = [native.find_compiler(), "-march=native", *native.extra_flags(), "-dM", "-E", "-x", "c++", "/dev/null"]
    macros = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in flags if f not in _FEATURE_MACROS or _FEATURE_MACROS[f] in macros]


def test_the_wide_path_is_claimed_only_where_the_cpu_has_it():
    """The wide path follows the CPU: AMX only with amx_bf16 in /proc/cpuinfo, the AVX-512 BF16 dot
    products only with avx512_bf16 (and no AMX granted), the AVX2 loops only with avx2 and without
    AVX-512, the AVX-512 strips only with avx512f and without avx512_bf16; jaxinfer.matmul sends a
    decode step's 64-row bucket to the kernel only where there is one."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    flags = _targeted(flags)
    wide = native.wide_path()
    if wide is None:
        assert native.matmul_max_rows() == native.MATMUL_MAX_ROWS
        assert "avx512_bf16" not in flags
        assert "avx512f" not in flags and not {"avx2", "fma"} <= set(flags)
    else:
        name, lo, hi = wide
        assert {"amx": "amx_bf16", "avx512_bf16": "avx512_bf16", "avx2": "avx2", "avx512": "avx512f"}[name] in flags
        assert name != "avx2" or "avx512f" not in flags
        assert name != "avx512" or "avx512_bf16" not in flags
        assert (lo, hi) == (native.MATMUL_MAX_ROWS + 1, 512 if name == "avx512" else 64)  # avx512: prompt chunks too
        assert native.matmul_max_rows() == hi


def test_bf16_matmul_refuses_what_it_does_not_take():
    x = jnp.ones((2, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"must be 2-D bfloat16, got float32\[2, 4\]"):
        native.bf16_matmul(x.astype(jnp.float32), jnp.ones((4, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x has 4 columns but w \[K, N\] has K = 5"):
        native.bf16_matmul(x, jnp.ones((5, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x has 4 columns but w \[N, K\] has K = 3"):
        native.bf16_matmul(x, jnp.ones((4, 3), jnp.bfloat16), transposed=True)


def test_native_layout_reads_the_models_products():
    assert matmul_lib.native_layout("BTD,DNH->BTNH") == (1, False)
    assert matmul_lib.native_layout("BTE,ED->BTD") == (1, False)
    assert matmul_lib.native_layout("BTD,DCF->BTCF") == (1, False)
    assert matmul_lib.native_layout("BD,VD->BV") == (1, True)
    assert matmul_lib.native_layout("BTNH,NHD->BTD") == (2, False)
    assert matmul_lib.native_layout("BTD,NDH->BTNH") is None  # the contracted letter is not w's first
    assert matmul_lib.native_layout("BTD,DNH->BTHN") is None  # the kept letters change order
    assert matmul_lib.native_layout("BD,DV->VB") is None


def _custom_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("ffi_call")


@pytest.mark.parametrize(
    "spec,x_shape,w_shape",
    [("BTD,DNH->BTNH", (2, 3, 40), (40, 4, 8)), ("BD,VD->BV", (5, 24), (50, 24)), ("BTF,FD->BTD", (1, 1, 70), (70, 9))],
)
def test_einsum_f32_takes_the_kernel_for_few_bf16_rows_only(spec, x_shape, w_shape):
    """Up to matmul_max_rows() rows of a bfloat16 product go to the C++ kernel, with XLA's result;
    more rows, or float32, stay XLA's dot."""
    rng = np.random.default_rng(1)
    x, w = _bf16(rng, x_shape), _bf16(rng, w_shape)
    fn = jax.jit(lambda x, w: matmul_lib.einsum_f32(spec, x, w))
    ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    got = np.asarray(fn(x, w))
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert _custom_calls(fn, x, w) == 1
    assert _custom_calls(fn, x.astype(jnp.float32), w.astype(jnp.float32)) == 0
    many = jnp.concatenate([x] * (native.matmul_max_rows() + 1))  # past the bound on the leading axis
    assert _custom_calls(fn, many, w) == 0
    np.testing.assert_allclose(np.asarray(fn(many, w))[: x.shape[0]], ref, rtol=1e-4, atol=1e-4)


def test_project_rounds_once_after_the_bias():
    """bfloat16 on the CPU: the float32 product plus the bias, rounded once to bfloat16 (as torch's
    addmm), whichever way the product ran."""
    rng = np.random.default_rng(2)
    x, w, b = _bf16(rng, (1, 2, 16)), _bf16(rng, (16, 3, 4)), _bf16(rng, (3, 4))
    got = jax.jit(lambda x, w, b: matmul_lib.project("BTD,DNH->BTNH", x, w, b))(x, w, b)
    exact = np.einsum("btd,dnh->btnh", np.asarray(x, np.float64), np.asarray(w, np.float64)) + np.asarray(b, np.float64)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kv_write_is_the_scatter_in_place(dtype):
    """Bit for bit the scatter's result, written into the donated pool's own buffer."""
    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.standard_normal((2, 6, 4, 8)), dtype)
    new = jnp.asarray(rng.standard_normal((2, 5, 8)), dtype)
    page, offset = jnp.array([1, 5, 5, 0, 3], jnp.int32), jnp.array([0, 3, 2, 1, 3], jnp.int32)
    expected = np.asarray(pool.at[:, page, offset].set(new), np.float32)
    before = pool.unsafe_buffer_pointer()
    write = jax.jit(native.kv_write, donate_argnums=0)
    out = write(pool, new, page, offset)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    assert out.unsafe_buffer_pointer() == before  # in place: no copy of the pool
    kept = jnp.asarray(rng.standard_normal((2, 6, 4, 8)), dtype)  # not donated: the input stays as it was
    copy = np.asarray(kept, np.float32)
    jax.jit(native.kv_write)(kept, new, page, offset).block_until_ready()
    np.testing.assert_array_equal(np.asarray(kept, np.float32), copy)


def test_kv_write_refuses_a_slot_outside_the_pool():
    pool = jnp.zeros((1, 3, 4, 2), jnp.bfloat16)
    new = jnp.ones((1, 2, 2), jnp.bfloat16)
    with pytest.raises(Exception, match="slot 1 is page 3, offset 0: outside the pool's 3 pages of 4"):
        jax.block_until_ready(jax.jit(native.kv_write)(pool, new, jnp.array([0, 3]), jnp.array([0, 0])))
    with pytest.raises(Exception, match="slot 0 is page 0, offset 4"):
        jax.block_until_ready(jax.jit(native.kv_write)(pool, new, jnp.array([0, 1]), jnp.array([4, 0])))
    # XLA packs sub-byte dtypes: the kernel's rows of H bytes overran a packed pool (heap corruption).
    packed = jnp.zeros((1, 2, 2, 8), jnp.int4)
    with pytest.raises(ValueError, match="the native KV write takes whole-byte dtypes, got int4"):
        native.kv_write(packed, jnp.ones((1, 1, 8), jnp.int4), jnp.array([0]), jnp.array([1]))


def test_bf16_dot_options_only_with_bf16_instructions_and_no_user_setting(monkeypatch):
    """YNNPACK's dots for a bfloat16 model's steps where the CPU has AMX or AVX-512 BF16 (measured on
    both), not where the user chose the flag or turned jaxinfer's defaults off, and not with neither."""
    ynn = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

    def options(cpu_flags, xla_flags="", defaults="1"):
        monkeypatch.setattr(_xla_flags, "_cpu_flags", lambda: set(cpu_flags))
        monkeypatch.setenv("XLA_FLAGS", xla_flags)
        monkeypatch.setenv("JAXINFER_XLA_DEFAULTS", defaults)
        _xla_flags.bf16_dot_options.cache_clear()
        return _xla_flags.bf16_dot_options()

    try:
        assert options({"avx512f", "amx_bf16"}) == ynn
        assert options({"avx512f", "amx_bf16"}, "--xla_cpu_experimental_ynn_fusion_type=-individual_dot") == ynn
        assert options({"avx512f", "avx512_bf16"}) == ynn
        assert options({"avx512f", "avx2"}) is None
        assert options({"amx_bf16"}, "--xla_cpu_experimental_ynn_fusion_type=eltwise") is None
        assert options({"amx_bf16"}, defaults="0") is None
    finally:
        _xla_flags.bf16_dot_options.cache_clear()


def test_jitted_steps_take_the_options_for_bf16_on_cpu_only(monkeypatch):
    from jaxinfer import default_model

    ynn = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    monkeypatch.setattr(_xla_flags, "bf16_dot_options", lambda: ynn)
    f32 = default_model.TINY_CONFIG
    bf16 = dataclasses.replace(f32, dtype="bfloat16")
    own = (model_lib.prefill, model_lib.decode_step, model_lib.prefill_with_prompt_logprobs)
    assert model_lib.jitted_steps(f32, "cpu") == own
    assert model_lib.jitted_steps(bf16, "gpu") == own
    steps = model_lib.jitted_steps(bf16, "cpu")
    assert steps != own and steps == model_lib.jitted_steps(bf16, "cpu")  # built once


def _bf16_engine_outputs(monkeypatch, *, native_parts: bool, options: dict | None, max_num_seqs: int = 4):
    """Greedy tokens and logprobs of the trained default model in bfloat16, three prompts, chunked
    prefill then decode, with or without the native product and write, with or without `options`."""
    from jaxinfer import SamplingParams, default_model
    from jaxinfer.engine import Engine

    with monkeypatch.context() as m:
        m.setattr(_xla_flags, "bf16_dot_options", lambda: options)
        if not native_parts:
            m.setattr(native, "runs_here", lambda: False)  # both the products and the cache writes
        jax.clear_caches()  # the steps are jitted per config: a cached one would skip the dispatch
        cfg, params, _ = default_model.load(dtype="bfloat16")
        engine = Engine(
            cfg, params, max_model_len=96, num_kv_pages=40, max_num_seqs=max_num_seqs, max_num_batched_tokens=32
        )
        prompts = [list(range(5, 5 + n)) for n in (40, 9, 23)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
        reqs = [engine.add_request(p, sp) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        jax.clear_caches()
        return [r.seqs[0].output_ids for r in reqs], [[lp.logprob for lp in r.seqs[0].logprobs] for r in reqs]


def test_bf16_model_with_the_native_parts_matches_xla(monkeypatch):
    """End to end in bfloat16: the C++ products and cache writes (decode rows, the 9-token chunk)
    and YNNPACK's dots (whatever this CPU) give the greedy tokens XLA's own ops give, and
    log-probabilities within bfloat16 rounding."""
    ynn = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    xla_tokens, xla_lps = _bf16_engine_outputs(monkeypatch, native_parts=False, options=None)
    for options in (None, ynn):
        tokens, lps = _bf16_engine_outputs(monkeypatch, native_parts=True, options=options)
        assert tokens == xla_tokens
        for a, b in zip(lps, xla_lps, strict=True):
            np.testing.assert_allclose(a, b, atol=0.05)
    assert len({tuple(t) for t in xla_tokens}) == 3  # distinct, so agreement means something


# ----------------------------------------------------------------------------------------------
# A float32 model on the CPU: the products on weights in column strips (native.f32_matmul).

needs_strips = pytest.mark.skipif(
    not native.f32_strip_cols(), reason="the float32 strips need AVX-512 or AVX2 with FMA, which this CPU lacks"
)
_f32_matmul = jax.jit(native.f32_matmul)


def _f32(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_strips_hold_the_columns_in_the_documented_order():
    w = np.arange(6 * 256, dtype=np.float32).reshape(6, 256)
    packed = np.asarray(matmul_lib.to_strips(jnp.asarray(w), 64))
    assert packed.shape == w.shape
    flat = packed.reshape(-1)
    for s, k, c in ((0, 0, 0), (0, 5, 63), (1, 0, 0), (3, 2, 17)):  # memory [N / 64][K][64]
        assert flat[(s * 6 + k) * 64 + c] == w[k, s * 64 + c]
    np.testing.assert_array_equal(np.asarray(matmul_lib.from_strips(jnp.asarray(packed), 64)), w)


# M on and off the register tiles' 6 (AVX-512) and 3 (AVX2) rows, past one prompt chunk's 512; K
# of 1, odd, on and past the 256-row blocks (and from 12 rows the 1024-row ones); N one strip,
# several, the 150M Llama's MLP width.
F32_SHAPES = [(1, 1024, 5632), (2, 1, 64), (5, 63, 128), (6, 256, 64), (7, 257, 192), (13, 600, 320)]
F32_SHAPES += [(48, 1024, 256), (64, 777, 128), (513, 100, 64), (0, 5, 64), (3, 0, 128)]
F32_SHAPES += [(11, 1300, 64), (12, 1025, 128), (30, 2500, 64)]


@needs_strips
@pytest.mark.parametrize("m,k,n", F32_SHAPES)
def test_f32_matmul_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _f32(rng, (m, k)), _f32(rng, (k, n))
    got = np.asarray(_f32_matmul(x, matmul_lib.to_strips(w, native.f32_strip_cols())))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert (np.abs(got - ref) <= _bound(x, w)).all(), np.abs(got - ref).max()


@needs_strips
@pytest.mark.parametrize("k", [700, 1300])
def test_f32_strips_give_a_row_the_same_bits_alone_and_in_any_batch(k):
    """What batch invariance in float32 rests on: one chain of FMAs per output, whatever the tile a
    row falls in (6 rows, or 1..5 at the end), the batch's size, the K blocks it is run in (256
    rows below 12 rows of x, 1024 from there: K 1300 splits differently) or the thread."""
    rng = np.random.default_rng(9)
    w = matmul_lib.to_strips(_f32(rng, (k, 192)), native.f32_strip_cols())
    x = _f32(rng, (50, k))
    whole = np.asarray(_f32_matmul(x, w))
    for row in (0, 5, 6, 31, 49):
        np.testing.assert_array_equal(np.asarray(_f32_matmul(x[row : row + 1], w))[0], whole[row])
    for lo, hi in ((1, 3), (3, 10), (7, 50)):
        np.testing.assert_array_equal(np.asarray(_f32_matmul(x[lo:hi], w)), whole[lo:hi])


_BITS = """
import hashlib, jax.numpy as jnp, numpy as np
from jaxinfer import matmul, native
rng, h = np.random.default_rng(3), hashlib.sha256()
for m, k, n in [(1, 1024, 256), (7, 300, 128), (50, 700, 192)]:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    h.update(np.asarray(native.f32_matmul(x, matmul.to_strips(w, 64))).tobytes())
print(native.f32_strip_cols(), h.hexdigest())
"""


@needs_strips
def test_f32_strips_are_the_same_bits_in_avx2_and_avx512(tmp_path):
    """The AVX2 tiles (a CPU without AVX-512) give the AVX-512 ones' bits: a model's tokens do not
    depend on which of the two a machine has. Built with -mno-avx512f beside this one."""
    import os
    import sys

    def bits(env):
        run = subprocess.run([sys.executable, "-c", _BITS], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.split()

    here = bits(os.environ.copy())
    avx2 = bits({**os.environ, "JAXINFER_CACHE_DIR": str(tmp_path), "JAXINFER_NATIVE_CXXFLAGS": "-mno-avx512f"})
    assert here[0] == avx2[0] == "64"
    assert here[1] == avx2[1]


@needs_strips
def test_f32_matmul_refuses_what_it_does_not_take():
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 64"):
        native.f32_matmul(x, jnp.ones((4, 96), jnp.float32))
    with pytest.raises(ValueError, match="K = 5"):
        native.f32_matmul(x, jnp.ones((5, 64), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        native.f32_matmul(x.astype(jnp.bfloat16), jnp.ones((4, 64), jnp.float32))


def _strips_cfg(**kw):
    from jaxinfer.config import ModelConfig

    # q and o [1024, 2048], k and v [1024, 1024], the MLP's [1024, 2048] and [1024, 1024]: big enough
    # for strips (matmul.STRIPS_MIN_WEIGHTS).
    base = dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_layers=2, num_heads=16, num_kv_heads=8)
    return ModelConfig(**{**base, "head_dim": 128, "max_position_embeddings": 128, **kw})


def _logits_and_cache(cfg, params, tokens, chunks):
    """The logits after each chunk of `tokens` (prefill, or decode for chunks of 1) and the cache."""
    from jaxinfer.kv_cache import Batch, KVCache

    cache, table, done, out = KVCache.create(cfg, num_pages=12, page_size=4), [[3, 9, 1, 7, 2, 5, 4, 8]], 0, []
    for n in chunks:
        step = model_lib.decode_step if n == 1 else model_lib.prefill
        batch = Batch(
            tokens=jnp.asarray([tokens[done : done + n]], jnp.int32),
            q_lens=jnp.asarray([n], jnp.int32),
            kv_lens=jnp.asarray([done + n], jnp.int32),
            page_table=jnp.asarray(table, jnp.int32),
        )
        logits, cache = step(params, cache, batch, cfg=cfg)
        out.append(np.asarray(logits[0]))
        done += n
    return out, [np.asarray(a) for a in (*cache.k, *cache.v)]


@needs_strips
@pytest.mark.parametrize(
    "variant,expected",
    [
        (dict(tie_word_embeddings=False), {"wqkv", "wo", "w_gate_up", "w_down", "lm_head"}),
        (
            dict(tie_word_embeddings=False, vocab_size=1000, qkv_bias=True, o_bias=True),
            {"wqkv", "wo", "w_gate_up", "w_down"},
        ),
        (
            dict(tie_word_embeddings=True, mlp_bias=True, intermediate_size=1000),
            {"wqkv", "wo"},
        ),  # down: 1000 x 1024 < 2**20
        (
            dict(tie_word_embeddings=False, num_kv_heads=1, head_dim=80, qkv_bias=True),
            {"wq", "wo", "w_gate_up", "w_down", "lm_head"},
        ),  # q, k, v: 18 heads of 80 columns, not a whole number of strips; k and v alone are small
    ],
    ids=["untied", "head-not-in-strips-biases", "tied-gate-up-not-in-strips", "qkv-not-fused"],
)
def test_a_model_in_strips_computes_what_the_declared_layout_does(variant, expected, monkeypatch):
    """to_weight_strips lays out exactly the weights einsum_f32 reads as strips: the model's logits
    over prefill and decode are the declared layout's within float32 rounding, whichever weights
    (the head: V off the strips, or tied; gate/up: 2F off them; down: small) stay as declared, also
    when the products fall back to XLA on the strips (a trace that cannot call the kernel); and the
    K/V a token writes are the same bits however its prompt is chunked, where strips made them."""
    cols = native.f32_strip_cols()
    cfg = _strips_cfg(**variant)
    params = model_lib.init_params(cfg, seed=5)
    if cfg.qkv_bias or cfg.mlp_bias:  # biases of zero would hide a bias added to the wrong columns
        params = jax.tree_util.tree_map_with_path(
            lambda path, v: v + 0.1 if path[-1].key.startswith("b") else v, params
        )
    strips_cfg = dataclasses.replace(cfg, weight_strips=cols)
    laid_out = model_lib.to_weight_strips(jax.tree.map(jnp.copy, params), cols)
    declared = {jax.tree_util.keystr(path): a for path, a in jax.tree_util.tree_leaves_with_path(params)}
    changed = {  # laid out, or new: the fused q/k/v
        path[-1].key
        for path, b in jax.tree_util.tree_leaves_with_path(laid_out)
        if (key := jax.tree_util.keystr(path)) not in declared or not np.array_equal(declared[key], b)
    }
    assert changed == expected
    assert model_lib.qkv_fused(strips_cfg) == ("wqkv" in expected)
    tokens = list(np.random.default_rng(1).integers(3, cfg.vocab_size, 21))
    chunks = [13, 1, 1, 4, 1, 1]
    want, _ = _logits_and_cache(cfg, params, tokens, chunks)
    got, cache = _logits_and_cache(strips_cfg, laid_out, tokens, chunks)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    _, rechunked = _logits_and_cache(strips_cfg, laid_out, tokens, [2, 11, 1, 1, 4, 1, 1])
    # Every layer's K/V where every product before them is in strips; else the first layer's (the
    # MLP's products on XLA's dot need not be the same bits at another chunk's row count); none
    # where k and v are XLA's products themselves.
    layers = (cfg.num_layers if {"w_gate_up", "w_down"} <= expected else 1) if "wqkv" in expected else 0
    for i in (*range(layers), *range(cfg.num_layers, cfg.num_layers + layers)):  # (k pools, then v)
        np.testing.assert_array_equal(rechunked[i], cache[i])
    monkeypatch.setattr(native, "runs_here", lambda: False)
    fallback, _ = _logits_and_cache(strips_cfg, laid_out, tokens, chunks)
    for a, b in zip(fallback, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    restored = model_lib.from_weight_strips(laid_out, cols)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_strips
def test_an_llm_lays_float32_weights_out_in_strips_and_saves_them_as_declared(monkeypatch, tmp_path):
    """LLM(dtype="float32") on the CPU keeps its big projections in strips (JAXINFER_F32_STRIPS=0:
    as declared), with XLA's greedy tokens; checkpoint.save of its params writes the declared layout."""
    from jaxinfer import LLM, SamplingParams, checkpoint

    cfg = _strips_cfg(tie_word_embeddings=False)
    checkpoint.save(tmp_path / "model", cfg, model_lib.init_params(cfg, seed=2))

    def llm(strips):
        monkeypatch.setenv("JAXINFER_F32_STRIPS", "1" if strips else "0")
        return LLM(str(tmp_path / "model"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)

    strips, plain = llm(True), llm(False)
    assert strips.cfg.weight_strips == native.f32_strip_cols() and plain.cfg.weight_strips == 0
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(3, 40)), [9] * 20]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert [o.token_ids for o in strips.generate(prompt_token_ids=prompts, sampling_params=sp)] == want
    assert len({tuple(t) for t in want}) == 3
    checkpoint.save(tmp_path / "saved", strips.cfg, strips.params)
    cfg, params = checkpoint.restore(tmp_path / "saved", dtype="float32")
    assert cfg.weight_strips == 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_strips
@pytest.mark.parametrize(
    "isa,env,mesh,dtype,laid_out",
    [
        ("avx512", None, None, "float32", True),
        ("avx2", None, None, "float32", False),
        ("avx2", "1", None, "float32", True),
    ]
    + [("avx512", "0", None, "float32", False), ("avx512", None, None, "bfloat16", False)]
    + [("avx512", None, "model=1", "float32", False)],
)
def test_which_models_an_llm_lays_out_in_strips(isa, env, mesh, dtype, laid_out, monkeypatch):
    """By default a float32 model on one device where the strips run in AVX-512 (measured faster than
    XLA there); JAXINFER_F32_STRIPS=1 takes the AVX2 tiles too, =0 none; never bfloat16, a mesh or a
    model whose weights are all small."""
    from jaxinfer import llm as llm_lib

    monkeypatch.setattr(native, "f32_strips_isa", lambda: isa)
    if env is None:
        monkeypatch.delenv("JAXINFER_F32_STRIPS", raising=False)
    else:
        monkeypatch.setenv("JAXINFER_F32_STRIPS", env)
    cfg = _strips_cfg(dtype=dtype)
    params = model_lib.init_params(cfg, seed=0)
    got_cfg, got = llm_lib._lay_out_weights(cfg, params, None if mesh is None else object())
    assert got_cfg.weight_strips == (native.f32_strip_cols() if laid_out else 0)
    assert (got is params) != laid_out
    # A model with no weight big enough (the embedded default's size) is never laid out.
    from jaxinfer.default_model import TINY_CONFIG

    small = model_lib.init_params(TINY_CONFIG, seed=0)
    assert llm_lib._lay_out_weights(TINY_CONFIG, small, None) == (TINY_CONFIG, small)
