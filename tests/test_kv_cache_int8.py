"""int8 KV caches with per-token-per-head scales: quantization, writes, attention, the engine end to end.

The kernels' int8 paths are compared with the reference in test_pallas_kernels.py (and with the
upstream TPU kernel's own int8 support); here the reference itself is checked against NumPy and
float caches, and the engine is run on an int8 cache through batching, preemption and NaN-poisoned
freed pages. The Pallas kernel on an int8 cache end to end (chunked prefill, decode, a sliding
window) runs in test_sharding.py, under shard_map on a 4x2 mesh, against the single-device tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, InvalidRequestError, SamplingParams
from jaxinfer.attention import reference_paged_attention, write_kv
from jaxinfer.config import GlobalAttention, ModelConfig, SlidingWindow
from jaxinfer.engine import Engine
from jaxinfer.kv_cache import Batch, KVCache, QuantizedPages, quantize_int8
from jaxinfer.model import init_params, prefill

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    layer_attention=(SlidingWindow(24), GlobalAttention()),
    kv_cache_dtype="int8",
)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, seed=5)  # sharpened, so greedy continuations vary (see test_engine.py)
    return jax.tree.map(lambda x: x * 6 if x.ndim >= 2 else x, p)


def test_quantize_int8_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 32)).astype(np.float32) * rng.uniform(0.01, 50, (3, 7, 1)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero vector: scale 0, values 0
    x[1, 2, 5] = 1e4  # one outlier only coarsens its own token's scale
    values, scales = quantize_int8(jnp.asarray(x))
    want_scales = np.abs(x).max(-1) / 127
    np.testing.assert_allclose(np.asarray(scales), want_scales, rtol=1e-6)
    want = np.round(x / np.where(want_scales == 0, 1, want_scales)[..., None])
    assert np.abs(np.asarray(values, np.int32) - want).max() <= 1  # ties may round either way
    assert np.asarray(values).dtype == np.int8 and np.abs(np.asarray(values, np.int32)).max() <= 127
    deq = np.asarray(values, np.float32) * np.asarray(scales)[..., None]
    assert (np.abs(deq - x) <= want_scales[..., None] * 0.5 + 1e-6 * np.abs(x)).all()
    assert not np.asarray(values)[0, 0].any() and float(scales[0, 0]) == 0.0
    assert np.abs(deq[1, 3] - x[1, 3]).max() < 0.05 * np.abs(x[1, 3]).max()  # its neighbour is unaffected


def test_write_kv_quantizes_into_its_slots_only():
    rng = np.random.default_rng(1)
    nk, pages, s, h = 2, 5, 4, 8
    pool = QuantizedPages(
        values=jnp.asarray(rng.integers(-127, 128, (nk, pages, s, h)), jnp.int8),
        scales=jnp.asarray(rng.uniform(0.1, 1, (nk, pages, s)), jnp.float32),
    )
    k = jnp.asarray(rng.standard_normal((1, 3, nk, h)), jnp.float32)
    slots = jnp.asarray([[9, 10, 19]])  # page 2 slots 1, 2; page 4 slot 3
    new_k, new_v = write_kv(pool, pool, k, 2 * k, slots)
    assert isinstance(new_k, QuantizedPages)
    deq = np.asarray(new_k.dequantize())
    for t, (page, off) in enumerate([(2, 1), (2, 2), (4, 3)]):
        np.testing.assert_allclose(deq[:, page, off], np.asarray(k[0, t]), atol=np.abs(k[0, t]).max() / 127)
        np.testing.assert_allclose(np.asarray(new_v.dequantize())[:, page, off], 2 * deq[:, page, off], rtol=1e-5)
    touched = np.zeros((pages, s), bool)
    touched[2, 1] = touched[2, 2] = touched[4, 3] = True
    np.testing.assert_array_equal(np.asarray(new_k.values)[:, ~touched], np.asarray(pool.values)[:, ~touched])
    np.testing.assert_array_equal(np.asarray(new_k.scales)[:, ~touched], np.asarray(pool.scales)[:, ~touched])


def test_reference_attention_on_int8_pools_equals_attention_on_their_float_values():
    """Dequantize-then-attend is the definition; stale slots carry NaN scales and must not leak."""
    rng = np.random.default_rng(2)
    nk, pages, s, h, b, t, n = 2, 12, 4, 16, 3, 3, 4
    k, v = (
        QuantizedPages(
            values=jnp.asarray(rng.integers(-127, 128, (nk, pages, s, h)), jnp.int8),
            scales=jnp.asarray(rng.uniform(0.001, 0.02, (nk, pages, s)), jnp.float32),
        )
        for _ in range(2)
    )
    kv_lens = np.array([9, 1, 0])
    table = np.array([[3, 7, 5, 0], [2, 0, 0, 0], [0, 0, 0, 0]])
    stale = np.ones((pages, s), bool)
    for row, length in enumerate(kv_lens):
        for p in range(length):
            stale[table[row, p // s], p % s] = False
    k = QuantizedPages(values=k.values, scales=jnp.where(jnp.asarray(stale), jnp.nan, k.scales))
    v = QuantizedPages(values=v.values, scales=jnp.where(jnp.asarray(stale), jnp.nan, v.scales))
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    positions = jnp.asarray(kv_lens - np.array([3, 1, 0]))[:, None] + jnp.arange(t)[None]
    args = (jnp.asarray(table), positions, jnp.asarray(kv_lens))
    kw = dict(scale=0.25, kind=GlobalAttention())
    got = np.asarray(reference_paged_attention(q, k, v, *args, **kw))
    want = np.asarray(reference_paged_attention(q, k.dequantize(), v.dequantize(), *args, **kw))
    for row, ql in enumerate([3, 1, 0]):
        assert np.isfinite(got[row, :ql]).all()
        np.testing.assert_allclose(got[row, :ql], want[row, :ql], rtol=1e-6, atol=1e-6)


def _step_logits(cfg, params, prompt):
    cache = KVCache.create(cfg, num_pages=8, page_size=4)
    n = len(prompt)
    batch = Batch(
        tokens=jnp.asarray([prompt]),
        q_lens=jnp.asarray([n]),
        kv_lens=jnp.asarray([n]),
        page_table=jnp.arange(1, 8)[None],
    )
    logits, cache = prefill(params, cache, batch, cfg=cfg)
    return np.asarray(logits[0]), cache


def test_int8_cache_is_close_to_the_float_cache_and_half_the_bytes(params):
    prompt = list(range(3, 23))
    int8_logits, int8_cache = _step_logits(CFG, params, prompt)
    f32_logits, f32_cache = _step_logits(dataclasses.replace(CFG, kv_cache_dtype="auto"), params, prompt)
    assert isinstance(int8_cache.k[0], QuantizedPages) and int8_cache.k[0].values.dtype == jnp.int8
    err = np.abs(int8_logits - f32_logits).max() / np.abs(f32_logits).max()
    assert 0 < err < 0.02, err  # quantized (not identical), yet within 2% of the logit range
    assert int8_logits.argmax() == f32_logits.argmax()
    h = CFG.head_dim
    assert int8_cache.nbytes * 4 * h == f32_cache.nbytes * (h + 4)  # int8 + a float32 scale per token-head
    assert CFG.kv_bytes_per_token * 8 * 4 == int8_cache.nbytes
    # A bfloat16 model's scales stay float32 (bfloat16 scales would cost the int8 values' precision).
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    bf16_cache = KVCache.create(bf16, num_pages=8, page_size=4)
    assert {p.scales.dtype for p in bf16_cache.k + bf16_cache.v} == {jnp.dtype(jnp.float32)}
    assert bf16.kv_bytes_per_token * 8 * 4 == bf16_cache.nbytes


def _run(engine, prompts, sps):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
    while engine.has_unfinished():
        engine.step()
    return [r.seqs[0].output_ids for r in reqs]


def test_engine_on_an_int8_cache_batch_invariant_preempting_and_poisoned(params):
    """Quantization is per token, so a sequence's output cannot depend on its neighbours: batched
    with preemption and NaN-poisoned freed pages == each request alone."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, int(rng.integers(2, 60))).tolist() for _ in range(12)]
    sps = [SamplingParams(max_tokens=int(rng.integers(4, 16)), temperature=0.0, ignore_eos=True) for _ in prompts]
    kw = dict(max_model_len=128, page_size=8, max_num_seqs=8, max_num_batched_tokens=32)
    alone = [_run(Engine(CFG, params, num_kv_pages=32, **kw), [p], [sp])[0] for p, sp in zip(prompts, sps)]
    assert len({tuple(o) for o in alone}) > 8
    e = Engine(CFG, params, num_kv_pages=14, poison_reused_pages=True, **kw)
    assert _run(e, prompts, sps) == alone
    assert e.stats()["num_preemptions"] > 0
    assert e.stats()["kv_pages_free"] == e.stats()["kv_pages_total"]


def test_llm_takes_the_kv_cache_dtype_by_name():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="fp8")
    llm = LLM(kv_cache_dtype="int8", num_kv_pages=16, max_num_seqs=2)
    assert isinstance(llm.engine.cache.k[0], QuantizedPages)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
