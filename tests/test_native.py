"""The C++ CPU paged-attention kernel (jaxinfer.native, the "native" backend) against the pure-JAX
reference on the random ragged batches of kernel_cases.py (NaN in every slot a row does not own),
under shard_map, in the model end to end, and its fallback where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

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
    random_batch,
    static_id,
)

from jaxinfer import native
from jaxinfer.attention import resolve_backend

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable (no C++ compiler?): {native.why_unavailable()}"
)

# STATICS and PAGE_STATICS, plus the shapes that take the vectorised inner loops (head sizes
# 64/128/256 with groups of 1, 2, 4 or 8) in decode, bfloat16 and int8, and head sizes that take the
# generic ones.
NATIVE_STATICS = [
    *STATICS,
    *PAGE_STATICS,
    Static(group=8, head_dim=128, t=1, kv_heads=1),
    Static(group=4, head_dim=64, t=1, dtype="bfloat16", window=6, soft_cap=20.0),
    Static(group=2, head_dim=256, t=2, int8=True, window=10),
    Static(group=1, head_dim=256, t=1, dtype="bfloat16", int8=True),
    Static(group=4, head_dim=32, t=3),
    Static(group=5, head_dim=16, t=1, kv_heads=1, soft_cap=5.0),
]

_kernel = jax.jit(native.paged_attention, static_argnames=("scale", "window", "soft_cap"))


@pytest.mark.parametrize("st", NATIVE_STATICS, ids=static_id)
def test_native_matches_reference(st):
    check_kernel_against_reference(_kernel, st, [{}], interpret=None)


@pytest.mark.parametrize("model_axis,kv_heads,int8", [(2, 2, False), (4, 4, True), (2, 3, False)])
def test_native_under_shard_map_over_kv_heads(model_axis, kv_heads, int8):
    check_under_shard_map(native.paged_attention, model_axis, kv_heads, int8, interpret=None)


def test_a_row_does_not_depend_on_its_neighbours():
    """Bit for bit: a row's output alone equals its output inside a batch (the engine's batch
    invariance rests on it), and padding query tokens come back as zeros."""
    rng = np.random.default_rng(3)
    st = Static(group=4, head_dim=64, t=3)
    q, k, v, table, kv, ql = random_batch(rng, st)
    whole = np.asarray(_kernel(q, k, v, table, kv, ql, scale=0.125))
    for row in range(q.shape[0]):
        one = slice(row, row + 1)
        alone = np.asarray(_kernel(q[one], k, v, table[one], kv[one], ql[one], scale=0.125))
        np.testing.assert_array_equal(alone[0], whole[row])
        assert not whole[row, int(ql[row]) :].any()


def test_a_page_outside_the_pool_is_refused_not_read():
    """Inside a jit nothing upstream can check the table; the kernel itself refuses a page index
    outside the pool, naming it, instead of reading another array's memory."""
    rng = np.random.default_rng(0)
    q, k, v, table, kv, ql = random_batch(rng, Static(group=1, head_dim=64, t=1))
    row = int(np.argmax(np.asarray(kv)))  # a row with context
    with pytest.raises(Exception, match=rf"page_table\[{row}, 0\] = 1000 is outside the pool's 24 pages"):
        jax.block_until_ready(_kernel(q, k, v, table.at[row, 0].set(1000), kv, ql, scale=0.125))


def test_inputs_the_kernel_does_not_take_are_refused_by_name():
    q, k, v, table, kv, ql = random_batch(np.random.default_rng(0), Static(group=1, head_dim=64, t=1))
    with pytest.raises(ValueError, match="q: the native kernel takes float32 or bfloat16"):
        native.paged_attention(q.astype(jnp.float16), k, v, table, kv, ql, scale=0.125)
    with pytest.raises(ValueError, match="int8 pools need k_scales and v_scales"):
        native.paged_attention(q, k, v, table, kv, ql, scale=0.125, k_scales=jnp.ones(k.shape[:3]))
    # The kernel trusts every shape: these were read out of bounds (a segfault for the small v pool,
    # attention over whatever memory followed for the others); now refused as the Pallas kernels do.
    with pytest.raises(ValueError, match="v_pages must match k_pages"):
        native.paged_attention(q, k, v[:, :2], table, kv, ql, scale=0.125)
    k8, scales = jnp.ones(k.shape, jnp.int8), jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match=r"k_scales/v_scales must have shape \(\d+, \d+, \d+\)"):
        native.paged_attention(q, k8, k8, table, kv, ql, scale=0.125, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match=rf"kv_lens must have shape \[B\] = \({q.shape[0]},\)"):
        native.paged_attention(q, k, v, table, kv[:1], ql, scale=0.125)
    with pytest.raises(ValueError, match="window must be a positive int"):
        native.paged_attention(q, k, v, table, kv, ql, scale=0.125, window=0)


def test_model_with_the_native_backend_matches_reference():
    """End to end: greedy tokens and log-probabilities with the C++ kernel == with the reference,
    through chunked prefill (prompts longer than the 16-token chunks), decode, a sliding-window layer
    and a soft cap (weights scaled so both move the logprobs)."""
    outs, lps, _ = engine_outputs_by_backend(("reference", "native"))
    assert outs["native"] == outs["reference"]
    assert len({tuple(t) for t in outs["reference"]}) == 3  # distinct, so agreement means something
    for a, b in zip(lps["native"], lps["reference"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_auto_is_native_on_cpu():
    assert resolve_backend("auto", "cpu") == "native"
    assert resolve_backend("native", "cpu") == "native"


def test_without_a_compiler_auto_falls_back_and_native_says_why(tmp_path):
    """No compiler (CXX pointing nowhere, an empty build cache): "auto" is the pure-JAX tiled
    attention, generation still works, and asking for "native" by name is refused with the reason."""
    script = """
from jaxinfer import LLM, InvalidRequestError, SamplingParams, native
from jaxinfer.attention import resolve_backend
assert not native.available()
print("why:", native.why_unavailable())
print("auto:", resolve_backend("auto", "cpu"))
llm = LLM(max_model_len=64, num_kv_pages=8)
print("tokens:", len(llm.generate(["In the"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids))
try:
    LLM(attention_backend="native")
except InvalidRequestError as e:
    print("refused:", e)
"""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), JAXINFER_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "auto: xla" in out.stdout
    assert "tokens: 3" in out.stdout
    assert 'refused: attention_backend="native" cannot run here:' in out.stdout
    assert "no-such-compiler" in out.stdout


def test_a_fresh_build_goes_to_the_cache_dir(tmp_path):
    """Built from source on first use into $JAXINFER_CACHE_DIR, then loaded and run."""
    script = """
import jax.numpy as jnp
from jaxinfer import native
assert native.available(), native.why_unavailable()
q = jnp.ones((1, 1, 2, 64)); pool = jnp.ones((1, 2, 4, 64))
out = native.paged_attention(q, pool, 2 * pool, jnp.zeros((1, 1), jnp.int32), jnp.array([3]), jnp.array([1]), scale=0.1)
print("out:", float(out.min()), float(out.max()))
"""
    env = dict(os.environ, JAXINFER_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "out: 2.0 2.0" in out.stdout  # every value is 2: softmax weights sum to one
    assert list(tmp_path.glob("native/*/libjaxinfer_native.so"))
