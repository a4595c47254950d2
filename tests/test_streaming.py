"""Incremental detokenization and streaming: UTF-8, leading spaces, stop strings, cancellation."""

import dataclasses
import random
import time

import pytest
from hf_models import train_sentencepiece

from jaxinfer import LLM, InvalidRequestError, SamplingParams
from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer import ByteTokenizer, SentencePieceTokenizer


def feed(tok, prompt_ids, ids, stop=(), **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, stop, **kw)
    deltas = []
    for i in ids:
        d.add(i)
        deltas.append(d.pop_delta())
        if d.stopped:
            break
    d.flush()
    deltas.append(d.pop_delta(final=True))
    return deltas, d


def test_multibyte_utf8_never_broken_mid_stream():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂"
    deltas, d = feed(tok, tok.encode("x"), tok.encode(text)[1:])
    assert "".join(deltas) == text == d.text
    assert all("\ufffd" not in x for x in deltas)
    assert len([x for x in deltas if x]) > 5  # it really streamed


def test_a_prompt_ending_mid_character_puts_no_stray_replacement_in_the_output():
    """The output's first byte completes a character the prompt began: the output text is what
    decoding prompt + output adds to decoding the prompt alone (the decoding window reaches back)."""
    tok = ByteTokenizer()
    smile = tok.encode("🙂", add_special_tokens=False)
    prompt, out = tok.encode("x") + smile[:3], smile[3:] + tok.encode("ab", add_special_tokens=False)
    deltas, d = feed(tok, prompt, out)
    assert "".join(deltas) == d.text == tok.decode(prompt + out)[len(tok.decode(prompt)) :] == "ab"


def test_a_character_begun_at_the_end_of_a_full_window_of_stray_bytes_is_kept():
    """16 tokens (a full pending window) of bytes invalid throughout, the last a lead byte: the window
    was taken in whole, the lead byte came out as U+FFFD and the character it began never did."""
    tok = ByteTokenizer()

    def raw(*bs):
        return [b + tok.OFFSET for b in bs]

    prompt = tok.encode("x")
    for stray in (15, 14, 16, 31):
        out = raw(*[0x80] * stray, 0xE2, 0x82, 0xAC) + raw(*b"ab")
        deltas, d = feed(tok, prompt, out)
        assert "".join(deltas) == d.text == "\ufffd" * stray + "\u20acab" == tok.decode(prompt + out)[1:], stray


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return SentencePieceTokenizer(train_sentencepiece(tmp_path_factory.mktemp("spm")))


def test_sentencepiece_keeps_leading_spaces(spm):
    prompt = spm.encode("In the beginning")
    out_text = " God created the heaven and the earth"
    ids = spm.encode(out_text)[1:]  # without BOS
    deltas, d = feed(spm, prompt, ids)
    assert "".join(deltas) == d.text
    # Decoded with its prompt, the output keeps the space before "God" (decoding alone would drop it).
    assert d.text == spm.decode(prompt + ids)[len(spm.decode(prompt)) :]
    assert d.text.startswith(" God")


def test_stop_string_never_leaks_into_the_stream():
    tok = ByteTokenizer()
    deltas, d = feed(tok, [1], tok.encode("abc END tail")[1:], stop=("END", "zz"))
    assert d.stopped and d.text == "abc "
    assert "".join(deltas) == "abc " and not any("E" in x for x in deltas)
    # Held back: the last len("END") - 1 = 2 characters, no more (each could begin a stop string).
    assert deltas[:4] == ["", "", "a", "b"]


def test_include_stop_str_in_output_ends_the_text_after_it_and_holds_nothing_back():
    """vLLM's include_stop_str_in_output: the stop string stays, what follows it in the same token is
    cut, and since nothing needs hiding the stream is not held back (one token, one delta)."""
    tok = ByteTokenizer()
    deltas, d = feed(tok, [1], tok.encode("abc END tail")[1:], stop=("END", "zz"), include_stop=True)
    assert d.stopped and d.stop_string == "END" and d.text == "abc END"
    assert "".join(deltas) == "abc END" and deltas[:7] == list("abc END")
    # A stop string spread over several tokens, ending mid-token: cut after it.
    ids = [tok.encode(x)[1:] for x in ("ab", "c E", "NDxy")]
    d = IncrementalDetokenizer(tok, [1], ("END",), include_stop=True)
    got = []
    for group in ids:
        for i in group:
            d.add(i)
        got.append(d.pop_delta())
    assert d.stopped and got == ["ab", "c E", "ND"]


def test_earliest_stop_string_wins():
    tok = ByteTokenizer()
    _, d = feed(tok, [1], tok.encode("one two three")[1:], stop=("three", "two"))
    assert d.text == "one "


def test_byte_fallback_runs_come_out_as_the_whole_decode_gives_them(tmp_path):
    """A run of byte pieces decodes as a whole (transformers' ByteFallback: any invalid byte makes every
    byte of the run U+FFFD), so the stream holds a run back until it ends. Sending its valid first
    bytes at once made the text differ from the decode in 294 of 500 random-id outputs."""
    import random

    from test_tokenizer import _spm_dir

    from jaxinfer.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})))
    assert len(tok.byte_ids) == 256
    prompt = tok.encode("In the beginning")
    rng = random.Random(0)
    for _ in range(500):
        # Special tokens mixed in (what ignore_eos or a random model draws): decode skips them, so
        # the byte runs on either side of one are one run (it used to end at the special).
        ids = [rng.choice([rng.randrange(0, 3), rng.randrange(3, tok.vocab_size)]) for _ in range(rng.randrange(1, 13))]
        deltas, d = feed(tok, prompt, ids)
        assert "".join(deltas) == d.text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :], ids
    # A newline, then an emoji cut short: the newline's byte joins the invalid run.
    nl, f0, x9f = (tok._piece_id(f"<0x{b:02X}>") for b in (0x0A, 0xF0, 0x9F))
    a, e2 = (tok._piece_id(f"<0x{b:02X}>") for b in (0x41, 0xE2))
    assert feed(tok, prompt, [a, tok.bos_id, e2])[1].text == "\ufffd\ufffd"  # one invalid run, as decoded
    deltas, d = feed(tok, prompt, [nl, f0, x9f])
    assert deltas[:3] == ["", "", ""] and d.text == "\ufffd" * 3
    # A long invalid run is not held forever (each step would decode the whole window again).
    deltas, _ = feed(tok, prompt, [x9f] * 100)
    assert sum(map(len, deltas[:-1])) >= 80


def test_an_output_continuing_the_prompts_byte_run_comes_out_as_the_whole_decode_gives_it(tmp_path):
    """A prompt ending in characters spelled in byte pieces (two emoji: 8 pieces) and an output that
    continues the run: the prompt context began inside the first emoji, and since a run decodes as a
    whole, the output's own valid emoji came out as four U+FFFD."""
    import random

    from test_tokenizer import _spm_dir

    from jaxinfer.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})))
    emoji = tok.encode("\U0001f643", add_special_tokens=False)[-4:]  # its 4 byte pieces
    assert set(emoji) <= tok.byte_ids
    prompt = tok.encode("Hi \U0001f643\U0001f643")
    deltas, d = feed(tok, prompt, emoji + tok.encode(" ok", add_special_tokens=False))
    assert "".join(deltas) == d.text == "\U0001f643 ok"
    rng = random.Random(0)
    chars = ["\U0001f643", "\u00e9", "\u65e5", "\u20ac", "\ufffd", "\uac01", "\n", "a", " "]  # U+FFFD as text too
    for _ in range(200):
        prompt = tok.encode("x " + "".join(rng.choices(chars, k=rng.randrange(1, 12))))
        out = tok.encode("".join(rng.choices(chars, k=rng.randrange(1, 6))), add_special_tokens=False)
        out = out[rng.randrange(2) :]  # sometimes without the "▁" a fresh encode puts first
        deltas, d = feed(tok, prompt, out)
        assert "".join(deltas) == d.text == tok.decode(prompt + out)[len(tok.decode(prompt)) :], (prompt, out)


@pytest.mark.parametrize("source", ["tokenizer.model", "tokenizer.json"])
def test_ids_without_text_neither_fill_the_context_nor_hold_a_character_open(tmp_path, source):
    """Special tokens the decode skips add no text, so they are left out of the detokenizer's windows.
    Kept, six of them ending a prompt were its whole context and the first word lost its space, and
    15 of them inside a two-byte character filled the pending window: "é" came out as U+FFFD."""
    from test_tokenizer import _spm_dir

    from jaxinfer.tokenizer import load_tokenizer

    d = _spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    if source == "tokenizer.json":  # the same model, as transformers writes its tokenizer.json
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(d)).save_pretrained(str(d))
        (d / "tokenizer.model").unlink()
    tok = load_tokenizer(str(d))
    eos = tok.eos_ids[0]
    assert eos in tok.skipped_ids and tok.bos_id in tok.skipped_ids

    def expected(prompt, ids):
        return tok.decode(prompt + ids)[len(tok.decode(prompt)) :]

    prompt = tok.encode("In the beginning") + [eos] * 8
    ids = tok.encode(" God created", add_special_tokens=False)
    deltas, det = feed(tok, prompt, ids)
    assert "".join(deltas) == det.text == expected(prompt, ids) == " God created"

    piece_id = tok._piece_id if source == "tokenizer.model" else tok._tok.token_to_id
    c3, a9 = (piece_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9))
    assert {c3, a9} <= tok.byte_ids
    ids = [c3, *[eos] * 15, a9, *tok.encode(" ok", add_special_tokens=False)]
    deltas, det = feed(tok, prompt, ids)
    assert "".join(deltas) == det.text == expected(prompt, ids) == "é ok"

    byte = ByteTokenizer()  # its BOS and EOS have no text either
    deltas, det = feed(byte, byte.encode("x"), [0xC3 + 3, *[2] * 15, 0xA9 + 3])
    assert "".join(deltas) == det.text == "é"


@pytest.mark.parametrize("source", ["tokenizer.model", "tokenizer.json"])
def test_long_byte_runs_of_valid_text_stream_whole(tmp_path, source):
    """Characters outside a SentencePiece vocabulary are spelled in byte pieces, and neighbours join
    one run: six rare CJK characters are 18 pieces, more than a window holds back. The window used
    to be taken in as it decoded, cut inside a character, so the whole run became U+FFFD per byte and
    so did everything after it (every later run began mid-character)."""
    import random

    import transformers
    from test_tokenizer import _spm_dir

    from jaxinfer.tokenizer import load_tokenizer

    (tmp_path / "spm").mkdir()
    path = _spm_dir(tmp_path / "spm", tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    if source == "tokenizer.json":  # a Llama 2 style hub checkpoint: read by the tokenizers library
        transformers.AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(tmp_path / "hub"))
        (tmp_path / "hub" / "tokenizer.model").unlink(missing_ok=True)
        path = tmp_path / "hub"
    tok = load_tokenizer(str(path))
    assert type(tok).__name__ == {"tokenizer.model": "SentencePieceTokenizer", "tokenizer.json": "HFTokenizer"}[source]
    prompt = tok.encode("In the beginning")
    text = " 鬱龘齉鬱龘齉 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end"
    ids = tok.encode(text)[1:]
    assert sum(i in tok.byte_ids for i in ids) > 40
    deltas, d = feed(tok, prompt, ids)
    assert "".join(deltas) == d.text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert "鬱龘齉鬱龘齉" in d.text and "\ufffd" not in d.text
    rng = random.Random(0)
    rare = "鬱龘齉爨癵驫麤𝔘𝔫𝔦😀🙂é"
    for _ in range(100):
        text = "".join(rng.choice([*rare, " a", " the", "x"]) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text)[1:]
        deltas, d = feed(tok, prompt, ids)
        assert "".join(deltas) == d.text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :], text


def _substring(rng: random.Random, text: str, longest: int) -> str:
    start = rng.randrange(len(text))
    return text[start : start + rng.randrange(1, longest + 1)]


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece", "bytes"])
def test_stop_strings_cut_random_outputs_at_their_first_occurrence(tmp_path, kind):
    """400 random outputs (words, multibyte characters, now and then random ids) with one or two stop
    strings drawn from the output's own text: the text ends right before (or, with include_stop,
    right after) the first occurrence of the stop string reported, no later than where the first
    stop string to complete begins, and the deltas join to the text."""
    from test_tokenizer import _bpe_dir, _spm_dir

    from jaxinfer.tokenizer import load_tokenizer

    if kind == "byte-level BPE":
        tok = load_tokenizer(str(_bpe_dir(tmp_path)))
    elif kind == "SentencePiece":
        tok = load_tokenizer(str(_spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})))
    else:
        tok = ByteTokenizer()
    rng = random.Random(0)
    prompt = tok.encode("the quick")
    words = ["the", " quick", " fox", "é", "日本語", "😀", " ", "\n", "ab", "Ω"]
    checked = 0
    for _ in range(400):
        ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randrange(1, 12))), add_special_tokens=False)
        if rng.random() < 0.3:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 6))]
        full = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
        whole = full.replace("\ufffd", "")  # stop strings are real text
        if not whole:
            continue
        drawn = [_substring(rng, whole, 4)] + ([_substring(rng, whole, 3)] if rng.random() < 0.5 else [])
        stops = tuple(s for s in dict.fromkeys(drawn) if s in full)
        if not stops:
            continue
        include = rng.random() < 0.3
        deltas, d = feed(tok, prompt, ids, stop=stops, include_stop=include)
        assert d.stopped and d.stop_string in stops, (full, stops)
        at = full.find(d.stop_string)
        assert d.text == full[: at + len(d.stop_string) * include] == "".join(deltas), (full, stops, include)
        # Found as soon as the token that completes one arrives: no later than where the stop string
        # completed first begins (earlier when another one, completed by the same token, began before).
        first_done = min(stops, key=lambda s: full.find(s) + len(s))
        assert at <= full.find(first_done), (full, stops)
        checked += 1
    assert checked > 300


class _PieceTokenizer:
    """Byte-level BPE in miniature: each id is a byte string, and one may end a character and begin the next."""

    def __init__(self, pieces):
        self.pieces = [p.encode() if isinstance(p, str) else p for p in pieces]

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_stop_string_caught_by_the_token_that_completes_it_even_mid_character():
    # "é" is b"\xc3\xa9": token 2 finishes the stop string "ab" and begins "é" in the same token.
    tok = _PieceTokenizer([b"x", b"a", b"b\xc3", b"\xa9", b"c"])
    deltas, d = feed(tok, [0], [1, 2, 3, 4], stop=("ab",))
    assert d.stopped and d.text == ""
    assert "".join(deltas) == ""
    # Caught on token 2 itself: token 3 was never taken in.
    d = IncrementalDetokenizer(tok, [0], ("ab",))
    d.add(1)
    d.add(2)
    assert d.stopped
    # Without a stop string, the split character still comes out whole, once.
    deltas, d = feed(tok, [0], [1, 2, 3, 4])
    assert "".join(deltas) == d.text == "abéc" and all("\ufffd" not in x for x in deltas)
    # A stop string that ends inside the half-made character is found once the character is whole.
    deltas, d = feed(tok, [0], [1, 2, 3, 4], stop=("bé",))
    assert d.stopped and d.text == "a" and "".join(deltas) == "a"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_pages=64, max_num_seqs=4)


def test_deltas_join_in_order_and_outputs_mirror_sample_0():
    """StreamDelta.then (deltas a lagging server handler sends as one): ids, text and logprobs in
    order, the prompt's logprobs from the first, the end from the later. A RequestOutput's
    properties are its first sample's, whatever the order of the rest."""
    from jaxinfer.llm import CompletionOutput, Logprob, RequestOutput, StreamDelta

    lp = [Logprob(token_id=i, logprob=-0.5 * i, top={i: -0.5 * i}) for i in range(4)]
    first = StreamDelta(token_ids=[1], text="ab", logprobs=lp[1:2], prompt_logprobs=[None, lp[0]])
    later = StreamDelta(token_ids=[2, 3], text="c", finish_reason="stop", stop_reason=3, logprobs=lp[2:])
    assert first.then(later) == StreamDelta(
        token_ids=[1, 2, 3],
        text="abc",
        finish_reason="stop",
        stop_reason=3,
        logprobs=lp[1:],
        prompt_logprobs=[None, lp[0]],
    )
    samples = [
        CompletionOutput(i, [i], f"s{i}", reason, lp[i : i + 1], stop, cumulative_logprob=-0.5 * i)
        for i, reason, stop in ((0, "stop", "END"), (1, "length", None))
    ]
    out = RequestOutput("r", "p", [5], samples)
    s0 = samples[0]
    assert (out.token_ids, out.text, out.finish_reason, out.logprobs, out.stop_reason, out.cumulative_logprob) == (
        s0.token_ids,
        s0.text,
        s0.finish_reason,
        s0.logprobs,
        s0.stop_reason,
        s0.cumulative_logprob,
    )


def test_stream_matches_generate(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    deltas = list(llm.stream("Hello", sp))
    full = llm.generate(["Hello"], sp)[0]
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    # A list of prompts is a natural slip: named as such (it used to blame "prompts[0]", a string).
    with pytest.raises(InvalidRequestError, match="stream takes one prompt .* got a list; generate takes several"):
        llm.stream(["a", "b"], sp)  # refused by the call itself, not at the first next()
    with pytest.raises(InvalidRequestError, match=r"stream takes one SamplingParams \(or None\), got a list"):
        llm.stream("a", [sp])  # generate's one-per-prompt form: it ran, where a list of prompts did not
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.stream("", sp)


def test_interleaved_streams_and_a_generate_meanwhile_lose_nothing(llm):
    """Every engine step advances every open request: whichever call steps it must hand the others
    their updates (they were dropped: streams missed tokens and their finish_reason)."""
    sps = {
        "In the beginning": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        "And God said": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    }
    ref = {p: llm.generate([p], sp)[0] for p, sp in sps.items()}
    streams = {p: llm.stream(p, sp) for p, sp in sps.items()}
    got = {p: [] for p in sps}
    while streams:  # consumed alternately, in one thread
        for p in list(streams):
            if (d := next(streams[p], None)) is None:
                del streams[p]
            else:
                got[p].append(d)
    opened = llm.stream("In the beginning", sps["In the beginning"])
    first = next(opened)
    other = llm.generate(["And God said"], sps["And God said"])[0]  # runs the open stream's request too
    got["meanwhile"] = [first, *opened]
    for p, deltas in got.items():
        want = ref["In the beginning" if p == "meanwhile" else p]
        assert [t for d in deltas for t in d.token_ids] == want.token_ids, p
        assert "".join(d.text for d in deltas) == want.text, p
        assert deltas[-1].finish_reason == "length", p
    assert other.token_ids == ref["And God said"].token_ids
    assert not llm.engine.requests and not llm._updates


def test_stop_strings_end_generation_through_the_api(llm):
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["The"], sp)[0]
    stop = free.text[5:7]
    assert stop and stop in free.text
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["never said", stop])
    out = llm.generate(["The"], params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # which stop string (vLLM's stop_reason)
    assert free.finish_reason == "length" and free.stop_reason is None
    assert out.text == free.text[: free.text.index(stop)]
    deltas = list(llm.stream("The", params))
    assert stop not in "".join(d.text for d in deltas)
    assert deltas[-1].stop_reason == stop and all(d.stop_reason is None for d in deltas[:-1])


def test_include_stop_str_in_output_through_the_api(llm):
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["The"], sp)[0]
    stop = free.text[5:8]
    params = dataclasses.replace(sp, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate(["The"], params)[0]
    want = free.text[: free.text.index(stop) + len(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == want
    assert "".join(d.text for d in llm.stream("The", params)) == want


def test_closing_a_stream_aborts_and_frees_pages(llm):
    gen = llm.stream("abc", SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    next(gen)
    next(gen)
    assert llm.stats()["running"] == 1
    gen.close()
    stats = llm.stats()
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_n_samples_and_logprobs_through_the_api(llm):
    out = llm.generate(["Hi"], SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, logprobs=3, ignore_eos=True))[
        0
    ]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 6
        for lp, t in zip(o.logprobs, o.token_ids):
            assert lp.token_id == t and lp.logprob <= 0 and len(lp.top) == 3
            assert max(lp.top.values()) >= lp.logprob - 1e-6
        assert o.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in o.logprobs))
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_stats_and_prometheus_registry(llm):
    llm.generate(["abc", "defg"], SamplingParams(max_tokens=4, temperature=0.0))
    s = llm.stats()
    for key in (
        "kv_pages_total",
        "kv_pages_free",
        "running",
        "waiting",
        "num_preemptions",
        "prefix_cache_hit_tokens",
        "num_compiles",
        "kv_cache_bytes",
    ):
        assert key in s
    assert s["ttft_seconds"]["count"] >= 2 and s["itl_seconds"]["count"] >= 1
    assert s["kv_cache_bytes"] == 64 * 16 * s["kv_bytes_per_token"]
    from prometheus_client import generate_latest

    text = generate_latest(llm.engine.metrics.registry).decode()
    assert "jaxinfer_time_to_first_token_seconds_count" in text
    assert "jaxinfer_kv_pages_free" in text


def test_phase_metrics_split_ttft_and_count_every_computed_token():
    """Queue + prefill time add up to TTFT per request; step tokens count prompt tokens and decode rows."""
    from prometheus_client import generate_latest

    from jaxinfer import default_model

    llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=2, enable_prefix_caching=False)
    prompts = [[1] + list(range(5, 5 + n)) for n in (3, 20, 9, 40, 6)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in outs)
    s = llm.stats()
    ttft, queue, prefill = s["ttft_seconds"], s["queue_time_seconds"], s["prefill_time_seconds"]
    assert ttft["count"] == queue["count"] == prefill["count"] == 5
    assert queue["sum"] + prefill["sum"] == pytest.approx(ttft["sum"], rel=1e-9)
    # Two slots for five requests: the last three waited behind the first two.
    assert queue["p99"] > 0 and prefill["p50"] > 0
    assert s["step_tokens"] == {"prefill": sum(map(len, prompts)), "decode": 5 * (5 - 1)}
    steps = s["step_seconds"]
    assert steps["prefill"]["count"] >= 3 and steps["decode"]["count"] >= 4
    assert steps["prefill"]["sum"] > 0 and steps["decode"]["sum"] > 0
    text = generate_latest(llm.engine.metrics.registry).decode()
    assert 'jaxinfer_step_seconds_count{phase="decode"}' in text
    assert f'jaxinfer_step_tokens_total{{phase="decode"}} {5 * 4}.0' in text
    assert "jaxinfer_request_queue_time_seconds_sum" in text
    # Prometheus has what stats() has: every histogram's count and sum, each phase under its own
    # label, every finished sequence by reason.
    registry = llm.engine.metrics.registry
    for name, got in [
        ("jaxinfer_time_to_first_token_seconds", ttft),
        ("jaxinfer_inter_token_latency_seconds", s["itl_seconds"]),
        ("jaxinfer_request_latency_seconds", s["request_latency_seconds"]),
        ("jaxinfer_request_queue_time_seconds", queue),
        ("jaxinfer_request_prefill_time_seconds", prefill),
        *((f"jaxinfer_step_seconds/{phase}", steps[phase]) for phase in ("prefill", "decode")),
    ]:
        name, _, phase = name.partition("/")
        labels = {"phase": phase} if phase else {}
        assert registry.get_sample_value(f"{name}_count", labels) == got["count"] > 0, name
        assert registry.get_sample_value(f"{name}_sum", labels) == pytest.approx(got["sum"], rel=1e-9), name
    assert registry.get_sample_value("jaxinfer_finished_sequences_total", {"reason": "length"}) == 5


def test_request_metrics_count_requests_once_and_include_aborts():
    """TTFT, queue, prefill and request latency are per request (n samples count once; an aborted
    request still has a latency); latency counts from the arrival time the server passes in; the
    compilation gauge is current right after the warm-up."""
    from prometheus_client import generate_latest

    from jaxinfer import default_model
    from jaxinfer.engine import num_compiles

    llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=4)
    registry = llm.engine.metrics.registry
    assert f"jaxinfer_xla_compilations {float(num_compiles())}" in generate_latest(registry).decode()
    params = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=params)
    s = llm.stats()
    for key in ("ttft_seconds", "queue_time_seconds", "prefill_time_seconds", "request_latency_seconds"):
        assert s[key]["count"] == 1, key
    assert s["itl_seconds"]["count"] == 3 * 3  # per sample: three gaps in each of three samples

    engine = llm.engine
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    req = engine.add_request([1, 7, 8], long, arrival_time=time.perf_counter() - 5)
    while not req.seqs[0].output_ids:  # its first token read (async scheduling: the step after its own)
        engine.step()
    engine.abort(req.request_id)
    engine.release(req.request_id)
    s = llm.stats()
    assert s["ttft_seconds"]["count"] == 2 and s["ttft_seconds"]["sum"] > 5  # counted from the given arrival
    assert s["request_latency_seconds"]["count"] == 2 and s["request_latency_seconds"]["sum"] > 5


def test_latency_percentiles_follow_the_recent_window():
    from prometheus_client import CollectorRegistry, Histogram

    from jaxinfer.metrics import LatencyHistogram

    h = LatencyHistogram(Histogram("t", "t", registry=CollectorRegistry()), window=10)
    for x in range(1, 21):
        h.observe(float(x))
    assert h.count == 20 and h.sum == 210.0  # every observation counted
    assert h.percentiles(0, 50, 99) == [11.0, 15.0, 20.0]  # nearest rank, over the last 10 only
    assert h.percentiles(99) == [20.0] and h.percentiles(90) == [19.0]


def test_stats_from_another_thread_while_steps_donate_the_cache(llm):
    """The server reads stats and metrics on its event loop while the engine thread steps; every step
    donates (deletes) the previous cache, so stats() must never touch the live cache's buffers."""
    import threading

    errors, done = [], threading.Event()

    def poll():
        from prometheus_client import generate_latest

        while not done.is_set():
            try:
                llm.stats()
                generate_latest(llm.engine.metrics.registry)
            except Exception as e:  # what the server's scrape would have died of
                errors.append(e)
                return

    t = threading.Thread(target=poll)
    t.start()
    try:
        outs = llm.generate(["abc", "defg", "hi"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    finally:
        done.set()
        t.join()
    assert not errors, errors[0]
    assert all(len(o.token_ids) == 24 for o in outs)
    assert llm.stats()["kv_cache_bytes_per_device"] == llm.stats()["kv_cache_bytes"]  # one device, whole cache


def test_min_tokens_ignores_a_stop_string_the_text_completes_before_it():
    """As vLLM: with min_tokens=k, a stop string that ends in the text of the first k tokens does
    not stop (it is not searched there); the first one ending after that text does, and the text
    and tokens up to it are those of the run without any stop."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM()  # the trained default model: English text, so "e" comes early and again later
    prompt = "And God said"
    free = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    texts = [
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text
        for n in range(1, 41)
    ]
    j = next(n for n, t in enumerate(texts, 1) if "e" in t)  # the token whose text completes the first "e"
    stop = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["e"])
    early = llm.generate(prompt, stop)[0]
    assert early.text == free.text[: free.text.index("e")] and early.finish_reason == "stop"
    late = llm.generate(prompt, dataclasses.replace(stop, min_tokens=j))[0]
    cut = free.text.index("e", len(texts[j - 1]))  # the first "e" past the unsearched text
    assert late.text == free.text[:cut] and late.finish_reason == "stop" and late.stop_reason == "e"
    assert late.token_ids == free.token_ids[: len(late.token_ids)] and len(late.token_ids) >= j + 1
    streamed = "".join(d.text for d in llm.stream(prompt, dataclasses.replace(stop, min_tokens=j)))
    assert streamed == late.text
    # min_tokens = j - 1: the token completing the first "e" is searched, so it stops there, as without.
    assert llm.generate(prompt, dataclasses.replace(stop, min_tokens=j - 1))[0].text == early.text
    # A character made of byte pieces before min_tokens is not searched either, though the byte run
    # it is in is still open then (the text takes it in only when the run ends, past min_tokens).
    tok = llm.tokenizer
    ids = tok.encode("\U0001f600,eh", add_special_tokens=False)  # "▁", then the emoji's 4 byte pieces
    made = next(k for k in range(1, len(ids) + 1) if "\U0001f600" in tok.decode(ids[:k]))
    assert ids[made - 1] in tok.byte_ids  # the emoji's last piece: the byte run is still open after it
    for include in (False, True):
        d = IncrementalDetokenizer(tok, tok.encode("And"), ("\U0001f600",), include_stop=include)
        for k, t in enumerate(ids, 1):
            d.add(t, find_stops=k > made)
        d.flush()
        assert not d.stopped and d.text == " \U0001f600,eh"
    # End to end: only the two byte pieces of "é" allowed, a stop string "é" and min_tokens 2: the
    # first "é" (tokens 1-2) does not stop it, the second (tokens 3-4) does.
    pieces = tok.encode("é", add_special_tokens=False)[-2:]
    assert all(t in tok.byte_ids for t in pieces)
    base = SamplingParams(temperature=2.0, seed=1, max_tokens=6, ignore_eos=True, allowed_token_ids=pieces)
    assert llm.generate(prompt, base)[0].text == "ééé"  # (this seed draws the pieces in order)
    p = dataclasses.replace(base, stop=["é"], min_tokens=2)
    for include, want in ((False, "é"), (True, "éé")):
        out = llm.generate(prompt, dataclasses.replace(p, include_stop_str_in_output=include))[0]
        assert out.text == want and out.token_ids == [pieces[0], pieces[1]] * 2, (include, out)
