"""Parity with Hugging Face transformers on random-weight checkpoints written by save_pretrained."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_models import FAMILIES, GEMMA_FAMILIES, make_hf_gemma, make_hf_model, random_hf_model, save_hf_model

from jaxinfer import LLM, InvalidRequestError, SamplingParams
from jaxinfer.kv_cache import Batch, KVCache
from jaxinfer.loading import load_hf_checkpoint
from jaxinfer.model import decode_step, prefill

PROMPT = [1, 17, 33, 5, 90, 64, 12, 101, 7, 45, 88, 3, 19, 27, 56, 120, 9, 77]
NEW = 14


def _jax_logits(cfg, params, tokens, prompt_len, page_size=4):
    """Prefill the prompt, then teacher-force the rest one token at a time; logits per step."""
    total = len(tokens)
    pages = -(-total // page_size)
    # Deliberately non-contiguous, shuffled pages, with an unused column at the end.
    table = np.zeros((1, pages + 1), np.int32)
    table[0, :pages] = np.random.RandomState(1).permutation(np.arange(1, pages + 1)) + 2
    cache = KVCache.create(cfg, num_pages=pages + 4, page_size=page_size)
    batch = Batch(
        tokens=jnp.asarray([tokens[:prompt_len]], jnp.int32),
        q_lens=jnp.array([prompt_len]),
        kv_lens=jnp.array([prompt_len]),
        page_table=jnp.asarray(table),
    )
    logits, cache = prefill(params, cache, batch, cfg=cfg)
    out = [np.asarray(logits[0])]
    for pos in range(prompt_len, total):
        batch = Batch(
            tokens=jnp.asarray([[tokens[pos]]], jnp.int32),
            q_lens=jnp.array([1]),
            kv_lens=jnp.array([pos + 1]),
            page_table=jnp.asarray(table),
        )
        logits, cache = decode_step(params, cache, batch, cfg=cfg)
        out.append(np.asarray(logits[0]))
    return np.stack(out)


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_match_transformers(family, tmp_path):
    hf = make_hf_model(family)
    save_hf_model(hf, tmp_path)
    hf_tokens = _hf_greedy(hf, PROMPT, NEW)
    full = PROMPT + hf_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].float().numpy()  # [T, V]
    cfg, params = load_hf_checkpoint(str(tmp_path))
    ours = _jax_logits(cfg, params, full[:-1], len(PROMPT))
    expected = ref[len(PROMPT) - 1 : -1]
    np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=2e-4)

    # Small pages and a 16-token budget (chunked prefill). Mistral's 8-key window lets the sequence (8
    # pages of 4) run in a cache of 7: it holds only its window's pages, giving back the ones before.
    pages = 8 if cfg.kv_window else 64
    llm = LLM(str(tmp_path), num_kv_pages=pages, page_size=4, max_num_batched_tokens=16)
    out = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.token_ids == hf_tokens
    assert out.finish_reason == "length"


@pytest.mark.parametrize("family", [*FAMILIES, *GEMMA_FAMILIES])
def test_rope_frequencies_are_transformers_to_the_bit(family, tmp_path):
    """RoPE's per-pair frequencies equal transformers' float32 buffers bit for bit, scaled kinds and
    Gemma's local tables included. They were computed in float64 and rounded once, 1-2 ulp off on some
    pairs: an angle error that grows with the position (4e-4 in the log-probs at 2k tokens, 1e-3 at
    7k, where HF's own float32 noise is ~1e-5; these tests' short prompts never saw it)."""
    from jaxinfer.config import load_hf_config, rope_inv_freq

    hf = make_hf_gemma(family) if family in GEMMA_FAMILIES else make_hf_model(family)
    save_hf_model(hf, tmp_path)
    cfg = load_hf_config(str(tmp_path))
    rotary = hf.model.rotary_emb
    buffers = {name: b for name, b in rotary.named_buffers() if name.endswith("inv_freq") and "original" not in name}
    assert buffers, list(dict(rotary.named_buffers()))
    for name, theirs in buffers.items():
        local = name.startswith("sliding")
        ours = rope_inv_freq(cfg, local=local)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours.view(np.int32), theirs.numpy().view(np.int32), err_msg=name)


@pytest.mark.parametrize("seed", range(8))
def test_random_configurations_match_transformers(seed, tmp_path):
    """Configurations no hand-written case above holds, drawn at random (`random_hf_model`: family,
    group size, head size, tying, biases, RoPE scaling, window; page size, step budget, batch limit,
    attention backend): three prompts of 1-39 tokens through one engine, each greedy token HF's
    argmax on the same sequence and its log-probability HF's to float32 tolerance. An argmax may
    differ only where HF's own top two logits tie within rounding. Seeds 0-7 cover the four
    families and the three backends; a 2026-11-28 sweep of 74 more passed too (WORKSPACE.md)."""
    family, hf, engine = random_hf_model(seed)
    save_hf_model(hf, tmp_path)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in rng.integers(1, 40, 3)]
    llm = LLM(str(tmp_path), num_kv_pages=64, **engine)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompt_token_ids=prompts, sampling_params=params)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].double(), -1).numpy()
        ref = ref[len(prompt) - 1 : -1]  # the distribution each generated token was drawn from
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            top2 = np.sort(ref[i])[-2:]
            assert token == ref[i].argmax() or top2[1] - top2[0] < 1e-4, (family, engine, i)
            assert lp.logprob == pytest.approx(ref[i][token], abs=1e-4), (family, engine, i)


def test_sliding_window_is_active():
    """The Mistral case above only proves parity if the window changes the result: check it does."""
    import dataclasses

    from jaxinfer.config import GlobalAttention

    hf = make_hf_model("mistral-swa")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_hf_model(hf, d)
        cfg, params = load_hf_checkpoint(d)
    assert cfg.attention_kind(0).window == 8
    tokens = PROMPT + PROMPT
    windowed = _jax_logits(cfg, params, tokens, len(tokens))
    cfg_global = dataclasses.replace(cfg, layer_attention=(GlobalAttention(),) * cfg.num_layers)
    unwindowed = _jax_logits(cfg_global, params, tokens, len(tokens))
    assert np.abs(windowed - unwindowed).max() > 1e-3


# Keys users add to, or leave in, a saved config.json by hand, with what transformers makes of them.
# Each once loaded silently into different logits (found by a fuzz against transformers 5).
EDITED_CONFIGS = {
    # Model cards say "add rope_scaling to config.json": it replaces a v5 rope_parameters (base: the
    # top-level rope_theta, else the default), and merges into Gemma 3's global-layer RoPE.
    "qwen2+rope_scaling-yarn": (
        "qwen2",
        dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16)),
    ),
    "llama+rope_scaling-linear": ("llama2", dict(rope_theta=1000.0, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "gemma3+rope_scaling-linear": ("gemma3_text", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    # A top-level original_max_position_embeddings overrides the YaRN object's (Phi-3-style configs).
    "llama+yarn-toplevel-original": (
        "llama2",
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=64),
            original_max_position_embeddings=16,
        ),
    ),
    # Llama and Gemma 1 have no sliding window. A Mistral config with layer_types is read as Ministral's
    # by transformers' AutoConfig, whose layers follow the list (only the second is windowed here).
    "llama+stray-window": (
        "llama2",
        dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma+stray-window": ("gemma", dict(sliding_window=6)),
    "mistral+layer_types": ("mistral-swa", dict(layer_types=["full_attention", "sliding_attention"])),
    "mistral+layer_types-null": ("mistral-swa", dict(layer_types=None)),
    "ministral": (
        "mistral-swa",
        dict(model_type="ministral", architectures=["MinistralForCausalLM"], layer_types=["sliding_attention"] * 2),
    ),
    # Gemma 3's layers come from sliding_window_pattern alone (default 6: both layers windowed here);
    # the private _sliding_window_pattern transformers also writes never shapes them.
    "gemma3+rope_parameters-empty": ("gemma3_text", dict(rope_parameters={})),
    "gemma3+private-pattern-only": (
        "gemma3_text",
        dict(layer_types=None, sliding_window_pattern=None, _sliding_window_pattern=2),
    ),
    # Qwen 2's max_window_layers defaults to 28: with fewer layers, use_sliding_window windows none.
    "qwen2+window-no-max_window_layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=None, layer_types=None),
    ),
    # Qwen 2 always has q/k/v biases and no o bias; Mistral none: both ignore attention_bias.
    "qwen2+attention_bias": ("qwen2", dict(attention_bias=True)),
    "mistral+attention_bias": ("mistral-swa", dict(attention_bias=True)),
    # Only Llama's MLP reads mlp_bias: transformers builds the others' without biases whatever it says.
    "qwen3+mlp_bias": ("qwen3", dict(mlp_bias=True)),
}


@pytest.mark.parametrize("case", list(EDITED_CONFIGS))
def test_hand_edited_configs_read_as_transformers_reads_them(case, tmp_path):
    from hf_models import GEMMA_FAMILIES, make_hf_gemma

    family, edit = EDITED_CONFIGS[case]
    gemma = family in GEMMA_FAMILIES
    save_hf_model(make_hf_gemma(family) if gemma else make_hf_model(family), tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key, value in edit.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    _assert_logits_as_transformers_reads(tmp_path, (GEMMA_FAMILIES if gemma else FAMILIES)[family][1], 14)


def _assert_logits_as_transformers_reads(path, model_cls: str, new: int) -> None:
    """transformers' AutoModelForCausalLM loads `path` (as `model_cls`, or whatever its AutoConfig makes
    of the edited file: a Mistral config with layer_types is a Ministral one); jaxinfer loads the same
    directory; prompt + `new` teacher-forced tokens give the same logits."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    ministral = config.get("model_type") == "ministral" or (
        config.get("model_type") == "mistral" and "layer_types" in config
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ("MinistralForCausalLM" if ministral else model_cls)
    tokens = PROMPT + PROMPT[:new]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float().numpy()
    cfg, params = load_hf_checkpoint(str(path))
    ours = _jax_logits(cfg, params, tokens, len(PROMPT))
    np.testing.assert_allclose(ours, ref[len(PROMPT) - 1 :], atol=2e-4, rtol=2e-4)


def _tied_config_distinct_head(d):
    """A fine-tune that trained its own head but kept the tie flag in config.json."""
    config = json.loads((d / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(config))


def _tied_only_head_stored(d):
    """A tied model saved with safetensors' save_model: only one of the two shared tensors is kept."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "family, tie, edit",
    [
        ("llama2", False, _tied_config_distinct_head),
        ("llama2", True, _tied_only_head_stored),
    ],
    ids=["tied-config-distinct-head", "tied-only-head-stored"],
)
def test_tying_follows_the_stored_tensors_as_transformers_does(family, tie, edit, tmp_path):
    """transformers 5 ties the head to the embedding only when the checkpoint agrees: a stored head
    that differs is used untied, and a lone stored head is the embedding too."""
    save_hf_model(make_hf_model(family, tie_word_embeddings=tie), tmp_path)
    edit(tmp_path)
    _assert_logits_as_transformers_reads(tmp_path, FAMILIES[family][1], 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_sharded_half_precision_checkpoint(tmp_path, dtype):
    """bf16 / fp16 weights split over several files with an index load exactly (as float32 compute)."""
    hf = make_hf_model("llama2")
    save_hf_model(hf, tmp_path, dtype=dtype, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    hf32 = hf.to(torch.float32)  # rounded weights, float32 maths: what we do with dtype=float32
    hf_tokens = _hf_greedy(hf32, PROMPT, NEW)
    llm = LLM(str(tmp_path), num_kv_pages=64)
    out = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.token_ids == hf_tokens


def test_bfloat16_compute_close_to_transformers(tmp_path):
    hf = make_hf_model("llama3.2-tied")
    save_hf_model(hf, tmp_path, dtype=torch.bfloat16)
    hfb = hf.to(torch.bfloat16)
    with torch.no_grad():
        ref = hfb(torch.tensor([PROMPT])).logits[0, -1].float().numpy()
    cfg, params = load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
    assert params["embedding"].dtype == jnp.bfloat16
    ours = _jax_logits(cfg, params, PROMPT, len(PROMPT))[0]
    # bf16 keeps ~3 significant digits; compare against the logit scale.
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert np.argmax(ours) == np.argmax(ref)


@pytest.mark.parametrize("family", ["qwen2", "llama3.2-tied"])
def test_bfloat16_kv_cache_holds_what_transformers_caches(family, tmp_path):
    """In bfloat16 the first layer's cached K and V (after RoPE) are transformers' own, bit for bit:
    same embedding, norm, projections (a bias joins the float32 sum before the one rounding, as
    nn.Linear does) and rotation. Adding Qwen2's biases after a bfloat16 rounding made ~30% differ."""
    import transformers

    save_hf_model(make_hf_model(family), tmp_path, dtype=torch.bfloat16)
    # Loaded as users load it (`.to(bfloat16)` would round RoPE's inverse frequencies as well).
    hfb = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        past = hfb(torch.tensor([PROMPT]), use_cache=True).past_key_values
    theirs = [x[0].float().numpy() for x in (past.layers[0].keys, past.layers[0].values)]  # [K, T, H]
    cfg, params = load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
    page_size, n = 4, len(PROMPT)
    pages = -(-n // page_size)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]
    cache = KVCache.create(cfg, num_pages=pages + 1, page_size=page_size)
    batch = Batch(
        tokens=jnp.asarray([PROMPT], jnp.int32), q_lens=jnp.array([n]), kv_lens=jnp.array([n]), page_table=table
    )
    _, cache = prefill(params, cache, batch, cfg=cfg)
    for pool, ref in zip((cache.k[0], cache.v[0]), theirs):
        ours = np.asarray(pool[:, table[0]].astype(jnp.float32))  # [K, pages, S, H]
        ours = ours.reshape(ours.shape[0], -1, ours.shape[-1])[:, :n]
        assert np.mean(ours == ref) > 0.999, np.mean(ours == ref)


@pytest.mark.parametrize("via", ["stop_token_ids", "eos"])
def test_min_tokens_matches_transformers_min_new_tokens(via, tmp_path):
    """SamplingParams.min_tokens against transformers' min_new_tokens: the stop id cannot be drawn
    before, so greedy takes the next best token there, and stops at the stop id after."""
    hf = make_hf_model("llama3.1")
    free = _hf_greedy(hf, PROMPT, NEW)
    # A token greedy picks third and not before: without min_tokens generation ends after two.
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    at = free.index(stop)
    if via == "eos":
        hf.config.eos_token_id = hf.generation_config.eos_token_id = stop
    save_hf_model(hf, tmp_path)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW,
            do_sample=False,
            min_new_tokens=at + 3,
            eos_token_id=stop,
            pad_token_id=0,
        )
    hf_tokens = out[0, len(PROMPT) :].tolist()
    expected = hf_tokens[:-1] if hf_tokens[-1] == stop else hf_tokens  # we never emit the stop token
    assert stop not in expected and len(expected) >= at + 3

    llm = LLM(str(tmp_path), num_kv_pages=64, page_size=4, max_num_batched_tokens=16)
    kw = dict(max_tokens=NEW, temperature=0.0)
    kw.update(stop_token_ids=[stop], ignore_eos=True) if via == "stop_token_ids" else None
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**kw))[0]
    assert plain.token_ids == free[:at] and plain.finish_reason == "stop"
    ours = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(min_tokens=at + 3, **kw))[0]
    assert ours.token_ids == expected
    assert ours.finish_reason == ("stop" if hf_tokens[-1] == stop else "length")


@pytest.mark.parametrize("case", ["logit_bias+repetition_penalty", "allowed_token_ids", "both+min_tokens"])
def test_logit_bias_and_allowed_token_ids_match_transformers(case, tmp_path):
    """logit_bias against transformers' sequence_bias (single-token sequences), added before the
    repetition penalty as there; allowed_token_ids against a prefix_allowed_tokens_fn that always
    allows the same ids; greedy, token for token."""
    hf = make_hf_model("llama3.1")
    save_hf_model(hf, tmp_path)
    free = _hf_greedy(hf, PROMPT, NEW)
    # Push greedy off its own path (its first and third tokens), towards prompt tokens (which the
    # repetition penalty then divides: the order of the two matters).
    bias = {free[0]: -100.0, free[2]: -6.0, PROMPT[3]: 3.0, PROMPT[7]: 2.5}
    allowed = sorted({*range(0, 128, 3), free[1], PROMPT[3]})
    kw, hf_kw = dict(max_tokens=NEW, temperature=0.0, ignore_eos=True), dict(min_new_tokens=NEW)
    if "bias" in case or case.startswith("both"):
        kw["logit_bias"] = bias
        hf_kw["sequence_bias"] = {(t,): b for t, b in bias.items()}
    if case == "logit_bias+repetition_penalty":
        kw["repetition_penalty"] = hf_kw["repetition_penalty"] = 1.4
    if "allowed" in case or case.startswith("both"):
        kw["allowed_token_ids"] = allowed
        hf_kw["prefix_allowed_tokens_fn"] = lambda batch_id, ids: allowed
    if case.startswith("both"):  # EOS, allowed: banned for 5 tokens, then it may end the output
        kw.update(ignore_eos=False, min_tokens=5)
        hf_kw["min_new_tokens"] = 5
        hf.config.eos_token_id = hf.generation_config.eos_token_id = allowed[1]
        save_hf_model(hf, tmp_path)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, **hf_kw)
    hf_tokens = out[0, len(PROMPT) :].tolist()
    if case.startswith("both") and allowed[1] in hf_tokens:
        hf_tokens = hf_tokens[: hf_tokens.index(allowed[1])]  # we never emit the stop token
    assert hf_tokens != free[: len(hf_tokens)]
    if "allowed" in case or case.startswith("both"):
        assert set(hf_tokens) <= set(allowed)
    llm = LLM(str(tmp_path), num_kv_pages=64, page_size=4, max_num_batched_tokens=16)
    ours = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**kw))[0]
    assert ours.token_ids == hf_tokens
    if case.startswith("both"):  # (this checkpoint has no tokenizer)
        with pytest.raises(InvalidRequestError, match="SamplingParams.bad_words needs the model's tokenizer"):
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(bad_words=["x"]))


@pytest.mark.parametrize("length", [2, 1])
def test_bad_words_match_transformers_bad_words_ids(length, tmp_path):
    """bad_words against transformers' bad_words_ids, greedy, token for token: a word of the
    free-running output made of `length` tokens, as the tokenizer encodes it alone and after a space.
    Greedy runs as before up to the word's first appearance, then takes another way there."""
    from hf_models import train_sentencepiece

    from jaxinfer.tokenizer import SentencePieceTokenizer

    hf = make_hf_model("llama3.1", vocab_size=36)  # the tokenizer's vocabulary
    save_hf_model(hf, tmp_path)
    tok = SentencePieceTokenizer(train_sentencepiece(tmp_path, vocab_size=36))
    prompt = tok.encode("darkness upon")  # (a prompt whose greedy output does not fall into UNK tokens)
    free = _hf_greedy(hf, prompt, NEW)
    llm = LLM(str(tmp_path), num_kv_pages=64, page_size=4, max_num_batched_tokens=16)

    def word_of(span):
        """The word whose tokens (alone or after a space) are exactly `span`, if any."""
        word = tok.decode(list(span)).strip()
        return word if word and span in llm.engine.bad_word_ids((word,)) else None

    at, word = next((i, w) for i in range(NEW - length + 1) if (w := word_of(tuple(free[i : i + length]))))
    ids = llm.engine.bad_word_ids((word,))
    assert len(ids) <= 2 and all(len(w) >= 1 for w in ids)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            bad_words_ids=[list(w) for w in ids],
        )
    hf_tokens = out[0, len(prompt) :].tolist()
    last = at + length - 1  # where the word's last token was drawn
    assert hf_tokens[:last] == free[:last] and hf_tokens[last] != free[last]
    p = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, bad_words=[word])  # EOS banned, as there
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids == hf_tokens


@pytest.mark.parametrize("family", ["llama3.2-tied", "mistral-swa", "gemma3_text"])
def test_prompt_logprobs_match_transformers(family, tmp_path):
    """prompt_logprobs against transformers' log-softmax of a full forward over the prompt: every
    prompt token's log-probability and the top 5 at its position. The prompt (35 tokens) runs in
    16-token chunks over 4-token pages; a tied head, a sliding window (Mistral) and a hybrid model
    with a final logit softcap (Gemma 3) each take their own path. The prompt is in the prefix cache
    already: sample 0 computes it all the same, sample 1 (n=2) reads it from there."""
    hf = make_hf_gemma(family) if family in GEMMA_FAMILIES else make_hf_model(family)
    save_hf_model(hf, tmp_path)
    prompt = PROMPT + PROMPT[::-1][1:]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()  # [T, V]
    llm = LLM(str(tmp_path), num_kv_pages=64, page_size=4, max_num_batched_tokens=16)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=plain)  # fills the prefix cache

    def hits():
        return llm.engine.stats()["prefix_cache_hit_tokens"]

    before = hits()
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=plain)[0]
    one_sample_hit = hits() - before
    assert one_sample_hit > 0
    before = hits()
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, n=2, prompt_logprobs=5, logprobs=3)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0]
    assert hits() - before == one_sample_hit  # sample 1's; sample 0 read nothing from the cache

    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == prompt[1:]
    positions = np.arange(len(prompt) - 1)
    np.testing.assert_allclose([lp.logprob for lp in lps[1:]], ref[positions, prompt[1:]], atol=2e-4)
    for pos, lp in zip(positions, lps[1:]):
        ids = list(lp.top)
        assert len(ids) == 5
        np.testing.assert_allclose(list(lp.top.values()), ref[pos, ids], atol=2e-4)  # each its own value
        fifth = np.sort(ref[pos])[-5]
        assert min(lp.top.values()) >= fifth - 2e-4  # and they are the top 5, most likely first
        assert list(lp.top.values()) == sorted(lp.top.values(), reverse=True)
    # Asking for them changes nothing else: the same tokens, and the first one's logprob is the
    # prompt's next-position distribution too.
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == first.token_ids
    np.testing.assert_allclose(out.outputs[0].logprobs[0].logprob, ref[-1, first.token_ids[0]], atol=2e-4)


def test_skip_special_tokens_false_writes_them_as_transformers_decodes(tmp_path):
    """skip_special_tokens=False: the same tokens, and the text as transformers decodes the prompt and
    output with skip_special_tokens=False (past the prompt's own text), streamed or not; a stop string
    may then be a special token's text. A bias on BOS and EOS (ignore_eos) mixes them into the output."""
    import transformers
    from hf_models import train_sentencepiece

    hf = make_hf_model("llama3.1", vocab_size=36)  # the tokenizer's vocabulary
    save_hf_model(hf, tmp_path)
    train_sentencepiece(tmp_path, vocab_size=36)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), num_kv_pages=64, page_size=4)
    prompt = llm.tokenizer.encode("darkness upon")
    p = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logit_bias={1: 2.0, 2: 2.0})
    keep = dataclasses.replace(p, skip_special_tokens=False)
    skipped = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0]
    kept = llm.generate(prompt_token_ids=[prompt], sampling_params=keep)[0]
    ids = kept.token_ids
    assert ids == skipped.token_ids and 2 in ids and len(set(ids) - {1, 2}) >= 3

    def hf_text(skip):
        before = theirs.decode(prompt, skip_special_tokens=skip)
        return theirs.decode(prompt + ids, skip_special_tokens=skip)[len(before) :]

    assert skipped.text == hf_text(True) and "</s>" not in skipped.text
    assert kept.text == hf_text(False) and "</s>" in kept.text
    assert "".join(d.text for d in llm.stream({"prompt_token_ids": prompt}, keep)) == kept.text
    stopped = llm.generate(prompt_token_ids=[prompt], sampling_params=dataclasses.replace(keep, stop=["</s>"]))[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "</s>")
    assert stopped.text == kept.text[: kept.text.index("</s>")]
