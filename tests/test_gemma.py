"""Gemma 1, 2 and 3 (text): parity with transformers on random-weight checkpoints, and refusals by name."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_models import GEMMA_FAMILIES, GEMMA_TINY, make_hf_gemma, save_hf_model
from test_hf_parity import _hf_greedy, _jax_logits

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import (
    GlobalAttention,
    LinearRopeScaling,
    SlidingWindow,
    from_hf_config,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.kv_cache import Batch, KVCache
from jaxinfer.loading import load_hf_checkpoint
from jaxinfer.model import abstract_params, forward

PROMPT = [1, 17, 33, 5, 90, 64, 12, 101, 7, 45, 88, 3, 19, 27, 56, 120, 9, 77]  # 18 tokens > window 6
NEW = 12
PAGE_SIZE = 4  # the prompt and the decode steps cross several pages

# How each family is written: one sharded over several files, one in bfloat16, one plain.
SAVES = {
    "gemma": dict(max_shard_size="40KB"),
    "gemma2": dict(dtype=torch.bfloat16),
    "gemma3_text": dict(),
}


def _load_family(family, path):
    hf = make_hf_gemma(family)
    save_hf_model(hf, path, **SAVES[family])
    if SAVES[family].get("max_shard_size"):
        assert (path / "model.safetensors.index.json").exists()
        assert len(list(path.glob("*.safetensors"))) > 1
    if SAVES[family].get("dtype") is not None:
        # Compare in float32 on the bf16-rounded weights. Reload rather than cast back: the cast
        # would also have rounded transformers' RoPE frequency buffers.
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        assert hf.model.embed_tokens.weight.dtype == torch.float32
    return hf.eval()


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_logits_and_greedy_match_transformers(family, tmp_path):
    hf = _load_family(family, tmp_path)
    hf_tokens = _hf_greedy(hf, PROMPT, NEW)
    full = PROMPT + hf_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].float().numpy()  # [T, V]

    cfg, params = load_hf_checkpoint(str(tmp_path))
    assert cfg.family == family.removesuffix("_text")
    ours = _jax_logits(cfg, params, full[:-1], len(PROMPT), page_size=PAGE_SIZE)
    np.testing.assert_allclose(ours, ref[len(PROMPT) - 1 : -1], atol=2e-4, rtol=2e-4)

    llm = LLM(str(tmp_path), page_size=PAGE_SIZE, num_kv_pages=64)
    out = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.token_ids == hf_tokens


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_window_pools_of_a_hybrid_model_match_transformers(family, tmp_path):
    """With few sequences and small chunks the sliding-window layers get pools of their own (7 pages
    per sequence at most, against up to 16 for the global layers); two prompts several windows
    long, in one batch, still continue exactly as transformers continues each."""
    hf = _load_family(family, tmp_path)
    prompts = [PROMPT, (PROMPT * 3)[5:50]]
    want = [_hf_greedy(hf, q, NEW) for q in prompts]
    llm = LLM(str(tmp_path), page_size=PAGE_SIZE, num_kv_pages=64, max_num_seqs=2, max_num_batched_tokens=16)
    stats = llm.stats()
    assert stats["kv_window_pages_total"] == 2 * ((6 - 1 + 16) // PAGE_SIZE + 2)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)] == want
    stats = llm.stats()
    assert stats["kv_window_pages_free"] == stats["kv_window_pages_total"]


def _eager_logits(cfg, params, tokens):
    """Last-position logits of one prefill, op by op: no whole-model compile per variant."""
    n = len(tokens)
    pages = -(-n // PAGE_SIZE)
    batch = Batch(
        tokens=jnp.asarray([tokens], jnp.int32),
        q_lens=jnp.array([n]),
        kv_lens=jnp.array([n]),
        page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
    )
    logits, _ = forward(params, KVCache.create(cfg, num_pages=pages + 1, page_size=PAGE_SIZE), batch, cfg=cfg)
    return np.asarray(logits[0])


def _variants(cfg):
    """Configs with one Gemma option switched off each: the parity test above is only evidence for
    an option if switching it off changes the logits."""
    out = {
        "embed_scale": dict(embed_scale=False),
        "norm_unit_offset": dict(norm_unit_offset=False),
        "mlp_activation": dict(mlp_activation="silu"),
    }
    if cfg.layer_attention:
        out["layer_attention"] = dict(layer_attention=(GlobalAttention(),) * cfg.num_layers)
    for field in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "local_rope_theta"):
        if getattr(cfg, field) is not None:
            out[field] = {field: None}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(rope_scaling=None)
    if cfg.post_norms:
        out["post_norms"] = dict(post_norms=False)
    return out


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_every_option_changes_the_logits(family, tmp_path):
    save_hf_model(make_hf_gemma(family), tmp_path)
    cfg, params = load_hf_checkpoint(str(tmp_path))
    tokens = PROMPT + PROMPT[:8]
    base = _eager_logits(cfg, params, tokens)
    variants = _variants(cfg)
    expected = {"embed_scale", "norm_unit_offset", "mlp_activation", "layer_attention", "post_norms"}
    expected |= {"final_logit_softcap", "query_pre_attn_scalar"}
    expected |= {"attn_logit_softcap"} if family == "gemma2" else {"local_rope_theta", "rope_scaling"}
    assert set(variants) == expected
    for name, change in variants.items():
        p = params
        if name == "post_norms":  # the parameter tree loses the two post norms
            p = jax.tree.map(lambda x: x, params)
            for i in range(cfg.num_layers):
                del p[f"layer_{i}"]["attn_post_norm"], p[f"layer_{i}"]["mlp_post_norm"]
        other = _eager_logits(dataclasses.replace(cfg, **change), p, tokens)
        assert np.abs(other - base).max() > 1e-3, name


def test_configs_convert():
    def convert_dict(family, **kw):
        cfg_cls, _, extra = GEMMA_FAMILIES[family]
        return getattr(transformers, cfg_cls)(**{**GEMMA_TINY, **extra, **kw}).to_dict()

    def convert(family, **kw):
        return from_hf_config(convert_dict(family, **kw))

    c = convert("gemma")
    assert (c.family, c.mlp_activation, c.embed_scale, c.norm_unit_offset) == ("gemma", "gelu_tanh", True, True)
    assert c.tie_word_embeddings and not c.post_norms and c.head_dim == 32 and c.layer_attention == ()
    assert c.attention_scale == 32**-0.5 and c.final_logit_softcap is None and c.attn_logit_softcap is None

    c = convert("gemma2")
    assert c.post_norms and not c.qk_norm and c.attention_scale == 24**-0.5
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (2.0, 2.0)
    assert [c.attention_kind(i) for i in range(2)] == [SlidingWindow(6), GlobalAttention()]
    # Configs written before layer_types: even layers local.
    c = from_hf_config({**convert_dict("gemma2", num_hidden_layers=4), "layer_types": None})
    assert [c.attention_kind(i) for i in range(4)] == [SlidingWindow(6), GlobalAttention()] * 2

    c = convert("gemma3_text")
    assert c.family == "gemma3" and c.qk_norm and c.post_norms and c.attn_logit_softcap is None
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (10_000.0, LinearRopeScaling(factor=4.0), 100.0)
    assert [c.uses_local_rope(i) for i in range(2)] == [True, False]

    # Gemma 1's released configs say hidden_act "gelu" and mean the tanh form (as transformers does).
    assert convert("gemma", hidden_act="gelu").mlp_activation == "gelu_tanh"
    # Gemma 2 with hidden_activation "gelu" means the exact form.
    assert convert("gemma2", hidden_activation="gelu").mlp_activation == "gelu"


def test_keys_left_out_take_the_transformers_defaults():
    """Keys a Gemma config.json may leave out convert as the transformers classes default them."""

    def without(family, *keys, **kw):
        cfg_cls, _, extra = GEMMA_FAMILIES[family]
        hf = getattr(transformers, cfg_cls)(**{**GEMMA_TINY, **extra, **kw}).to_dict()
        for key in keys:
            hf.pop(key, None)
        return from_hf_config(hf), getattr(transformers, cfg_cls)()

    for family in GEMMA_FAMILIES:
        c, default = without(family, "tie_word_embeddings")
        assert c.tie_word_embeddings is default.tie_word_embeddings is True
    # Gemma 2/3 run `hidden_activation` (its default: the tanh form) and never read `hidden_act`.
    for family in ("gemma2", "gemma3_text"):
        c, default = without(family, "hidden_activation", hidden_act="gelu")
        assert default.hidden_activation == "gelu_pytorch_tanh" and c.mlp_activation == "gelu_tanh"
    c, default = without("gemma2", "query_pre_attn_scalar")
    assert c.attention_scale == default.query_pre_attn_scalar**-0.5
    # Gemma 3 without layer_types or a pattern: every sixth layer global.
    c, _ = without("gemma3_text", "layer_types", "_sliding_window_pattern", num_hidden_layers=7, layer_types=None)
    theirs = transformers.Gemma3TextConfig(num_hidden_layers=7).layer_types
    slides = [isinstance(c.attention_kind(i), SlidingWindow) for i in range(7)]
    assert ["sliding_attention" if s else "full_attention" for s in slides] == theirs
    assert theirs.count("full_attention") == 1


@pytest.mark.parametrize("hf_norm", ["GemmaRMSNorm", "LlamaRMSNorm"])
def test_rms_norm_in_bfloat16_is_transformers_bit_for_bit(hf_norm):
    """Both norms in bfloat16, as transformers rounds them: Gemma's (1 + w) scale applied in float32
    before the one rounding, Llama's w applied after the normalised value is rounded."""
    import importlib

    from jaxinfer.config import ModelConfig
    from jaxinfer.model import RMSNorm

    gemma = hf_norm == "GemmaRMSNorm"
    family = "gemma" if gemma else "llama"
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        norm_unit_offset=gemma,
        dtype="bfloat16",
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 64)).astype(np.float32)
    w = rng.normal(0 if gemma else 1, 0.3, size=(64,)).astype(np.float32)
    ref = getattr(module, hf_norm)(64, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
        want = ref.to(torch.bfloat16)(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    got = RMSNorm(cfg, 64).apply({"params": {"scale": jnp.asarray(w, jnp.bfloat16)}}, jnp.asarray(x, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


def test_gemma3_old_style_config_keys():
    """Hub configs written before transformers v5: rope_theta / rope_local_base_freq / rope_scaling at
    top level and sliding_window_pattern instead of layer_types."""
    hf = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=7,
        vocab_size=128,
        intermediate_size=160,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=32,
        rope_theta=1_000_000.0,
        rope_local_base_freq=20_000.0,  # not the default (1e4): read, not defaulted
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=3,
    )
    c = from_hf_config(hf)
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (1e6, LinearRopeScaling(factor=8.0), 2e4)
    kinds = [c.attention_kind(i) for i in range(7)]
    assert kinds == [SlidingWindow(512), SlidingWindow(512), GlobalAttention()] * 2 + [SlidingWindow(512)]
    # transformers reads the same dict the same way.
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert theirs.layer_types == [
        "sliding_attention" if isinstance(k, SlidingWindow) else "full_attention" for k in kinds
    ]
    with pytest.raises(UnsupportedModelError, match="'sliding_window_pattern' must be a positive integer, got 0"):
        from_hf_config({**hf, "sliding_window_pattern": 0})


# YaRN on the global layers with truncate=false: transformers reads `truncate` from the outer
# rope_parameters, so it truncates anyway (a real difference in the tables when read literally).
_YARN_NO_TRUNCATE = dict(
    rope_parameters={
        "full_attention": dict(
            rope_type="yarn", factor=4.0, rope_theta=1e6, original_max_position_embeddings=64, truncate=False
        ),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
    }
)


@pytest.mark.parametrize("change", [{}, _YARN_NO_TRUNCATE], ids=["family-config", "yarn-truncate-false"])
def test_gemma3_rope_tables_match_transformers(change):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf = transformers.Gemma3TextConfig(**{**GEMMA_TINY, **GEMMA_FAMILIES["gemma3_text"][2], **change})
    rope = Gemma3RotaryEmbedding(hf)
    c = from_hf_config(hf.to_dict())
    for layer_type, local in (("full_attention", False), ("sliding_attention", True)):
        theirs = getattr(rope, f"{layer_type}_inv_freq").to(torch.float64).numpy()
        np.testing.assert_allclose(rope_inv_freq(c, local=local), theirs, rtol=1e-6)
        # YaRN's attention factor scales the global tables only.
        scaling = getattr(rope, f"{layer_type}_attention_scaling")
        assert rope_attention_factor(c, local=local) == pytest.approx(scaling, rel=1e-12)


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_num_params_counts_the_real_tree(family):
    cfg_cls, _, extra = GEMMA_FAMILIES[family]
    c = from_hf_config(getattr(transformers, cfg_cls)(**{**GEMMA_TINY, **extra}).to_dict())
    assert c.num_params == sum(x.size for x in jax.tree.leaves(abstract_params(c)))


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma2", dict(hidden_activation="relu"), "hidden_activation 'relu'"),
        ("gemma", dict(hidden_act="relu"), "hidden_act 'relu'"),
        # transformers 5 runs hidden_act, transformers 4 ran hidden_activation: no silent pick.
        ("gemma", dict(hidden_act="gelu", hidden_activation="silu"), "hidden_act 'gelu' and hidden_activation 'silu'"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (
            "gemma3_text",
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
            "sliding_attention",
        ),
        ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "longrope", "factor": 2.0}}), "longrope"),
        ("gemma3_text", dict(architectures=["Gemma3ForConditionalGeneration"]), "Gemma3ForConditionalGeneration"),
        ("gemma3_text", dict(architectures=None, model_type="gemma3"), "gemma3"),
        ("gemma2", dict(query_pre_attn_scalar=None), "'query_pre_attn_scalar' must be a number, got None"),
        ("gemma2", dict(final_logit_softcapping="30"), "'final_logit_softcapping' must be a number, got '30'"),
        # A flat object: transformers would silently drop it and run unscaled RoPE.
        ("gemma3_text", dict(rope_parameters={"rope_type": "linear", "factor": 8.0}), "must be keyed by layer type"),
    ],
)
def test_unsupported_is_refused_by_name(family, change, message):
    cfg_cls, _, extra = GEMMA_FAMILIES[family]
    hf = getattr(transformers, cfg_cls)(**{**GEMMA_TINY, **extra}).to_dict()
    hf.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        from_hf_config(hf)


@pytest.mark.parametrize("outer_tied", [True, False])
def test_multimodal_gemma3_text_decoder_matches_transformers(tmp_path, outer_tied):
    """A Gemma 3 vision-language checkpoint serves text prompts with its text decoder: the vision
    tower's tensors are left unread, and the logits equal Gemma3ForConditionalGeneration's on text.

    transformers ties the LM head by the outer config's flag and never reads the text_config's: an
    untied outer config with a (default, tied) text_config must use the saved lm_head.weight."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    # transformers' vision-language class ignores final_logit_softcapping (we refuse it: tested below).
    text_config = {**GEMMA_TINY, **GEMMA_FAMILIES["gemma3_text"][2], "final_logit_softcapping": None}
    config = transformers.Gemma3Config(
        text_config=text_config,
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=125,
        eoi_token_index=126,
        image_token_index=127,
        tie_word_embeddings=outer_tied,
    )
    assert config.text_config.tie_word_embeddings  # the text_config's flag says tied either way
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "vision" not in name:
                p.normal_(0, 0.3)
    save_hf_model(hf, tmp_path)
    hf_tokens = _hf_greedy(hf, PROMPT, NEW)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT + hf_tokens])).logits[0].float().numpy()

    cfg, params = load_hf_checkpoint(str(tmp_path))
    assert cfg.family == "gemma3" and cfg.local_rope_theta == 100.0 and cfg.tie_word_embeddings == outer_tied
    ours = _jax_logits(cfg, params, (PROMPT + hf_tokens)[:-1], len(PROMPT), page_size=PAGE_SIZE)
    np.testing.assert_allclose(ours, ref[len(PROMPT) - 1 : -1], atol=2e-4, rtol=2e-4)
    if not outer_tied:
        return  # the logits decide it; the engine run below is the same code either way
    out = LLM(str(tmp_path), page_size=PAGE_SIZE, num_kv_pages=64).generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.token_ids == hf_tokens


def test_multimodal_config_reads_tying_and_token_ids_as_transformers():
    """The text decoder of a Gemma 3 vision-language config: tied by the outer flag (missing: tied),
    never the text_config's; BOS/EOS from the text_config, or from the outer config where it has none."""
    text = {**GEMMA_TINY, **GEMMA_FAMILIES["gemma3_text"][2], "final_logit_softcapping": None}
    hf = transformers.Gemma3Config(text_config=text, tie_word_embeddings=False).to_dict()
    assert hf["text_config"]["tie_word_embeddings"] and not from_hf_config(hf).tie_word_embeddings
    del hf["tie_word_embeddings"]
    assert from_hf_config(hf).tie_word_embeddings
    hf["text_config"] = {**hf["text_config"], "bos_token_id": 2, "eos_token_id": 1}
    hf.update(bos_token_id=5, eos_token_id=[1, 106])
    c = from_hf_config(hf)
    assert (c.bos_token_id, c.eos_token_ids) == (2, (1,))
    del hf["text_config"]["bos_token_id"], hf["text_config"]["eos_token_id"]
    c = from_hf_config(hf)
    assert (c.bos_token_id, c.eos_token_ids) == (5, (1, 106))


def test_other_multimodal_checkpoints_are_refused(tmp_path):
    hf = dict(architectures=["LlavaForConditionalGeneration"], model_type="llava", text_config=dict(GEMMA_TINY))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration"):
        LLM(str(tmp_path))
    text = {**GEMMA_TINY, **GEMMA_FAMILIES["gemma3_text"][2]}  # final_logit_softcapping set
    hf = transformers.Gemma3Config(text_config=text).to_dict()
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        from_hf_config(hf)


def test_bfloat16_compute_close_to_transformers(tmp_path):
    """bf16 end to end: embedding scale rounded to bf16, (1 + w) norms in float32, as transformers."""
    save_hf_model(make_hf_gemma("gemma3_text"), tmp_path, dtype=torch.bfloat16)
    hfb = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        ref = hfb(torch.tensor([PROMPT])).logits[0, -1].float().numpy()
    cfg, params = load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
    ours = _jax_logits(cfg, params, PROMPT, len(PROMPT), page_size=PAGE_SIZE)[0]
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert np.argmax(ours) == np.argmax(ref)


def test_pallas_backend_greedy_equals_reference(tmp_path):
    """Soft cap, window and query_pre_attn_scalar reach the Pallas kernel too (interpret mode on CPU),
    and so does the window layers' own page table (2 sequences x 7 pages: smaller than 32)."""
    save_hf_model(make_hf_gemma("gemma2"), tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(
            str(tmp_path),
            page_size=PAGE_SIZE,
            num_kv_pages=32,
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=16,
            attention_backend=backend,
        )
        assert llm.stats()["kv_window_pages_total"] == 2 * 7
        outs[backend] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].token_ids
    assert outs["pallas"] == outs["reference"]
