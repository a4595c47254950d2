"""Hugging Face config conversion: each family, RoPE scaling against transformers, refusals by name."""

import math

import numpy as np
import pytest
import torch
from hf_models import FAMILIES, GEMMA_FAMILIES, GEMMA_TINY, TINY

from jaxinfer.config import (
    GlobalAttention,
    Llama3RopeScaling,
    ModelConfig,
    SlidingWindow,
    YarnRopeScaling,
    from_hf_config,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxinfer.errors import UnsupportedModelError


def _hf_config(family, **kw):
    import transformers

    cfg_cls, _, extra = FAMILIES[family]
    return getattr(transformers, cfg_cls)(**{**TINY, **extra, **kw})


def test_each_family_converts():
    c = from_hf_config(_hf_config("qwen2").to_dict())
    assert c.family == "qwen2" and c.qkv_bias and not c.qk_norm
    c = from_hf_config(_hf_config("qwen3").to_dict())
    assert c.qk_norm and not c.qkv_bias and c.head_dim == 16
    c = from_hf_config(_hf_config("llama3.2-tied").to_dict())
    assert c.tie_word_embeddings and c.head_dim == 32
    c = from_hf_config(_hf_config("mistral-swa").to_dict())
    assert c.attention_kind(0) == SlidingWindow(8)
    c = from_hf_config(_hf_config("llama2").to_dict())
    assert c.attention_kind(1) == GlobalAttention() and c.eos_token_ids == (2,)


def test_old_style_llama3_config_keys():
    """Configs written before transformers v5 keep rope_theta and rope_scaling at top level."""
    hf = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=10,
        intermediate_size=8,
        rope_theta=500000.0,
        hidden_act="silu",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    c = from_hf_config(hf)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )


@pytest.mark.parametrize("family", ["llama2", "llama3.1", "qwen2-yarn", "llama-yarn-mscale", "llama-dynamic"])
def test_rope_frequencies_match_transformers(family):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config(family, head_dim=64)
    cfg = from_hf_config(hf.to_dict())
    rotary = LlamaRotaryEmbedding(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), rotary.inv_freq.to(torch.float64).numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_yarn_mscale_without_mscale_all_dim_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {k: v for k, v in FAMILIES["llama-yarn-mscale"][2]["rope_scaling"].items() if k != "mscale_all_dim"}
    hf = _hf_config("llama-yarn-mscale", head_dim=64, rope_scaling=scaling)
    cfg = from_hf_config(hf.to_dict())
    rotary = LlamaRotaryEmbedding(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), rotary.inv_freq.to(torch.float64).numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_yarn_ramp_clamped_at_the_last_pair_matches_transformers():
    """A small base and a long original context put YaRN's slow end past the last frequency pair:
    the ramp is clamped at head_dim - 1, as transformers clamps it. (Base 10, 1024 positions, head_dim
    16: the ramp runs from pair 5.66 to 17.70, rounded out to 5 and 18, so the clamp to 15 moves the
    ramp's slope for pairs 6 and 7. Base 100 and 4096 positions ended at 11.26, and clamped nothing.)"""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, rope_theta=10.0)
    hf = _hf_config("qwen2-yarn", head_dim=16, rope_scaling=scaling)
    cfg = from_hf_config(hf.to_dict())
    assert cfg.rope_theta == 10.0
    rotary = LlamaRotaryEmbedding(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), rotary.inv_freq.to(torch.float64).numpy(), rtol=1e-6)


def _layer_types(c, n):
    """transformers' `layer_types` of a converted config's first n layers."""
    slides = [isinstance(c.attention_kind(i), SlidingWindow) for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def test_keys_left_out_take_the_transformers_defaults():
    """A config.json may leave out what its transformers class defaults; the conversion defaults it
    alike (the defaults read from the classes themselves)."""
    import transformers

    hf = _hf_config("mistral-swa").to_dict()
    del hf["sliding_window"]
    assert from_hf_config(hf).attention_kind(0) == SlidingWindow(transformers.MistralConfig().sliding_window)
    # Qwen2 without layer_types: the layers from max_window_layers on slide.
    hf = _hf_config("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3)
    c = from_hf_config({**hf.to_dict(), "layer_types": None})
    assert _layer_types(c, 3) == hf.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


@pytest.mark.parametrize("family", ["llama2", "mistral-swa", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_kv_heads_left_out_are_what_transformers_builds(family):
    """Without num_key_value_heads transformers takes its class default (Mistral 8, Gemma 16, Gemma 2/3
    4), not the head count. Qwen2/3's default of 32 is the one exception kept (see
    config._HF_DEFAULTS): the head count, with the weights' shapes as the judge. A null is the head
    count (transformers' fallback where its class takes a null)."""
    import transformers

    cls_name, _, extra = {**FAMILIES, **GEMMA_FAMILIES}[family]
    cls = getattr(transformers, cls_name)
    tiny = GEMMA_TINY if family in GEMMA_FAMILIES else TINY
    hf = cls(**{**tiny, **extra, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 8}).to_dict()
    left_out = {k: v for k, v in hf.items() if k != "num_key_value_heads"}
    expected = 32 if family.startswith("qwen") else cls(**left_out).num_key_value_heads
    assert from_hf_config(left_out).num_kv_heads == expected
    assert (expected == 32) == (family in ("llama2", "qwen2", "qwen3"))  # Mistral 8, Gemma 16, Gemma 2/3 4
    assert from_hf_config({**hf, "num_key_value_heads": None}).num_kv_heads == 32


def test_yarn_without_factor_takes_the_ratio_of_context_lengths():
    """As transformers does: a YaRN config without `factor` scales max / original context."""
    hf = _hf_config("qwen2-yarn").to_dict()
    hf.pop("rope_parameters", None)
    hf.update(
        max_position_embeddings=32768,
        rope_scaling=dict(type="yarn", original_max_position_embeddings=4096, mscale=0.5, mscale_all_dim=1.0),
    )
    s = from_hf_config(hf).rope_scaling
    assert isinstance(s, YarnRopeScaling) and s.factor == 8.0
    assert s.attention_factor == pytest.approx((0.05 * math.log(8) + 1) / (0.1 * math.log(8) + 1))


def test_a_mistral_window_must_be_positive():
    hf = _hf_config("mistral-swa").to_dict()
    hf["sliding_window"] = -4
    with pytest.raises(
        UnsupportedModelError, match=r"config.json field 'sliding_window' must be a positive integer, got -4"
    ):
        from_hf_config(hf)


def test_architectures_as_a_bare_string_is_read_as_a_list():
    hf = _hf_config("llama2").to_dict()
    hf["architectures"] = "LlamaForCausalLM"
    assert from_hf_config(hf).family == "llama"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (dict(architectures=None, model_type="falcon"), "falcon"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters=dict(rope_type="longrope", factor=2.0, rope_theta=1e4)), "'longrope'"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=0.5, rope_theta=1e4)), "must be a number >= 1"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor="2", rope_theta=1e4)), "must be a number >= 1"),
        (
            dict(rope_parameters=dict(rope_type="yarn", factor=0.0, original_max_position_embeddings=8)),
            "rope_scaling.factor must be positive, got 0.0",
        ),
        (
            dict(
                rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4, original_max_position_embeddings=0)
            ),
            "original_max_position_embeddings must be a positive integer, got 0",
        ),
        (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4)), "type 'linear' is missing field 'factor'"),
        (dict(rope_parameters=dict(rope_type="default", rope_theta="abc")), "rope_scaling.rope_theta must be a number"),
        (
            dict(rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast="x", original_max_position_embeddings=8)),
            "rope_scaling.beta_fast must be a number, got 'x'",
        ),
        (dict(architectures=5), "'architectures' must be a list of names, got 5"),
        # transformers builds what model_type names (here Llama, which ignores sliding_window): the
        # weights fit both, so only the refusal stops a silent choice.
        (
            dict(architectures=["MistralForCausalLM"], sliding_window=8),
            "architecture 'MistralForCausalLM' but model_type 'llama'",
        ),
        (dict(architectures=None, model_type=["llama"]), "'model_type' must be a string"),
        (dict(vocab_size=2**31), "'vocab_size' must be below 2\\*\\*31"),
        (dict(mlp_bias="true"), "'mlp_bias' must be true or false, got 'true'"),
        # A GPTQ checkpoint has qweight/scales instead of weights: said up front, not as a missing tensor.
        (dict(quantization_config=dict(quant_method="gptq", bits=4)), "quantization_config.*'gptq'"),
        (dict(num_key_value_heads=3), "multiple"),
        # Values that loaded and then gave garbage (all-zero tokens) or ignored a weight:
        (dict(rope_theta=0, rope_parameters=None), "'rope_theta' must be a positive number, got 0"),
        (dict(rope_parameters=dict(rope_type="default", rope_theta=-5.0)), "'rope_theta' must be a positive"),
        (dict(rms_norm_eps=-1.0), "'rms_norm_eps' must be a positive number"),
        # An int past a double's range (JSON allows it): float() of it raised OverflowError.
        (dict(rope_theta=10**400, rope_parameters=None), r"rope_theta.? must be a (positive )?number, got 1000"),
        (dict(rms_norm_eps=-(10**400)), r"'rms_norm_eps' must be a (positive )?number, got -1000"),
        (dict(rope_parameters=dict(rope_type="linear", factor=0.0, rope_theta=1e4)), "'rope_scaling.factor'"),
        (dict(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false, got 'false'"),
        (dict(attention_bias="no"), "'attention_bias' must be true or false"),
        # Wrong types or ranges: a one-line error naming the field, not a traceback.
        (dict(hidden_size="abc"), "'hidden_size' must be an integer, got 'abc'"),
        (dict(hidden_size=None), "missing required field 'hidden_size'"),
        (dict(num_attention_heads=0, head_dim=None), "'num_attention_heads' must be positive"),
        (dict(head_dim=15), "'head_dim' must be even"),
        (dict(eos_token_id="abc"), "eos token ids must be non-negative integers"),
        (dict(rope_parameters="default"), "'rope_parameters' must be a JSON object, got 'default'"),
        (dict(rope_scaling="linear", rope_parameters=None), "'rope_scaling' must be a JSON object, got 'linear'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor != 1 is not supported"),
        # The same key inside the RoPE object (where transformers 5 reads it) was accepted and ignored.
        (
            dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4, partial_rotary_factor=0.5)),
            r"partial_rotary_factor != 1 \(in the RoPE parameters\) is not supported",
        ),
        (dict(rope_scaling=dict(rope_type="default", partial_rotary_factor=0.25)), "partial_rotary_factor != 1"),
    ],
)
def test_unsupported_is_refused_by_name(change, message):
    hf = _hf_config("llama2").to_dict()
    hf.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        from_hf_config(hf)


def test_dynamic_rope_of_factor_one_is_plain_rope():
    hf = _hf_config("llama2").to_dict()
    hf["rope_parameters"] = dict(rope_type="dynamic", factor=1.0, rope_theta=1e4)
    assert from_hf_config(hf).rope_scaling is None


_SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=0), "config field 'hidden_size' must be a positive integer, got 0"),
        (dict(num_layers=-1), "config field 'num_layers' must be a positive integer, got -1"),
        (dict(num_heads=2.0), "config field 'num_heads' must be a positive integer, got 2.0"),
        (dict(query_pre_attn_scalar=0.0), "'query_pre_attn_scalar' must be a positive number or unset, got 0.0"),
        (dict(attn_logit_softcap=-30.0), "'attn_logit_softcap' must be a positive number or unset, got -30.0"),
        (
            dict(layer_attention=(SlidingWindow(0), GlobalAttention())),
            r"layer_attention\[0\] must be global or a sliding window of a positive integer size",
        ),
        (dict(layer_attention=(GlobalAttention(), SlidingWindow(4.0))), r"layer_attention\[1\] must be global"),
        (dict(eos_token_ids=(2, -1)), "bos/eos token ids must be non-negative integers"),
        (dict(bos_token_id=-1), "bos/eos token ids must be non-negative integers"),
    ],
)
def test_a_config_built_in_python_is_checked_as_one_read_from_json(change, message):
    """`ModelConfig` checks its own fields (a config built in Python never passes `from_hf_config`)."""
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig(**{**_SMALL, **change})


def test_token_id_zero_is_a_valid_bos_and_eos():
    cfg = ModelConfig(**_SMALL, bos_token_id=0, eos_token_ids=(0, 1))
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (0, 1))


@pytest.mark.parametrize(
    "flags", [dict(), dict(qkv_bias=True, o_bias=True), dict(qk_norm=True, tie_word_embeddings=True)]
)
def test_num_params_counts_the_real_tree(flags):
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.model import abstract_params

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        **flags,
    )
    assert cfg.num_params == sum(x.size for x in jax.tree.leaves(abstract_params(cfg)))


def test_kv_bytes_a_query_reads_count_each_layer_its_window():
    base = {k: v for k, v in _SMALL.items() if k != "num_layers"}
    flat = ModelConfig(num_layers=2, **base)
    assert flat.kv_bytes_read(100) == 100 * flat.kv_bytes_per_token == 100 * 2 * 2 * 2 * 8 * 4
    mixed = ModelConfig(num_layers=2, layer_attention=(SlidingWindow(16), GlobalAttention()), **base)
    assert mixed.kv_bytes_read(100) == (16 + 100) * 2 * 2 * 8 * 4  # K and V, 2 KV heads, 8 x float32
    assert mixed.kv_bytes_read(10) == flat.kv_bytes_read(10)  # inside the window: the whole context
    assert mixed.kv_window is None and mixed.hybrid_window == 16  # the windowed layers get pools of their own
    all_windowed = ModelConfig(num_layers=2, layer_attention=(SlidingWindow(16), SlidingWindow(24)), **base)
    assert all_windowed.kv_window == 24 and all_windowed.hybrid_window is None  # one pool, as a global model
    assert flat.hybrid_window is None
