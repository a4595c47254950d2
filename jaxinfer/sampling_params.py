"""`SamplingParams`: what one request asks of the sampler, validated on the host.

Kept apart from the jitted sampler (jaxinfer.sampling, which re-exports every name here) so that
checking a request imports no JAX: the command line refuses a bad flag before the seconds JAX takes
to import, and a client can build and check its parameters without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
import sys

import numpy as np

from jaxinfer.errors import InvalidRequestError
from jaxinfer.tokenizer import require_unicode


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool: what every integer field of a request accepts."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def is_finite_number(x) -> bool:
    """A number (not a bool) that a double holds, finite: a 400-digit int is none (float() overflows)."""
    if not _is_number(x):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


MAX_LOGPROBS = 20  # top-n logprobs per generated token, at most
MAX_N = 64  # samples per prompt, at most
# Stop conditions are checked on the host for every generated token, on the thread all requests
# share: bounded, so one request cannot slow every other one down.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most, as OpenAI's API bounds it
MAX_ALLOWED_TOKEN_IDS = 4096  # entries of one request's allowed_token_ids
MAX_BAD_WORDS = 64  # bad_words of one request, each tokenized two ways (see Engine.bad_word_ids)
MAX_BAD_WORD_CHARS = 256
NO_ID = 2**31 - 1  # pads lists of token ids: past any vocabulary, so a scatter with mode="drop" skips it


# Temperatures below this are greedy: dividing by them only turns float32 rounding noise between
# near-tied logits into a coin flip.
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each generated token, and when to stop.

    Checked when made, and frozen so it stays checked: where a vLLM script sets a field
    (`sp = llm.get_default_sampling_params(); sp.max_tokens = 64`), write
    `dataclasses.replace(sp, max_tokens=64)`, which checks the new value.

    Attributes:
        max_tokens: tokens to generate at most (>= 1); None: up to the model's length limit
            (`max_model_len`, prompt included), as in vLLM.
        min_tokens: tokens to generate before EOS, `stop_token_ids` or a `stop` string may end the
            output, as in vLLM (HF's min_new_tokens): those ids cannot be drawn among them, and a stop
            string that ends in their text is not one (one a later token completes is). In [0,
            max_tokens]; the model's length limit still ends it.
        temperature: logits are divided by it (>= 0); 0, and anything below `GREEDY_TEMPERATURE` (1e-5,
            vLLM's threshold), means greedy.
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
            The three apply in HF's warper order: top_k, then top_p over what top_k kept
            (renormalised), then min_p (vLLM's V1 sampler applies min_p first, so a request that
            sets both top_p and min_p can keep a different set there).
        presence_penalty: subtracted once from every token already generated, in [-2, 2].
        frequency_penalty: subtracted per occurrence of a token already generated, in [-2, 2].
        repetition_penalty: > 1 discourages tokens seen in the prompt or output (positive logits are
            divided by it, negative ones multiplied), in (0, 2]; 1 is off.
        seed: makes sampling reproducible for this request, independent of its batch mates.
        stop: strings that end generation when they appear in the text (not included in the text
            unless `include_stop_str_in_output`); at most 64, of at most 1024 characters each. None,
            here and for `stop_token_ids` and `bad_words`, is none (as in vLLM).
        stop_token_ids: extra token ids that end generation (not included in the output); at most 256.
        include_stop_str_in_output: the text ends after the stop string that ended it, not before
            (vLLM's); what followed it in the same token is still cut.
        ignore_eos: keep generating past the end-of-sequence token.
        skip_special_tokens: leave special tokens (BOS, EOS, <unk>, a chat format's markers) out of
            the text, as vLLM and transformers' decode do by default; False: each is its own text
            there ("</s>"), and stop strings may match it. token_ids are the same either way.
        logprobs: also return the log-probabilities of the top-n tokens (0..20) at each step, and of
            the chosen token; None for none. Log-probabilities are those of the model's raw
            distribution (before penalties, temperature and filtering).
        prompt_logprobs: also return, for every prompt token after the first, its log-probability
            given the tokens before it and the top-n (0..20) at its position (vLLM's); None for none.
            Raw distribution, as `logprobs`. Such a request's prompt is computed in full: it reads no
            pages from the prefix cache (it still offers its own).
        n: independent samples per prompt (1..64); sample i uses seed + i when a seed is given.
        truncate_prompt_tokens: run only the prompt's last k tokens (vLLM's left truncation); -1: the
            last max_model_len - 1 (as many as the engine takes); None: the whole prompt. The output's
            prompt_token_ids are the tokens run. A text prompt is then not refused for its size
            before it is tokenized.
        logit_bias: {token id: bias} added to those tokens' logits before sampling, as in OpenAI's API
            and vLLM; biases in [-100, 100], at most 1024 entries (an empty dict is None). Added before
            the penalties, as vLLM and transformers' `sequence_bias` add it (a repetition penalty
            then scales the biased logit).
        bad_words: words the output must not contain (vLLM's), as token sequences: each word as the
            tokenizer encodes it alone and after a space. When the tokens before the next one are a
            word's tokens but its last, that last token cannot be drawn. The tokens before may be the
            prompt's, as in transformers' bad_words_ids (vLLM looks at the output only). At most 64
            non-blank words of at most 256 characters; needs the model's tokenizer.
        allowed_token_ids: only these ids may be drawn (vLLM's); None: any. Non-empty, at most 4096,
            kept sorted and without repeats. EOS and stop ids outside it can never end the output.
            Where bad_words or min_tokens would ban every allowed id, those bans are lifted for that
            token (with min_tokens alone, such a request is refused at once).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()

    def __post_init__(self):
        def bad(field, value, limit):
            raise InvalidRequestError(f"SamplingParams.{field} {limit}, got {reprlib.repr(value)}")

        def number_in(field, lo, hi, *, lo_open=False):
            v = getattr(self, field)
            ok = is_finite_number(v) and (v > lo if lo_open else v >= lo) and v <= hi
            if not ok:
                bad(field, v, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")

        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "must be an integer >= 1, or unset (None) for the model's length limit")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens < 2**31:
            bad("min_tokens", self.min_tokens, "must be an integer in [0, 2**31)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be at most max_tokens ({self.max_tokens})")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            bad("top_k", self.top_k, "must be an integer in [1, 2**31), or 0 / -1 to disable")
        number_in("top_p", 0, 1, lo_open=True)
        number_in("min_p", 0, 1)
        number_in("presence_penalty", -2, 2)
        number_in("frequency_penalty", -2, 2)
        number_in("repetition_penalty", 0, 2, lo_open=True)
        if self.seed is not None and (not is_int(self.seed) or not (0 <= self.seed < 2**32)):
            bad("seed", self.seed, "must be an integer in [0, 2**32)")
        # None is "none", as vLLM declares these three (code passes `stop=request.get("stop")`).
        for field in ("stop", "stop_token_ids", "bad_words"):
            if getattr(self, field) is None:
                object.__setattr__(self, field, ())
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        # Each list's length is checked before its elements: a request of millions must be refused
        # at once (on a server this runs on the event loop, where every stream waits for it).
        too_many = f"must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"
        if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP_STRINGS:
            bad("stop", self.stop, too_many)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            bad("stop", self.stop, "must be a string or a list of strings")
        if any(x == "" for x in stop):
            bad("stop", self.stop, "must not contain an empty string")
        for i, x in enumerate(stop):
            require_unicode(x, f"SamplingParams.stop[{i}]")
        if any(len(x) > MAX_STOP_STRING_CHARS for x in stop):
            bad("stop", self.stop, too_many)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if isinstance(ids, np.ndarray) and ids.ndim == 1:  # as allowed_token_ids and prompt ids take it
            ids = ids.tolist()
        if isinstance(ids, (list, tuple)) and len(ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", ids, f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and 0 <= t < 2**31 for t in ids):
            bad("stop_token_ids", ids, "must be a list of integers in [0, 2**31)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                bad(field, getattr(self, field), "must be a bool")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(field, v, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", self.n, f"must be an integer in [1, {MAX_N}]")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or not (k == -1 or 1 <= k < 2**31)):
            bad("truncate_prompt_tokens", k, "must be None, -1 (the engine's prompt limit) or an integer >= 1")
        self._check_logit_bias(bad)
        words = self.bad_words
        too_many = f"must hold at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_BAD_WORD_CHARS} characters"
        if isinstance(words, (list, tuple)) and len(words) > MAX_BAD_WORDS:
            bad("bad_words", words, too_many)
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            bad("bad_words", words, "must be a list of strings")
        if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
            bad("bad_words", words, too_many)
        for i, w in enumerate(words):
            require_unicode(w, f"SamplingParams.bad_words[{i}]")
        object.__setattr__(self, "bad_words", tuple(words))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, np.ndarray):
                allowed = allowed.tolist() if allowed.ndim == 1 else allowed
            if isinstance(allowed, (list, tuple)) and len(allowed) > MAX_ALLOWED_TOKEN_IDS:  # repeats count too
                bad("allowed_token_ids", self.allowed_token_ids, f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} distinct ids")
            if not isinstance(allowed, (list, tuple)) or not all(is_int(t) and 0 <= t < 2**31 for t in allowed):
                bad("allowed_token_ids", allowed, "must be None or a list of integers in [0, 2**31)")
            allowed = tuple(sorted({int(t) for t in allowed}))
            if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                bad("allowed_token_ids", self.allowed_token_ids, f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} distinct ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        # NumPy scalars become Python numbers (a np.uint32 seed + sample index would overflow).
        for field in (
            *("max_tokens", "min_tokens", "top_k", "seed"),
            *("logprobs", "prompt_logprobs", "n", "truncate_prompt_tokens"),
        ):
            if (v := getattr(self, field)) is not None:
                object.__setattr__(self, field, int(v))
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, field, float(getattr(self, field)))

    def __hash__(self) -> int:  # logit_bias, a dict, hashes as its sorted items
        return hash(
            tuple(
                tuple(sorted(v.items())) if isinstance(v, dict) else v
                for v in (getattr(self, f.name) for f in dataclasses.fields(self))
            )
        )

    def _check_logit_bias(self, bad) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            bad("logit_bias", bias, "must be None or a dict of token id -> bias")
        if len(bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", bias, f"must hold at most {MAX_LOGIT_BIAS} entries")
        out = {}
        for t, b in bias.items():
            if not is_int(t) or not 0 <= t < 2**31:
                bad("logit_bias", bias, f"keys must be token ids, integers in [0, 2**31); one is {reprlib.repr(t)}")
            if not is_finite_number(b) or abs(b) > LOGIT_BIAS_LIMIT:
                bad(f"logit_bias[{int(t)}]", b, f"must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
            out[int(t)] = float(b)
        object.__setattr__(self, "logit_bias", out or None)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# generation_config.json keys that set default SamplingParams fields: the ones vLLM reads (HF's
# max_new_tokens is max_tokens). Everything else in the file (num_beams, length_penalty, ...) is ignored.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


GENERATION_CONFIG_CHOICES = ("auto", "none")  # LLM(generation_config=...): read generation_config.json, or not


def generation_defaults(model_dir: str | None) -> dict:
    """The sampling defaults a checkpoint's `generation_config.json` recommends, as SamplingParams
    keyword arguments ({} when it has none).

    Only keys the file sets count (HF's implicit top_k=50 does not, as in vLLM). `"do_sample": false`
    means greedy, as it does in transformers' `generate`: temperature 0, and the filters it would
    ignore are dropped. The file is advisory: a value SamplingParams refuses is left out with a warning
    on stderr naming it, and an unreadable file counts as none.
    """
    if model_dir is None:
        return {}
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(gen, dict):
        return {}
    greedy = gen.get("do_sample") is False
    out = {"temperature": 0.0} if greedy else {}
    for key, field in GENERATION_CONFIG_KEYS.items():
        value = gen.get(key)
        if value is None or (greedy and field in ("temperature", "top_k", "top_p", "min_p")):
            continue
        try:
            SamplingParams(**{field: value})
        except InvalidRequestError as e:
            print(f"jaxinfer: ignoring {path} {key!r}: {e}", file=sys.stderr)
            continue
        out[field] = value
    return out
