"""The jitted per-row sampler, on the parameters `SamplingParams` validated on the host (defined in
jaxinfer.sampling_params, which imports no JAX, and re-exported here).

Every parameter is a per-row array, so one batch can mix greedy and stochastic requests with
different settings. Randomness is keyed per request: row b draws from
fold_in(key(seed_b), step_b), where step_b counts the tokens that request has generated. A
request's random draws therefore do not depend on which other requests share its batch. Its logits
can, in their last bits, on XLA CPU (matrix kernels round differently at different row counts; see
WORKSPACE.md, "Batch invariance"), so a seeded draw that falls within rounding of a boundary
between two tokens can still pick the other one in another batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import native
from jaxinfer.sampling_params import (  # noqa: F401 - re-exported: jaxinfer.sampling has always named them
    GENERATION_CONFIG_KEYS,
    GREEDY_TEMPERATURE,
    LOGIT_BIAS_LIMIT,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    NO_ID,
    SamplingParams,
    _is_number,
    generation_defaults,
    is_finite_number,
    is_int,
)

# A larger temperature draws as uniformly all the same (logits of size ~10 divided by it differ by
# ~1e-29). Not float32's largest: XLA divides by multiplying with 1 / temperature, which from ~1e38
# is below the smallest normal float and flushed to 0, and a banned logit's -inf * 0 is NaN (a
# temperature of 1e38 drew tokens outside allowed_token_ids).
_MAX_TEMPERATURE = 1e30


@struct.dataclass
class SamplingBatch:
    """Per-row sampling inputs as device arrays (a pytree)."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    repetition: jax.Array  # [B] float32, 1 = off
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32, tokens this sequence has generated so far
    want_logprobs: jax.Array  # [B] bool
    history: jax.Array  # [B, W] int32: prompt then output ids, -1 past the end; W = 1 when no row has a penalty
    prompt_lens: jax.Array  # [B] int32: history[:, :prompt_len] is prompt, the rest output
    # Where `sample(last=)` writes the row's last token into its history (W: nowhere): a history that
    # ends in a placeholder (a negative id) whose token is still on the device.
    last_pos: jax.Array  # [B] int32
    # Added to the logits before the penalties (logit_bias; -inf bans the ids min_tokens holds back):
    bias_ids: jax.Array  # [B, N] int32, NO_ID past a row's list; N = 1: no row has any
    bias: jax.Array  # [B, N] float32
    bias_if_last: jax.Array  # [B, N] int32: the bias applies only when the row's last token is this id (NO_ID: always)
    allowed: jax.Array  # [B, A] int32: allowed_token_ids, NO_ID past the list (all NO_ID: any); A = 1: none

    @classmethod
    def from_rows(
        cls,
        rows,
        batch_size: int,
        history_len: int = 1,
        *,
        bans=None,
        bans_if_last=None,
        bias_width: int = 1,
        allowed_width: int = 1,
    ) -> SamplingBatch:
        """rows: (params, seed, step, tokens, prompt_len) per live row; padded with greedy rows.

        `history_len` must hold the tokens of every row that uses a penalty (see `history_width`); rows
        without penalties leave their history at -1. A penalised row whose tokens end in a negative id
        (a placeholder for a token not yet on the host) has it filled in by `sample(last=)`. `bans`: per
        row, the ids it may not draw yet (or None). `bias_width` must hold a row's logit_bias and bans
        together (1 when no row has either), `allowed_width` its allowed_token_ids (1 when no row has
        them).
        """
        b = batch_size
        temp, top_k = np.zeros(b, np.float32), np.zeros(b, np.int32)
        top_p, min_p = np.ones(b, np.float32), np.zeros(b, np.float32)
        presence, frequency, repetition = np.zeros(b, np.float32), np.zeros(b, np.float32), np.ones(b, np.float32)
        seed, step = np.zeros(b, np.uint32), np.zeros(b, np.int32)
        want = np.zeros(b, bool)
        history = np.full((b, history_len), -1, np.int32)
        prompt_lens = np.zeros(b, np.int32)
        last_pos = np.full(b, history_len, np.int32)
        bias_ids = np.full((b, bias_width), NO_ID, np.int32)
        bias = np.zeros((b, bias_width), np.float32)
        bias_if_last = np.full((b, bias_width), NO_ID, np.int32)
        allowed = np.full((b, allowed_width), NO_ID, np.int32)
        bans = bans or [None] * len(rows)
        bans_if_last = bans_if_last or [None] * len(rows)
        for i, ((p, *_), ban, after) in enumerate(zip(rows, bans, bans_if_last)):
            k = 0
            if p.logit_bias:
                k = len(p.logit_bias)
                bias_ids[i, :k] = list(p.logit_bias)
                bias[i, :k] = list(p.logit_bias.values())
            if ban:
                bias_ids[i, k : k + len(ban)] = ban
                bias[i, k : k + len(ban)] = -np.inf
                k += len(ban)
            if after:
                bias_ids[i, k : k + len(after)] = [t for t, _ in after]
                bias_if_last[i, k : k + len(after)] = [t for _, t in after]
                bias[i, k : k + len(after)] = -np.inf
            if p.allowed_token_ids:
                allowed[i, : len(p.allowed_token_ids)] = p.allowed_token_ids
        for i, (p, s, n, tokens, prompt_len) in enumerate(rows):
            temp[i] = 0.0 if p.temperature < GREEDY_TEMPERATURE else min(p.temperature, _MAX_TEMPERATURE)
            top_k[i], top_p[i], min_p[i] = max(p.top_k, 0), p.top_p, p.min_p
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            seed[i], step[i], want[i] = s, n, p.logprobs is not None
            if p.has_penalties:
                history[i, : len(tokens)] = tokens
                prompt_lens[i] = prompt_len
                if len(tokens) and tokens[-1] < 0:
                    last_pos[i] = len(tokens) - 1
        return cls(
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            seed=seed,
            step=step,
            want_logprobs=want,
            history=history,
            prompt_lens=prompt_lens,
            last_pos=last_pos,
            bias_ids=bias_ids,
            bias=bias,
            bias_if_last=bias_if_last,
            allowed=allowed,
        )


def history_width(rows, *, maximum: int) -> int:
    """Bucketed history width for these rows: 1 when none uses a penalty (the common case), else
    the power of two >= 64 that holds the longest penalised row, capped at `maximum`."""
    longest = max((len(tokens) for p, _, _, tokens, _ in rows if p.has_penalties), default=0)
    if not longest:
        return 1
    return min(max(64, 1 << (longest - 1).bit_length()), maximum)


def history_widths(maximum: int) -> list[int]:
    """Every width `history_width` can return (for warm-up)."""
    widths, w = [1], 64
    while w < maximum:
        widths.append(w)
        w *= 2
    return widths + [maximum]


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, raw log-probability of the chosen token
    top_ids: jax.Array  # [B, min(MAX_LOGPROBS, V)] int32, most likely first
    top_logprobs: jax.Array  # [B, min(MAX_LOGPROBS, V)] float32


def apply_penalties(logits: jax.Array, sb: SamplingBatch, last: jax.Array | None = None) -> jax.Array:
    """Presence/frequency penalties over output tokens, repetition penalty over prompt + output.
    `last` [B, 1]: each row's last token, written into its history at `sb.last_pos` first."""
    b, v = logits.shape
    hist = sb.history
    if last is not None:
        hist = jnp.asarray(hist).at[jnp.arange(b), sb.last_pos].set(jnp.asarray(last)[:, 0], mode="drop")
    valid = hist >= 0
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= sb.prompt_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], hist.shape)
    ids = jnp.where(valid, hist, 0)
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, ids].max(valid)
    rep = sb.repetition[:, None]
    # A banned or masked id stays -inf: a penalty that rounded to 0 in float32 made it -inf * 0 = NaN,
    # which argmax picks.
    seen &= logits > -jnp.inf
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sb.frequency[:, None] * out_counts
    return logits - sb.presence[:, None] * (out_counts > 0)


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float32 order of x (-inf lowest; -0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_keys(keys: jax.Array) -> jax.Array:
    """The floats `_order_keys` made these keys of (0, padding, is a NaN: a key no float has)."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(keys: jax.Array, reaches, values: jax.Array | None = None) -> jax.Array:
    """Per row, the largest uint32 m with reaches(keys >= m, values) true, built bit by bit from the top.

    `reaches([B, N] bool, values) -> [B] bool` must be monotone: true for the whole row (m = 0) and,
    once false, false for every larger m. `values` ([B, N], or None) is handed to it as it is: the
    probabilities of `keys`' tokens, for top-p. Thirty-two O(N) passes; no sort.
    """

    def bit(i, m):
        candidate = m | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(reaches(keys >= candidate[:, None], values), candidate, m)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:1], jnp.uint32))


# The candidates a cut is searched among first: the _CANDIDATE_BLOCKS blocks of _CANDIDATE_BLOCK
# consecutive tokens with the largest maxima (2048 of a row's tokens), which hold every token above
# the largest maximum of the other blocks. The 32 passes of a cut then read those, not the whole
# vocabulary: the sampler with top-k 50 and top-p 0.9 on [8 / 16 / 32 / 48, 32000] logits took
# 2.0-2.4 / 3.5 / 6.7-7.1 / 10.3-11.0 ms so, against 2.6-6.1 / 5.3-13.7 / 8.9-33.6 / 18.9-46.6 over
# whole rows (2 vCPUs, 2026-12-06; 4096 candidates were no faster; WORKSPACE.md, "Sampler").
_CANDIDATE_BLOCK = 32
_CANDIDATE_BLOCKS = 64


class _Candidates(NamedTuple):
    blocks: jax.Array  # [B, J] int32: the chosen blocks of each row
    keys: jax.Array  # [B, J * block] uint32: their tokens' keys (0, below every float's, past the vocabulary)
    above: jax.Array  # [B] uint32: every key >= above is among them (0 where that bound is unknown)

    def gather(self, values: jax.Array) -> jax.Array:
        """values [B, V] -> [B, J * block] at the candidates' tokens (0 past the vocabulary)."""
        return _gather_blocks(values, self.blocks)


def _gather_blocks(values: jax.Array, blocks: jax.Array) -> jax.Array:
    b, v = values.shape
    per_row = _blocked(values)
    return jnp.take_along_axis(per_row, blocks[:, :, None], axis=1).reshape(b, -1)


def _blocked(values: jax.Array) -> jax.Array:
    """[B, V] -> [B, NB, _CANDIDATE_BLOCK], padded with zeros."""
    b, v = values.shape
    return jnp.pad(values, ((0, 0), (0, -v % _CANDIDATE_BLOCK))).reshape(b, -1, _CANDIDATE_BLOCK)


def _candidates(keys: jax.Array, wanted: jax.Array) -> _Candidates | None:
    """The blocks of each row with the largest maxima, picked where `wanted` ([] bool: some row cuts;
    else unused zeros, at no cost); None for a vocabulary too small to gain from them."""
    b, v = keys.shape
    if -(-v // _CANDIDATE_BLOCK) <= 2 * _CANDIDATE_BLOCKS:
        return None
    j = _CANDIDATE_BLOCKS
    unused = _Candidates(
        jnp.zeros((b, j), jnp.int32), jnp.zeros((b, j * _CANDIDATE_BLOCK), jnp.uint32), jnp.zeros((b,), jnp.uint32)
    )
    return jax.lax.cond(wanted, _pick_candidates, lambda _: unused, keys)


def _pick_candidates(keys: jax.Array) -> _Candidates:
    b, v = keys.shape
    maxima = _blocked(keys).max(axis=-1)  # [B, NB]
    # The blocks are picked by their maxima as floats (XLA CPU's top_k is fast for float32 only:
    # 0.6 against 2.0 ms on uint32 [48, 500]); which blocks it picks among exact ties does not
    # matter, as the bound is taken from the keys of the blocks it left out.
    _, chosen = jax.lax.top_k(_from_order_keys(maxima), _CANDIDATE_BLOCKS)
    left_out = jnp.ones(maxima.shape, jnp.bool_).at[jnp.arange(b)[:, None], chosen].set(False)
    rest = jnp.where(left_out, maxima, jnp.uint32(0)).max(axis=-1)
    above = jnp.where(rest == jnp.uint32(0xFFFFFFFF), jnp.uint32(0), rest + jnp.uint32(1))
    return _Candidates(chosen, _gather_blocks(keys, chosen), above)


def _cut(keys, reaches, values, uses, candidates: _Candidates | None) -> tuple[jax.Array, jax.Array]:
    """Per row, `_largest_threshold(keys, reaches, values)` where `uses` (elsewhere anything), and
    whether it was searched among the candidates alone.

    It is, when for every row that uses the cut `reaches` holds on the candidates at their bound
    `above`: from that bound up they hold every token of the row that counts, so `reaches` on them
    is `reaches` on the row there, and below it true (monotone): the same threshold. (A count is
    exact either way; top-p's mass is summed over fewer zeros, so where a cut's mass is within
    float32 rounding of p the two sums may round to opposite sides of it.) Otherwise (a top-p nucleus
    wider than the candidates, a top-k beyond them) every row is searched whole.
    """
    if candidates is None:
        return _largest_threshold(keys, reaches, values), jnp.asarray(False)
    few = candidates.gather(values) if values is not None else None
    at_bound = reaches(candidates.keys >= candidates.above[:, None], few)
    inside = jnp.all(~uses | (at_bound & (candidates.above > 0)))
    at = jax.lax.cond(
        inside,
        lambda: _largest_threshold(candidates.keys, reaches, few),
        lambda: _largest_threshold(keys, reaches, values),
    )
    return at, inside


def native_cuts() -> bool:
    """Whether keep_mask's cuts run in the C++ kernel (`native.cut_thresholds`): a radix select, two
    passes over each row, where the pure-JAX search takes 32 over every row whose cut the candidate
    blocks do not hold (a flat row's top-p nucleus): top-p 0.95 on [48, 32000] flat logits took
    24.6-25.6 ms so, 6.2-7.0 in the kernel (WORKSPACE.md, "Sampler"). On the CPU, outside a
    multi-device mesh, where the kernels built."""
    return native.runs_here()


def keep_mask(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens each row may draw after top-k, then top-p on the top-k renormalised
    distribution, then min-p; x is [B, V] temperature-scaled logits.

    The same sets as sorting each row and cutting at ranks (top-k: rank < k; top-p: the exclusive
    cumulative probability < p; the most likely token always survives), found as per-row thresholds
    on the value instead: a stage's threshold is the largest value whose "at least this value" set
    still holds k tokens (top-k) or p of the mass (top-p). Where logits tie exactly at a cut, all the
    tied tokens stay, where a sort would keep an arbitrary subset of them. Why: XLA's CPU sort of a
    32k vocabulary costs ~10 ms per row, more than the decode step it follows; these are 32 linear
    passes per stage, over the few thousand candidates that hold the cut where they do (`_cut`), and
    a stage no row uses is skipped. On the CPU the same thresholds come from a C++ kernel
    (`native_cuts`), two passes over each row that uses the stage.
    """
    b, v = x.shape
    keys = _order_keys(x)
    keep = jnp.ones((b, v), jnp.bool_)
    uses_k = (top_k > 0) & (top_k < v)
    uses_p = top_p < 1.0
    in_native = native_cuts()
    candidates = None if in_native else _candidates(keys, jnp.any(uses_k | uses_p))

    def top_k_cut():
        if in_native:  # a target of 0 skips the rows without top-k
            at = native.cut_thresholds(keys, jnp.where(uses_k, top_k, 0))
        else:
            k = jnp.where(uses_k, top_k, v)
            at, _ = _cut(keys, lambda at_least, _: at_least.sum(-1) >= k, None, uses_k, candidates)
        return keys >= jnp.where(uses_k, at, 0)[:, None]

    keep = jax.lax.cond(jnp.any(uses_k), top_k_cut, lambda: keep)

    # A p below float32's range (a valid double) is 0 here, and "at least 0 of the mass" would keep
    # no token at all: at least the smallest positive float keeps the most likely one.
    p = jnp.maximum(top_p, jnp.finfo(jnp.float32).tiny)

    def by_probability(keep):  # top-p, then min-p: the two filters on the renormalised distribution
        probs = jax.nn.softmax(jnp.where(keep, x, -jnp.inf), axis=-1)

        def top_p_cut():
            if in_native:  # a target of 0 skips the rows without top-p
                at = native.cut_thresholds(keys, jnp.where(uses_p, p, 0.0), probs)
            else:
                mass = lambda at_least, pr: jnp.where(at_least, pr, 0.0).sum(-1) >= p  # noqa: E731
                at, _ = _cut(keys, mass, probs, uses_p, candidates)
            return keep & ((keys >= at[:, None]) | ~uses_p[:, None])  # p = 1 keeps all, whatever the rounding

        keep = jax.lax.cond(jnp.any(uses_p), top_p_cut, lambda: keep)
        # (A row without min-p keeps all as it does alone, NaN probabilities included: a row must
        # not depend on its neighbours, whatever its logits.)
        return keep & ((probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True)) | (min_p <= 0)[:, None])

    # min-p 0 keeps every probability (>= 0): a batch with neither filter skips the softmax too.
    return jax.lax.cond(jnp.any(uses_p | (min_p > 0)), by_probability, lambda keep: keep, keep)


# Up to this many logits a row takes one level: the second costs a gather, ~0.07 s more to compile
# per sampler program (the test suite compiles hundreds, most for a 259-token vocabulary), and saves
# nothing there; at [48, 4096] (the default model's) it saves 0.35 -> 0.08 ms a step.
_ONE_LEVEL_ARGMAX = 1024


def argmax_last_axis(x: jax.Array, *, block: int = 64) -> jax.Array:
    """jnp.argmax(x, axis=-1) for [B, V] x - the first index of the largest value, the first NaN
    where there is one - in two levels: each block of `block` values' maximum (one pass over x, a
    single-operand reduction XLA CPU vectorizes), the first block holding the row's maximum, then the
    first index inside it. XLA CPU's variadic argmax reduce took 3.4-4.5 ms for [48-64, 32000]
    float32 logits; a max and then a min over the indices holding it, 1.6-2.5 ms (it writes a [B, V]
    array of indices between the two); this, 0.4-0.5 ms (2 vCPUs, 2026-12-06).

    XLA CPU's max reduction (YNNPACK's) may skip a NaN (the blocks' maxima here did, at [6, 2000]:
    the max's index came back, not the NaN's), so the maxima say nothing of NaN. A row's sum does (one more pass, 0.1 ms
    at [48, 32000]): a batch where some row's sum is NaN (a NaN, or both infinities) is answered by
    `_exact_argmax` instead, which looks for NaN on its own.
    """
    b, v = x.shape
    if v <= _ONE_LEVEL_ARGMAX:
        return _exact_argmax(x)
    blocks = jnp.pad(x, ((0, 0), (0, -v % block)), constant_values=-jnp.inf).reshape(b, -1, block)
    maxima = blocks.max(axis=-1)  # [B, NB]
    top = maxima.max(axis=-1, keepdims=True)
    first = _first_true(maxima == top)
    inner = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # [B, block]
    fast = first * block + _first_true(inner == top)
    return jax.lax.cond(jnp.any(jnp.isnan(x.sum(axis=-1))), _exact_argmax, lambda _: fast, x)


def _exact_argmax(x: jax.Array) -> jax.Array:
    """argmax by its rule with every NaN looked for (two passes over x and a [B, V] mask between)."""
    nan = jnp.isnan(x)
    top = x.max(axis=-1, keepdims=True)
    return _first_true(jnp.where(nan.any(axis=-1, keepdims=True), nan, x == top))


def _first_true(mask: jax.Array) -> jax.Array:
    """[B, N] bool -> [B] int32: the first true index of each row (N where none is)."""
    index = jax.lax.broadcasted_iota(jnp.int32, mask.shape, 1)
    return jnp.min(jnp.where(mask, index, mask.shape[1]), axis=-1)


def _last_true(mask: jax.Array) -> jax.Array:
    """Index of the last true entry along the last axis (0 when none is)."""
    return mask.shape[-1] - 1 - jnp.argmax(mask[..., ::-1], axis=-1)


def _draw(x: jax.Array, keep: jax.Array, seed: jax.Array, step: jax.Array, *, block: int = 256) -> jax.Array:
    """[B] token ids: row b drawn from softmax(x[b]) restricted to keep[b], by inverting its
    cumulative distribution at one uniform number from fold_in(key(seed_b), step_b).

    In two levels: the block of `block` tokens where the cumulative mass passes the target, then the
    token inside it. A cumulative sum over the whole vocabulary would cost more than everything else
    here on CPU (XLA's scan over 32k entries), and its float32 running total would blur the
    smallest probabilities; the two short ones have neither problem.
    """
    b, v = x.shape
    w = jnp.where(keep, jnp.exp(x - x.max(axis=-1, keepdims=True)), 0.0)
    blocks = jnp.pad(w, ((0, 0), (0, -v % block))).reshape(b, -1, block)  # [B, NB, block]
    block_cdf = jnp.cumsum(blocks.sum(-1), axis=-1)  # [B, NB]
    u = jax.vmap(lambda s, n: jax.random.uniform(jax.random.fold_in(jax.random.key(s), n)))(seed, step)
    target = u * block_cdf[:, -1]
    # The first block whose cumulative mass passes the target (a block without mass never does);
    # u * total can round up to the total, hence the clamp to the last block with mass.
    blk = jnp.minimum((block_cdf <= target[:, None]).sum(-1), _last_true(blocks.sum(-1) > 0))
    before = jnp.where(blk > 0, jnp.take_along_axis(block_cdf, jnp.maximum(blk - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, block]
    idx = (jnp.cumsum(inner, axis=-1) <= (target - before)[:, None]).sum(-1)
    idx = jnp.minimum(idx, _last_true(inner > 0))  # the two levels' sums may round differently
    return (blk * block + idx).astype(jnp.int32)


_apply_penalties = jax.jit(apply_penalties)


def sample(logits: jax.Array, params: SamplingBatch, last: jax.Array | np.ndarray | None = None) -> SampleOutput:
    """Picks one token per row, and the log-probabilities rows asked for.

    Args:
        logits: [B, V] float32 raw model logits.
        params: SamplingBatch with [B] fields and a [B, W] history.
        last: [B, 1] int32, each row's last token (a decode call's input tokens, on the device),
            for the penalised rows whose history ends in a placeholder (`SamplingBatch.last_pos`)
            and the bans that follow it (`SamplingBatch.bias_if_last`).

    Returns:
        SampleOutput. Two stages run as small programs of their own, only in steps that need them:
        logit_bias, allowed_token_ids and the bans (`_apply_bias`, when the bias or allowed arrays
        are wider than one entry), then the penalties (when the history is wider than one token:
        some row has a penalty, `history_width`). The sampler proper sees neither stage's inputs, so
        it compiles once per row count, not once per row count and stage width (a warm-up compiles
        every pair, and the sampler is the costlier program to compile).
    """
    # Each stage sees only its own inputs: its programs are keyed on their shapes alone.
    processed = logits
    biased = params.bias_ids.shape[1] > 1 or params.allowed.shape[1] > 1
    if biased or params.history.shape[1] > 1:
        if last is None:
            last = np.zeros((logits.shape[0], 1), np.int32)
        # Placed as the logits are, from the host or the device: one program per stage, and a
        # processed array placed as the unprocessed one (the logits) for `_sample`.
        if isinstance(logits, jax.Array) and logits.committed:
            last = jax.device_put(last, logits.sharding)
    if biased:
        processed = _apply_bias(processed, params.bias_ids, params.bias, params.bias_if_last, params.allowed, last)
    if params.history.shape[1] > 1:
        stage = params.replace(bias_ids=None, bias=None, bias_if_last=None, allowed=None)
        processed = _apply_penalties(processed, stage, last)
    return _sample(
        logits,
        processed,
        params.replace(
            history=None, prompt_lens=None, last_pos=None, bias_ids=None, bias=None, bias_if_last=None, allowed=None
        ),
    )


@jax.jit
def _apply_bias(logits, bias_ids, bias, bias_if_last, allowed, last) -> jax.Array:
    """allowed_token_ids (every other id -inf), then logit_bias and the bans (-inf: min_tokens' stop
    ids, bad words) added, each entry only if the row's last token (`last` [B, 1]) is its
    `bias_if_last` (or that is NO_ID). Bans that would leave a row nothing to draw (its only allowed
    ids banned) are lifted for this step: an allowed token is drawn, not an arbitrary one."""
    rows = jnp.arange(logits.shape[0])[:, None]
    bias = jnp.where((bias_if_last == NO_ID) | (bias_if_last == last), bias, 0.0)
    if allowed.shape[1] > 1:
        ok = jnp.zeros(logits.shape, jnp.bool_).at[rows, allowed].set(True, mode="drop")
        restricted = allowed[:, :1] != NO_ID  # rows with a list (sorted: an empty one starts with NO_ID)
        logits = jnp.where(restricted & ~ok, -jnp.inf, logits)
    out = logits.at[rows, bias_ids].add(bias, mode="drop")
    nothing_left = jnp.all(out == -jnp.inf, axis=-1, keepdims=True)
    unbanned = logits.at[rows, bias_ids].add(jnp.where(bias == -jnp.inf, 0.0, bias), mode="drop")
    return jnp.where(nothing_left, unbanned, out)


@jax.jit
def _sample(logits: jax.Array, processed: jax.Array, params: SamplingBatch) -> SampleOutput:
    """`sample` after the penalties: tokens from `processed`, log-probabilities from raw `logits`.

    Each optional stage (the stochastic path, log-probability top-n) sits behind a `lax.cond` on
    whether any row needs it, so an all-greedy batch pays for an argmax only.
    """
    greedy = argmax_last_axis(processed)

    def stochastic():
        # +inf (a repetition penalty that rounded to 0 in float32 divides a positive logit by it)
        # becomes the largest float: x - max must stay a number.
        x = jnp.minimum(processed / jnp.maximum(params.temperature, 1e-6)[:, None], jnp.finfo(jnp.float32).max)
        keep = keep_mask(x, params.top_k, params.top_p, params.min_p)
        drawn = _draw(x, keep, params.seed, params.step)
        # Never a token the filters dropped, nor one past the vocabulary (the draw's padded blocks;
        # take_along_axis would fill such an index, with True).
        ok = (drawn < x.shape[-1]) & jnp.take_along_axis(keep, drawn[:, None], axis=1, mode="clip")[:, 0]
        return jnp.where((params.temperature == 0) | ~ok, greedy, drawn)

    tokens = jax.lax.cond(jnp.all(params.temperature == 0), lambda: greedy, stochastic)
    k = min(MAX_LOGPROBS, logits.shape[-1])

    def logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, k)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        b = logits.shape[0]
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(params.want_logprobs), logprobs, no_logprobs)
    return SampleOutput(tokens=tokens, logprob=chosen, top_ids=top_ids, top_logprobs=top_lp)
