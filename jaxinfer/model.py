"""The functional Llama-family model and the two jitted entry points, `prefill` and `decode_step`.

The Flax modules describe the computation; parameters are a plain pytree passed to `apply`, and
the KV cache goes in and comes out as an explicit argument. Nothing keeps state in a module.

Each parameter is declared once, in the module that uses it, with its shape and logical axis
names; the abstract tree, the initialiser and the sharding (`jaxinfer/sharding.py`) all derive
from that one declaration (`param_axes`, `init_params`). Einsum letters: see the glossary in WORKSPACE.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import attention
from jaxinfer.config import ModelConfig, rope_attention_factor, rope_inv_freq
from jaxinfer.kv_cache import Batch, KVCache
from jaxinfer.matmul import einsum_f32, from_strips, stored_in_strips, to_strips
from jaxinfer.matmul import project as _project
from jaxinfer.numerics import sum_last_axis

_normal = nn.initializers.normal(stddev=0.02)


def _param(module: nn.Module, name: str, shape, axes, init=_normal):
    dtype = jnp.dtype(module.cfg.dtype)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * w, statistics in float32 (summed in a shape-independent order), scaled in the
    model dtype (as HF does).

    With `cfg.norm_unit_offset` (Gemma) the stored weight is w and the scale is (1 + w), applied in
    float32 before the cast back, as the Gemma reference does; the weight then starts at zero.
    """

    cfg: ModelConfig
    dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        offset = self.cfg.norm_unit_offset
        init = nn.initializers.zeros if offset else nn.initializers.ones
        w = _param(self, "scale", (self.dim,), ("norm",), init)
        x32 = x.astype(jnp.float32)
        mean_square = sum_last_axis(x32 * x32) / self.dim  # batch-invariant: see sum_last_axis
        y = x32 * jax.lax.rsqrt(mean_square + self.cfg.rms_norm_eps)
        if offset:
            return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * y.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array, *, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, H] for the rotate-half RoPE convention used by HF checkpoints.

    `local=True`: the sliding-window layers' table (see `rope_inv_freq`).
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg, local=local), jnp.float32)  # [H/2]
    scale = rope_attention_factor(cfg, local=local)

    def tables(positions):
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
        angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos, sin

    return _computed_once(tables, positions)


def _computed_once(fn, x):
    """fn(x), where on the CPU it is computed once into a buffer rather than inside each consumer.

    XLA CPU fuses an elementwise producer into every consumer and evaluates it per element of that
    consumer: the RoPE tables' cos and sin ([B, T, H]) were computed once per head (16 times for q, 4
    for k) in every layer's rotation, 270 us of each layer of a 48-row decode step of the 150M Llama.
    An optimization_barrier does not stop it (XLA expands barriers before fusing). A conditional's
    result is a buffer, so the tables go through one whose branches are both `fn`: the predicate
    only has to be traced. Measured 2026-12-06 night, the same program with and without, alternating
    calls in one process: 1.05-1.06x at 48 rows, 1.04x for a 512-token prompt, the same logits. Not
    on accelerators, where a conditional's predicate costs a device-to-host wait.
    """
    if jax.default_backend() != "cpu":
        return fn(x)
    return jax.lax.cond(jnp.all(x >= 0), fn, fn, x)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, H]; cos/sin: [B, T, H]. Computed in x's dtype, like the reference."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, batch: Batch, table, slots, k_pages, v_pages):
        cfg = self.cfg
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        fused = qkv_fused(cfg)
        if fused:  # q, k and v heads side by side, in strips: one product (see `to_weight_strips`)
            wqkv = _param(self, "wqkv", (d, n + 2 * k, h), ("embed", "qkv_heads", "head_dim"))
        else:
            wq = _param(self, "wq", (d, n, h), ("embed", "q_heads", "head_dim"))
            wk = _param(self, "wk", (d, k, h), ("embed", "kv_heads", "head_dim"))
            wv = _param(self, "wv", (d, k, h), ("embed", "kv_heads", "head_dim"))
        wo = _param(self, "wo", (n, h, d), ("q_heads", "head_dim", "embed"))

        bq = bk = bv = None
        if cfg.qkv_bias:
            zeros = nn.initializers.zeros
            bq = _param(self, "bq", (n, h), ("q_heads", "head_dim"), zeros)
            bk = _param(self, "bk", (k, h), ("kv_heads", "head_dim"), zeros)
            bv = _param(self, "bv", (k, h), ("kv_heads", "head_dim"), zeros)
        if fused:
            bqkv = None if bq is None else jnp.concatenate([bq, bk, bv], axis=0)
            qkv = _project("BTD,DNH->BTNH", x, wqkv, bqkv, strips=cfg.weight_strips)
            q, kx, vx = jnp.split(qkv, [n, n + k], axis=2)
        else:
            q = _project("BTD,DNH->BTNH", x, wq, bq, strips=cfg.weight_strips)
            kx = _project("BTD,DKH->BTKH", x, wk, bk, strips=cfg.weight_strips)
            vx = _project("BTD,DKH->BTKH", x, wv, bv, strips=cfg.weight_strips)
        if cfg.qk_norm:
            q = RMSNorm(cfg, h, name="q_norm")(q)
            kx = RMSNorm(cfg, h, name="k_norm")(kx)
        q = apply_rope(q, cos, sin)
        kx = apply_rope(kx, cos, sin)

        k_pages, v_pages = attention.write_kv(k_pages, v_pages, kx, vx, slots, backend=cfg.attention_backend)
        out = attention.paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            batch.positions(),
            batch.kv_lens,
            scale=cfg.attention_scale,
            kind=cfg.attention_kind(self.layer),
            soft_cap=cfg.attn_logit_softcap,
            q_lens=batch.q_lens,
            backend=cfg.attention_backend,
        )  # [B, T, N, H]
        # Contract over one merged N*H axis: with two contracting axes XLA CPU re-lays-out (copies)
        # the whole of wo on every step.
        b, t = out.shape[:2]
        bo = _param(self, "bo", (d,), ("embed",), nn.initializers.zeros) if cfg.o_bias else None
        o = _project("BTE,ED->BTD", out.reshape(b, t, n * h), wo.reshape(n * h, d), bo, strips=cfg.weight_strips)
        return o, k_pages, v_pages


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), with gate and up as one [D, 2, F] weight.

    act is SiLU (SwiGLU, Llama) or GELU (GeGLU, Gemma): `cfg.mlp_activation`.

    One matrix-vector product over the merged weight streams it faster than two over the halves
    (XLA CPU: 3-6% of a whole 150M decode step); the F axis shards over `mlp`.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        w_gate_up = _param(self, "w_gate_up", (d, 2, f), ("embed", None, "mlp"))
        b_gate_up = b_down = None
        if self.cfg.mlp_bias:
            b_gate_up = _param(self, "b_gate_up", (2, f), (None, "mlp"), nn.initializers.zeros)
            b_down = _param(self, "b_down", (d,), ("embed",), nn.initializers.zeros)
        gate_up = _project("BTD,DCF->BTCF", x, w_gate_up, b_gate_up, strips=self.cfg.weight_strips)  # C = 2: gate, up
        h = _ACTIVATIONS[self.cfg.mlp_activation](gate_up[:, :, 0]) * gate_up[:, :, 1]
        return _project(
            "BTF,FD->BTD", h, _param(self, "w_down", (f, d), ("mlp", "embed")), b_down, strips=self.cfg.weight_strips
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with `cfg.post_norms` (Gemma 2/3) each block's output is
    normed again before it joins the residual stream."""

    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, batch, table, slots, k_pages, v_pages):
        d = self.cfg.hidden_size
        with jax.named_scope("attention"):
            h, k_pages, v_pages = Attention(self.cfg, self.layer, name="attn")(
                RMSNorm(self.cfg, d, name="attn_norm")(x), cos, sin, batch, table, slots, k_pages, v_pages
            )
            if self.cfg.post_norms:
                h = RMSNorm(self.cfg, d, name="attn_post_norm")(h)
        x = x + h
        with jax.named_scope("mlp"):
            h = MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, d, name="mlp_norm")(x))
            if self.cfg.post_norms:
                h = RMSNorm(self.cfg, d, name="mlp_post_norm")(h)
        x = x + h
        return x, k_pages, v_pages


class Transformer(nn.Module):
    """Embedding -> L decoder layers over the paged cache -> final norm -> last-token logits.

    With `targets` ([B, T] token ids), also the PromptLogprobs of every position (top `top_n`)."""

    cfg: ModelConfig
    top_n: int = 0

    @nn.compact
    def __call__(self, batch: Batch, cache: KVCache, targets: jax.Array | None = None):
        cfg = self.cfg
        embedding = _param(self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        x = jnp.take(embedding, batch.tokens, axis=0)  # [B, T, D]
        if cfg.embed_scale:  # the factor is rounded to the params dtype first, as the Gemma reference does
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        rope = rope_tables(cfg, batch.positions())
        local = cfg.local_rope_theta is not None and any(cfg.uses_local_rope(i) for i in range(cfg.num_layers))
        local_rope = rope_tables(cfg, batch.positions(), local=True) if local else rope
        # Write slots: computed once, shared by every layer of a pool kind (see kv_cache: a hybrid
        # model's sliding-window layers may have pools and a page table of their own).
        tables = {False: (batch.page_table, batch.slots(cache.page_size))}
        windowed = batch.window_page_table
        tables[True] = tables[False] if windowed is None else (windowed, batch.slots(cache.page_size, windowed))

        ks, vs = list(cache.k), list(cache.v)
        for i in range(cfg.num_layers):
            with jax.named_scope(f"layer_{i}"):
                cos, sin = local_rope if cfg.uses_local_rope(i) else rope
                table, slots = tables[cfg.in_window_pool(i)]
                x, ks[i], vs[i] = DecoderLayer(cfg, i, name=f"layer_{i}")(
                    x, cos, sin, batch, table, slots, ks[i], vs[i]
                )

        norm = RMSNorm(cfg, cfg.hidden_size, name="final_norm")
        if cfg.tie_word_embeddings:
            head, spec = embedding, "BD,VD->BV"
        else:
            head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
            spec = "BD,DV->BV"

        def logits_of(h):  # [N, D], normed -> [N, V] float32
            logits = einsum_f32(spec, h, head, strips=cfg.weight_strips)
            if cfg.final_logit_softcap is not None:
                logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
            return logits

        # Only each row's last new token needs logits: gather before the norm and LM head.
        last = jnp.maximum(batch.q_lens - 1, 0)
        logits = logits_of(norm(jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]))  # [B, V]
        cache = KVCache(k=tuple(ks), v=tuple(vs))
        if targets is None:
            return logits, cache
        return logits, cache, _prompt_logprobs(logits_of, norm(x), targets, vocab=cfg.vocab_size, top_n=self.top_n)


class PromptLogprobs(NamedTuple):
    """Log-probabilities at every position of a prompt chunk: position t's distribution is over the
    token after it (the raw distribution: no sampling parameter touches it)."""

    logprob: jax.Array  # [B, T] float32: log p(targets[b, t] | the tokens up to position t)
    top_ids: jax.Array  # [B, T, top_n] int32, most likely first
    top_logprobs: jax.Array  # [B, T, top_n] float32


# Logits of at most this many elements (64 MiB of float32) exist at once while PromptLogprobs are
# computed: a 2048-token chunk of a 256k-vocabulary model would otherwise need 2 GiB for them.
_PROMPT_LOGITS_BLOCK = 2**24


def _prompt_logprobs(logits_of, hidden: jax.Array, targets: jax.Array, *, vocab: int, top_n: int) -> PromptLogprobs:
    """PromptLogprobs from the normed hidden states [B, T, D], a block of positions at a time."""
    b, t, d = hidden.shape
    n = b * t
    rows = min(n, 1 << max(0, (_PROMPT_LOGITS_BLOCK // vocab).bit_length() - 1))
    pad = -n % rows
    h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, rows, d)
    tg = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad)).reshape(-1, rows)

    def block(args):
        h, tg = args
        lp = jax.nn.log_softmax(logits_of(h), axis=-1)
        chosen = jnp.take_along_axis(lp, tg[:, None], axis=1, mode="clip")[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, top_n)
        return chosen, top_ids.astype(jnp.int32), top_lp

    chosen, top_ids, top_lp = jax.lax.map(block, (h, tg))
    return PromptLogprobs(
        logprob=chosen.reshape(-1)[:n].reshape(b, t),
        top_ids=top_ids.reshape(-1, top_n)[:n].reshape(b, t, top_n),
        top_logprobs=top_lp.reshape(-1, top_n)[:n].reshape(b, t, top_n),
    )


# ----------------------------------------------------------------------------------------------
# The functional core (contract): pure, jitted once, cache donated.


def forward(params, cache: KVCache, batch: Batch, *, cfg: ModelConfig):
    """The un-jitted step behind `prefill` and `decode_step`, for composing into larger jitted programs."""
    return Transformer(cfg).apply({"params": params}, batch, cache)


def _decode(params, cache: KVCache, batch: Batch, *, cfg: ModelConfig):
    if batch.tokens.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got tokens of shape {batch.tokens.shape}")
    return forward(params, cache, batch, cfg=cfg)


prefill = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))
prefill.__doc__ = """Processes a chunk of prompt tokens for each row and writes their K/V into the cache.

Args:
    params: parameter pytree (from `init_params` or a checkpoint loader).
    cache: KVCache, donated: do not use the argument after the call.
    batch: Batch with tokens [B, T]; rows may start mid-sequence (chunked prefill, prefix reuse).
    cfg: ModelConfig (static).

Returns:
    (logits [B, V] float32 at each row's last new token, the new KVCache).
"""


def forward_with_prompt_logprobs(
    params, cache: KVCache, batch: Batch, targets: jax.Array, *, cfg: ModelConfig, top_n: int
):
    """`forward`, plus the PromptLogprobs of `targets` [B, T] (the token after each position; any id
    where none is wanted) with the top `top_n` of every position: (logits, KVCache, PromptLogprobs)."""
    return Transformer(cfg, top_n=top_n).apply({"params": params}, batch, cache, targets)


prefill_with_prompt_logprobs = jax.jit(
    forward_with_prompt_logprobs, static_argnames=("cfg", "top_n"), donate_argnames=("cache",)
)
prefill_with_prompt_logprobs.__doc__ = """`prefill` that also returns the PromptLogprobs of `targets`
[B, T] (see `forward_with_prompt_logprobs`); the logits it returns are exactly `prefill`'s."""

decode_step_fn = _decode  # un-jitted, for callers that jit with their own shardings (Engine on a mesh)
decode_step = jax.jit(_decode, static_argnames=("cfg",), donate_argnames=("cache",))
decode_step.__doc__ = """One new token per row (tokens [B, 1]); otherwise exactly `prefill`."""


@functools.cache
def _steps_compiled_with(options: tuple[tuple[str, str], ...]):
    jit = functools.partial(
        jax.jit, static_argnames=("cfg",), donate_argnames=("cache",), compiler_options=dict(options)
    )
    prompt_lp = functools.partial(jit, static_argnames=("cfg", "top_n"))
    return jit(forward), jit(_decode), prompt_lp(forward_with_prompt_logprobs)


def step_compiler_options(cfg: ModelConfig, platform: str) -> dict[str, str] | None:
    """XLA compiler options for `cfg`'s steps on `platform`: `_xla_flags.bf16_dot_options` for a
    bfloat16 model on a CPU, else None (the process's XLA flags as they are)."""
    from jaxinfer._xla_flags import bf16_dot_options

    return bf16_dot_options() if platform == "cpu" and cfg.dtype == "bfloat16" else None


def jitted_steps(cfg: ModelConfig, platform: str):
    """(prefill, decode_step, prefill_with_prompt_logprobs) for `cfg` on `platform`: the module's own
    jitted steps, or where `step_compiler_options` gives options, the same functions compiled with
    them (built once per process, like the module's)."""
    options = step_compiler_options(cfg, platform)
    if options is None:
        return prefill, decode_step, prefill_with_prompt_logprobs
    return _steps_compiled_with(tuple(sorted(options.items())))


def _dummy_inputs(cfg: ModelConfig) -> tuple[Batch, KVCache]:
    one = jnp.ones((1,), jnp.int32)
    batch = Batch(tokens=jnp.zeros((1, 1), jnp.int32), q_lens=one, kv_lens=one, page_table=jnp.ones((1, 1), jnp.int32))
    return batch, KVCache.create(cfg, num_pages=2, page_size=1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _init(key, *, cfg: ModelConfig):
    batch, cache = _dummy_inputs(cfg)
    return nn.unbox(Transformer(cfg).init(key, batch, cache)["params"])


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters as a pytree: normal(0.02) weights, zero biases, norm scales of one (zeros
    where the norm adds one itself, as Gemma's do)."""
    return _init(jax.random.key(seed), cfg=cfg)


def param_axes(cfg: ModelConfig):
    """The logical axis names of every parameter, as a pytree of PartitionSpec (no compute)."""
    batch, cache = _dummy_inputs(cfg)
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), batch, cache)["params"])
    return nn.get_partition_spec(boxed)


def abstract_params(cfg: ModelConfig):
    """ShapeDtypeStructs of every parameter (no compute)."""
    return jax.eval_shape(lambda: init_params(cfg))


def params_nbytes(params) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))


# Every weight that `matmul.project` or the LM head's product takes, and how many of its leading
# axes the product contracts: what `to_weight_strips` lays out and einsum_f32 reads back by
# matmul.stored_in_strips. (wqkv: q, k and v fused, which only the strips have.)
_PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "lm_head": 1}


def _fused_in_strips(shape, dtype, cols: int) -> bool:
    """Whether the fused [D, N + 2K, H] weight of this shape is kept in strips (then the model has it
    in place of wq, wk and wv)."""
    return stored_in_strips(1, shape, dtype, cols)


def qkv_fused(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s attention computes q, k and v as one product on a fused `wqkv`: where its
    weights are in strips (`cfg.weight_strips`) and the fused weight qualifies. One call streams
    what three did; k and v ([1024, 256] in the 150M Llama) alone are too small for strips, and
    XLA's dot read them at ~11 GB/s in a decode step (2026-12-06)."""
    shape = (cfg.hidden_size, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
    return bool(cfg.weight_strips) and _fused_in_strips(shape, cfg.dtype, cfg.weight_strips)


def _fusable(node, cols: int) -> bool:
    """Whether `node`, an attention's params, holds wq, wk and wv whose fused weight is kept in strips."""
    if not {"wq", "wk", "wv"} <= node.keys():
        return False
    (d, n, h), k = node["wq"].shape, node["wk"].shape[1]
    return _fused_in_strips((d, n + 2 * k, h), node["wq"].dtype, cols)


def _is_attention(node) -> bool:
    return isinstance(node, Mapping) and ({"wq", "wk", "wv"} <= node.keys() or "wqkv" in node)


def _attention_nodes(params):
    """Every attention's params (a mapping holding wq, wk and wv, or wqkv) in the tree."""
    if _is_attention(params):
        yield params
    elif isinstance(params, Mapping):
        for value in params.values():
            yield from _attention_nodes(value)


def _map_attention(params, change):
    """params with every attention's params replaced by `change(node)`, the rest as it is."""
    if _is_attention(params):
        return change(params)
    if isinstance(params, Mapping):
        return {key: _map_attention(value, change) for key, value in params.items()}
    return params


@jax.jit
def _concat_heads(wq, wk, wv):
    return jnp.concatenate([wq, wk, wv], axis=1)


def _fuse_qkv(params, cols: int):
    def fuse(node):
        if not _fusable(node, cols):
            return dict(node)
        rest = {key: v for key, v in node.items() if key not in ("wq", "wk", "wv")}
        wqkv = _concat_heads(node["wq"], node["wk"], node["wv"])
        for key in ("wq", "wk", "wv"):  # consumed, as a donated leaf is (a size-changing jit cannot reuse them)
            node[key].delete()
        return {**rest, "wqkv": wqkv}

    return _map_attention(params, fuse)


def _split_qkv(params):
    def split(node):
        if "wqkv" not in node:
            return dict(node)
        rest = {key: v for key, v in node.items() if key != "wqkv"}
        n = node["wo"].shape[0]  # q heads
        k = (node["wqkv"].shape[1] - n) // 2
        wq, wk, wv = jnp.split(node["wqkv"], [n, n + k], axis=1)
        return {**rest, "wq": wq, "wk": wk, "wv": wv}

    return _map_attention(params, split)


def _contracted_in_strips(path, w, cols: int) -> int | None:
    """How many leading axes of the weight at `path` its product contracts, if it is kept in strips."""
    contracted = _PROJECTIONS.get(getattr(path[-1], "key", None))
    return contracted if contracted is not None and stored_in_strips(contracted, w.shape, w.dtype, cols) else None


def has_weight_strips(params, cols: int) -> bool:
    """Whether `to_weight_strips(params, cols)` would lay any weight out."""
    return any(_fusable(node, cols) for node in _attention_nodes(params)) or any(
        _contracted_in_strips(path, w, cols) for path, w in jax.tree_util.tree_leaves_with_path(params)
    )


def _strips_map(params, cols: int, change):
    def lay_out(path, w):
        contracted = _contracted_in_strips(path, w, cols)
        return w if contracted is None else change(w, contracted=contracted, cols=cols)

    return jax.tree_util.tree_map_with_path(lay_out, params)


@functools.partial(jax.jit, static_argnames=("contracted", "cols"), donate_argnums=0)
def _to_strips(w: jax.Array, *, contracted: int, cols: int) -> jax.Array:
    k = int(np.prod(w.shape[:contracted]))
    return to_strips(w.reshape(k, -1), cols).reshape(w.shape)


@functools.partial(jax.jit, static_argnames=("contracted", "cols"))
def _from_strips(w: jax.Array, *, contracted: int, cols: int) -> jax.Array:
    k = int(np.prod(w.shape[:contracted]))
    return from_strips(w.reshape(k, -1), cols).reshape(w.shape)


def to_weight_strips(params, cols: int):
    """`params` with each projection weight that matmul.stored_in_strips keeps in strips of `cols`
    columns laid out so, leaf by leaf (each old leaf is donated: the model's weights are never held
    twice); where the fused [D, N + 2K, H] weight qualifies, an attention's wq, wk and wv become one
    `wqkv` first (`qkv_fused`). Use the result with `dataclasses.replace(cfg, weight_strips=cols)`."""
    return _strips_map(_fuse_qkv(params, cols), cols, _to_strips)


def from_weight_strips(params, cols: int):
    """The declared layout of params that `to_weight_strips(..., cols)` laid out (new arrays; wq,
    wk and wv apart again)."""
    return _split_qkv(_strips_map(params, cols, _from_strips))
