"""Model configuration: frozen, keyword-only, hashable (usable as a static jit argument).

`from_hf_config` is the one place where a Hugging Face `config.json` becomes a `ModelConfig`.
Anything it does not understand is refused by name rather than silently ignored: a silently
dropped option (a RoPE scaling, a bias, a window) is the classic source of "loads fine, outputs
garbage".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
from typing import Any

from jaxinfer.errors import CheckpointError, InvalidRequestError, UnsupportedModelError

# ----------------------------------------------------------------------------------------------
# Variants as types.


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent scaling (long wavelengths scaled, short kept, smooth between)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN (Peng et al., 2023, arXiv:2309.00071): NTK-by-parts interpolation plus a temperature.

    Pairs that turn fewer than `beta_slow` times over the original context are interpolated (their
    frequency divided by `factor`), pairs that turn more than `beta_fast` times are kept, and a linear
    ramp over the pair index blends the two in between. cos and sin are multiplied by
    `attention_factor`, which scales every attention logit by its square.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # round the ramp's ends outwards to whole pairs


RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling


@dataclasses.dataclass(frozen=True)
class GlobalAttention:
    """Every query attends to its whole causal prefix."""


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """A query at position p attends to keys at positions in (p - window, p]."""

    window: int


AttentionKind = GlobalAttention | SlidingWindow


_REQUIRED = object()  # marks a field with no default


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_positive(field: str, value, limit: str = "must be a positive number") -> None:
    try:
        ok = math.isfinite(x := _as_float(value, field)) and x > 0
    except UnsupportedModelError:  # not a number, or an int past a double's range
        ok = False
    if not ok:
        raise UnsupportedModelError(f"config field {field!r} {limit}, got {reprlib.repr(value)}")


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "reference", "xla", "native", "pallas")
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama family.

    Letters in comments refer to the glossary in WORKSPACE.md (D model width, F MLP width,
    N query heads, K KV heads, H head dim, L layers, V vocabulary).
    """

    name: str = "model"
    family: str = "llama"  # one of FAMILIES
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention output projection (Llama's attention_bias does both)
    mlp_bias: bool = False  # biases on the MLP's gate, up and down projections (Llama's mlp_bias)
    qk_norm: bool = False
    # One entry per layer; () means "all global".
    layer_attention: tuple[AttentionKind, ...] = ()
    # Gemma options; the defaults are the Llama behaviour. See "Model families" in WORKSPACE.md.
    mlp_activation: str = "silu"  # gate activation of the GLU MLP: silu | gelu_tanh | gelu
    embed_scale: bool = False  # embeddings times sqrt(D), the factor rounded to the params dtype
    norm_unit_offset: bool = False  # RMSNorm weights stored as w, applied as (1 + w)
    post_norms: bool = False  # an RMSNorm on the output of attention and of the MLP, before the residual
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcap: float | None = None  # output logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # RoPE base of sliding-window layers, unscaled (None: as global)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # compute and parameter dtype
    # How paged attention runs (a serving choice, kept here because the jitted steps are specialised
    # on it): "auto" picks per platform, "reference" and "xla" are pure JAX (plain; tiled), "native"
    # the C++ CPU kernel, "pallas" the kernels (interpreted on CPU). See attention.resolve_backend.
    attention_backend: str = "auto"
    # How K/V are stored (same reason for living here): "auto" in `dtype`; "int8" as int8 with one
    # float32 scale per token and KV head (about half the bytes of bfloat16). See jaxinfer.kv_cache.
    kv_cache_dtype: str = "auto"
    # How the projections' weights are stored (same reason): 0, as declared ([in..., out...]); else
    # the float32 ones in strips of this many columns for the CPU's float32 kernel (jaxinfer.matmul).
    # jaxinfer.llm sets it with the params it lays out so (model.to_weight_strips): the two go together.
    weight_strips: int = 0

    def __post_init__(self):
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise UnsupportedModelError(f"config field {field!r} must be a positive integer, got {value!r}")
            if value >= 2**31:  # token ids, positions and shapes are int32
                raise UnsupportedModelError(f"config field {field!r} must be below 2**31, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_attention and len(self.layer_attention) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_attention has {len(self.layer_attention)} entries for {self.num_layers} layers"
            )
        if self.dtype not in DTYPES:
            raise UnsupportedModelError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise UnsupportedModelError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"config field 'family' must be one of {FAMILIES}, got {self.family!r}")
        if self.head_dim % 2:
            raise UnsupportedModelError(
                f"config field 'head_dim' must be even (RoPE rotates pairs), got {self.head_dim}"
            )
        for field in ("rms_norm_eps", "rope_theta"):
            _check_positive(field, getattr(self, field))
        for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
            if getattr(self, field) is not None:
                _check_positive(field, getattr(self, field), "must be a positive number or unset")
        for field in (
            "tie_word_embeddings",
            "qkv_bias",
            "o_bias",
            "mlp_bias",
            "qk_norm",
            "embed_scale",
            "norm_unit_offset",
            "post_norms",
        ):
            if not isinstance(getattr(self, field), bool):
                raise UnsupportedModelError(
                    f"config field {field!r} must be true or false, got {getattr(self, field)!r}"
                )
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, (LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling)):
                raise UnsupportedModelError(
                    f"config field 'rope_scaling' is not a known scaling: {self.rope_scaling!r}"
                )
            for f in dataclasses.fields(self.rope_scaling):
                value = getattr(self.rope_scaling, f.name)
                if f.name != "truncate":
                    _check_positive(f"rope_scaling.{f.name}", value)
        for i, kind in enumerate(self.layer_attention):
            window = getattr(kind, "window", None)
            if not (isinstance(kind, GlobalAttention) or (_is_int(window) and window > 0)):
                raise UnsupportedModelError(
                    f"layer_attention[{i}] must be global or a sliding window of a positive integer size, got {kind!r}"
                )
        ids = (self.bos_token_id,) if self.bos_token_id is not None else ()
        if not isinstance(self.eos_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in (*ids, *self.eos_token_ids)
        ):
            raise UnsupportedModelError(
                f"bos/eos token ids must be non-negative integers, got {self.bos_token_id!r} / {self.eos_token_ids!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not _is_int(self.weight_strips) or self.weight_strips < 0:
            raise InvalidRequestError(f"weight_strips must be an integer >= 0, got {self.weight_strips!r}")

    @property
    def q_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def attention_kind(self, layer: int) -> AttentionKind:
        return self.layer_attention[layer] if self.layer_attention else GlobalAttention()

    @property
    def kv_window(self) -> int | None:
        """How far back any layer attends when every layer has a sliding window (the widest one);
        None when some layer attends to the whole context. Keys further back are never read again."""
        kinds = [self.attention_kind(i) for i in range(self.num_layers)]
        if all(isinstance(k, SlidingWindow) for k in kinds):
            return max(k.window for k in kinds)
        return None

    @property
    def hybrid_window(self) -> int | None:
        """Hybrid models (Gemma 2/3: global layers interleaved with sliding-window layers): the widest
        window of the windowed layers. Their K/V then live in pools of their own (`in_window_pool`)
        that keep only each sequence's window. None when all layers are alike (see kv_window)."""
        kinds = [self.attention_kind(i) for i in range(self.num_layers)]
        windows = [k.window for k in kinds if isinstance(k, SlidingWindow)]
        return max(windows) if windows and len(windows) < len(kinds) else None

    def in_window_pool(self, layer: int) -> bool:
        """Whether this layer's K/V go to the sliding-window pools of a hybrid model."""
        return self.hybrid_window is not None and isinstance(self.attention_kind(layer), SlidingWindow)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention logits (a Python float: it is compiled in)."""
        base = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base) ** -0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with the local RoPE base (Gemma 3's sliding-window layers)."""
        return self.local_rope_theta is not None and isinstance(self.attention_kind(layer), SlidingWindow)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in the cache, over all layers (int8: with its scales)."""
        if self.kv_cache_dtype == "int8":
            per_head = self.head_dim + 4  # int8 values + one float32 scale
        else:
            per_head = self.head_dim * (4 if self.dtype == "float32" else 2)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def kv_bytes_read(self, context: float) -> float:
        """Bytes of K and V one query at `context` tokens must read over all layers: a sliding-window
        layer reads only its window, so counting the whole context would overstate what decode moves."""
        per_layer = self.kv_bytes_per_token / self.num_layers
        kinds = [self.attention_kind(i) for i in range(self.num_layers)]
        return per_layer * sum(min(context, k.window) if isinstance(k, SlidingWindow) else context for k in kinds)

    @property
    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * h
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        per_layer = attn + mlp + (4 if self.post_norms else 2) * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d


# ----------------------------------------------------------------------------------------------
# Hugging Face conversion.

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "mistral",  # Mistral whose layers follow layer_types (see _layer_attention)
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# model_type -> family
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "ministral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_GEMMA = ("gemma", "gemma2", "gemma3")
# Vision-language checkpoints whose text decoder we run on text prompts (images are not supported):
# architecture or model_type -> the model_type of their `text_config`.
_MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3_text", "gemma3": "gemma3_text"}
# What transformers' config classes assume for a key config.json leaves out, where it changes the
# model's maths and differs from jaxinfer's own fallbacks (a key present with null stays null).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=4096 * 32),
    "qwen2": dict(sliding_window=4096, max_window_layers=28, max_position_embeddings=32768),
    "qwen3": dict(head_dim=128, sliding_window=4096, max_window_layers=28, max_position_embeddings=32768),
    "gemma": dict(num_key_value_heads=16, head_dim=256, max_position_embeddings=8192),
    "gemma2": dict(
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=4096,
        max_position_embeddings=8192,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3": dict(num_key_value_heads=4, head_dim=256, sliding_window=4096, max_position_embeddings=131_072),
}
# A config.json without num_key_value_heads takes the class's default above, as transformers does
# (found by a config fuzz, 2026-12-07: such a Gemma 2 with 8 heads and 4 KV heads was refused with a
# shape error). For Llama, and where the key is null, it is num_attention_heads (transformers'
# fallback for a null, where its class takes one). Qwen2/3 declare 32, which fits only a 32-head
# model (transformers then builds K/V projections the stored weights do not fill); jaxinfer keeps the
# head count there, and the weights' shapes decide: a wrong guess is refused by tensor name.


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling of a config with one RoPE for every layer, read as transformers does.

    A `rope_scaling` object (the older key, and what model cards tell users to add by hand) takes the
    place of a v5 `rope_parameters` when both are present. The base is the object's own `rope_theta`,
    else the top-level one, else 10000. For llama3 and yarn, a top-level
    `original_max_position_embeddings` overrides the object's (transformers' rule for Phi-3-style
    configs); without either it is `max_position_embeddings`.
    """
    scaling = _object_field(hf, "rope_scaling")
    params = dict(scaling) if scaling else dict(_object_field(hf, "rope_parameters") or {})
    if params.get("rope_theta") is None:
        params["rope_theta"] = hf["rope_theta"] if hf.get("rope_theta") is not None else 10_000.0
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("llama3", "yarn"):
        if hf.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return _rope_params(params, hf)


def _rope_params(params: dict[str, Any], hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one standardised RoPE object (its `rope_theta` already filled in)."""
    # Some configs spell the kind "type" (older transformers), some "rope_type".
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _rope_number(params, "rope_theta", kind)
    # transformers 5 keeps partial_rotary_factor in the RoPE object as well as at the top level.
    if _float_field(params, "partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 (in the RoPE parameters) is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, LinearRopeScaling(factor=_rope_number(params, "factor", kind))
    if kind == "llama3":
        return theta, Llama3RopeScaling(
            factor=_rope_number(params, "factor", kind),
            low_freq_factor=_rope_number(params, "low_freq_factor", kind),
            high_freq_factor=_rope_number(params, "high_freq_factor", kind),
            original_max_position_embeddings=_original_context(params, "llama3"),
        )
    if kind == "yarn":
        return theta, _yarn(params, hf)
    if kind == "dynamic":
        # Dynamic NTK (transformers' rule) rescales the base only for sequences longer than
        # max_position_embeddings; below that it is plain RoPE. jaxinfer never runs a sequence past
        # max_position_embeddings (max_model_len is capped there), so plain RoPE is exact here.
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
            raise UnsupportedModelError(f"rope_scaling.factor of type 'dynamic' must be a number >= 1, got {factor!r}")
        return theta, None
    raise UnsupportedModelError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn, dynamic)"
    )


def _object_field(hf: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = hf.get(key)
    if value is not None and not isinstance(value, dict):
        raise UnsupportedModelError(f"config.json field {key!r} must be a JSON object, got {value!r}")
    return value


def _rope_number(params: dict[str, Any], key: str, kind: str, default: Any = _REQUIRED) -> float:
    """params[key] of a RoPE object as a float (None: `default`); an error naming it otherwise."""
    value = params.get(key)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedModelError(f"rope_scaling of type {kind!r} is missing field {key!r}")
        return default
    return _as_float(value, f"rope_scaling.{key}")


def _as_float(value, field: str) -> float:
    """A JSON number as a float; an error naming `field` for anything else, or an integer past a
    double's range (JSON allows any number of digits)."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError
        return float(value)
    except (TypeError, OverflowError):
        raise UnsupportedModelError(f"{field} must be a number, got {reprlib.repr(value)}") from None


def _original_context(params: dict[str, Any], kind: str) -> int:
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedModelError(
            f"rope_scaling of type {kind!r} is missing field 'original_max_position_embeddings'"
        )
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if not _is_int(original) or original <= 0:
        raise UnsupportedModelError(
            f"rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    return original


def _yarn(params: dict[str, Any], hf: dict[str, Any]) -> YarnRopeScaling:
    """YaRN settings as transformers reads them: a missing `factor` is max / original context, and a
    missing `attention_factor` is 0.1 ln(factor) + 1 (or, with DeepSeek's `mscale` and
    `mscale_all_dim`, the ratio of two such terms)."""
    original = _original_context(params, "yarn")
    factor = _rope_number(params, "factor", "yarn", hf.get("max_position_embeddings", original) / original)
    if not factor > 0:
        raise UnsupportedModelError(f"rope_scaling.factor must be positive, got {factor!r}")

    def temperature(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = _rope_number(params, "attention_factor", "yarn", None)
    if attention_factor is None:
        mscale, mscale_all_dim = (_rope_number(params, k, "yarn", None) for k in ("mscale", "mscale_all_dim"))
        if mscale and mscale_all_dim:
            attention_factor = temperature(factor, mscale) / temperature(factor, mscale_all_dim)
        else:
            attention_factor = temperature(factor)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=_rope_number(params, "beta_fast", "yarn", 32.0),
        beta_slow=_rope_number(params, "beta_slow", "yarn", 1.0),
        attention_factor=float(attention_factor),
        truncate=_bool_field(params, "truncate", True),
    )


def _layer_attention(hf: dict[str, Any], family: str, num_layers: int) -> tuple[AttentionKind, ...]:
    """Per-layer attention kinds (empty: every layer global), as each transformers model reads them.

    Llama and Gemma 1 have no sliding windows (a stray `sliding_window` key is ignored, as there).
    Mistral windows every layer, unless the config has a `layer_types` list: transformers' AutoConfig
    then reads it as a Ministral config, whose layers follow that list. Qwen 2/3 window nothing unless
    `use_sliding_window`, then `layer_types` or the layers from `max_window_layers` on. Gemma 2/3
    follow `layer_types`, or their fixed patterns in configs written before it.
    """
    if family in ("llama", "gemma"):
        return ()
    window = hf.get("sliding_window")
    if window is not None:
        window = _int_field(hf, "sliding_window")
        if window <= 0:
            raise UnsupportedModelError(f"config.json field 'sliding_window' must be a positive integer, got {window}")
    if family == "mistral" and hf.get("layer_types") is None:
        return (SlidingWindow(window),) * num_layers if window else ()
    if family in ("qwen2", "qwen3") and not _bool_field(hf, "use_sliding_window", False):
        # Qwen configs carry a sliding_window value even when the feature is off.
        return ()
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise UnsupportedModelError(f"config.json field 'layer_types' must be a list, got {layer_types!r}")
        kinds = []
        for i, t in enumerate(layer_types):
            if t == "full_attention":
                kinds.append(GlobalAttention())
            elif t == "sliding_attention":
                if not window:
                    raise UnsupportedModelError(f"layer_types[{i}] is 'sliding_attention' but sliding_window is unset")
                kinds.append(SlidingWindow(window))
            else:
                raise UnsupportedModelError(f"layer_types[{i}] = {t!r} is not supported")
        if len(kinds) != num_layers:
            raise UnsupportedModelError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
        return tuple(kinds) if any(isinstance(k, SlidingWindow) for k in kinds) else ()
    if not window:
        return ()
    if family == "gemma2":  # configs written before layer_types: even layers local, odd global
        return tuple(SlidingWindow(window) if i % 2 == 0 else GlobalAttention() for i in range(num_layers))
    if family == "gemma3":  # every `sliding_window_pattern`-th layer global, the rest local
        # (transformers reads only this key here; the private `_sliding_window_pattern` it also writes
        # never shapes the layers)
        pattern = _int_field(hf, "sliding_window_pattern", 6)
        if pattern <= 0:
            raise UnsupportedModelError(
                f"config.json field 'sliding_window_pattern' must be a positive integer, got {pattern}"
            )
        return tuple(SlidingWindow(window) if (i + 1) % pattern else GlobalAttention() for i in range(num_layers))
    first_sliding = _int_field(hf, "max_window_layers")  # qwen2 / qwen3 (defaults: _HF_DEFAULTS)
    return tuple(SlidingWindow(window) if i >= first_sliding else GlobalAttention() for i in range(num_layers))


def _activation(hf: dict[str, Any], family: str) -> str:
    """The MLP gate activation, in our names. Gemma 1 reads `hidden_act`, Gemma 2/3 `hidden_activation`."""
    if family == "gemma":
        # transformers 5 reads `hidden_act` (the released configs' "gelu" meaning the tanh form it was
        # trained with); transformers 4 read `hidden_activation` first. Where they disagree, refused.
        def tanh_if_gelu(a):
            return "gelu_pytorch_tanh" if a == "gelu" else a

        key, act = "hidden_act", tanh_if_gelu(hf.get("hidden_act") or "gelu_pytorch_tanh")
        other = hf.get("hidden_activation")
        if other and tanh_if_gelu(other) != act:
            raise UnsupportedModelError(
                f"gemma: hidden_act {hf.get('hidden_act')!r} and hidden_activation {other!r} disagree "
                "(transformers 5 uses hidden_act, transformers 4 hidden_activation): make them the same"
            )
    elif family in _GEMMA:
        # Gemma 2/3 in transformers 4 and 5 alike: `hidden_activation` only (a `hidden_act` beside it
        # is never read; without it, the tanh form).
        key = "hidden_activation"
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        key = "hidden_act"
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    ours = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
    if act not in ours or (family not in _GEMMA and ours[act] != "silu"):
        supported = "'gelu_pytorch_tanh', 'gelu', 'silu'" if family in _GEMMA else "'silu'"
        raise UnsupportedModelError(f"{key} {act!r} is not supported for {family} (supported: {supported})")
    return ours[act]


def _gemma3_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta), read as transformers' Gemma 3 config does.

    transformers v5 writes `rope_parameters` keyed by layer type. Older configs keep `rope_theta`,
    `rope_scaling` and `rope_local_base_freq` at top level; a `rope_scaling` is merged into the
    global layers' object in either layout (so one added by hand to a v5 config takes effect). Unset
    bases: 1e6 global, 1e4 local.
    """
    params = hf.get("rope_parameters")
    if params is None or params == {}:  # (an empty object: transformers' defaults too, nothing dropped)
        params = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    if not isinstance(params, dict) or not ({"full_attention", "sliding_attention"} & set(params)):
        # transformers would silently drop such an object and run unscaled RoPE.
        raise UnsupportedModelError(
            "gemma3: rope_parameters must be keyed by layer type ('full_attention', 'sliding_attention'), "
            f"got {params!r}"
        )
    full = dict(_object_field(params, "full_attention") or {"rope_type": "default"})
    if _object_field(hf, "rope_scaling") is not None:
        full.update(hf["rope_scaling"])
    # transformers looks YaRN's `truncate` up in the outer rope_parameters, where a per-layer-type
    # config never has it, so Gemma 3 always truncates; read the same way.
    full.pop("truncate", None)
    if full.get("rope_theta") is None:
        full["rope_theta"] = hf["rope_theta"] if hf.get("rope_theta") is not None else 1_000_000.0
    if full.get("rope_type", full.get("type")) in ("llama3", "yarn"):
        full.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    local = dict(_object_field(params, "sliding_attention") or {"rope_type": "default"})
    if local.get("rope_theta") is None:
        local_base = hf.get("rope_local_base_freq")
        local["rope_theta"] = local_base if local_base is not None else 10_000.0
    theta, scaling = _rope_params(full, hf)
    local_theta, local_scaling = _rope_params(local, hf)
    if local_scaling is not None:
        raise UnsupportedModelError(
            "rope_parameters['sliding_attention'] has a rope scaling; only unscaled local RoPE is supported"
        )
    return theta, scaling, local_theta


def _gemma_options(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelConfig fields that differ from Llama for Gemma 1/2/3 (empty for other families)."""
    if family not in _GEMMA:
        return {}
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported (decoder-only, causal)")
    opts: dict[str, Any] = dict(embed_scale=True, norm_unit_offset=True)
    if family == "gemma":
        return opts
    scalar = hf.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
        raise UnsupportedModelError(f"config.json field 'query_pre_attn_scalar' must be a number, got {scalar!r}")
    opts.update(post_norms=True, query_pre_attn_scalar=float(scalar))
    final_cap = _float_field(hf, "final_logit_softcapping", None)
    attn_cap = _float_field(hf, "attn_logit_softcapping", None)
    if final_cap is not None:
        opts["final_logit_softcap"] = final_cap
    if family == "gemma2":
        if attn_cap is not None:
            opts["attn_logit_softcap"] = attn_cap
        return opts
    if attn_cap is not None:
        # Gemma 3 replaced attention soft-capping by q/k norms; transformers ignores the field, so a
        # config that sets it is ambiguous.
        raise UnsupportedModelError("attn_logit_softcapping is not supported for gemma3 (Gemma 3 does not use it)")
    theta, scaling, local_theta = _gemma3_rope(hf)
    opts.update(qk_norm=True, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)
    return opts


def _text_decoder_config(hf: dict[str, Any], *, dtype: str, name: str) -> ModelConfig:
    """The text decoder of a vision-language checkpoint (Gemma 3): its `text_config`, with the token
    ids that only the outer config may carry and the outer config's embedding tying. Images are not
    supported."""
    archs = hf.get("architectures") or []
    kind = next((a for a in archs if a in _MULTIMODAL), archs[0] if archs else hf.get("model_type"))
    if kind not in _MULTIMODAL:
        raise UnsupportedModelError(
            f"multimodal checkpoint {kind!r} (a config with a text_config) is not supported "
            f"(supported: {', '.join(sorted(_MULTIMODAL))}, text prompts only)"
        )
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"text_config must be a JSON object, got {type(text).__name__}")
    if text.get("final_logit_softcapping") is not None:
        # Gemma3ForConditionalGeneration never applies it (Gemma3ForCausalLM does): ambiguous, refuse.
        raise UnsupportedModelError(
            "final_logit_softcapping in the text_config of a vision-language Gemma 3 checkpoint is not supported "
            "(transformers' Gemma3ForConditionalGeneration ignores it)"
        )
    text = {**text, "model_type": _MULTIMODAL[kind], "architectures": None}
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    # transformers ties the LM head to the embeddings by the OUTER config's flag (missing: true; null:
    # untied); the text_config's own flag is never read.
    tie = "tie_word_embeddings" not in hf or _bool_field(hf, "tie_word_embeddings", False)
    text["tie_word_embeddings"] = tie
    return from_hf_config(text, dtype=dtype, name=name)


def _int_field(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """hf[key] as an int (a null or missing value takes `default`); a clear error otherwise."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedModelError(f"config.json is missing required field {key!r}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise UnsupportedModelError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _float_field(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    return _as_float(value, f"config.json field {key!r}")


def _bool_field(hf: dict[str, Any], key: str, default: bool) -> bool:
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):  # "false" would be truthy
        raise UnsupportedModelError(f"config.json field {key!r} must be true or false, got {value!r}")
    return value


def from_hf_config(hf: dict[str, Any], *, dtype: str = "float32", name: str = "model") -> ModelConfig:
    """Converts a Hugging Face `config.json` dict into a `ModelConfig`.

    Raises:
        UnsupportedModelError: naming the architecture or option that is not supported, or the field
            whose value has the wrong type or range.
    """
    try:
        return _from_hf_config(hf, dtype=dtype, name=name)
    except UnsupportedModelError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as e:
        # The fields read above check their own types; this catches the rest (a string where a
        # nested object belongs, ...) so a malformed file is a one-line error, never a traceback.
        raise UnsupportedModelError(f"config.json has a malformed value: {type(e).__name__}: {e}") from None


def _from_hf_config(hf: dict[str, Any], *, dtype: str, name: str) -> ModelConfig:
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UnsupportedModelError(f"config.json field 'architectures' must be a list of names, got {archs!r}")
    model_type = hf.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise UnsupportedModelError(f"config.json field 'model_type' must be a string, got {model_type!r}")
    if "text_config" in hf:
        return _text_decoder_config(hf, dtype=dtype, name=name)
    family = None
    for arch in archs:
        if arch in _ARCHITECTURES:
            family = _ARCHITECTURES[arch]
            break
    typed = _MODEL_TYPES.get(model_type)
    if family is not None and typed is not None and typed != family:
        # transformers builds the class model_type names; the weights may fit either (Llama, Mistral).
        raise UnsupportedModelError(
            f"config.json says architecture {arch!r} but model_type {model_type!r}, which disagree "
            "(transformers would build the model_type's class): make the two name the same family"
        )
    if family is None:
        if archs:
            raise UnsupportedModelError(
                f"architecture {archs[0]!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
            )
        if model_type not in _MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_MODEL_TYPES))})"
            )
        family = typed

    hf = {**_HF_DEFAULTS[family], **hf}
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise UnsupportedModelError(
            f"quantization_config (quant_method {method!r}) is not supported: jaxinfer loads float16, bfloat16 or "
            "float32 weights (int8 applies to the KV cache only)"
        )
    activation = _activation(hf, family)
    if _float_field(hf, "partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")

    hidden = _int_field(hf, "hidden_size")
    num_heads = _int_field(hf, "num_attention_heads")
    num_layers = _int_field(hf, "num_hidden_layers")
    vocab = _int_field(hf, "vocab_size")
    inter = _int_field(hf, "intermediate_size")
    if num_heads <= 0:
        raise UnsupportedModelError(f"config.json field 'num_attention_heads' must be positive, got {num_heads}")
    num_kv = _int_field(hf, "num_key_value_heads", num_heads)
    head_dim = _int_field(hf, "head_dim", hidden // num_heads)
    theta, scaling = _rope(hf)

    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    # Qwen 2 always has q/k/v biases and never an output bias; Mistral never has any. Both ignore an
    # `attention_bias` key, as transformers does; the other families put it on all four projections.
    attention_bias = family not in ("qwen2", "mistral") and _bool_field(hf, "attention_bias", False)
    qkv_bias = family == "qwen2" or attention_bias
    # Only Llama's MLP reads `mlp_bias`; transformers builds every other family's without biases.
    mlp_bias = family == "llama" and _bool_field(hf, "mlp_bias", False)
    fields = dict(
        name=name,
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=_float_field(hf, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int_field(hf, "max_position_embeddings", 2048),
        tie_word_embeddings=_bool_field(hf, "tie_word_embeddings", family in _GEMMA),
        qkv_bias=qkv_bias,
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=family == "qwen3",
        layer_attention=_layer_attention(hf, family, num_layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=dtype,
        mlp_activation=activation,
    )
    fields.update(_gemma_options(hf, family))
    return ModelConfig(**fields)


def load_hf_config(model_dir: str, *, dtype: str = "float32") -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"model directory {model_dir!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # (nested past Python's limit)
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    # generation_config.json may list extra end-of-turn tokens (Llama 3 instruct does).
    gen_path = os.path.join(model_dir, "generation_config.json")
    cfg = from_hf_config(hf, dtype=dtype, name=os.path.basename(os.path.normpath(model_dir)))
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
            # Ids only: `true` is not token 1, nor "2" token 2 (config.json refuses both).
            extra = [e for e in extra if type(e) is int and e >= 0]
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
            cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            RecursionError,
            TypeError,
            ValueError,
            AttributeError,
            UnsupportedModelError,
        ):
            pass  # generation_config is advisory; a broken one must not block loading
    return cfg


def _pow_f32(base: float, exponents):
    """float32 `base ** exponents`, correctly rounded (computed in float64, then rounded): torch's
    float32 pow, which transformers' tables use, agrees on ~99.4% of pairs and is 1 ulp off on the rest."""
    import numpy as np

    return (np.float64(np.float32(base)) ** exponents.astype(np.float64)).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False):
    """Per-pair inverse frequencies [H/2] as float32 numpy, with the configured scaling applied.

    Computed in float32 in transformers' order of operations (what a checkpoint was trained and is
    checked against): the exact float64 table, rounded once, differs from it by an ulp or two on
    some pairs, an error of the angle that grows with the position (4e-4 in the log-probs at 2k
    tokens, 1e-3 at 7k, against HF's ~1e-5; found by a long-context review).

    `local=True` gives the sliding-window layers' table when the config has a separate local base
    (`local_rope_theta`, Gemma 3): that base, never scaled.
    """
    import numpy as np

    f32 = np.float32
    h = cfg.head_dim
    exponents = np.arange(0, h, 2).astype(f32) / f32(h)
    if local and cfg.local_rope_theta is not None:
        return f32(1.0) / _pow_f32(cfg.local_rope_theta, exponents)
    powers = _pow_f32(cfg.rope_theta, exponents)
    inv = f32(1.0) / powers
    s = cfg.rope_scaling
    if isinstance(s, LinearRopeScaling):
        inv = inv / f32(s.factor)
    elif isinstance(s, Llama3RopeScaling):
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = f32(old / s.low_freq_factor), f32(old / s.high_freq_factor)
        with np.errstate(divide="ignore", invalid="ignore"):  # low == high factors: the mask leaves it out
            # torch's `number / tensor` is `tensor.reciprocal() * number`: two roundings, kept here.
            wavelen = (f32(1.0) / inv) * f32(2 * math.pi)
            scaled = np.where(wavelen > low_wavelen, inv / f32(s.factor), inv)
            smooth = ((f32(1.0) / wavelen) * f32(old) - f32(s.low_freq_factor)) / f32(
                s.high_freq_factor - s.low_freq_factor
            )
            smoothed = (f32(1.0) - smooth) * scaled / f32(s.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif isinstance(s, YarnRopeScaling):
        # The (fractional) pair index whose wavelength fits `turns` times into the original context.
        def pair_at(turns: float) -> float:
            return (
                h
                * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(cfg.rope_theta))
            )

        lo, hi = pair_at(s.beta_fast), pair_at(s.beta_slow)
        if s.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, h - 1)
        if hi == lo:
            hi += 0.001
        ramp = np.clip((np.arange(h // 2, dtype=f32) - f32(lo)) / f32(hi - lo), f32(0.0), f32(1.0))  # 1: interpolate
        keep = f32(1.0) - ramp
        inv = (f32(1.0) / (f32(s.factor) * powers)) * (f32(1.0) - keep) + inv * keep
    return inv.astype(f32)


def rope_attention_factor(cfg: ModelConfig, *, local: bool = False) -> float:
    """What cos and sin are multiplied by (YaRN's temperature; 1 for every other kind of RoPE)."""
    if local and cfg.local_rope_theta is not None:
        return 1.0
    s = cfg.rope_scaling
    return s.attention_factor if isinstance(s, YarnRopeScaling) else 1.0
