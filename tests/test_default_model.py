"""The embedded default model: shipped as a jaxinfer checkpoint, trained, and it writes KJV English.

The English check counts generated words found in the corpus word list shipped beside the model
(every word of the King James Bible) and how many are among the commonest English function words;
`test_the_english_check_rejects_token_salad` runs the same check on random tokens of the same
vocabulary to show it can fail.
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint, default_model, train
from jaxinfer.cli import main

PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the", "And it came to pass, when"]

# Function words of English in general (not of this corpus): about 40% of running English text.
COMMON_ENGLISH = set(
    "the of and to a in that is was he for it with as his on be at by i this had not are but from or have an they "
    "which you were her she all we there their been has when who will no if out so said what up its into them "
    "than him then my me our your us".split()
)


def _words(text: str) -> list[str]:
    return [w.strip("'") for w in re.findall(r"[a-z']+", text.lower()) if w.strip("'")]


def english_check(texts: list[str]) -> tuple[float, float, int]:
    """(fraction of words in the corpus word list, fraction that are common English words, distinct words)."""
    words = [w for t in texts for w in _words(t)]
    if not words:
        return 0.0, 0.0, 0
    vocab = default_model.corpus_words()
    return (
        sum(w in vocab for w in words) / len(words),
        sum(w in COMMON_ENGLISH for w in words) / len(words),
        len(set(words)),
    )


def looks_like_english(texts: list[str]) -> bool:
    in_corpus, common, distinct = english_check(texts)
    return in_corpus >= 0.8 and common >= 0.25 and distinct >= 30


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_pages=48, max_num_seqs=8)


def test_generations_are_kjv_english(llm):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7, n=2, ignore_eos=True)
    texts = [o.text for o in llm.generate(PROMPTS, greedy)]
    texts += [s.text for r in llm.generate(PROMPTS, sampled) for s in r.outputs]
    in_corpus, common, distinct = english_check(texts)
    assert sum(len(_words(t)) for t in texts) >= 150
    assert in_corpus >= 0.8, (in_corpus, texts)
    assert common >= 0.25, (common, texts)
    assert distinct >= 30, texts
    assert looks_like_english(texts)


def test_the_english_check_rejects_token_salad(llm):
    rng = np.random.default_rng(0)
    vocab = llm.tokenizer.vocab_size
    salad = [llm.tokenizer.decode(rng.integers(3, vocab, 40).tolist()) for _ in range(12)]
    assert not looks_like_english(salad), english_check(salad)
    tiny = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=16, max_num_seqs=4)
    noise = [o.text for o in tiny.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]
    assert not looks_like_english(noise), english_check(noise)


def test_training_forward_matches_prefill_on_the_shipped_weights():
    cfg, params = checkpoint.restore(default_model.ASSETS, dtype="float32")
    _, _, tok = default_model.load()
    rows = [
        tok.encode("And God said, Let there be light: and there was light.")[:12],
        tok.encode("Blessed are the meek: for they shall inherit the earth.")[:12],
    ]
    diff = train.check_against_prefill(cfg, params, np.asarray(rows))
    assert diff < 1e-4


@pytest.mark.parametrize("untied", [False, True])
def test_training_forward_matches_prefill_on_random_weights(untied):
    """The options the training forward handles beyond the shipped model's (a sliding window, q/k
    norms, q/k/v biases, an untied head), on random weights: norm scales and biases too, so that no
    weight is a one or a zero that a mix-up could hide behind."""
    import dataclasses

    from jaxinfer.config import GlobalAttention, SlidingWindow
    from jaxinfer.model import init_params

    base = train.default_config(vocab_size=48)
    cfg = dataclasses.replace(
        base,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layer_attention=(SlidingWindow(4), GlobalAttention()),
        qk_norm=True,
        qkv_bias=True,
        tie_word_embeddings=not untied,
    )
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), init_params(cfg, 1))
    tokens = rng.integers(3, 48, (2, 12))  # the last token's window (4) ends well inside the 12
    assert train.check_against_prefill(cfg, params, tokens) < 1e-4


def test_training_loss_and_held_out_rows_by_hand():
    """The loss scores each next token under the logits before it (against NumPy's log-softmax);
    held-out rows pack whole verses behind a BOS and score only their tokens; EOS ends each book."""
    import jax.numpy as jnp

    from jaxinfer.model import init_params

    cfg = train.default_config(vocab_size=40)
    params = init_params(cfg, 0)
    tokens = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33], np.int32)
    rows, mask = train.heldout_chunks(tokens, np.array([0, 3, 5]), seq_len=5)
    assert rows.tolist() == [[1, 10, 11, 12, 20, 21], [1, 30, 31, 32, 33, 0]]
    assert mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    total, count = train._loss(params, jnp.asarray(rows), jnp.asarray(mask, jnp.float32), cfg)
    logits = np.asarray(train.train_logits(params, jnp.asarray(rows[:, :-1]), cfg=cfg), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
    assert int(count) == 9 and float(total) == pytest.approx(nll[mask].sum(), rel=1e-5)

    class Pieces:  # a tokenizer whose pieces are characters
        def encode(self, texts, out_type):
            return [[ord(c) for c in t] for t in texts]

    verses = [("Ge", "ab"), ("Ge", "c"), ("Ex", "de")]
    stream, starts = train.encode_stream(Pieces(), verses)
    assert stream.tolist() == [97, 98, 99, train.EOS, 100, 101, train.EOS] and starts.tolist() == [0, 2, 4]


def test_compressed_corpus_blocks_decode_as_compress_wrote_them():
    """The corpus's .Z blocks: tests/data/lzw_words.Z was written by ncompress (the code of Unix
    `compress`, 16-bit block mode) from the words below; its 6 KB of codes grow from 9 to 13 bits."""
    words = "and the LORD said unto Moses in that day of Israel children people land house king God".split()
    x, text = 1, []
    for _ in range(5000):
        x = (x * 1103515245 + 12345) % 2**31
        text.append(words[x % len(words)] + ("\n" if x % 11 == 0 else " "))
    with open(os.path.join(os.path.dirname(__file__), "data", "lzw_words.Z"), "rb") as f:
        data = f.read()
    assert train._unlzw(data) == "".join(text).encode()


def test_learning_rate_warms_up_then_decays_on_a_cosine_to_a_tenth():
    import argparse
    import math

    args = argparse.Namespace(lr=3e-3, warmup=10, steps=110, weight_decay=0.1)
    schedule, _ = train.make_optimizer(args)
    floor = 3e-4
    for step, want in [
        (0, 0.0),
        (5, 1.5e-3),
        (10, 3e-3),
        (60, floor + (3e-3 - floor) * 0.5 * (1 + math.cos(math.pi * 0.5))),
        (110, floor),
    ]:
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), step


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "2"], r"--warmup must be an integer in \[0, --steps = 2\), got 50"),  # optax raised, deep inside
        (["--steps", "0"], "--steps must be an integer >= 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["--heldout-frac", "1"], r"--heldout-frac must be a number in \(0, 1\)"),
        (["--vocab-size", "100"], r"--vocab-size must be an integer in \[260, 65536\]"),
        (["--corpus", "/nonexistent/bible.data"], "--corpus '/nonexistent/bible.data': no such file or directory"),
    ],
)
def test_the_training_command_refuses_bad_flags_in_one_line(tmp_path, capsys, flags, message):
    assert train.main(["--out", str(tmp_path / "out"), "--warmup", "50", *flags]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: {message}.*\n", err) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_smaller_than_the_corpus_needs_is_named(tmp_path):
    """SentencePiece needs a piece per character of the corpus besides the 256 bytes: fewer raised
    its RuntimeError from C++."""
    sentences = [f"verse {i}: {chr(0x3B1 + i % 24)}{chr(0x410 + i % 32)} and so on" for i in range(200)]
    with pytest.raises(train.InvalidRequestError, match=r"--vocab-size must be at least \d+ for this corpus.*got 260"):
        train.train_tokenizer(sentences, str(tmp_path / "tok"), 260)


def test_shipped_files_config_and_report():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(default_model.ASSETS) for f in fs)
    assert total <= 25 * 2**20
    cfg, params, tok = default_model.load(dtype="bfloat16")
    assert 3e6 <= cfg.num_params <= 8e6 and cfg.dtype == "bfloat16"
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
    # Stored in bfloat16, restored in float32 unless asked: computed as LLM() computes it.
    cfg32, params32, _ = default_model.load()
    assert cfg32.dtype == "float32" and {x.dtype.name for x in jax.tree.leaves(params32)} == {"float32"}
    cfg16, params16, _ = default_model.tiny_random(dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and {x.dtype.name for x in jax.tree.leaves(params16)} == {"bfloat16"}
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
    assert tok.vocab_size == cfg.vocab_size and tok.bos_id == cfg.bos_token_id and tok.eos_ids == cfg.eos_token_ids
    with open(os.path.join(default_model.ASSETS, "training_report.json")) as f:
        report = json.load(f)
    assert report["num_params"] == cfg.num_params
    assert 1 < report["heldout_token_perplexity"] < 200
    with open(os.path.join(default_model.ASSETS, checkpoint.MARKER)) as f:
        assert json.load(f)["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "text",
    [
        "In the beginning God created the heaven and the earth.",
        "Tabs\tand\nnewlines,  doubled  spaces, a trailing one ",
        "Grüße, 世界 🙂 ½",
    ],
)
def test_tokenizer_round_trips_any_text(text):
    """Byte fallback: nothing is lost (but one leading space, which encodes as the word prefix, as in Llama)."""
    _, _, tok = default_model.load()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == text


def test_cli_uses_the_trained_default(capsys, monkeypatch):
    from jaxinfer import llm as llm_module

    monkeypatch.setattr(llm_module, "_announced_default", False)  # as in a fresh process
    assert main(["generate", "--max-tokens", "12", "--json", "--max-model-len", "64", "In the beginning"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)
    assert obj["model"] == "jaxinfer-kjv-6m"
    # Said on stderr, once per process (`bench mesh` loads it once per mesh: it was said each time).
    assert captured.err.count("using the embedded default model 'jaxinfer-kjv-6m'") == 1, captured.err
    llm_module._load(None, "float32", None)
    assert "embedded default model" not in capsys.readouterr().err
    assert english_check([obj["text"]])[0] >= 0.8, obj["text"]


def test_tiny_random_model_is_embedded_too():
    tiny = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=16, max_num_seqs=2)
    assert tiny.cfg.vocab_size == 259 and tiny.cfg.num_layers == 2
    out = tiny.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_the_restored_model_serves_without_compiling_after_warmup():
    """The shipped checkpoint is restored onto a device (committed arrays), unlike the random
    parameters the engine tests build: a warm-up must cover that placement too, or every server's
    first requests compile (they did: one sampler per batch size and the first decode shape)."""
    from jaxinfer.engine import num_compiles

    llm = LLM(max_model_len=64, num_kv_pages=24, max_num_seqs=4, max_num_batched_tokens=32, warmup=True)
    before = num_compiles()
    warmed = set(llm.engine._compiled_shapes)  # its own record: blind to what other tests compiled
    params = [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(max_tokens=6, temperature=0.7, presence_penalty=0.5, logprobs=2, seed=2),
    ]
    outs = llm.generate(PROMPTS[:3], params)
    assert all(len(o.token_ids) == 6 or o.finish_reason == "stop" for o in outs)
    assert llm.engine._compiled_shapes == warmed
    assert num_compiles() == before
    assert llm.stats()["num_compiles"] == before
