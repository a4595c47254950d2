"""Random ragged paged-attention batches shared by the kernel tests (test_pallas_kernels*.py,
test_native.py), and the end-to-end engine run they compare backends on.

Each static configuration (group size, head dim, window, soft cap, dtype, query tokens per row,
page size) compiles once and then runs on many random ragged batches: lengths 0 and 1, on and one
past a page boundary, full tables, page tables wider than needed, padding rows, and NaN in every
page a row does not own (so masking, not luck, keeps them out), including page 0, where a windowed
row's table points for the pages wholly before its window (the engine gives those back), and in the
keys before that window on the page it starts in. Only each
row's real query tokens are compared; the rest is don't-care.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import reference_paged_attention
from jaxinfer.config import GlobalAttention, SlidingWindow
from jaxinfer.kv_cache import QuantizedPages

PAGE = 8
WIDTH = 4  # pages per row in the table (rows use fewer)
POOL = 24


@dataclasses.dataclass(frozen=True)
class Static:
    group: int
    head_dim: int
    t: int  # query tokens per row (1: decode)
    window: int | None = None
    soft_cap: float | None = None
    dtype: str = "float32"
    kv_heads: int = 2
    int8: bool = False  # int8 pools with per-token-per-head scales (q and output stay in dtype)
    scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    page_size: int = PAGE

    @property
    def softmax_scale(self) -> float:
        return float(self.head_dim**-0.5) if self.scale is None else self.scale


STATICS = [
    Static(group=1, head_dim=64, t=1),
    Static(group=2, head_dim=128, t=1, window=5),
    Static(group=4, head_dim=64, t=6),
    Static(group=8, head_dim=64, t=1, kv_heads=1, soft_cap=20.0),
    Static(group=3, head_dim=256, t=4, window=7, soft_cap=30.0),
    Static(group=2, head_dim=64, t=8, dtype="bfloat16"),
    Static(group=1, head_dim=128, t=3, window=9, dtype="bfloat16", soft_cap=15.0),
    Static(group=4, head_dim=128, t=1, int8=True),
    Static(group=2, head_dim=64, t=5, window=6, soft_cap=25.0, dtype="bfloat16", int8=True),
    # Large logits over bfloat16 queries and int8 pools: the reference once rounded value x scale to
    # bfloat16 before its dots and was 5x further from a float64 oracle than the kernels.
    Static(group=2, head_dim=64, t=4, dtype="bfloat16", int8=True, scale=1.0),
]
# Pages of other sizes than PAGE: the engine's default (16), tiny ones a window spans many of, and
# pages as long as most rows (the kernels take the page size from the pools' shape).
PAGE_STATICS = [
    Static(group=4, head_dim=64, t=1, page_size=16),
    Static(group=2, head_dim=128, t=5, window=9, int8=True, page_size=2),
    Static(group=1, head_dim=64, t=3, soft_cap=20.0, dtype="bfloat16", page_size=32),
]
CASES_PER_STATIC = 16


def lengths(rng, t: int, page: int = PAGE) -> tuple[list[int], list[int]]:
    """kv_lens and q_lens of one batch of 4 rows, biased toward the edge cases."""
    edges = [0, 1, page, page + 1, 2 * page, WIDTH * page - 1, WIDTH * page]
    kv, q = [], []
    for _ in range(4):
        n = int(rng.choice(edges)) if rng.random() < 0.6 else int(rng.integers(0, WIDTH * page + 1))
        kv.append(n)
        q.append(0 if n == 0 else int(rng.integers(1, min(n, t) + 1)) if rng.random() < 0.8 else min(n, t))
    return kv, q


def random_batch(rng, st: Static):
    b, nk, page = 4, st.kv_heads, st.page_size
    n = nk * st.group
    dtype = jnp.dtype(st.dtype)
    kv, ql = lengths(rng, st.t, page)
    owned = rng.permutation(np.arange(1, POOL))[: b * WIDTH].reshape(b, WIDTH)
    if st.window:  # pages wholly before a row's window are given back, as the engine does: scratch (NaN)
        for i in range(b):
            owned[i, : max(kv[i] - ql[i] - st.window + 1, 0) // page] = 0
    k = rng.standard_normal((nk, POOL, page, st.head_dim)).astype(np.float32)
    v = rng.standard_normal((nk, POOL, page, st.head_dim)).astype(np.float32)
    used = {int(owned[i, j]) for i in range(b) for j in range(-(-kv[i] // page))} - {0}
    stale = [p for p in range(POOL) if p not in used]
    k[:, stale] = np.nan
    v[:, stale] = np.nan
    # Slots past a row's length inside its last page are stale too.
    for i in range(b):
        if kv[i] % page:
            last = owned[i, kv[i] // page]
            k[:, last, kv[i] % page :] = np.nan
            v[:, last, kv[i] % page :] = np.nan
        # So are a windowed row's keys before its first query's window, on the page the window starts
        # in: no query sees them (the GPU kernels let such a NaN through, from 0 * NaN, until 2026-12-07).
        lo = max(kv[i] - ql[i] - st.window + 1, 0) if st.window else 0
        if lo % page and ql[i]:
            k[:, owned[i, lo // page], : lo % page] = np.nan
            v[:, owned[i, lo // page], : lo % page] = np.nan
    q = rng.standard_normal((b, st.t, n, st.head_dim)).astype(np.float32)
    if st.int8:
        k, v = np_quantized(rng, k), np_quantized(rng, v)
    else:
        k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    return (
        jnp.asarray(q, dtype),
        k,
        v,
        jnp.asarray(owned, jnp.int32),
        jnp.asarray(kv, jnp.int32),
        jnp.asarray(ql, jnp.int32),
    )


def np_quantized(rng, x: np.ndarray) -> QuantizedPages:
    """Symmetric per-token-per-head int8 in NumPy; NaN slots get random values and a NaN scale."""
    stale = np.isnan(x).any(axis=-1)
    scales = np.abs(np.nan_to_num(x)).max(axis=-1) / 127.0
    values = np.round(np.nan_to_num(x) / np.where(scales == 0, 1, scales)[..., None]).astype(np.int8)
    values[stale] = rng.integers(-127, 128, size=(int(stale.sum()), x.shape[-1]), dtype=np.int8)
    scales[stale] = np.nan
    return QuantizedPages(values=jnp.asarray(values), scales=jnp.asarray(scales, jnp.float32))


def kernel_args(k, v) -> tuple:
    """(k_pages, v_pages, scale kwargs) as the kernels take them."""
    if isinstance(k, QuantizedPages):
        return k.values, v.values, dict(k_scales=k.scales, v_scales=v.scales)
    return k, v, {}


def static_id(s: Static) -> str:
    scale = "" if s.scale is None else f"-s{s.scale}"
    page = "" if s.page_size == PAGE else f"-p{s.page_size}"
    return f"g{s.group}-h{s.head_dim}-t{s.t}-w{s.window}-c{s.soft_cap}-{s.dtype}{'-int8' * s.int8}{scale}{page}"


@functools.partial(jax.jit, static_argnames=("scale", "kind", "soft_cap"))
def _reference(q, k, v, table, kv, ql, *, scale, kind, soft_cap):
    """The reference on a kernel's inputs, jitted: one program per static configuration, where
    running it op by op compiled some forty small ones (most of these tests' compile time)."""
    positions = (kv - ql)[:, None] + jnp.arange(q.shape[1])[None, :]
    return reference_paged_attention(q, k, v, table, positions, kv, scale=scale, kind=kind, soft_cap=soft_cap)


def check_kernel_against_reference(
    kernel, st: Static, blocks: list[dict], *, interpret, seed_offset: int = 0, cases: int = CASES_PER_STATIC
):
    """`cases` random batches of `st` through `kernel` (block settings cycled) vs the reference."""
    rng = np.random.default_rng(zlib.crc32(static_id(st).encode()) + seed_offset)  # hash() varies by process
    scale = st.softmax_scale
    kind = SlidingWindow(st.window) if st.window else GlobalAttention()
    tol = {"bfloat16": 2e-2, "float16": 2e-3}.get(st.dtype, 2e-5)
    for case in range(cases):
        q, k, v, table, kv, ql = random_batch(rng, st)
        kp, vp, kwargs = kernel_args(k, v)
        kwargs.update(blocks[case % len(blocks)])
        if interpret is not None:
            kwargs["interpret"] = interpret
        out = kernel(q, kp, vp, table, kv, ql, scale=scale, window=st.window, soft_cap=st.soft_cap, **kwargs)
        jax.block_until_ready(out)  # nothing else may be dispatched while TPU interpret mode runs
        ref = _reference(q, k, v, table, kv, ql, scale=scale, kind=kind, soft_cap=st.soft_cap)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        for row in range(q.shape[0]):
            n = int(ql[row])
            got, want = out[row, :n], ref[row, :n]
            assert np.isfinite(got).all(), (case, row, "stale NaN leaked")
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"case {case} row {row} {blocks}")


def check_under_shard_map(
    kernel, model_axis: int, kv_heads: int, int8: bool, *, interpret: bool | None = True, dtype: str = "float32"
) -> None:
    """`kernel` under shard_map over the `model` axis of a 1 x model_axis mesh == the kernel unsharded
    (`interpret` passed on unless None: the C++ kernel has no such argument)."""
    from jax.sharding import Mesh

    from pallas_kernels.sharded import kv_head_sharded

    mesh = Mesh(np.array(jax.devices()[:model_axis]).reshape(1, model_axis), ("data", "model"))
    rng = np.random.default_rng(model_axis)
    st = Static(group=2, head_dim=64, t=3, kv_heads=kv_heads, window=6, int8=int8, dtype=dtype)
    q, k, v, table, kv, ql = random_batch(rng, st)
    k, v, kwargs = kernel_args(k, v)
    if interpret is not None:
        kwargs["interpret"] = interpret
    single = kernel(q, k, v, table, kv, ql, scale=0.125, window=6, **kwargs)
    sharded = kv_head_sharded(kernel, mesh)(q, k, v, table, kv, ql, scale=0.125, window=6, **kwargs)
    for row in range(q.shape[0]):
        n = int(ql[row])
        np.testing.assert_allclose(np.asarray(sharded)[row, :n], np.asarray(single)[row, :n], atol=1e-6)


def engine_outputs_by_backend(backends: tuple[str, ...], **config) -> tuple[dict, dict, dict]:
    """Greedy tokens and log-probabilities (prompt, then generated) of three prompts run through an
    Engine with each attention backend: chunked prefill (prompts longer than the 16-token chunks),
    decode, a sliding-window layer and a soft cap. Weights are 6x the usual init, so that attention
    logits are O(1) and both the cap and the window move the logprobs (greedy tokens alone did not
    see either left out of a kernel call). `config`: ModelConfig fields to change (head_dim, dtype).
    Returns ({backend: tokens}, {backend: logprobs}, {backend: margins}): per request, its generated
    tokens; its log-probabilities, the prompt's then the generated tokens'; and at each generated
    token how far the most likely token led the second (log-probabilities)."""
    from jaxinfer import SamplingParams, default_model
    from jaxinfer.engine import Engine
    from jaxinfer.model import init_params

    base = dataclasses.replace(
        default_model.CONFIG, layer_attention=(SlidingWindow(12), GlobalAttention()), attn_logit_softcap=2.0, **config
    )
    weights = jax.tree.map(lambda x: 6 * x, init_params(base, 0))
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs, lps, margins = {}, {}, {}
    for backend in backends:
        cfg = dataclasses.replace(base, attention_backend=backend)
        engine = Engine(cfg, weights, max_model_len=64, num_kv_pages=20, max_num_seqs=4, max_num_batched_tokens=16)
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outs[backend] = [r.seqs[0].output_ids for r in reqs]
        lps[backend] = [[lp.logprob for lp in r.seqs[0].prompt_logprobs + r.seqs[0].logprobs] for r in reqs]
        margins[backend] = [[_lead(lp.top) for lp in r.seqs[0].logprobs] for r in reqs]
    return outs, lps, margins


def _lead(top: dict[int, float]) -> float:
    first, second = sorted(top.values(), reverse=True)[:2]
    return first - second


def greedy_agreement(tokens, logprobs, ref_tokens, ref_logprobs, ref_margins, *, tie: float) -> float:
    """Two greedy runs of the same requests in 16-bit floats, where two correct implementations may
    part at a near tie: for each request, the generated tokens must agree up to the first where the
    reference's leader was ahead by at most `tie` (after it the runs continue different texts), and
    the largest difference of their log-probabilities before that point - every prompt token's, then
    the generated ones' - is returned."""
    worst = 0.0
    for toks, lps, ref_toks, ref_lps, ref_lead in zip(
        tokens, logprobs, ref_tokens, ref_logprobs, ref_margins, strict=True
    ):
        parted = next((i for i, (a, b) in enumerate(zip(toks, ref_toks, strict=True)) if a != b), len(toks))
        assert parted == len(toks) or ref_lead[parted] <= tie, (toks, ref_toks, ref_lead)
        agreed = len(lps) - len(toks) + parted  # the prompt's logprobs and the generated ones before it
        worst = max(worst, float(np.max(np.abs(np.subtract(lps[:agreed], ref_lps[:agreed])))))
    return worst
