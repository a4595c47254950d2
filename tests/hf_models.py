"""Random-weight Hugging Face checkpoints, written by transformers itself, for parity tests."""

from __future__ import annotations

import torch
import transformers

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, extra config)
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(rms_norm_eps=1e-5)),
    "llama3.1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            max_position_embeddings=256,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama3.2-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    # Configurations beyond the headline families' defaults.
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-tied-mqa": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "llama-bias-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, rope_scaling=dict(rope_type="linear", factor=4.0)),
    ),
    # YaRN (Qwen2.5 / Qwen3 long-context configs): the ramp between kept and interpolated pairs falls
    # inside the 8 pairs of these heads, and the test sequence outruns the "original" context.
    "qwen2-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    ),
    # Dynamic NTK: transformers rescales only past max_position_embeddings, which jaxinfer never runs.
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(rope_type="dynamic", factor=4.0))),
    # DeepSeek-style YaRN temperature (mscale / mscale_all_dim), custom betas, no truncation.
    "llama-yarn-mscale": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=32,
                mscale=1.0,
                mscale_all_dim=0.5,
                beta_fast=16.0,
                beta_slow=2.0,
                truncate=False,
            ),
        ),
    ),
}


def make_hf_model(family: str, **overrides):
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    if family.startswith("qwen2") or family.startswith("llama-bias"):  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_proj,
                    layer.mlp.up_proj,
                    layer.mlp.down_proj,
                ):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.5)
    if family.startswith("qwen3"):  # q/k norms start at one; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "q_norm" not in name and "k_norm" not in name:
                p.normal_(1, 0.2)
    return model


def save_hf_model(model, path, *, dtype=None, max_shard_size=None):
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


SPM_CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the deep.",
]


def train_sentencepiece(directory, vocab_size: int = 36) -> str:
    """Trains a small SentencePiece model (BOS 1, EOS 2, UNK 0) into directory/tokenizer.model."""
    import sentencepiece as spm

    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(SPM_CORPUS * 40))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=vocab_size,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    return str(directory / "tokenizer.model")


# Gemma 1/2/3 (text). Shapes chosen so every Gemma option changes the output: head_dim != D / N,
# windows shorter than the test sequences, soft caps near the logit scale, a query_pre_attn_scalar
# that is not head_dim, separate local/global RoPE bases with linear scaling on the global layers.
GEMMA_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

GEMMA_FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2, num_key_value_heads=1)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=2,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=2,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=2.5,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
}


def make_hf_gemma(family: str, **overrides):
    """A random-weight Gemma model (float32, eager attention) with every norm weight made to matter."""
    cfg_cls, model_cls, extra = GEMMA_FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**GEMMA_TINY, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma norms scale by (1 + w) and start at w = 0
                p.normal_(0, 0.3)
    return model


def random_hf_model(seed: int):
    """A random configuration of one of the four headline families, its weights random too, and the
    engine settings to run it under: (family, model, LLM keyword arguments). The draws mix what the
    fixed FAMILIES above hold one at a time (group sizes 1-8, head sizes set apart from hidden / heads,
    tied heads, q/k/v, o and MLP biases, RoPE scalings, sliding windows shorter than the prompts) with the
    engine's page sizes, step budgets (chunked prefill), batch limits and attention backends."""
    import random

    rng = random.Random(seed)
    family = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
    config = dict(
        TINY,
        vocab_size=rng.choice([97, 128, 256]),
        hidden_size=kv_heads * group * rng.choice([8, 12, 16]),  # Llama's config wants whole heads
        intermediate_size=rng.choice([40, 64, 160]),
        num_hidden_layers=rng.choice([1, 2, 3]),
        num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads,
        head_dim=rng.choice([8, 16, 32]),
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=rng.random() < 0.3,
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        rope_theta=rng.choice([1000.0, 10000.0, 500000.0]),
    )
    if family == "llama":
        config["attention_bias"] = rng.random() < 0.4
        config["mlp_bias"] = rng.random() < 0.4
        config["rope_scaling"] = rng.choice(
            [
                None,
                dict(rope_type="linear", factor=2.0),
                dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=32,
                ),
            ]
        )
    elif family == "mistral":
        config["sliding_window"] = rng.choice([None, 5, 8, 16])
    elif family == "qwen2" and rng.random() < 0.4:
        config["rope_scaling"] = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    hf_config = getattr(transformers, name + "Config")(**config)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, name + "ForCausalLM")(hf_config).eval()
    with torch.no_grad():  # norms start at one and biases at zero: make them matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1, 0.3)
            elif pname.endswith("bias"):
                p.normal_(0, 0.5)
    engine = dict(
        page_size=rng.choice([2, 4, 8, 16]),
        max_num_batched_tokens=rng.choice([16, 24, 64]),
        max_num_seqs=rng.choice([1, 2, 8]),
        attention_backend=rng.choice(["reference", "xla", "native", "pallas"]),
    )
    return family, model, engine
