"""The per-row sampler against NumPy references of each filter, and parameter validation."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import native
from jaxinfer import sampling as sp
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingBatch, SamplingParams, keep_mask, sample

V = 40
LOGITS = np.random.RandomState(0).randn(V).astype(np.float32) * 2


def allowed_set(logits, temperature, top_k, top_p, min_p):
    """NumPy reference: the tokens a correct sampler may return."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones(len(x), bool)
    if top_k > 0:
        keep[top_k:] = False
    p = np.exp(x[order] - x[order].max()) * keep
    p /= p.sum()
    cum = np.cumsum(p) - p
    if top_p < 1:  # p = 1 cuts nothing (a rounded running sum can reach 1 before the last token)
        keep &= cum < top_p
    keep &= p >= min_p * p[0]
    return set(order[keep].tolist()), dict(zip(order.tolist(), p / p[keep].sum() * keep))


def draw(params_list, steps, logits=LOGITS, history=None, prompt_len=0):
    rows = [(p, p.seed or 0, s, history or [], prompt_len) for p, s in zip(params_list, steps)]
    sb = SamplingBatch.from_rows(rows, len(rows), history_len=16)
    return np.asarray(sample(jnp.asarray(np.tile(logits, (len(rows), 1))), sb).tokens)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.7, top_p=0.6),
        dict(temperature=1.3, min_p=0.2),
        dict(temperature=1.0, top_k=8, top_p=0.8, min_p=0.05),
    ],
)
def test_samples_stay_in_allowed_set_with_right_frequencies(kw):
    p = SamplingParams(seed=7, **kw)
    n = 3000
    got = draw([p] * n, list(range(n)))
    allowed, probs = allowed_set(
        LOGITS, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0)
    )
    assert set(got.tolist()) <= allowed
    assert len(set(got.tolist())) > 1
    for tok in allowed:
        freq = np.mean(got == tok)
        assert abs(freq - probs[tok]) < 4 * np.sqrt(probs[tok] * (1 - probs[tok]) / n) + 1e-3


def test_greedy_and_top_k_1_are_argmax():
    got = draw([SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1, seed=3)], [0, 0])
    assert got.tolist() == [int(np.argmax(LOGITS))] * 2


def test_argmax_last_axis_is_numpys_argmax_ties_nan_and_infinities_included():
    """The first index of the largest value (NumPy's rule, and jnp.argmax's): ties, all -inf rows,
    +inf, signed zeros, NaN anywhere (the first NaN wins), and rows of a wide random batch."""
    nan, inf = np.nan, np.inf
    rows = [[1, 3, 3, 2], [nan, 1, nan, 5], [1, 2, nan, nan], [-inf] * 4, [inf, 1, inf, 2], [-0.0, 0.0, -1, -2],
            [0.0, -0.0, -1, -2], [-inf, -5, -inf, -5], [2, 2, 2, 2]]  # fmt: skip
    x = np.array(rows, np.float32)
    wide = np.random.default_rng(0).integers(-3, 4, (48, 32000)).astype(np.float32)  # many ties per row
    # Across its 64-value blocks (the last one partial): the largest value last, tied in the first and
    # last blocks, NaN in a later block than the largest value, every value -inf, signed zeros apart.
    blocks = np.zeros((6, 2000), np.float32)  # past the one-level width: two levels
    assert blocks.shape[1] > sp._ONE_LEVEL_ARGMAX
    blocks[0, 1999] = 1
    blocks[1, [70, 3, 1990]] = 4
    blocks[2, 10], blocks[2, 1500] = 9, nan
    blocks[3] = -inf
    blocks[4, :] = -1
    blocks[4, 1000], blocks[4, 5] = 0.0, -0.0
    blocks[5, 1280:] = inf
    for a in (x, wide, wide[:1], blocks):
        assert np.asarray(jax.jit(sp.argmax_last_axis)(a)).tolist() == np.argmax(a, axis=-1).tolist()


def test_temperatures_below_the_greedy_threshold_are_greedy():
    """0 < T < 1e-5 (vLLM's cut) is greedy: dividing a 1-ulp near-tie by it would be a coin flip."""
    tie = np.zeros(V, np.float32)
    tie[3], tie[4] = 1.0, np.nextafter(np.float32(1.0), np.float32(0.0))
    for t in (1e-7, 1e-6, 9e-6):
        got = draw([SamplingParams(temperature=t, seed=s) for s in range(64)], [0] * 64, logits=tie)
        assert set(got.tolist()) == {3}, t
    # At the threshold it samples again: the two near-tied tokens both come out.
    got = draw([SamplingParams(temperature=1e-5, seed=s) for s in range(64)], [0] * 64, logits=tie)
    assert set(got.tolist()) == {3, 4}


def test_values_past_float32_still_draw_a_token_the_filters_keep():
    """top_p and repetition_penalty are doubles in (0, 1] and (0, 2]; far below float32's range they
    round to 0 there. top-p then kept no token and the draw returned the last id (in the engine, a
    padded id past the vocabulary, with NaN logprobs); a positive logit over a 0 penalty is +inf,
    and x - max was NaN. A temperature past float32's range overflowed its cast."""
    n = 32
    got = draw([SamplingParams(temperature=1.0, top_p=1e-300, seed=s) for s in range(n)], [0] * n)
    assert set(got.tolist()) == {int(np.argmax(LOGITS))}  # the most likely token always survives
    kept = keep_mask(jnp.asarray(LOGITS)[None], jnp.array([0]), jnp.array([np.float32(1e-300)]), jnp.array([0.0]))
    assert np.flatnonzero(kept[0]).tolist() == [int(np.argmax(LOGITS))]
    seen = np.argsort(LOGITS)[[0, -9, -7, -5, -3]].tolist()  # the least likely token, and four positive ones
    assert LOGITS[seen[0]] < 0 < min(LOGITS[seen[1:]])
    params = [SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=s) for s in range(n)]
    got = draw(params, [0] * n, history=seen, prompt_len=len(seen))
    # The positive seen logits went to +inf, capped at the largest float: four equal chances (an
    # uncapped +inf made every weight NaN).
    assert set(got.tolist()) <= set(seen[1:]) and len(set(got.tolist())) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = draw([SamplingParams(temperature=1e308, seed=s) for s in range(400)], [0] * 400)
    assert len(set(got.tolist())) > V // 2  # as good as uniform


@pytest.mark.parametrize("temperature", [1e30, 8e37, 1e38, 3.4e38, 1e300])
def test_a_huge_temperature_never_draws_a_banned_token(temperature):
    """XLA divides the logits by the temperature as a multiply by its reciprocal, which from ~1e38 on
    is below float32's smallest normal and flushed to 0: a banned logit (-inf) times 0 was NaN, and
    every draw at 1e38 came out as token 0, outside allowed_token_ids. The temperature is capped at
    1e30, as uniform a draw already."""
    allowed = [5, 6, 7]
    rows = [
        (SamplingParams(temperature=temperature, seed=s, allowed_token_ids=allowed), s, 0, [], 0) for s in range(64)
    ]
    sb = SamplingBatch.from_rows(rows, len(rows), history_len=16, allowed_width=4)
    got = np.asarray(sample(jnp.asarray(np.tile(LOGITS, (len(rows), 1))), sb).tokens)
    assert set(got.tolist()) == set(allowed)  # each allowed one, as good as uniform; nothing else


def test_a_row_the_filters_empty_falls_back_to_greedy():
    """A row of NaN logits (a broken model) keeps no token at all; the draw then returned the last
    padded index, past the vocabulary. It now falls back to greedy, an id inside it."""
    nan = np.full(V, np.nan, np.float32)
    got = draw([SamplingParams(temperature=1.0, seed=s) for s in range(4)], [0] * 4, logits=nan)
    assert got.tolist() == [int(jnp.argmax(jnp.asarray(nan)))] * 4 and 0 <= got[0] < V


def test_mixed_rows_and_seed_independent_of_batch_mates():
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = draw([p], [5])[0]
    mixed = draw([SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=9), p], [0, 3, 5])
    assert mixed[2] == alone
    assert mixed[0] == int(np.argmax(LOGITS))
    # A different step gives an independent draw (over many steps, not always the same token).
    assert len({int(draw([p], [s])[0]) for s in range(20)}) > 1


NO_NATIVE = f"no native kernels here: {native.why_unavailable()}"


@pytest.fixture(params=["native", "jax"])
def cuts(request, monkeypatch):
    """keep_mask's cuts in the C++ kernel (the CPU's path) or in pure JAX (every other backend's)."""
    if request.param == "native":
        if not native.available():
            pytest.skip(NO_NATIVE)
        assert sp.native_cuts()
    else:
        monkeypatch.setattr(sp, "native_cuts", lambda: False)
    return request.param


def test_keep_mask_is_the_sorting_definition_on_a_large_vocabulary(cuts):
    """The sort-free thresholds keep exactly the tokens a sort-and-cut keeps (NumPy, float64), per
    row, for a 32k vocabulary and every mix of the three filters, rows differing within one batch."""
    rng = np.random.RandomState(1)
    v = 32000
    combos = [(k, p, m) for k in (0, 1, 7, 50, 1000, v, v + 5) for p in (1.0, 0.95, 0.5, 0.01) for m in (0.0, 0.05)]
    # Peaked and flat rows: the top-p cut lands at a handful of tokens in one, thousands in the other.
    x = rng.randn(len(combos), v).astype(np.float32) * rng.choice([0.5, 4.0], size=(len(combos), 1)).astype(np.float32)
    top_k, top_p, min_p = (np.array(c, dt) for c, dt in zip(zip(*combos), (np.int32, np.float32, np.float32)))
    got = np.asarray(keep_mask(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
    for i, (k, p, m) in enumerate(combos):
        ref, _ = allowed_set(x[i], 1.0, k, p, m)
        kept = set(np.flatnonzero(got[i]).tolist())
        assert kept == ref, (k, p, m, len(kept), len(ref))


def test_keep_mask_on_the_candidate_blocks_is_the_sorting_definition():
    """Where the blocks with the largest maxima hold every row's cut (peaked rows, small k, a
    nucleus of a few tokens), the cut is searched among them alone - and keeps what a sort-and-cut
    keeps; a row whose nucleus is wider than them sends the batch to the whole-row search, with the
    same thresholds as that search would have found for the other rows."""
    rng = np.random.RandomState(3)
    v = 32000
    combos = [(k, p, m) for k in (0, 1, 7, 50) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.05)]
    x = (rng.randn(len(combos), v) * 8).astype(np.float32)
    top_k, top_p, min_p = (np.array(c, dt) for c, dt in zip(zip(*combos), (np.int32, np.float32, np.float32)))
    got = np.asarray(keep_mask(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
    for i, (k, p, m) in enumerate(combos):
        ref, _ = allowed_set(x[i], 1.0, k, p, m)
        assert set(np.flatnonzero(got[i]).tolist()) == ref, (k, p, m)

    keys = sp._order_keys(jnp.asarray(x))
    k = jnp.asarray(np.where(top_k > 0, top_k, v))
    count = lambda at_least, _: at_least.sum(-1) >= k  # noqa: E731
    candidates = sp._candidates(keys, jnp.asarray(True))
    at, inside = sp._cut(keys, count, None, jnp.asarray(top_k > 0), candidates)
    assert bool(inside)
    whole = sp._largest_threshold(keys, count)
    np.testing.assert_array_equal(np.asarray(at)[top_k > 0], np.asarray(whole)[top_k > 0])

    # A flat row's top-p nucleus (thousands of tokens) is wider than the candidates: searched whole.
    flat = np.concatenate([x[:1], (rng.randn(1, v) * 0.5).astype(np.float32)])
    keys = sp._order_keys(jnp.asarray(flat))
    probs = jax.nn.softmax(jnp.asarray(flat), axis=-1)
    p = jnp.asarray([0.9, 0.9], jnp.float32)
    mass = lambda at_least, pr: jnp.where(at_least, pr, 0.0).sum(-1) >= p  # noqa: E731
    uses = jnp.asarray([True, True])
    at, inside = sp._cut(keys, mass, probs, uses, sp._candidates(keys, jnp.asarray(True)))
    assert not bool(inside)
    np.testing.assert_array_equal(np.asarray(at), np.asarray(sp._largest_threshold(keys, mass, probs)))
    got = np.asarray(keep_mask(jnp.asarray(flat), jnp.asarray([0, 0]), p, jnp.asarray([0.0, 0.0])))
    for i in range(2):
        assert set(np.flatnonzero(got[i]).tolist()) == allowed_set(flat[i], 1.0, 0, 0.9, 0.0)[0]


def test_keep_mask_keeps_every_tie_at_a_cut_among_the_candidates(cuts):
    """A large vocabulary of few distinct values: blocks tie at their maxima and tokens at the cut;
    every token tied with the k-th largest stays, and the bound taken from the blocks left out keeps
    the search exact (here it cannot hold the cut: the whole rows are searched)."""
    rng = np.random.RandomState(4)
    x = rng.randint(0, 6, size=(2, 32000)).astype(np.float32)
    got = np.asarray(keep_mask(jnp.asarray(x), jnp.asarray([50, 1]), jnp.asarray([1.0, 1.0]), jnp.asarray([0.0, 0.0])))
    np.testing.assert_array_equal(got, x >= 5)  # the 50th largest is a 5, as is the largest


def test_keep_mask_keeps_every_token_tied_at_the_cut(cuts):
    x = jnp.asarray([[3.0, 2.0, 2.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    got = keep_mask(x, jnp.asarray([2, 1]), jnp.asarray([1.0, 1.0]), jnp.asarray([0.0, 0.0]))
    assert np.asarray(got).tolist() == [[True, True, True, False, False], [True, True, True, True, False]]


def test_keep_mask_cuts_exactly_at_top_p_and_min_p(cuts):
    """At the boundaries: top-p keeps a token while the mass before it is below p (a first token of
    exactly p is kept alone, as in vLLM), and min-p keeps a token of exactly min_p times the largest
    probability."""
    x = jnp.asarray([[2.0, 1.0, 0.5, -1.0]])
    p0 = jax.nn.softmax(x, axis=-1)[0, 0]  # the most likely token's probability, as keep_mask computes it
    no = (jnp.asarray([0]), jnp.asarray([1.0]), jnp.asarray([0.0]))
    got = keep_mask(x, no[0], jnp.asarray([p0]), no[2])
    assert np.asarray(got).tolist() == [[True, False, False, False]]
    got = keep_mask(x, no[0], jnp.asarray([np.nextafter(p0, np.float32(1))]), no[2])
    assert np.asarray(got).tolist() == [[True, True, False, False]]
    ties = jnp.asarray([[1.0, 1.0, 0.0]])
    assert np.asarray(keep_mask(ties, no[0], no[1], jnp.asarray([1.0]))).tolist() == [[True, True, False]]


def _threshold_reference(keys: np.ndarray, target: float, weights: np.ndarray | None) -> int:
    """NumPy: the largest key m with weight(keys >= m) >= target (float64 sums), 0 if none."""
    if target <= 0:  # even the empty set of keys >= the largest uint32 weighs that much
        return 0xFFFFFFFF
    w = np.ones(len(keys)) if weights is None else weights.astype(np.float64)
    order = np.argsort(-keys.astype(np.int64), kind="stable")
    k, cum = keys[order], np.cumsum(w[order])
    # A candidate m is a key itself (a larger m between two keys selects the same, lighter set).
    last = np.r_[k[1:] != k[:-1], True]  # the last of each run of equal keys: the set >= that key
    reached = np.flatnonzero(last & (cum >= target))
    return int(k[reached[0]]) if len(reached) else 0


@pytest.mark.skipif(not native.available(), reason=NO_NATIVE)
def test_native_cut_thresholds_are_the_largest_threshold_reaching_the_target():
    """The radix kernel against NumPy and against the pure-JAX bit-by-bit search, on rows of ties,
    infinities, NaN and zero weights, widths that are no multiple of the kernel's four bin sets, and
    targets from nothing to past the whole row."""
    rng = np.random.RandomState(7)
    for v in (1, 3, 5, 257, 4099, 32000):
        rows = [
            rng.randn(v) * 3,
            rng.randint(0, 4, v).astype(np.float64),  # a few distinct values: ties at every cut
            np.where(rng.rand(v) < 0.3, -np.inf, rng.randn(v)),
            np.where(rng.rand(v) < 0.1, np.nan, rng.randn(v) * 0.01),  # NaN keys rank above +inf
            np.full(v, 2.5),
        ]
        x = np.stack(rows).astype(np.float32)
        b = len(x)
        keys = sp._order_keys(jnp.asarray(x))
        k = rng.randint(0, v + 3, b)
        got = np.asarray(native.cut_thresholds(keys, jnp.asarray(k)))
        kj = jnp.asarray(k)
        count = lambda at_least, _, kj=kj: at_least.sum(-1) >= kj  # noqa: E731
        jax_at = np.asarray(sp._largest_threshold(keys, count))
        np.testing.assert_array_equal(got, jax_at)
        for i in range(b):
            assert got[i] == _threshold_reference(np.asarray(keys[i]), k[i], None), (v, i, k[i])

        probs = np.array(jax.nn.softmax(jnp.asarray(np.where(np.isnan(x), -np.inf, x)), axis=-1))
        probs[:, ::7] = 0.0  # tokens of no weight (those top-k dropped) weigh nothing
        for p in (0.0, 1e-9, 0.3, 0.9, 0.999, 2.0):
            target = jnp.full((b,), p, jnp.float32)
            got = np.asarray(native.cut_thresholds(keys, target, jnp.asarray(probs)))
            for i in range(b):
                want = _threshold_reference(np.asarray(keys[i]), np.float32(p), probs[i])
                assert got[i] == want, (v, i, p)


@pytest.mark.skipif(not native.available(), reason=NO_NATIVE)
def test_native_cut_thresholds_name_a_bad_argument():
    keys = jnp.zeros((2, 8), jnp.uint32)
    with pytest.raises(ValueError, match="keys must be"):
        native.cut_thresholds(keys.astype(jnp.int32), jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"weights \[2, 4\] must have the keys' shape \[2, 8\]"):
        native.cut_thresholds(keys, jnp.ones((2,)), jnp.ones((2, 4)))


def test_draws_across_vocabulary_blocks_have_the_right_frequencies():
    """The two-level inverse-CDF draw over a vocabulary of many 256-token blocks: likely tokens in
    different blocks (first, last, neighbours across a block edge) come out as often as they should."""
    v = 1000
    logits = np.full(v, -6.0, np.float32)
    hot = {3: 1.0, 255: 0.5, 256: 0.8, 700: 0.2, 999: 1.2}
    for t, val in hot.items():
        logits[t] = val
    n = 4000
    p = SamplingParams(temperature=1.0, seed=11)
    got = draw([p] * n, list(range(n)), logits=logits)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    for tok in list(hot) + [0, 998]:
        freq = np.mean(got == tok)
        assert abs(freq - probs[tok]) < 4 * np.sqrt(probs[tok] * (1 - probs[tok]) / n) + 1e-3, tok
    cold = np.mean(~np.isin(got, list(hot)))
    assert abs(cold - probs[[t for t in range(v) if t not in hot]].sum()) < 0.02


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        # Were accepted here and overflowed int32 inside the engine's step (an OverflowError there).
        (dict(top_k=2**31), r"top_k must be an integer in \[1, 2\*\*31\)"),
        (dict(stop_token_ids=[2**31]), r"stop_token_ids must be a list of integers in \[0, 2\*\*31\)"),
        # A lone surrogate (invalid UTF-8 from a command line) has no UTF-8 form to match against.
        (dict(stop=["ok", "bad\udcff"]), r"SamplingParams.stop\[1\] is not valid Unicode"),
        (dict(min_tokens=-1), r"SamplingParams.min_tokens must be an integer in \[0, 2\*\*31\)"),
        (dict(min_tokens=True), r"SamplingParams.min_tokens must be an integer in \[0, 2\*\*31\)"),
        (dict(min_tokens=2**31, max_tokens=None), r"SamplingParams.min_tokens must be an integer in \[0, 2\*\*31\)"),
        (dict(min_tokens=17), r"SamplingParams.min_tokens must be at most max_tokens \(16\), got 17"),
        # Ints past a double's range: math.isfinite raised OverflowError.
        (dict(temperature=10**400), r"SamplingParams.temperature must be a finite number >= 0"),
        (dict(top_p=10**400), r"SamplingParams.top_p must be in \(0, 1\]"),
        (dict(repetition_penalty=-(10**400)), r"SamplingParams.repetition_penalty must be in"),
        (dict(logit_bias={5: 10**400}), r"SamplingParams.logit_bias\[5\] must be a number"),
        (dict(logit_bias=[(1, 2.0)]), r"SamplingParams.logit_bias must be None or a dict of token id -> bias"),
        (dict(logit_bias={-1: 2.0}), r"SamplingParams.logit_bias keys must be token ids.*one is -1"),
        (dict(logit_bias={"50256": 2.0}), r"SamplingParams.logit_bias keys must be token ids.*one is '50256'"),
        (dict(logit_bias={3: 100.5}), r"SamplingParams.logit_bias\[3\] must be a number in \[-100, 100\], got 100.5"),
        (dict(logit_bias={3: float("-inf")}), r"SamplingParams.logit_bias\[3\] must be a number in \[-100, 100\]"),
        (dict(logit_bias={3: "1"}), r"SamplingParams.logit_bias\[3\] must be a number"),
        (dict(logit_bias=dict.fromkeys(range(1025), 1.0)), r"SamplingParams.logit_bias must hold at most 1024"),
        (dict(allowed_token_ids=[]), r"SamplingParams.allowed_token_ids must hold 1 to 4096 distinct ids"),
        (dict(allowed_token_ids=[3, -1]), r"SamplingParams.allowed_token_ids must be None or a list of integers"),
        (dict(allowed_token_ids=7), r"SamplingParams.allowed_token_ids must be None or a list of integers"),
        (dict(allowed_token_ids=list(range(4097))), r"SamplingParams.allowed_token_ids must hold 1 to 4096"),
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw)


# A value at each documented limit (test_client_input.py sends them over the wire too).
AT_THE_LIMITS = [
    dict(max_tokens=1),
    dict(max_tokens=5, min_tokens=5),
    dict(min_tokens=2**31 - 1, max_tokens=None),
    dict(temperature=0.0),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=2**31 - 1),
    dict(top_p=1.0),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(repetition_penalty=2.0),
    dict(seed=0),
    dict(seed=2**32 - 1),
    dict(stop=["x" * sp.MAX_STOP_STRING_CHARS] * sp.MAX_STOP_STRINGS),
    dict(stop_token_ids=[0, 2**31 - 1]),
    dict(stop_token_ids=list(range(sp.MAX_STOP_TOKEN_IDS))),
    dict(logprobs=0, prompt_logprobs=0),
    dict(logprobs=sp.MAX_LOGPROBS, prompt_logprobs=sp.MAX_LOGPROBS),
    dict(n=sp.MAX_N),
    dict(truncate_prompt_tokens=-1),
    dict(truncate_prompt_tokens=1),
    dict(truncate_prompt_tokens=2**31 - 1),
    dict(logit_bias={0: -sp.LOGIT_BIAS_LIMIT, 2**31 - 1: sp.LOGIT_BIAS_LIMIT}),
    dict(logit_bias=dict.fromkeys(range(sp.MAX_LOGIT_BIAS), 1.0)),
    dict(allowed_token_ids=[0, 2**31 - 1]),
    dict(allowed_token_ids=list(range(sp.MAX_ALLOWED_TOKEN_IDS))),
    dict(bad_words=["y" * sp.MAX_BAD_WORD_CHARS] * sp.MAX_BAD_WORDS),
]


@pytest.mark.parametrize("kw", AT_THE_LIMITS, ids=lambda kw: ",".join(kw))
def test_values_at_each_limit_are_accepted(kw):
    """Every documented limit is inclusive where its message says so: the value at the limit itself
    is taken as given (the refusals just past them are in the bad-value tests)."""
    params = SamplingParams(**kw)
    for field, value in kw.items():
        got = getattr(params, field)
        want = tuple(value) if isinstance(value, list) else value
        assert got == want, field  # (allowed_token_ids come back sorted: these are)


def test_penalties_match_numpy():
    """Penalised greedy choice equals argmax of the NumPy-penalised logits (vLLM's definitions)."""
    logits = np.array([2.0, 1.9, 1.8, -0.5, -0.4, 0.3], np.float32)
    history, prompt_len = [0, 3, 1, 1, 2], 2  # prompt [0, 3]; output [1, 1, 2]
    for kw in [
        dict(presence_penalty=0.15),
        dict(frequency_penalty=0.1),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=-0.5, frequency_penalty=0.2, repetition_penalty=1.1),
    ]:
        p = SamplingParams(temperature=0.0, **kw)
        ref = logits.astype(np.float64).copy()
        seen = set(history)
        counts = np.bincount(history[prompt_len:], minlength=len(logits))
        r = kw.get("repetition_penalty", 1.0)
        for t in seen:
            ref[t] = ref[t] / r if ref[t] > 0 else ref[t] * r
        ref -= kw.get("frequency_penalty", 0.0) * counts
        ref -= kw.get("presence_penalty", 0.0) * (counts > 0)
        got = draw([p], [3], logits=logits, history=history, prompt_len=prompt_len)[0]
        assert got == int(np.argmax(ref)), kw
    # Without penalties the raw argmax wins; with a strong one the choice moves.
    assert draw([SamplingParams(temperature=0.0)], [0], logits=logits, history=history, prompt_len=2)[0] == 0
    assert (
        draw(
            [SamplingParams(temperature=0.0, frequency_penalty=0.5)],
            [0],
            logits=logits,
            history=[3, 0, 0, 1],
            prompt_len=1,
        )[0]
        == 2
    )


def test_a_sequences_token_array_follows_its_appends():
    """The penalty history reads `Sequence.token_array()`, a buffer that copies only new tokens."""
    from jaxinfer.scheduler import Sequence

    seq = Sequence(seq_id=0, request_id="0", index=0, params=SamplingParams(), seed=0, tokens=[5, 6, 7], prompt_len=2)
    rng = np.random.default_rng(0)
    for _ in range(40):  # across several regrowths of the buffer
        seq.tokens.extend(rng.integers(0, 1000, int(rng.integers(0, 9))).tolist())
        a = seq.token_array()
        assert a.dtype == np.int32 and a.tolist() == seq.tokens
    assert seq.token_array().tolist() == seq.tokens  # unchanged without appends


def test_rows_without_penalties_are_untouched_by_a_wide_history():
    """A history wider than one token runs the penalties on every row; a row without any must get
    the very same sample and log-probabilities as with no history at all, next to a penalised
    batch-mate or not. The sampler proper compiles once per row count, whatever the history width."""
    from jaxinfer.sampling import _sample

    logits = jnp.asarray(np.random.RandomState(1).randn(2, V).astype(np.float32) * 3)
    plain = SamplingParams(temperature=0.9, top_p=0.8, seed=5, logprobs=3)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3)
    history = list(range(10))
    _sample.clear_cache()
    outs = []
    for width, mate in [(1, plain), (16, plain), (64, penalised)]:
        rows = [(plain, 5, 2, history, 4), (mate, 0, 2, history, 4)]
        outs.append(sample(logits, SamplingBatch.from_rows(rows, 2, width)))
    for out in outs[1:]:
        assert int(out.tokens[0]) == int(outs[0].tokens[0])
        np.testing.assert_array_equal(np.asarray(out.top_logprobs[0]), np.asarray(outs[0].top_logprobs[0]))
        np.testing.assert_array_equal(np.asarray(out.logprob[0]), np.asarray(outs[0].logprob[0]))
    assert _sample._cache_size() == 1


def test_logprobs_are_raw_log_softmax():
    p = SamplingParams(temperature=0.0, logprobs=5)
    sb = SamplingBatch.from_rows([(p, 0, 0, [], 0)], 1, history_len=4)
    out = sample(jnp.asarray(LOGITS[None]), sb)
    ref = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    order = np.argsort(-ref)
    np.testing.assert_array_equal(np.asarray(out.top_ids[0, :5]), order[:5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0, :5]), ref[order[:5]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(out.logprob[0]), ref[int(out.tokens[0])], rtol=1e-5, atol=1e-5)


def test_a_placeholder_at_the_end_of_a_history_is_penalised_as_the_token_given_for_it():
    """Async scheduling: a penalised row's last token may still be on the device, a placeholder (-1)
    in the host's history; `sample(last=)` fills it in. The same penalised logits as a history that
    holds the token, and not those of one without it; a row without a placeholder ignores `last`."""
    from jaxinfer.sampling import apply_penalties

    p = SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.6)
    top = np.argsort(-LOGITS)[:4].tolist()
    logits = jnp.asarray(np.tile(LOGITS, (2, 1)))

    def penalised(histories, last=None):
        rows = [(p, 0, 3, h, 2) for h in histories]
        return np.asarray(apply_penalties(logits, SamplingBatch.from_rows(rows, 2, history_len=8), last))

    last = jnp.asarray([[top[0]], [top[3]]], jnp.int32)
    filled = penalised([[5, 6, top[1], -1], [5, 6, top[1], top[2]]], last)
    want = penalised([[5, 6, top[1], top[0]], [5, 6, top[1], top[2]]])
    np.testing.assert_array_equal(filled, want)
    assert not np.array_equal(filled[0], penalised([[5, 6, top[1]], [5]])[0])
    # A history as long as the width: the placeholder is its last slot, not one past it.
    full = [5, 6, 9, 10, 11, 12, top[1]]
    filled = penalised([[*full, -1], [*full, top[2]]], last)
    np.testing.assert_array_equal(filled, penalised([[*full, top[0]], [*full, top[2]]]))


def test_a_ban_if_last_applies_only_after_that_token():
    """A bad word whose second to last token is still on the device: its last token is banned only
    in the rows whose last token (given by `sample(last=)`) is that one."""
    greedy = SamplingParams(temperature=0.0)
    best, runner_up = np.argsort(-LOGITS)[:2].tolist()
    rows = [(greedy, 0, 3, [], 0)] * 3
    after = [[(best, 7)], [(best, 7)], None]
    sb = SamplingBatch.from_rows(rows, 3, bans_if_last=after, bias_width=4)
    out = sample(jnp.asarray(np.tile(LOGITS, (3, 1))), sb, last=np.array([[7], [8], [7]], np.int32))
    assert np.asarray(out.tokens).tolist() == [runner_up, best, best]


def test_logprobs_are_raw_whatever_the_penalties_bias_and_temperature():
    """Log-probabilities are of the model's own distribution (vLLM's default, raw_logprobs), not of
    the one the penalties, the bias and the temperature shaped for the draw."""
    p = SamplingParams(
        temperature=0.7,
        seed=3,
        logprobs=5,
        presence_penalty=1.0,
        repetition_penalty=1.8,
        logit_bias={int(np.argmax(LOGITS)): -8.0},
    )
    history = np.argsort(-LOGITS)[:6].tolist()  # the likeliest tokens, all penalised
    sb = SamplingBatch.from_rows([(p, 3, 4, history, 2)], 1, history_len=8)
    out = sample(jnp.asarray(LOGITS[None]), sb)
    ref = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    order = np.argsort(-ref)
    assert int(out.tokens[0]) != order[0]  # the draw did see the shaped distribution
    np.testing.assert_array_equal(np.asarray(out.top_ids[0, :5]), order[:5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0, :5]), ref[order[:5]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(out.logprob[0]), ref[int(out.tokens[0])], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(stop=3), "stop"),
        (dict(stop=["ok", 5]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(n=0), "n"),
        (dict(n=65), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
        (dict(prompt_logprobs=2.0), "prompt_logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=["a"] * 65), "stop must hold at most 64"),
        (dict(stop=["x" * 1025]), "stop must hold at most 64 strings of at most 1024 characters"),
        (dict(stop_token_ids=[1] * 257), "stop_token_ids must hold at most 256"),
        # Just past the limits that test_values_at_each_limit_are_accepted takes.
        (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None, -1"),
        (dict(truncate_prompt_tokens=2**31), "truncate_prompt_tokens must be None, -1"),
        (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens must be None, -1"),
        (dict(bad_words="the"), "bad_words must be a list of strings"),
        (dict(bad_words=["ok", 3]), "bad_words must be a list of strings"),
        (dict(bad_words=["ok", " "]), "bad_words must hold at most 64 non-blank strings"),
        (dict(bad_words=["ok"] * 65), "bad_words must hold at most 64 non-blank strings"),
        (dict(bad_words=["y" * 257]), "bad_words must hold at most 64 non-blank strings of at most 256 characters"),
        (dict(allowed_token_ids=[2**31]), r"allowed_token_ids must be None or a list of integers in \[0, 2\*\*31\)"),
        (dict(logit_bias={2**31: 1.0}), r"logit_bias keys must be token ids, integers in \[0, 2\*\*31\)"),
        # A list's length is checked before its elements (a million of them took a server's event
        # loop ~1 s): a list too long is refused as such, whatever it holds.
        (dict(stop=[None] * 10**6), "stop must hold at most 64"),
        (dict(stop_token_ids=["x"] * 10**6), "stop_token_ids must hold at most 256"),
        (dict(bad_words=[None] * 10**6), "bad_words must hold at most 64"),
        (dict(allowed_token_ids=[None] * 10**6), "allowed_token_ids must hold 1 to 4096"),
        (dict(allowed_token_ids=[7] * 4097), "allowed_token_ids must hold 1 to 4096"),  # repeats count
    ],
)
def test_bad_engine_sampling_values_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw)


def test_logit_bias_and_allowed_token_ids_match_numpy():
    """Greedy rows take the argmax of the NumPy-biased logits restricted to their allowed ids;
    stochastic rows draw only allowed ids, with the biased distribution's frequencies; rows with
    neither are untouched beside them. Log-probabilities stay the raw model's."""
    bias = {int(np.argmax(LOGITS)): -100.0, 7: 3.5, 11: -2.0}
    allowed = (2, 7, 11, 30, 31)
    biased = LOGITS.astype(np.float64).copy()
    for t, b in bias.items():
        biased[t] += b
    # Greedy: bias alone, allowed alone, both; and a plain row.
    cases = [
        (SamplingParams(temperature=0.0, logit_bias=bias), int(np.argmax(biased))),
        (SamplingParams(temperature=0.0, allowed_token_ids=allowed), max(allowed, key=lambda t: LOGITS[t])),
        (
            SamplingParams(temperature=0.0, logit_bias=bias, allowed_token_ids=allowed),
            max(allowed, key=lambda t: biased[t]),
        ),
        (SamplingParams(temperature=0.0, logprobs=2), int(np.argmax(LOGITS))),
    ]
    rows = [(p, 0, 0, [], 0) for p, _ in cases]
    out = sample(jnp.asarray(np.tile(LOGITS, (4, 1))), SamplingBatch.from_rows(rows, 4, bias_width=8, allowed_width=8))
    assert np.asarray(out.tokens).tolist() == [want for _, want in cases]
    assert len({want for _, want in cases}) == 4  # each case picks a token of its own
    raw = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    np.testing.assert_allclose(float(out.logprob[3]), raw[cases[3][1]], rtol=1e-5)

    n = 3000
    p = SamplingParams(temperature=1.0, seed=3, logit_bias=bias, allowed_token_ids=allowed)
    rows = [(p, 3, i, [], 0) for i in range(n)]
    sb = SamplingBatch.from_rows(rows, n, bias_width=8, allowed_width=8)
    got = np.asarray(sample(jnp.asarray(np.tile(LOGITS, (n, 1))), sb).tokens)
    probs = np.exp(biased[list(allowed)] - biased[list(allowed)].max())
    probs /= probs.sum()
    assert set(got.tolist()) <= set(allowed)
    for tok, q in zip(allowed, probs):
        assert abs(np.mean(got == tok) - q) < 4 * np.sqrt(q * (1 - q) / n) + 1e-3, tok


def test_logit_bias_and_allowed_token_ids_normalise():
    p = SamplingParams(logit_bias={np.int64(4): np.float32(1.5), 9: 0}, allowed_token_ids=np.array([9, 4, 9]))
    assert p.logit_bias == {4: 1.5, 9: 0.0} and all(type(k) is int for k in p.logit_bias)
    assert p.allowed_token_ids == (4, 9)
    assert SamplingParams(logit_bias={}).logit_bias is None
    # None is empty for the list fields, as vLLM declares them (it was refused).
    assert SamplingParams(stop=None, stop_token_ids=None, bad_words=None) == SamplingParams()
    # A NumPy array of ids is taken for stop_token_ids too (it was refused as if out of range).
    stop = SamplingParams(stop_token_ids=np.array([7, 2], np.int32)).stop_token_ids
    assert stop == (7, 2) and all(type(t) is int for t in stop)
    # Still hashable, equal parameters alike, whatever the dict's order.
    assert hash(SamplingParams(logit_bias={4: 1.5, 9: 0})) == hash(SamplingParams(logit_bias={9: 0.0, 4: 1.5}))
    assert len({SamplingParams(logit_bias={4: 1.5}), SamplingParams(logit_bias={4: 1.5}), SamplingParams()}) == 2


def test_bans_that_would_leave_nothing_to_draw_are_lifted():
    """A row whose allowed ids are all banned this step (a bad word, min_tokens) draws one of its
    allowed ids, biased as asked, not token 0; its batch mate keeps its ban."""
    p = SamplingParams(temperature=0.0, allowed_token_ids=(5, 9), logit_bias={5: 1.0, 9: 30.0})
    rows = [(p, 0, 0, [], 0)] * 2
    bans = [(5, 9), (9,)]
    out = sample(
        jnp.asarray(np.tile(LOGITS, (2, 1))), SamplingBatch.from_rows(rows, 2, bans=bans, bias_width=8, allowed_width=4)
    )
    assert np.asarray(out.tokens).tolist() == [9, 5]


@pytest.mark.parametrize("rep", [1e-46, 5e-324, 1e-40])  # 0 in float32 (or a denormal, flushed to 0)
def test_a_repetition_penalty_that_rounds_to_zero_keeps_masked_ids_out(rep):
    """A seen id that is masked (outside allowed_token_ids) or banned stays -inf: -inf * 0 was NaN,
    which argmax picked."""
    logits = jnp.asarray(np.tile(LOGITS, (2, 1)))
    masked = SamplingParams(temperature=0.0, repetition_penalty=rep, allowed_token_ids=(9, 10))
    banned = SamplingParams(temperature=0.0, repetition_penalty=rep)
    rows = [(masked, 0, 0, [5, 6, 7], 3), (banned, 0, 0, [2, 5, 6], 3)]
    sb = SamplingBatch.from_rows(rows, 2, history_len=4, bans=[None, (2, 5, 6)], bias_width=4, allowed_width=4)
    tokens = np.asarray(sample(logits, sb).tokens).tolist()
    assert tokens[0] in (9, 10) and tokens[1] not in (2, 5, 6)


def test_a_row_of_nan_logits_is_masked_the_same_alone_and_beside_filtered_rows():
    """A row without top-p or min-p keeps every token alone; beside a top-p or min-p row, `probs >=
    0 * max` (NaN) dropped all of a NaN row's tokens: its draw depended on its neighbours."""
    x = np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 2.0]], np.float32)
    alone = keep_mask(jnp.asarray(x[:1]), jnp.array([0]), jnp.array([1.0]), jnp.array([0.0]))
    for top_p, min_p in (([1.0, 0.9], [0.0, 0.0]), ([1.0, 1.0], [0.0, 0.2])):
        batch = keep_mask(jnp.asarray(x), jnp.array([0, 0]), jnp.array(top_p), jnp.array(min_p))
        np.testing.assert_array_equal(np.asarray(batch[0]), np.asarray(alone[0]))
    assert np.asarray(alone).all()
