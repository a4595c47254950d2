"""The per-row sampler against NumPy references of each filter, and parameter validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingBatch, SamplingParams, sample

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
    keep &= cum < top_p
    keep &= p >= min_p * p[0]
    return set(order[keep].tolist()), dict(zip(order.tolist(), p / p[keep].sum() * keep))


def draw(params_list, steps, logits=LOGITS):
    rows = [(p, p.seed or 0, s) for p, s in zip(params_list, steps)]
    sb = SamplingBatch.from_rows(rows, len(rows))
    return np.asarray(sample(jnp.asarray(np.tile(logits, (len(rows), 1))), sb))


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


def test_mixed_rows_and_seed_independent_of_batch_mates():
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = draw([p], [5])[0]
    mixed = draw([SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=9), p], [0, 3, 5])
    assert mixed[2] == alone
    assert mixed[0] == int(np.argmax(LOGITS))
    # A different step gives an independent draw (over many steps, not always the same token).
    assert len({int(draw([p], [s])[0]) for s in range(20)}) > 1


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
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw)
