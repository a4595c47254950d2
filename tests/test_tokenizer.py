"""Tokenizers and chat templates against transformers' AutoTokenizer on the same files."""

import dataclasses
import enum
import itertools
import json
import random
import re
from typing import Any, Literal

import pytest
import transformers
from hf_models import make_hf_model, save_hf_model, train_sentencepiece

from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import CheckpointError, InvalidRequestError
from jaxinfer.tokenizer import HFTokenizer, SentencePieceTokenizer, encode_prompt, load_tokenizer

STRINGS = [
    "Hello world",
    "hello world, the quick brown fox.",
    " leading space",
    "  two leading spaces",
    "trailing spaces  ",
    "new\nline",
    "\n\nstarts with newlines\n",
    "tab\tseparated",
    "emoji 😀🚀 and more 👍🏽",
    "日本語のテキスト",
    "café naïve Ωmega",
    "1234567 digits",
    "",
    "a",
    "special <s> inside </s> text",
    "<s>starts with bos",
]

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]

# A Llama-3-style template (headers around each role, end-of-turn tokens, optional generation prompt).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# A Gemma-style template: no system role (folded into the first user turn), roles must alternate,
# the assistant is called "model"; written with whitespace control so trim_blocks/lstrip_blocks matter.
GEMMA_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set first_prefix = messages[0]['content'] + '\n\n' %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set first_prefix = '' %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
<start_of_turn>{{ role }}
{{ (first_prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2 + 2?\n"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And naïve 😀 café?"},
    ],
]


def _corpus(n_lines=300, seed=0):
    """A few KB of text with the characters the tests use (generated, not stored)."""
    rng = random.Random(seed)
    words = (
        "the quick brown fox jumps over lazy dog hello world café naïve Ωmega 日本語 テキスト "
        "😀 🚀 👍🏽 tab\tseparated new line 1234567 digits what is and more user model system"
    ).split(" ")
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(n_lines)]


def _bpe_dir(path, specials=(), **tokenizer_kwargs):
    """A byte-level BPE tokenizer.json trained here, saved by transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    kwargs = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    kwargs.update(tokenizer_kwargs)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if specials:
        fast.add_special_tokens({"additional_special_tokens": list(specials)})
    fast.save_pretrained(path)
    return path


def _spm_dir(path, *, dummy_prefix=True, normalization="identity", tokenizer_config=None, ids=(0, 1, 2)):
    """A tiny SentencePiece BPE model (byte fallback, as Llama and Gemma use) trained on generated text."""
    import sentencepiece as spm

    (path / "corpus.txt").write_text("\n".join(_corpus(400, seed=1)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(path / "corpus.txt"),
        model_prefix=str(path / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name=normalization,
        remove_extra_whitespaces=normalization != "identity",
        add_dummy_prefix=dummy_prefix,
        user_defined_symbols=GEMMA_SPECIALS,
        unk_id=ids[0],
        bos_id=ids[1],
        eos_id=ids[2],
        pad_id=-1,
        minloglevel=2,
    )
    (path / "corpus.txt").unlink()
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **(tokenizer_config or {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _edit_config(path, **changes):
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))


def _assert_same_ids(path, strings=STRINGS):
    ours = load_tokenizer(str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in strings:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text) == expected, (text, theirs.convert_ids_to_tokens(expected))
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == expected, text
    return ours, theirs


def _assert_size_bound_holds(tok):
    """No text is more UTF-8 bytes than its token count times `max_token_bytes`: the bound on which
    `encode_prompt` refuses over-long texts without tokenizing them must never refuse one that fits."""
    rng = random.Random(0)
    alphabet = "ab cd\n\té😀日本<s>" + "".join(map(chr, range(0x20, 0x7F)))
    texts = STRINGS + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 300))) for _ in range(50)]
    for text in texts:
        assert len(text.encode("utf-8")) <= len(tok.encode(text, add_special_tokens=False)) * tok.max_token_bytes, text


# ----------------------------------------------------------------------------------------------
# tokenizer.json


@pytest.mark.parametrize(
    "saved, config, bos, eos",
    [
        (dict(add_bos_token=True), dict(), True, False),
        (dict(add_bos_token=False, add_eos_token=True), dict(), False, True),
        (dict(add_bos_token=True, add_eos_token=True), dict(), True, True),
        # With a tokenizer.json, transformers bakes the flags into its post-processor on save and
        # ignores them in tokenizer_config.json on load: so stated flags change nothing.
        (dict(add_bos_token=True), dict(add_bos_token=False, add_eos_token=True), True, False),
        # No post-processor at all: no special tokens, whatever the config says.
        (dict(add_bos_token=True), dict(add_bos_token=True, post_processor=None), False, False),
    ],
)
def test_tokenizer_json_ids_match_transformers(tmp_path, saved, config, bos, eos):
    _bpe_dir(tmp_path, **saved)
    if "post_processor" in config:
        tj = json.loads((tmp_path / "tokenizer.json").read_text())
        tj["post_processor"] = config.pop("post_processor")
        (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    if config:
        _edit_config(tmp_path, **config)
    ours, theirs = _assert_same_ids(tmp_path)
    assert isinstance(ours, HFTokenizer)
    assert ours.bos_id == theirs.bos_token_id == 1 and ours.eos_ids == (2,)
    assert (ours.encode("hello")[0] == 1) == bos  # the cases above really differ
    assert (ours.encode("hello")[-1] == 2) == eos
    for text in STRINGS[:12]:
        assert ours.decode(ours.encode(text)) == text
        ids = [1, *ours.encode(text, add_special_tokens=False), 2]
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False).startswith(theirs.convert_ids_to_tokens(1))
    _assert_size_bound_holds(ours)


def test_special_tokens_map_supplies_token_strings(tmp_path):
    """Older checkpoints name BOS/EOS only in special_tokens_map.json."""
    _bpe_dir(tmp_path, add_bos_token=True, add_eos_token=True)
    _edit_config(tmp_path, bos_token=None, eos_token=None)
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    ours, theirs = _assert_same_ids(tmp_path, STRINGS[:4])
    assert ours.encode("hello")[0] == 1 and ours.encode("hello")[-1] == 2
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


@pytest.mark.parametrize("decoder", [False, True])
def test_special_token_strings_come_from_the_file_transformers_reads(tmp_path, decoder):
    """tokenizer_config.json and special_tokens_map.json disagree on BOS and EOS. transformers reads
    the map over an older config, and ignores it beside a config with added_tokens_decoder."""
    _bpe_dir(tmp_path, ["<|a|>", "<|b|>"], eos_token="<|a|>")
    if decoder:
        entry = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
        names = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<|a|>", 4: "<|b|>"}
        _edit_config(tmp_path, added_tokens_decoder={str(i): {"content": t, **entry} for i, t in names.items()})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|b|>", "eos_token": "<|b|>"}))
    ours = load_tokenizer(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.special_tokens["bos_token"], ours.special_tokens["eos_token"]) == (theirs.bos_token, theirs.eos_token)
    assert ours.eos_ids == (theirs.eos_token_id,) and ours.bos_id == theirs.bos_token_id
    assert theirs.eos_token == ("<|a|>" if decoder else "<|b|>")  # both rules were exercised


def test_malformed_tokenizer_settings_are_named(tmp_path):
    _bpe_dir(tmp_path)
    _edit_config(tmp_path, additional_special_tokens=5)
    with pytest.raises(CheckpointError, match="additional_special_tokens in the tokenizer settings must be a list"):
        load_tokenizer(str(tmp_path))
    _edit_config(tmp_path, additional_special_tokens=None)
    (tmp_path / "chat_template.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="chat_template.json must hold a JSON object"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xff")
    with pytest.raises(CheckpointError, match="chat_template.jinja is not valid UTF-8"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").unlink()
    _edit_config(tmp_path, added_tokens_decoder={"x1": {"content": "<a>"}})
    with pytest.raises(CheckpointError, match="added_tokens_decoder key must be a token id .* got 'x1'"):
        load_tokenizer(str(tmp_path))
    _edit_config(tmp_path, added_tokens_decoder=None)
    for bad in ("-3", "400.7", "Infinity", "true", '"12a"', str(2**31)):
        (tmp_path / "added_tokens.json").write_text(f'{{"<a>": {bad}}}')
        with pytest.raises(CheckpointError, match="added_tokens.json: the id of '<a>' must be a token id"):
            load_tokenizer(str(tmp_path))


def test_eos_ids_are_the_models_and_the_tokenizers(tmp_path):
    """EOS ids from config.json / generation_config.json (passed by the loader) come first; the
    tokenizer's own eos_token stops generation too (as in vLLM), also when the config names another."""
    _bpe_dir(tmp_path)
    assert load_tokenizer(str(tmp_path)).eos_ids == (2,)
    assert load_tokenizer(str(tmp_path), eos_ids=(2, 5)).eos_ids == (2, 5)
    assert load_tokenizer(str(tmp_path), eos_ids=(5,)).eos_ids == (5, 2)


# ----------------------------------------------------------------------------------------------
# SentencePiece tokenizer.model


@pytest.mark.parametrize(
    "dummy_prefix, normalization, config",
    [
        (True, "identity", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}),
        (True, "identity", {"tokenizer_class": "LlamaTokenizer", "legacy": True}),
        (True, "nmt_nfkc", {"tokenizer_class": "LlamaTokenizer", "add_eos_token": True}),
        (False, "identity", {"tokenizer_class": "GemmaTokenizer"}),
        (True, "identity", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_prefix_space": False}),
        # LlamaTokenizer prefixes "▁" by default even when the model's own add_dummy_prefix is off.
        (False, "identity", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}),
        # CodeLlamaTokenizer: BOS unless the config says no, `legacy` ignored.
        (True, "identity", {"tokenizer_class": "CodeLlamaTokenizer"}),
        (True, "identity", {"tokenizer_class": "CodeLlamaTokenizer", "legacy": True}),
    ],
)
def test_sentencepiece_ids_match_transformers(tmp_path, dummy_prefix, normalization, config):
    _spm_dir(tmp_path, dummy_prefix=dummy_prefix, normalization=normalization, tokenizer_config=config)
    strings = STRINGS + ["<start_of_turn>user\nhi<end_of_turn>", "x<s> y"]
    ours, theirs = _assert_same_ids(tmp_path, strings)
    assert isinstance(ours, SentencePieceTokenizer)
    assert ours.eos_ids == (2,)
    for text in ["hello world", "naïve 😀 café", "new\nline"]:
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    _assert_size_bound_holds(ours)


@pytest.mark.parametrize("legacy", [None, True, False])
def test_llama2_style_tokenizer_json_is_rebuilt_as_transformers_does(tmp_path, legacy):
    """Llama 2 checkpoints ship a tokenizer.json with a Prepend("▁") + Replace(" ", "▁")
    normaliser under tokenizer_class LlamaTokenizer. transformers 5 keeps only its vocabulary, merges
    and post-processor and rebuilds the rest (Metaspace, prepend "first", or "always" when legacy): read
    as written, " hello" gave ['▁▁', 'hello'] and "a</s>b" a '▁' after '</s>'."""
    (tmp_path / "spm").mkdir()
    spm = _spm_dir(tmp_path / "spm", tokenizer_config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": True})
    hub = _llama2_style_dir(tmp_path / "hub", spm)
    config = json.loads((hub / "tokenizer_config.json").read_text())
    config.pop("legacy", None)
    if legacy is not None:
        config["legacy"] = legacy
    (hub / "tokenizer_config.json").write_text(json.dumps(config))
    strings = STRINGS + [" hello", "a</s>b", "<s>hello", "[INST] hi [/INST] ok</s>[INST] q [/INST]", "  two  spaces "]
    ours, theirs = _assert_same_ids(hub, strings)
    assert isinstance(ours, HFTokenizer)
    for text in strings:
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def _assert_encodes_and_decodes_alike(ours, theirs, strings, *case):
    """Our ids and transformers' for each text, and the decode of its ids; `case` labels a failure."""
    for text in strings:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text) == expected, (*case, type(theirs).__name__, text)
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True), (*case, text)


def _llama2_style_dir(path, spm_dir):
    """A Llama 2 / Mistral v0.1 style tokenizer.json (Prepend("▁") + Replace(" ", "▁") normaliser, byte
    fallback, no pre-tokenizer), converted by transformers from the SentencePiece model in spm_dir."""
    transformers.AutoTokenizer.from_pretrained(str(spm_dir)).save_pretrained(str(path))
    tj = json.loads((path / "tokenizer.json").read_text())
    tj["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    tj["pre_tokenizer"] = None
    (path / "tokenizer.json").write_text(json.dumps(tj))
    (path / "tokenizer.model").unlink(missing_ok=True)
    return path


def _byte_level_extras_dir(path):
    """A byte-level BPE tokenizer.json whose pipeline adds to GPT-2's: a lowercasing normaliser and
    digit splitting before the bytes (trained without either, so a rebuild that drops them shows)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus() + ["Hello HELLO World 2024 20 24 cafe\u0301"] * 20, trainer)
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("kind", ["llama2-style", "byte-level"])
@pytest.mark.parametrize("model_type", [None, "llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_the_tokenizer_class_is_chosen_and_rebuilt_as_transformers_does(tmp_path, kind, model_type):
    """transformers 5 picks the tokenizer class from tokenizer_config.json's tokenizer_class and
    config.json's model_type (Mistral's registration reads the file as written, Qwen 2's overrides the
    declared class), and LlamaTokenizer, GemmaTokenizer, GPT2Tokenizer and Qwen2Tokenizer rebuild the
    file's pipeline. A Mistral v0.1 checkpoint (LlamaTokenizer under model_type mistral) was rebuilt
    here: its [INST] prompts and every text with a leading space came out other ids."""
    if kind == "llama2-style":
        (tmp_path / "spm").mkdir()
        spm = _spm_dir(tmp_path / "spm", tokenizer_config={"add_bos_token": True})
        source = _llama2_style_dir(tmp_path / "src", spm)
    else:
        source = _byte_level_extras_dir(tmp_path / "src")
    strings = [*STRINGS, " hello", "a</s>b", "<s>[INST] hi [/INST] ok</s>[INST] q [/INST]", "2024 HELLO cafe\u0301"]
    declared = [None, "LlamaTokenizerFast", "GPT2Tokenizer", "Qwen2TokenizerFast", "GemmaTokenizer"]
    declared += ["PreTrainedTokenizerFast", "MyOwnTokenizer"]
    for i, cls in enumerate(declared):
        for prefix_space in [None, True] if cls in ("GPT2Tokenizer", "Qwen2TokenizerFast") else [None]:
            d = tmp_path / f"case{i}{prefix_space}"
            d.mkdir()
            (d / "tokenizer.json").write_text((source / "tokenizer.json").read_text())
            config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
            config |= {"tokenizer_class": cls} if cls else {}
            config |= {"add_prefix_space": prefix_space} if prefix_space is not None else {}
            (d / "tokenizer_config.json").write_text(json.dumps(config))
            if model_type is not None:
                (d / "config.json").write_text(json.dumps({"model_type": model_type}))
            theirs = transformers.AutoTokenizer.from_pretrained(str(d))
            try:
                theirs("hello world")
            except Exception as e:  # GemmaTokenizer over a vocabulary without its <unk>
                assert "Unk token" in str(e), e
                with pytest.raises(CheckpointError, match="GemmaTokenizer"):
                    load_tokenizer(str(d))
                continue
            _assert_encodes_and_decodes_alike(load_tokenizer(str(d)), theirs, strings, cls, prefix_space)


@pytest.mark.parametrize("dummy_prefix", [True, False])
@pytest.mark.parametrize("model_type", [None, "llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_a_sentencepiece_model_alone_encodes_as_the_class_transformers_chooses(tmp_path, dummy_prefix, model_type):
    """A tokenizer.model without a tokenizer.json, under each class transformers 5 can choose for it.
    The generic one (no class named, or a Mistral model type) converts the model as SentencePiece
    encodes: its own dummy prefix, before every run of text and before a leading space too (unless
    `legacy` is false), add_prefix_space unread. Under GPT2Tokenizer / Qwen2Tokenizer transformers
    re-encodes the vocabulary as byte-level BPE, which jaxinfer refuses by name."""
    (tmp_path / "spm").mkdir()
    model = _spm_dir(tmp_path / "spm", dummy_prefix=dummy_prefix) / "tokenizer.model"
    strings = [*STRINGS, " hello", "a</s>b", "x<s> y", "<s>[INST] hi [/INST] ok</s>[INST] q [/INST]"]
    classes = [None, "LlamaTokenizer", "GemmaTokenizer", "PreTrainedTokenizerFast", "GPT2Tokenizer"]
    variants = [{}, {"legacy": False}, {"legacy": True}, {"add_prefix_space": False}, {"add_prefix_space": True}]
    for i, (cls, variant) in enumerate(itertools.product(classes, variants)):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "tokenizer.model").write_bytes(model.read_bytes())
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, **variant}
        config |= {"tokenizer_class": cls} if cls else {}
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        if model_type is not None:
            (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        theirs = transformers.AutoTokenizer.from_pretrained(str(d))
        if type(theirs).__name__ in ("GPT2Tokenizer", "Qwen2Tokenizer"):
            with pytest.raises(CheckpointError, match=type(theirs).__name__):
                load_tokenizer(str(d))
            continue
        _assert_encodes_and_decodes_alike(load_tokenizer(str(d)), theirs, strings, cls, variant)


@pytest.mark.parametrize("kind", ["tokenizer.json", "tokenizer.model"])
def test_special_tokens_named_by_the_class_or_by_any_token_key_are_special(tmp_path, kind):
    """transformers 5 names special tokens beyond the configs' seven: the class's own defaults where the
    configs leave a name out (GemmaTokenizer's mask_token "<mask>", which real Gemma files list as a
    plain added token) and every other "*_token" key holding a token (Gemma 3's boi_token). Decode
    skips them and chat templates see them; jaxinfer kept them in the text and rendered nothing."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    (tmp_path / "spm").mkdir()
    spm = _spm_dir(tmp_path / "spm", dummy_prefix=False, tokenizer_config={"tokenizer_class": "GemmaTokenizer"})
    d = tmp_path / "gemma"
    if kind == "tokenizer.json":
        transformers.AutoTokenizer.from_pretrained(str(spm)).save_pretrained(str(d))
        (d / "tokenizer.model").unlink(missing_ok=True)
        spec = json.loads((d / "tokenizer.json").read_text())  # without the <pad> and <mask> saving added
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < 400]
        (d / "tokenizer.json").write_text(json.dumps(spec))
    else:
        d.mkdir()
        (d / "tokenizer.model").write_bytes((spm / "tokenizer.model").read_bytes())
    config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config["boi_token"] = "<start_of_image>"
    # named here, in no vocabulary: appended after the rest, in transformers' order (it was hash order)
    config |= {"eoi_token": "<end_of_image>", "image_token": "<image_soft_token>", "audio_token": "<audio>"}
    plain = {"special": False, "lstrip": False, "rstrip": False, "single_word": False, "normalized": False}
    config["added_tokens_decoder"] = {
        "400": {"content": "<mask>", **plain},
        "401": {"content": "<start_of_image>", **plain},
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = load_tokenizer(str(d))
    hello, world = ours.encode("hello", add_special_tokens=False), ours.encode(" world", add_special_tokens=False)
    for ids, text in [([*hello, 400, *world], "hello world"), ([*hello, 401, 400, *world], "hello world"), ([400], "")]:
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    strings = ["a<mask>b", "<start_of_image> x", "hello<mask> world", "x<pad>y<end_of_image><audio>"]
    for text in [*strings, "<image_soft_token>"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert ours.vocab_size == len(theirs) == 406  # <pad> and the last three appended
    template = "{{ boi_token }}|{{ mask_token }}|{{ pad_token }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    conv = [{"role": "user", "content": "hi"}]
    rendered = render_chat_template(template, validate_messages(conv), special_tokens=ours.special_tokens)
    assert (
        rendered
        == theirs.apply_chat_template(conv, chat_template=template, tokenize=False)
        == ("<start_of_image>|<mask>|<pad>|hi")
    )


def test_named_special_tokens_follow_transformers_precedence(tmp_path):
    """Which "*_token" entries name a token, and which value wins: special_tokens_map.json's count too
    (after the config's), an `extra_special_tokens` object overrides the rest (eos_token included), an
    object without AddedToken's "__type" is no token, and CodeLlama's fill token is named. An older
    checkpoint's added_tokens.json left the list of additional special tokens a dict (a name reused),
    which made Qwen 2's plain <tool_call> special: decode dropped it from tool calls."""
    from jaxinfer.tokenizer import read_settings

    d = _bpe_dir(tmp_path / "a", specials=("<img>", "<b>", "<c>"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config |= {"image_token": "<img>", "plain_token": {"content": "<c>"}}
    config["extra_special_tokens"] = {"video_token": "<b>", "eos_token": "<b>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({"audio_token": "<c>", "image_token": "<b>"}))
    named = read_settings(str(d)).special_tokens
    assert {k: named.get(k) for k in ("image_token", "audio_token", "video_token", "eos_token", "plain_token")} == {
        "image_token": "<img>",
        "audio_token": "<c>",
        "video_token": "<b>",
        "eos_token": "<b>",
        "plain_token": None,
    }
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    assert named == {k: str(v) for k, v in theirs.special_tokens_map.items()}
    assert load_tokenizer(str(d)).eos_ids == (theirs.eos_token_id,)

    d = _bpe_dir(tmp_path / "qwen", specials=("<|im_end|>",))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    tok.add_tokens(["<tool_call>"])  # a plain added token, as Qwen 2.5 has
    tok.save_pretrained(str(d))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<pad>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tool = tok.convert_tokens_to_ids("<tool_call>")
    (d / "added_tokens.json").write_text(json.dumps({"<tool_call>": tool}))
    ours, theirs = _assert_same_ids(d, ["<tool_call>{}</s>"])
    ids = ours.encode("<tool_call>{}", add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "<tool_call>{}"

    d = _code_llama_dir(tmp_path / "code", {})
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    ours, theirs = load_tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    conv = validate_messages([{"role": "user", "content": "x"}])
    assert render_chat_template("[{{ fill_token }}]", conv, special_tokens=ours.special_tokens) == "[<FILL_ME>]"
    assert ours.vocab_size == len(theirs)


def test_a_code_llama_bos_that_cannot_head_a_template_is_a_checkpoint_error(tmp_path):
    for i, bos in enumerate(["<s> x", "a:b"]):
        d = _code_llama_dir(tmp_path / str(i), {"bos_token": bos})
        with pytest.raises(CheckpointError, match="bos_token cannot head a post-processor template"):
            load_tokenizer(str(d))


def test_qwen2_tokenizer_makes_its_special_tokens_plain_again(tmp_path):
    """Qwen2Tokenizer's constructor ends by adding every named and listed special token again as a plain
    special token: a fine-tune whose <|im_end|> strips the whitespace to its right (rstrip) keeps the
    newline after it, as transformers 5 encodes it; jaxinfer let the token swallow it."""
    d = _bpe_dir(tmp_path, specials=("<|im_start|>", "<|im_end|>"))
    spec = json.loads((d / "tokenizer.json").read_text())
    config = json.loads((d / "tokenizer_config.json").read_text())
    entries = [*spec["added_tokens"], *config.get("added_tokens_decoder", {}).values()]
    for entry in entries:
        entry["rstrip"] = entry["content"] == "<|im_end|>"
        entry["lstrip"] = entry["content"] == "<|im_start|>"
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    ours, theirs = _assert_same_ids(d, [*STRINGS, "<|im_end|>\n", "hi <|im_start|>user\nx<|im_end|>\n"])
    assert type(theirs).__name__ == "Qwen2Tokenizer"
    assert ours.decode(ours.encode("a<|im_end|>\nb"), skip_special_tokens=False).endswith("<|im_end|>\nb")


def _code_llama_dir(path, config, post=("<s> $A", [("<s>", 1)])):
    """A CodeLlama-style checkpoint's tokenizer: a Llama 2 style tokenizer.json (Prepend("▁") +
    Replace(" ", "▁") normaliser, byte fallback) with the four infilling markers as added tokens,
    under tokenizer_class CodeLlamaTokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    )
    tok.add_tokens(["▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"])
    tok.post_processor = processors.TemplateProcessing(single=post[0], special_tokens=post[1])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "CodeLlamaTokenizer"}
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return path


@pytest.mark.parametrize(
    "config",
    [{"legacy": None}, {"legacy": True, "add_bos_token": True}, {"add_prefix_space": False}],
    ids=["legacy-null", "legacy-true", "no-prefix-space"],
)
def test_code_llama_tokenizer_json_is_rebuilt_as_transformers_does(tmp_path, config):
    """CodeLlama checkpoints name CodeLlamaTokenizer, which transformers 5 rebuilds like LlamaTokenizer
    but with `legacy` ignored (prepend "first"), a decoder that always strips the prefix, and its
    infilling markers special. jaxinfer read the file as written: " Hello" gave ['▁▁', 'He', ...] and
    "a</s>b" an extra '▁' after '</s>'."""
    d = _code_llama_dir(tmp_path / "code", config)
    strings = [*STRINGS, " Hello world", "a</s>b", "x</s> Hello", "<s>hi", "  two spaces", "a ▁<PRE> b"]
    strings += ["▁<PRE> def f(x):▁<SUF>\n    return x▁<MID>", "def f(x):\n\treturn x * 2"]
    ours, theirs = _assert_same_ids(d, strings)
    assert isinstance(ours, HFTokenizer)
    for text in strings:
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    # transformers turns a prompt with the fill token into an infilling prompt; jaxinfer refuses it.
    with pytest.raises(InvalidRequestError, match="prompt holds the fill token '<FILL_ME>'"):
        encode_prompt(ours, "def f(<FILL_ME>):", max_tokens=100, field="prompt")


@pytest.mark.parametrize(
    "post",
    [("<s> $A </s>", [("<s>", 1), ("</s>", 2)]), ("$A", []), ("$A </s>", [("</s>", 2)])],
    ids=["bos-eos", "none", "eos"],
)
def test_code_llama_encodes_with_bos_and_without_eos_whatever_the_file_says(tmp_path, post):
    """CodeLlamaTokenizer replaces the file's post-processor with its own (BOS, never EOS): a fine-tune
    saved with EOS in it got an EOS at the end of every prompt here, one saved without BOS none."""
    d = _code_llama_dir(tmp_path / "code", {"add_eos_token": True}, post=post)
    ours, _ = _assert_same_ids(d, [*STRINGS, "def f(x):"])
    assert ours.encode("def f(x):")[0] == 1 and ours.encode("def f(x):")[-1] != 2


def test_byte_level_tokenizer_json_under_a_llama_class_is_read_as_written(tmp_path):
    """DeepSeek checkpoints name LlamaTokenizerFast over a byte-level BPE file: transformers 5 reads it
    as written (the Metaspace rebuild dropped every emoji and glued "Hello world" together)."""
    _bpe_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = _assert_same_ids(tmp_path, STRINGS + ["Hello world", "emoji 😀🚀", " leading"])
    for text in ["Hello world", "emoji 😀🚀"]:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_a_llama_class_file_that_mentions_byte_level_is_read_as_written_as_transformers_reads_it(tmp_path):
    """transformers 5 reads a LlamaTokenizer file as written when the text '"ByteLevel"' appears anywhere
    in it (`_tokenizer_json_has_byte_level`), a vocabulary entry or a post-processor included; the
    pipeline test (`_is_byte_level`, which bounds a prompt's bytes per token) looks at what runs."""
    from jaxinfer.tokenizer import _is_byte_level

    (tmp_path / "spm").mkdir()
    spm = _spm_dir(tmp_path / "spm", tokenizer_config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": True})
    for where in ("vocab", "post_processor"):
        d = _llama2_style_dir(tmp_path / where, spm)
        spec = json.loads((d / "tokenizer.json").read_text())
        if where == "vocab":
            vocab = spec["model"]["vocab"]
            victim = max((t for t in vocab if t.startswith("▁") and len(t) > 3), key=vocab.get)  # the last merged
            vocab["ByteLevel"] = vocab.pop(victim)
            merges = [m if isinstance(m, list) else m.split(" ") for m in spec["model"]["merges"]]
            spec["model"]["merges"] = [m for m in merges if "".join(m) != victim]
        else:
            byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
            spec["post_processor"] = {"type": "Sequence", "processors": [byte_level, spec["post_processor"]]}
        (d / "tokenizer.json").write_text(json.dumps(spec))
        ours, theirs = _assert_same_ids(d, [*STRINGS, " hello", "a</s>b"])
        assert type(theirs).__name__ == "TokenizersBackend" and not _is_byte_level(str(d / "tokenizer.json"))

    def spec(pre):
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps({"pre_tokenizer": pre, "decoder": None, "model": {"vocab": {}}}))
        return str(path)

    assert not _is_byte_level(spec({"type": "Metaspace"}))
    assert _is_byte_level(spec({"type": "ByteLevel"}))
    assert _is_byte_level(spec({"type": "Sequence", "pretokenizers": [{"type": "Split"}, {"type": "ByteLevel"}]}))


@pytest.mark.parametrize("kind", ["as written", "rebuilt"])
def test_a_file_saved_with_truncation_or_padding_still_encodes_the_whole_prompt(tmp_path, kind):
    """A tokenizer.json saved by a fine-tuning run with truncation or padding switched on: transformers
    switches both off for each call. Left on, every prompt was cut to 4 tokens or padded to 16."""
    if kind == "as written":
        source = _bpe_dir(tmp_path / "src")
    else:
        (tmp_path / "spm").mkdir()
        spm = _spm_dir(tmp_path / "spm", tokenizer_config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": True})
        source = _llama2_style_dir(tmp_path / "src", spm)
    spec = json.loads((source / "tokenizer.json").read_text())
    truncation = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    padding = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0}
    padding |= {"pad_type_id": 0, "pad_token": "<pad>"}
    (source / "tokenizer.json").write_text(json.dumps(spec | {"truncation": truncation, "padding": padding}))
    ours, _ = _assert_same_ids(source)
    assert len(ours.encode("hello world, the quick brown fox.")) > 4
    assert len(ours.encode("a")) < 16


def test_rebuilt_classes_neither_drop_out_merges_nor_skip_them(tmp_path):
    """The classes transformers 5 rebuilds make a fresh BPE: no dropout (a file's would make encoding
    random) and merges never skipped for a word the vocabulary holds whole (`ignore_merges`, which
    Llama 3's files set); both were kept from the file."""
    source = _bpe_dir(tmp_path / "src")
    spec = json.loads((source / "tokenizer.json").read_text())
    spec["model"] |= {"ignore_merges": True, "dropout": 0.5}
    used = [*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])]
    spec["model"]["vocab"]["Ġzzyzx"] = max(used) + 1  # no merge reaches it
    (source / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    ours, theirs = _assert_same_ids(source, [*STRINGS, "a zzyzx", "zzyzx zzyzx"] * 3)
    assert type(theirs).__name__ == "GPT2Tokenizer" and len(ours.encode("a zzyzx")) > 3


def test_sentencepiece_decode_skips_unk_and_ids_past_the_model(tmp_path):
    """<unk> is a special token transformers skips; an id past the pieces (a config vocabulary padded
    beyond the tokenizer's) raised IndexError from inside the streaming detokenizer."""
    _spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    ours = load_tokenizer(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    a = ours.encode("a", add_special_tokens=False)
    ids = [*a, 0, *a]  # 0: <unk>
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode([*a, ours.vocab_size, ours.vocab_size + 7, *a]) == ours.decode(a + a)


@pytest.mark.parametrize("ids", [(0, 1, 2), (2, 0, 1), (1, 2, 0)], ids=["unk0", "bos0", "eos0"])
def test_a_bare_sentencepiece_model_encodes_as_sentencepiece_does(tmp_path, ids):
    """A tokenizer.model with no tokenizer_config.json: BOS and EOS are the model's own (id 0 is an
    id, -1 none), BOS is added, and the model's dummy prefix is kept (no tokenizer class to say
    otherwise), as sentencepiece itself encodes, before a leading space too (as transformers'
    generic class converts the model; its Llama class would make the prefix and that space one)."""
    import sentencepiece as spm

    _spm_dir(tmp_path, ids=ids)
    (tmp_path / "tokenizer_config.json").unlink()
    ours = load_tokenizer(str(tmp_path))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert (ours.bos_id, ours.eos_ids) == (ids[1], (ids[2],))
    for text in STRINGS:
        assert ours.encode(text) == [ids[1], *sp.encode(text)], text
    assert ours._piece_id("<unk>") == ids[0] and ours._piece_id("<not-a-piece>") is None


@pytest.mark.parametrize(
    "dummy_prefix, config",
    [
        (True, {"tokenizer_class": "LlamaTokenizer"}),
        (False, {"tokenizer_class": "GemmaTokenizer", "additional_special_tokens": ["<start_of_turn>"]}),
    ],
)
def test_sentencepiece_decode_of_random_ids_matches_transformers(tmp_path, dummy_prefix, config):
    """Random ids, what a random-weight model generates: byte-fallback runs that mix valid and invalid
    UTF-8 decode, as in transformers, to one U+FFFD per byte of the run (SentencePiece's own decode
    kept the valid bytes: 1145 of 2000 such lists differed), and runs join across skipped specials."""
    _spm_dir(tmp_path, dummy_prefix=dummy_prefix, tokenizer_config=config)
    ours = load_tokenizer(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), theirs.convert_ids_to_tokens(ids)
    b = {n: ours._sp.piece_to_id(f"<0x{n:02X}>") for n in (0x41, 0xE2)}
    assert ours.decode([b[0x41], b[0xE2]]) == "\ufffd\ufffd"
    assert ours.decode([b[0x41], 2, b[0x41]]) == "AA"  # 2: </s>, skipped
    # Kept (skip_special_tokens=False): each special is its own text, and it splits a byte run.
    assert ours.decode([b[0x41], 2, b[0x41]], skip_special_tokens=False) == "A</s>A"
    specials = [0, 1, 2]  # <unk>, <s>, </s>: a random model draws them rarely, so mix them in
    for _ in range(300):
        ids = [rng.choice([rng.choice(specials), rng.randrange(ours.vocab_size)]) for _ in range(rng.randrange(1, 12))]
        got = ours.decode(ids, skip_special_tokens=False)
        assert got == theirs.decode(ids, skip_special_tokens=False), theirs.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("kind", ["spm_llama", "spm_gemma", "bpe"])
def test_skipped_ids_are_the_ids_transformers_decode_drops(tmp_path, kind):
    """`skipped_ids` (what the detokenizer leaves out of its windows): exactly the ids that vanish
    from transformers' decode with skip_special_tokens=True, placed between two words."""
    if kind == "bpe":
        _bpe_dir(tmp_path, specials=["<|im_start|>"])
    elif kind == "spm_llama":
        _spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    else:
        config = {"tokenizer_class": "GemmaTokenizer", "additional_special_tokens": ["<start_of_turn>"]}
        _spm_dir(tmp_path, dummy_prefix=False, tokenizer_config=config)
    ours = load_tokenizer(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    word = ours.encode("hello", add_special_tokens=False)[-1]
    both = theirs.decode([word, word], skip_special_tokens=True)
    vanish = {i for i in range(ours.vocab_size) if theirs.decode([word, i, word], skip_special_tokens=True) == both}
    assert ours.skipped_ids == vanish and ours.bos_id in vanish and set(ours.eos_ids) <= vanish


@pytest.mark.parametrize("source", ["added_tokens_decoder", "added_tokens.json"])
def test_sentencepiece_added_tokens_have_their_own_ids(tmp_path, source):
    """Tokens a tokenizer_config.json (or an older added_tokens.json) adds past the model's pieces, as
    fine-tunes add a pad token or tool markers: transformers gives them their ids in encode, and
    decodes a non-special one to its text. They were spelled out in pieces and decoded to nothing."""
    _spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if source == "added_tokens_decoder":
        entry = dict(lstrip=False, rstrip=False, normalized=False, single_word=False)
        config["added_tokens_decoder"] = {
            "400": {"content": "<tool>", "special": False, **entry},
            "401": {"content": "<|sp|>", "special": True, **entry},
            "402": {"content": "▁foo", "special": False, **entry},  # decodes through "▁" -> " " too
            "403": {"content": "</s>", "special": True, **entry},  # a piece already: ignored
            "404": {"content": "<unk>", "special": True, **entry},  # the unknown piece too
        }
    else:
        (tmp_path / "added_tokens.json").write_text(json.dumps({"<tool>": 400, "<|sp|>": 401, "▁foo": 402}))
        config["additional_special_tokens"] = ["<|sp|>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    strings = STRINGS + ["hi<tool>x<|sp|>y", "<tool><tool> a", "a <|sp|>", "a</s>b", "x▁foo"]
    ours, theirs = _assert_same_ids(tmp_path, strings)
    assert ours.vocab_size == len(theirs) == 403 and ours.eos_ids == (2,)
    assert {400, 401} <= set(ours.encode("hi<tool>x<|sp|>y"))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([400, 401, 402, rng.randrange(ours.vocab_size)]) for _ in range(rng.randrange(1, 10))]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), theirs.convert_ids_to_tokens(ids)
        kept = ours.decode(ids, skip_special_tokens=False)
        assert kept == theirs.decode(ids, skip_special_tokens=False), theirs.convert_ids_to_tokens(ids)


def _random_strings(pieces, n=400, seed=0):
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def test_sentencepiece_added_tokens_strip_the_whitespace_their_entries_say(tmp_path):
    """added_tokens_decoder's lstrip / rstrip: the whitespace on that side of the token goes with it,
    as transformers encodes it ("a <tool> b" was 'a', '▁', <tool>, '▁', 'b')."""
    _spm_dir(tmp_path, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    entry = dict(normalized=False, single_word=False)
    config["added_tokens_decoder"] = {
        "400": {"content": "<tool>", "special": False, "lstrip": True, "rstrip": True, **entry},
        "401": {"content": "<mask>", "special": True, "lstrip": True, "rstrip": False, **entry},
        "402": {"content": "<end>", "special": True, "lstrip": False, "rstrip": True, **entry},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    strings = _random_strings(["<tool>", "<mask>", "<end>", " ", "  ", "\n", "a", "hello", " the", "日本", "</s>"])
    ours, _ = _assert_same_ids(tmp_path, ["a <tool> b", "hello   <mask> world", *strings])
    ids = ours.encode("a <tool> b", add_special_tokens=False)
    at = ids.index(400)
    assert ours.decode(ids[:at]) == "a" and ours.decode(ids[at + 1 :]) == "b", ids  # no space piece either side


def test_tokenizer_json_takes_the_special_tokens_only_its_config_declares(tmp_path):
    """A chat model's <|im_end|> in tokenizer.json's vocabulary but not among its added tokens, named
    eos_token and special only in tokenizer_config.json (and a second token added there only):
    transformers adds them as special tokens, so they are matched inside text and skipped by a
    decode. They were encoded as the characters of their text and kept in the decoded text."""
    _bpe_dir(tmp_path, specials=["<|im_end|>"])
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    im_end = next(t for t in tj["added_tokens"] if t["content"] == "<|im_end|>")
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] != "<|im_end|>"]
    tj["model"]["vocab"]["<|im_end|>"] = im_end["id"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    entry = dict(special=True, lstrip=False, rstrip=False, normalized=False, single_word=False)
    new_id = len(tj["model"]["vocab"])
    decoder = {str(im_end["id"]): {"content": "<|im_end|>", **entry}, str(new_id): {"content": "<|tool|>", **entry}}
    _edit_config(tmp_path, eos_token="<|im_end|>", added_tokens_decoder=decoder, additional_special_tokens=None)
    pieces = ["<|im_end|>", "<|tool|>", "</s>", " ", "hi", " x", "the quick", "é"]
    ours, theirs = _assert_same_ids(tmp_path, ["hi<|im_end|> x", *_random_strings(pieces)])
    assert ours.eos_ids == (im_end["id"],) and {im_end["id"], new_id} <= ours.skipped_ids
    assert ours.vocab_size == len(theirs)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.choice([im_end["id"], new_id, rng.randrange(ours.vocab_size)]) for _ in range(rng.randrange(1, 9))]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


# ----------------------------------------------------------------------------------------------
# Chat templates


def _chat_dir(tmp_path, style, *, tokenizer="bpe"):
    d = tmp_path / f"{style}-{tokenizer}"
    d.mkdir()
    template = LLAMA3_TEMPLATE if style == "llama3" else GEMMA_TEMPLATE
    if tokenizer == "bpe":
        specials = LLAMA3_SPECIALS if style == "llama3" else GEMMA_SPECIALS
        bos = "<|begin_of_text|>" if style == "llama3" else "<s>"
        _bpe_dir(d, specials, bos_token=bos, add_bos_token=True)
    else:
        _spm_dir(d, tokenizer_config={"tokenizer_class": "LlamaTokenizer"})
    _edit_config(d, chat_template=template)
    return d


@pytest.mark.parametrize("style, tokenizer", [("llama3", "bpe"), ("gemma", "bpe"), ("gemma", "spm")])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_apply_chat_template(tmp_path, style, tokenizer, add_generation_prompt):
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    d = _chat_dir(tmp_path, style, tokenizer=tokenizer)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    for conv in CONVERSATIONS:
        text = render_chat_template(
            ours.chat_template,
            validate_messages(conv),
            add_generation_prompt=add_generation_prompt,
            special_tokens=ours.special_tokens,
        )
        kw = dict(add_generation_prompt=add_generation_prompt)
        assert text == theirs.apply_chat_template(conv, tokenize=False, **kw)
        expected = theirs.apply_chat_template(conv, tokenize=True, return_dict=False, **kw)
        assert ours.encode(text, add_special_tokens=False) == expected
        # The tokenizer's own apply_chat_template, for scripts written against vLLM's get_tokenizer():
        # transformers 5's defaults and forms (a dict of ids and mask unless return_dict=False).
        assert ours.apply_chat_template(conv, tokenize=False, **kw) == text
        assert ours.apply_chat_template(conv, return_dict=False, **kw) == expected
        assert ours.apply_chat_template(conv, **kw) == dict(theirs.apply_chat_template(conv, **kw))
        assert ours.apply_chat_template(conv, **kw).input_ids == theirs.apply_chat_template(conv, **kw).input_ids
        # Positional, in transformers' order (conversation, tools, documents, chat_template, ...).
        assert ours.apply_chat_template(conv, None, None, None, add_generation_prompt, False, False) == text
    both = theirs.apply_chat_template(CONVERSATIONS, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(CONVERSATIONS, tokenize=False, add_generation_prompt=add_generation_prompt) == both
    assert ours.apply_chat_template(CONVERSATIONS, add_generation_prompt=add_generation_prompt) == dict(
        theirs.apply_chat_template(CONVERSATIONS, add_generation_prompt=add_generation_prompt)
    )
    if style == "gemma":  # the template's own "\n" after <start_of_turn>model only with the prompt
        assert text.endswith("<start_of_turn>model\n") == add_generation_prompt


# A Qwen 3-style switch the caller sets through chat_template_kwargs.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<' + message['role'] + '>' + message['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}{% endif %}{% endif %}"
)


@pytest.mark.parametrize("style", ["llama3", "gemma"])
@pytest.mark.parametrize("answer", ["The answer is", "The answer is ", "  4\n", "", "   ", "of", "id"])
def test_continue_final_message_matches_transformers(tmp_path, style, answer):
    """The prompt ends inside the assistant's message, as transformers' continue_final_message makes it
    (the template's end-of-turn cut off; trailing spaces kept only where the template kept them). An
    empty message leaves the turn open; "of" and "id" are in the end-of-turn tokens <end_of_turn> and
    <|eot_id|> (found by searching for the text, the cut fell inside them)."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    d = _chat_dir(tmp_path, style)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    conv = [*CONVERSATIONS[1][1:3], {"role": "user", "content": "Again?"}, {"role": "assistant", "content": answer}]
    text = render_chat_template(
        ours.chat_template,
        validate_messages(conv),
        add_generation_prompt=False,
        special_tokens=ours.special_tokens,
        continue_final_message=True,
    )
    assert text == theirs.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith(answer.strip())


def test_chat_template_kwargs_reach_the_template(tmp_path):
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    d = _chat_dir(tmp_path, "llama3")
    _edit_config(d, chat_template=THINKING_TEMPLATE)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    conv = CONVERSATIONS[0]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        text = render_chat_template(
            ours.chat_template, validate_messages(conv), special_tokens=ours.special_tokens, template_kwargs=kwargs
        )
        assert text == theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kwargs)
        assert text.endswith("<think></think>") == (kwargs == {"enable_thinking": False})
        # apply_chat_template's further keyword arguments are the template's variables, as transformers'.
        assert ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kwargs) == text
    with pytest.raises(
        InvalidRequestError,
        match=r"apply_chat_template's template variables \(keyword arguments\) may not set \['messages'\]",
    ):
        ours.apply_chat_template(conv, messages=[])


def test_apply_chat_template_refuses_the_tokenizer_options_it_does_not_implement(tmp_path):
    """transformers' tokenizer-side options (tensors, padding, truncation, sanitized control tokens,
    ...) are refused by name: taken as template variables, they were ignored without a word (plain
    lists for return_tensors="np", every token for truncation=True). Left at their defaults, as
    scripts spell them out, they change nothing."""
    d = _chat_dir(tmp_path, "llama3")
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    conv = CONVERSATIONS[1]
    defaults = dict(
        sanitize_control_tokens=False,
        padding=False,
        truncation=False,
        max_length=None,
        return_tensors=None,
        return_assistant_tokens_mask=False,
        tokenizer_kwargs=None,
    )
    assert ours.apply_chat_template(conv, **defaults) == dict(theirs.apply_chat_template(conv, **defaults))
    for given in (
        {"return_tensors": "np"},
        {"truncation": True, "max_length": 5},
        {"padding": True},
        {"sanitize_control_tokens": True},
        {"return_assistant_tokens_mask": True},
        {"tokenizer_kwargs": {"add_special_tokens": True}},
    ):
        with pytest.raises(InvalidRequestError, match=re.escape(f"does not implement transformers' {list(given)}")):
            ours.apply_chat_template(conv, **given)


def test_a_callers_chat_templates_are_cached_in_bounded_number():
    """Every template a caller renders with is remembered (compiled, and whether it takes content
    apart) up to a bound: a long-running app that builds its templates must not grow without end."""
    from jaxinfer.tokenizer import ByteTokenizer, _compile_chat_template, _iterates_content

    tok = ByteTokenizer()
    conv = [{"role": "user", "content": "hi"}]
    for i in range(40):
        text = tok.apply_chat_template(conv, chat_template=f"{i}{{{{ messages[0].content }}}}", tokenize=False)
        assert text == f"{i}hi"
    assert _compile_chat_template.cache_info().currsize <= 32
    assert _iterates_content.cache_info().currsize <= 32


# Special tokens, tools through tojson, and content parts the template takes apart itself.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<{{ m.role }}>"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_chat_template_tools_kwargs_and_parts_match_transformers(tmp_path):
    """Non-ASCII tool text stays as written through tojson; chat_template_kwargs override the
    special tokens; continue_final_message continues a list content's last text part."""
    from jaxinfer.tokenizer import check_tools, render_chat_template, validate_messages

    d = _chat_dir(tmp_path, "llama3")
    _edit_config(d, chat_template=PARTS_TEMPLATE)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))

    def render(conv, **kw):
        special = ours.special_tokens
        return render_chat_template(ours.chat_template, validate_messages(conv), special_tokens=special, **kw)

    tools = [{"type": "function", "function": {"name": "météo", "description": "température °C, 東京"}}]
    conv = [{"role": "user", "content": "Quel temps à Tōkyō ?"}]
    text = render(conv, tools=check_tools(tools))
    assert text == theirs.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "température °C, 東京" in text
    text = render(conv, template_kwargs={"bos_token": "<BOS>"})
    assert text == theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, bos_token="<BOS>")
    assert text.startswith("<BOS><user>")
    parts = [{"type": "text", "text": "First"}, {"type": "text", "text": "Second"}]
    conv = [*conv, {"role": "assistant", "content": parts}]
    text = render(conv, add_generation_prompt=False, continue_final_message=True)
    assert text == theirs.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith("<assistant>First|Second")


def test_message_keys_set_to_none_are_left_out():
    """{"tool_calls": None} (as OpenAI-style clients send unset fields) is no tool call: a template
    testing `'tool_calls' in m` must not see the key."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    template = "{% for m in messages %}{% if 'tool_calls' in m %}CALLS{% endif %}{{ m.content }}{% endfor %}"
    conv = validate_messages([{"role": "user", "content": "hi", "tool_calls": None, "name": None}])
    assert conv == [{"role": "user", "content": "hi"}]
    assert render_chat_template(template, conv) == "hi"


def test_chat_template_jinja_file_is_read(tmp_path):
    d = _chat_dir(tmp_path, "llama3")
    _edit_config(d, chat_template=None)
    assert load_tokenizer(str(d)).chat_template is None
    (d / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    assert load_tokenizer(str(d)).chat_template == GEMMA_TEMPLATE


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    save_hf_model(make_hf_model("llama2", vocab_size=512), d)
    _bpe_dir(d, GEMMA_SPECIALS, add_bos_token=True)
    _edit_config(d, chat_template=GEMMA_TEMPLATE)
    return LLM(str(d), num_kv_pages=64, max_model_len=256), d


def test_llm_chat_generates_from_the_rendered_prompt(chat_llm):
    chat_llm, d = chat_llm
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = chat_llm.chat(CONVERSATIONS[1], params)
    assert len(outs) == 1
    ids = theirs.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, return_dict=False)
    assert outs[0].prompt_token_ids == ids
    assert outs[0].prompt == theirs.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)
    direct = chat_llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert outs[0].token_ids == direct.token_ids and len(direct.token_ids) == 6

    # A list of conversations gives one output each, in order.
    both = chat_llm.chat(CONVERSATIONS, params)
    assert [o.prompt_token_ids for o in both][1] == ids and len(both) == 2
    without = chat_llm.chat(CONVERSATIONS[0], params, add_generation_prompt=False)[0]
    assert not without.prompt.endswith("<start_of_turn>model\n")
    # A refusal names the conversation the caller passed, not the token ids chat() made of it.
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]: SamplingParams\.stop_token_ids"):
        chat_llm.chat(CONVERSATIONS, SamplingParams(stop_token_ids=[100000]))
    # truncate_prompt_tokens: a conversation past the prompt limit's size runs its last tokens
    # (it was refused for its size first, as a text prompt of generate() is not).
    long = [{"role": "user", "content": "hello there, how are you today? " * 400}]
    with pytest.raises(InvalidRequestError, match="cannot fit in 255 tokens"):
        chat_llm.chat(long, params)
    cut = chat_llm.chat(long, dataclasses.replace(params, truncate_prompt_tokens=20))[0]
    rendered = theirs.apply_chat_template(long, add_generation_prompt=True, return_dict=False)
    assert cut.prompt_token_ids == rendered[-20:]
    assert cut.token_ids == chat_llm.generate(prompt_token_ids=[rendered[-20:]], sampling_params=params)[0].token_ids


def test_llm_chat_continues_the_final_message(chat_llm):
    chat_llm, d = chat_llm
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    conv = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe"}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = chat_llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True)[0]
    ids = theirs.apply_chat_template(conv, continue_final_message=True, return_dict=False)
    assert out.prompt_token_ids == ids and out.prompt.endswith("A ripe")
    assert out.token_ids == chat_llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
    # Left out, add_generation_prompt gives way to continue_final_message (it defaults to True otherwise).
    assert chat_llm.chat(conv, params, continue_final_message=True)[0].prompt_token_ids == ids


def _nested(depth: int) -> list:
    """A string inside `depth` lists."""
    value = "a"
    for _ in range(depth):
        value = [value]
    return value


def _contains_itself() -> dict:
    """A dict one of whose values is the dict itself (what a bug in a caller's code can build)."""
    d = {"type": "object"}
    d["properties"] = d
    return d


_TOO_DEEP = "nests lists and dicts more than 64 deep"


def test_chat_data_may_nest_64_deep_and_no_deeper():
    """The limit counts from the message (tool, document): its content may hold 64 lists, not 65."""
    from jaxinfer.tokenizer import check_documents, validate_messages

    assert validate_messages([{"role": "user", "content": _nested(64)}])[0]["content"] == _nested(64)
    assert check_documents([{"text": _nested(64)}]) == [{"text": _nested(64)}]
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.content nests"):
        validate_messages([{"role": "user", "content": _nested(65)}])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(continue_final_message=True, add_generation_prompt=True), r"pass add_generation_prompt=False"),
        (dict(continue_final_message=1, add_generation_prompt=False), r"continue_final_message must be True or False"),
        (dict(chat_template_kwargs=["x"]), r"chat_template_kwargs must be a dict"),
        (dict(chat_template_kwargs={"messages": []}), r"chat_template_kwargs may not set \['messages'\]"),
        (
            dict(chat_template_kwargs={"documents": [], "x": 1}),
            r"may not set \['documents'\]: they are arguments of their own",
        ),
        (dict(chat_template_kwargs={"date_string": b"x"}), r"chat_template_kwargs\.date_string is a bytes"),
        # Were RecursionError tracebacks:
        (dict(chat_template_kwargs={"x": _nested(5000)}), rf"^chat_template_kwargs\.x {_TOO_DEEP}"),
    ],
)
def test_llm_chat_refuses_bad_options(chat_llm, kwargs, message):
    chat_llm, _ = chat_llm
    with pytest.raises(InvalidRequestError, match=message):
        chat_llm.chat(CONVERSATIONS[0], **kwargs)


def test_continue_final_message_needs_the_text_in_the_rendering(chat_llm):
    chat_llm, _ = chat_llm
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "image", "url": "x"}]}]
    with pytest.raises(InvalidRequestError, match="the final message has no text to continue"):
        chat_llm.chat(conv, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", r"messages must be a list"),
        ({"role": "user", "content": "hi"}, r"messages must be a list"),
        ([], r"messages is empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\.role is missing"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"messages\[1\]\.content is missing"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": 7, "content": "x"}], r"messages\[0\]\.role must be a non-empty string"),
        ([{"role": "user", "content": _nested(5000)}], rf"^messages\[0\]\.content {_TOO_DEEP}"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "meta": _contains_itself()}]}], _TOO_DEEP),
        ([[{"role": "user", "content": "a"}], [{"role": "user"}]], r"messages\[1\]\[0\]\.content is missing"),
        # The template's own raise_exception reaches the caller as a request error.
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], r"roles must alternate"),
    ],
)
def test_bad_messages_are_refused_by_field(chat_llm, messages, message):
    with pytest.raises(InvalidRequestError, match=message):
        chat_llm[0].chat(messages)


def test_a_template_that_fails_on_the_messages_is_a_request_error():
    """A template that raises on what it is given (a raw TypeError before) is a request error."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    messages = validate_messages([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match=r"chat template failed on them \(TypeError: .*str"):
        render_chat_template("{{ messages[0]['role'] + ': ' + messages[0]['content'] + 1 }}", messages)


def test_content_parts_are_joined_for_a_string_template_and_kept_for_a_list_template():
    """OpenAI-style content parts: a template that prints content as a string gets the text parts
    joined by newlines (vLLM's "auto" content format; the list's Python repr before); a template that
    loops over the parts gets them as they are."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    string_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    list_template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    as_parts = validate_messages([{"role": "user", "content": parts}])
    as_string = validate_messages([{"role": "user", "content": "Hello\nworld"}])
    assert render_chat_template(string_template, as_parts) == render_chat_template(string_template, as_string)
    assert render_chat_template(list_template, as_parts) == "<user>[Hello][world]"
    image = validate_messages([{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[2\] is of type 'image_url'"):
        render_chat_template(string_template, image)
    # A text part whose text is no string is no text part either (a TypeError from the join before).
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\] is of type 'text', not a text part"):
        render_chat_template(string_template, [{"role": "user", "content": [{"type": "text", "text": 5}]}])


@pytest.mark.parametrize(
    "template",
    [
        # A filter on the content that is not a loop over parts, with a part key as its argument.
        "{% for m in messages %}{{ m.content | replace('text', 'TEXT') }}{% endfor %}",
        # A loop-like filter over something else than the content.
        "{% for t in (tools or []) | selectattr('type') %}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    ],
)
def test_filters_that_do_not_take_the_parts_apart_leave_the_content_a_string(template):
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    parts = validate_messages([{"role": "user", "content": [{"type": "text", "text": "a text"}]}])
    assert render_chat_template(template, parts).lower() == "a text"


def test_template_data_takes_numpy_scalars_and_none_but_not_arrays():
    import numpy as np

    from jaxinfer.tokenizer import check_chat_options

    def options(kwargs):
        return check_chat_options(kwargs, add_generation_prompt=True, continue_final_message=False)

    got = options({"a": None, "b": [np.float32(1.5), np.int64(3), np.bool_(True)]})
    assert got == {"a": None, "b": [1.5, 3, True]}
    assert [type(x) for x in got["b"]] == [float, int, bool]
    with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs\.x is a ndarray, which has no JSON form"):
        options({"x": np.array([1, 2])})


@pytest.mark.parametrize(
    "template",
    [
        # Kimi-K2-style: the parts are looped over through a variable set from the content.
        "{% macro body(msg) %}{% set c = msg.get('content') %}{% if c is string %}{{ c }}{% else %}"
        "{% for part in c %}[{{ part['text'] }}]{% endfor %}{% endif %}{% endmacro %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ body(m) }}</s>{% endfor %}",
        # The text parts picked with filters, no loop.
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
        "{{ m.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') }}{% endif %}"
        "</s>{% endfor %}",
    ],
)
def test_templates_that_take_parts_apart_without_a_loop_over_content_get_the_parts(tmp_path, template):
    """Content parts reach a template that handles them through an alias or filters as they are,
    as transformers passes them (they were joined into one string, as for a template that prints
    content: "Hello\nworld" instead of "[Hello][world]" / "Hello world")."""
    from jaxinfer.tokenizer import render_chat_template, validate_messages

    d = _chat_dir(tmp_path, "gemma")
    _edit_config(d, chat_template=template)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    conv = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Hi"}]
    text = render_chat_template(template, validate_messages(conv), add_generation_prompt=False)
    assert text == theirs.apply_chat_template(conv, tokenize=False)
    assert "Hello\nworld" not in text


NAMED_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
TOOL_USE_TEMPLATE = "{% for t in tools %}({{ t.function.name }}){% endfor %}" + NAMED_TEMPLATE


@pytest.mark.parametrize("layout", ["tokenizer_config", "files"])
def test_named_chat_templates_are_chosen_as_transformers_chooses_them(tmp_path, layout):
    """A checkpoint with named templates (tokenizer_config.json's list, or chat_template.jinja plus
    additional_chat_templates/NAME.jinja): "tool_use" when tools are passed, else "default" - and
    one with no "default" still loads (it was refused), its chat then needs tools."""
    from jaxinfer.tokenizer import check_tools, choose_chat_template, render_chat_template, validate_messages

    d = _chat_dir(tmp_path, "gemma")
    _edit_config(d, chat_template=None)
    if layout == "tokenizer_config":
        named = [{"name": "default", "template": NAMED_TEMPLATE}, {"name": "tool_use", "template": TOOL_USE_TEMPLATE}]
        _edit_config(d, chat_template=named)
    else:
        (d / "chat_template.jinja").write_text(NAMED_TEMPLATE)
        (d / "additional_chat_templates").mkdir()
        (d / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_TEMPLATE)
    ours, theirs = load_tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    assert set(ours.chat_templates) == {"default", "tool_use"} and ours.chat_template == NAMED_TEMPLATE
    conv = CONVERSATIONS[0]
    for tools in (None, [get_weather]):
        template = choose_chat_template(ours.chat_templates, tools=check_tools(tools))
        text = render_chat_template(template, validate_messages(conv), tools=check_tools(tools))
        assert text == theirs.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("(get_weather)")
    with pytest.raises(InvalidRequestError, match=r"named chat templates \['rag', 'tool_use'\] and no 'default'"):
        choose_chat_template({"rag": "x", "tool_use": "y"}, tools=None)
    assert choose_chat_template({"rag": "x", "tool_use": "y"}, tools=[]) == "y"


def test_a_checkpoint_whose_templates_have_no_default_loads_and_chats_with_tools(tmp_path):
    d = tmp_path / "m"
    save_hf_model(make_hf_model("llama2", vocab_size=512), d)
    _bpe_dir(d, GEMMA_SPECIALS, add_bos_token=True)
    _edit_config(d, chat_template=[{"name": "tool_use", "template": TOOL_USE_TEMPLATE}])
    llm = LLM(str(d), num_kv_pages=16, max_model_len=128, warmup=False)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert llm.generate(["Hello"], params)[0].token_ids
    with pytest.raises(InvalidRequestError, match=r"named chat templates \['tool_use'\] and no 'default'"):
        llm.chat(CONVERSATIONS[0], params)
    out = llm.chat(CONVERSATIONS[0], params, tools=[get_weather])[0]
    assert out.prompt.startswith("(get_weather)")


def test_llm_chat_takes_a_template_of_the_callers_or_one_named(tmp_path):
    """`chat(chat_template=...)`, as vLLM's LLM.chat and transformers' apply_chat_template take it:
    Jinja source (for a model without a template, or another format), or the name of one of the
    model's templates; a template that does not compile is the caller's bad request."""
    d = tmp_path / "m"
    save_hf_model(make_hf_model("llama2", vocab_size=512), d)
    _bpe_dir(d, GEMMA_SPECIALS, add_bos_token=True)
    _edit_config(d, chat_template=[{"name": "tool_use", "template": TOOL_USE_TEMPLATE}])
    llm = LLM(str(d), num_kv_pages=16, max_model_len=128, warmup=False)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    conv = CONVERSATIONS[0]
    own = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    for template, tools in ((own, None), ("tool_use", [get_weather])):
        out = llm.chat(conv, params, chat_template=template, tools=tools)[0]
        assert out.prompt == theirs.apply_chat_template(
            conv, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = llm.tokenizer.encode(out.prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.token_ids == llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
        assert out.finished and out.outputs[0].finished()
    assert llm.chat(conv, params, chat_template=own)[0].prompt.startswith("[user] ")
    ours = llm.get_tokenizer()  # as a vLLM script renders a prompt: the same text, the same template rules
    for template, tools in ((own, None), ("tool_use", [get_weather])):
        text = ours.apply_chat_template(
            conv, chat_template=template, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert text == llm.chat(conv, params, chat_template=template, tools=tools)[0].prompt
    for bad, message in (
        ("{% for %}", "chat_template does not compile: .* \\(line 1\\)"),
        ("  ", "chat_template must be a non-empty string: Jinja source, or the name of one of the model's templates"),
        (5, "chat_template must be a non-empty string"),
        ("{{ ''.__class__.__mro__ }}", "chat_template tried an unsafe operation"),  # jaxinfer's sandbox
    ):
        with pytest.raises(InvalidRequestError, match=message):
            llm.chat(conv, params, chat_template=bad)


# A tool-use and retrieval template in the manner of Llama 3.1 / Qwen 2.5 (written here): tools as
# indented JSON, documents numbered, assistant tool calls as JSON, tool results as their own turns,
# and a reasoning block read under Qwen 3's name (reasoning_content) or gpt-oss's (thinking).
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nFunctions you may call:\n"
    "{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% if documents %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking is defined %}<analysis>{{ m.thinking }}</analysis>{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{% endfor %}"
    "{% elif m.content is mapping %}{{ m.content | tojson }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


class Unit(enum.Enum):
    CELSIUS = "C"
    FAHRENHEIT = "F"


def get_weather(city: str, unit: Literal["C", "F"] = "C", days: int | None = None) -> float:
    """Current temperature in a city.

    Args:
        city: the city's name, spelled
            in English
        unit: the temperature scale
        days (int): how many days ahead, or none for now
    Returns:
        The temperature in the given unit.
    """


def search(
    query: str,
    k: int = 3,
    tags: list[str] | None = None,
    weights: dict[str, float] | None = None,
    span: tuple[int, float] = (0, 1.0),
    key: int | str = 1,
    unit: Unit = Unit.CELSIUS,
    extra: Any = None,
    exact: bool = False,
    mode: str = "fast",
):
    """Searches the corpus
    for passages.

    Args:
        query: what to look for
        k: how many passages
        tags: only passages with these tags
        weights: a weight per field
        span: where to look
        key: an id or a name
        unit: a scale
        extra: anything else
        exact: match the words exactly
        mode: how hard to look (choices: ["fast", "thorough"])
    """


class Calculator:
    def add(self, a: float, b: float) -> dict:
        """Adds two numbers.

        Args:
            a: the first
            b: the second
        """


def test_function_tools_are_described_as_transformers_describes_them():
    """A Python function passed as a tool becomes the JSON schema transformers' get_json_schema
    writes for it: types, defaults, enums from Literal / Enum / "(choices: ...)", unions, methods."""
    from transformers.utils import get_json_schema

    from jaxinfer.tool_schema import function_schema

    for fn in (get_weather, search, Calculator().add, pick, described_twice):
        assert function_schema(fn) == get_json_schema(fn), fn.__name__
    # A repeated section: the first one describes the arguments, as in transformers.
    assert function_schema(described_twice)["function"]["parameters"]["properties"]["a"]["description"] == "the number"
    assert function_schema(pick)["function"]["parameters"]["properties"]["mode"]["enum"] == ["fast", "slow"]
    assert function_schema(pick)["function"]["return"]["description"] == "the pick, on a line\n    and the next"
    weather = function_schema(get_weather)["function"]
    assert weather["parameters"]["required"] == ["city"]
    assert weather["parameters"]["properties"]["unit"] == {
        "type": "string",
        "enum": ["C", "F"],
        "description": "the temperature scale",
    }
    assert weather["parameters"]["properties"]["city"]["description"] == "the city's name, spelled in English"
    assert weather["return"] == {"type": "number", "description": "The temperature in the given unit."}


def pick(mode: str, size: int = 1) -> str:
    """Picks one.

    Args:
        mode: how (choices: [" fast", "slow "])
        size: how many
    Returns:
        the pick, on a line
        and the next
    """


def described_twice(a: int, b: str) -> int:
    """Joins a and b.

    Args:
        a: the number
        b: the text

    Args:
        a: a later, second description
        b: also ignored

    Returns:
        a and b joined
    """


def double(x: int, y: int = 0) -> int:
    """Doubles x.

    Args:
        x: the value
        y: an offset,
            added after
    Returns: twice x, plus y

    Examples:
        >>> double(2)
        4

    This function is pure.
    """


def test_docstring_sections_after_args_do_not_swallow_the_arguments():
    """Sections transformers' parser does not know (Examples:, a closing paragraph) end the Args
    block (a first version read them as part of it and lost every argument), and a Returns: with its
    text on the header's line is read (the two parsers differ there: see tool_schema's docstring)."""
    from jaxinfer.tool_schema import function_schema

    fn = function_schema(double)["function"]
    assert fn["description"] == "Doubles x."
    assert {k: v["description"] for k, v in fn["parameters"]["properties"].items()} == {
        "x": "the value",
        "y": "an offset, added after",
    }
    assert fn["return"] == {"type": "integer", "description": "twice x, plus y"}


def _no_docstring(x: int):
    pass


def _no_hint(x):
    """Has no hint.

    Args:
        x: a value
    """


def _undocumented(x: int, y: int):
    """Documents one argument.

    Args:
        x: a value
    """


def _custom_type(x: Calculator):
    """Takes an object.

    Args:
        x: a calculator
    """


def _one_tuple(x: tuple[int]):
    """Takes a one-element tuple (transformers refuses it too).

    Args:
        x: a value
    """


@pytest.mark.parametrize(
    "tools, message",
    [
        ("get_weather", r"tools must be a list"),
        ({"type": "function"}, r"tools must be a list"),
        ([{"type": "function"}, 3], r"tools\[1\] must be a JSON-schema dict or a function"),
        ([_no_docstring], r"tools\[0\]: tool '_no_docstring' has no docstring"),
        ([_no_hint], r"tools\[0\]: tool '_no_hint': argument 'x' has no type hint"),
        ([_undocumented], r"tools\[0\]: tool '_undocumented': argument 'y' has no description under Args:"),
        ([_custom_type], r"tools\[0\]: tool '_custom_type': argument 'x': type hint .*Calculator.* no JSON schema"),
        ([_one_tuple], r"tools\[0\]: tool '_one_tuple': argument 'x': tuple\[int\] has no fixed-length JSON form"),
        ([{"name": "x\udcff"}], r"tools\[0\]\.name"),
        ([{"function": {"tags": {"a"}}}], r"tools\[0\]\.function\.tags is a set, which has no JSON form"),
        ([{1: "x"}], r"tools\[0\] has a key that is not a string: 1"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": _contains_itself()}}],
            rf"^tools\[0\]\.function {_TOO_DEEP}",
        ),
    ],
)
def test_bad_tools_are_refused_by_field(chat_llm, tools, message):
    with pytest.raises(InvalidRequestError, match=message):
        chat_llm[0].chat(CONVERSATIONS[0], tools=tools)


@pytest.mark.parametrize(
    "documents, message",
    [
        ("text", r"documents must be a list of dicts"),
        ([{"title": "a", "text": "b"}, "c"], r"documents\[1\] must be a dict"),
        ([{"title": "a", "text": _nested(65)}], rf"^documents\[0\]\.text {_TOO_DEEP}"),
    ],
)
def test_bad_documents_are_refused_by_field(chat_llm, documents, message):
    with pytest.raises(InvalidRequestError, match=message):
        chat_llm[0].chat(CONVERSATIONS[0], documents=documents)


TOOL_CONVERSATION = [
    {"role": "user", "content": "How warm is Paris?"},
    {
        "role": "assistant",
        "reasoning": "The user wants the weather; call the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": {"temperature": 21.5}},  # a structured result, as Llama 3.1's template takes
    {"role": "assistant", "thinking": "Answer briefly.", "content": "21.5 degrees."},
    {"role": "user", "content": "And in Lyon?"},
]


def test_tools_documents_and_reasoning_reach_the_template_as_in_transformers(tmp_path):
    """tools (schema dicts and functions), documents, tool-call and tool-result messages, and
    reasoning under any of its three names render as transformers' apply_chat_template renders them
    (tools and documents were always None, a message's reasoning only under the name it was given)."""
    from jaxinfer.tokenizer import check_documents, check_tools, render_chat_template, validate_messages

    d = _chat_dir(tmp_path, "llama3")
    _edit_config(d, chat_template=TOOL_TEMPLATE)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    schema = {
        "type": "function",
        "function": {"name": "lookup", "description": "Looks a word up.", "parameters": {"type": "object"}},
    }
    # An enum member (a str mixin) is printed as its value, as transformers hands it over (not "City.LYON").
    city = enum.Enum("City", {"LYON": "Lyon"}, type=str)
    documents = [{"title": "Paris", "text": "The capital of France."}, {"title": city.LYON, "text": "On the Rhône."}]
    cases = [(None, None), ([get_weather, schema], None), (None, documents), ([search], documents)]
    for tools, docs in cases:
        for conv in [CONVERSATIONS[0], TOOL_CONVERSATION]:
            text = render_chat_template(
                ours.chat_template,
                validate_messages(conv),
                special_tokens=ours.special_tokens,
                tools=check_tools(tools),
                documents=check_documents(docs),
            )
            expected = theirs.apply_chat_template(
                conv, tools=tools, documents=docs, tokenize=False, add_generation_prompt=True
            )
            assert text == expected
    assert '"name": "search"' in text
    assert "[2] Lyon: On the Rhône." in text
    # "reasoning" reached a template reading reasoning_content (and thinking), "thinking" both too.
    assert "<think>The user wants the weather; call the tool.</think>" in text
    assert "<think>Answer briefly.</think><analysis>Answer briefly.</analysis>" in text
    assert '{"temperature": 21.5}<|eot_id|>' in text


def now(tz: str):
    """Time.

    Args:
        tz: zone
    """


def test_llm_chat_with_tools_generates_from_the_rendered_prompt(chat_llm):
    """LLM.chat(tools=, documents=) prompts with the ids transformers renders and tokenizes (through
    a terser template than TOOL_TEMPLATE: this tokenizer's small vocabulary spells JSON out)."""
    llm, d = chat_llm
    template = (
        "{% for t in tools %}{{ t.function.name }}({{ t.function.parameters.properties | list | join(',') }})"
        "{% endfor %}{% for d in documents %}[{{ d.title }}]{% endfor %}"
        "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
        "<start_of_turn>model\n"
    )
    theirs = transformers.AutoTokenizer.from_pretrained(str(d), chat_template=template)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    conv = [{"role": "user", "content": "Time?"}]
    documents = [{"title": "N", "text": "Late."}]
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = template
    try:
        out = llm.chat(conv, params, tools=[now], documents=documents)[0]
    finally:
        llm.tokenizer.chat_template = saved
    kw = dict(tools=[now], documents=documents, add_generation_prompt=True)
    ids = theirs.apply_chat_template(conv, return_dict=False, **kw)
    assert out.prompt_token_ids == ids and out.prompt.startswith("now(tz)[N]<start_of_turn>user")
    assert out.token_ids == llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids


def test_model_without_chat_template_is_refused(tmp_path):
    save_hf_model(make_hf_model("llama2", vocab_size=512), tmp_path)
    _bpe_dir(tmp_path)
    llm = LLM(str(tmp_path), num_kv_pages=16, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_tokenizer_settings_files_must_hold_objects(tmp_path):
    _bpe_dir(tmp_path)
    config = (tmp_path / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="must hold JSON objects"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(config)
    (tmp_path / "special_tokens_map.json").write_text('"<s>"')
    with pytest.raises(CheckpointError, match="must hold JSON objects"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("entry", [{"name": "x", "template": 5}, {"name": 5, "template": "{{ 1 }}"}])
def test_a_named_chat_template_needs_a_string_name_and_text(tmp_path, entry):
    _bpe_dir(tmp_path)
    _edit_config(tmp_path, chat_template=[{"name": "default", "template": "{{ 1 }}"}, entry])
    with pytest.raises(CheckpointError, match="must be a string with a string name"):
        load_tokenizer(str(tmp_path))


def test_only_jinja_files_of_the_named_template_folder_are_templates(tmp_path):
    _bpe_dir(tmp_path)
    extra = tmp_path / "additional_chat_templates"
    (extra / "folder.jinja").mkdir(parents=True)
    (extra / "README.md").write_text("not a template")
    (extra / "rag.jinja").write_text("{{ 2 }}")
    assert load_tokenizer(str(tmp_path)).chat_templates == {"rag": "{{ 2 }}"}


def test_prompt_size_bound_refuses_before_encoding_and_never_a_text_that_fits(monkeypatch):
    """With one byte per token at most, 8 tokens take 8 ASCII characters; 5 two-byte characters (10
    bytes) cannot fit, and are refused without running the tokenizer."""
    from jaxinfer.tokenizer import ByteTokenizer, encode_prompt

    tok = ByteTokenizer()
    assert len(encode_prompt(tok, "a" * 8, max_tokens=8, field="p", add_special_tokens=False)) == 8
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: pytest.fail("encoded a text that cannot fit"))
    for text in ("a" * 9, "é" * 5):
        with pytest.raises(InvalidRequestError, match="p"):
            encode_prompt(tok, text, max_tokens=8, field="p")


def test_prompt_size_bound_only_where_no_token_can_fold_a_run_of_text(tmp_path):
    """A SentencePiece model without byte fallback folds a run of unknown characters of any length
    into one <unk>: 4,200 bytes of rare CJK are a few tokens, and were refused as unable to fit in
    100. Such tokenizers have no byte bound; ones with all 256 byte pieces keep it."""
    from jaxinfer.tokenizer import SentencePieceTokenizer, encode_prompt, load_tokenizer

    text = "鬱龘齉爨癵驫麤" * 200
    no_fallback = SentencePieceTokenizer(train_sentencepiece(tmp_path))
    assert no_fallback.max_token_bytes is None
    ids = encode_prompt(no_fallback, text, max_tokens=100, field="p")
    assert ids == no_fallback.encode(text) and len(ids) < 10
    # Unbounded, a text is encoded and counted (Tokenize returned more tokens than the prompt limit).
    with pytest.raises(InvalidRequestError, match=r"^p: prompt has \d+ tokens; the limit is max_model_len - 1 = 5$"):
        encode_prompt(no_fallback, "the quick fox " * 4, max_tokens=5, field="p")
    (tmp_path / "fallback").mkdir()
    fallback = load_tokenizer(str(_spm_dir(tmp_path / "fallback")))
    assert fallback.max_token_bytes is not None and len(fallback.encode(text)) > 100
    with pytest.raises(InvalidRequestError, match="4200 bytes of text cannot fit in 100 tokens"):
        encode_prompt(fallback, text, max_tokens=100, field="p")


def test_byte_tokenizer_decodes_every_byte_id_and_nothing_else():
    from jaxinfer.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    assert tok.decode([0, 1, 2, tok.OFFSET, tok.OFFSET + ord("a"), tok.vocab_size, tok.vocab_size + 1]) == "\x00a"
    assert tok.decode([tok.vocab_size - 1]) == "\ufffd"  # byte 0xff alone is no UTF-8
