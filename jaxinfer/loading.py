"""Loading Hugging Face checkpoints: safetensors (single or sharded) into the parameter pytree.

Tensors are read one at a time through a memory map and placed on their devices before the next
is read, so host memory holds about one tensor (in its converted layout), not the model. With target
shardings, each device's shard is cut from the memory-mapped view and converted on its own
(`jax.make_array_from_callback`), so a process reads only the slices its own devices hold: on a
multi-host mesh no process ever touches a whole tensor it does not keep. The safetensors format is
simple enough (8-byte header length, JSON header, raw little-endian data) that reading it directly
gives us bfloat16 through ml_dtypes and precise errors for truncated files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig, load_hf_config
from jaxinfer.errors import CheckpointError
from jaxinfer.model import abstract_params

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

_FLOAT_DTYPES = {np.dtype(_ST_DTYPES[k]) for k in ("F64", "F32", "F16", "BF16")}


class SafetensorsFile:
    """A memory-mapped safetensors file; `get(name)` returns a zero-copy view."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: not a file")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.header = header
        self._data_start = 8 + n
        self._data_len = size - 8 - n
        self._check_entries()
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def _check_entries(self) -> None:
        """Every tensor's entry is well formed, lies inside the data section, matches its shape and
        dtype, and overlaps no other tensor: a bad entry must not read the header or a neighbour as
        weights."""
        spans = []
        for name, info in self.header.items():
            bad = f"{self.path}: tensor {name!r} has a corrupt header entry"
            if not isinstance(info, dict):
                raise CheckpointError(f"{bad} ({info!r})")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype!r}")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise CheckpointError(f"{bad} (shape {shape!r})")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
                raise CheckpointError(f"{bad} (data_offsets {offsets!r})")
            begin, end = offsets
            expected = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize
            if not 0 <= begin <= end <= self._data_len or end - begin != expected:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} is truncated or corrupt "
                    f"(needs bytes {begin}..{end} for {expected} bytes, data section has {self._data_len})"
                )
            spans.append((begin, end, name))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.path}: tensors {a!r} and {b!r} overlap")

    def keys(self) -> list[str]:
        return list(self.header)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a zero-copy uint8 view."""
        begin, end = self.header[name]["data_offsets"]  # checked at open
        return self._mmap[self._data_start + begin : self._data_start + end]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        return self.raw(name).view(_ST_DTYPES[info["dtype"]]).reshape(tuple(info["shape"]))


def _checkpoint_files(model_dir: str) -> dict[str, str]:
    """Maps tensor name -> file, choosing the checkpoint as transformers does: `model.safetensors`
    when it exists (other *.safetensors beside it - an adapter, a Mistral-format copy - are not
    read), else the shards `model.safetensors.index.json` lists, else every *.safetensors file."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return dict.fromkeys(SafetensorsFile(single).keys(), single)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index (weight_map must map tensor names to file names)")
        for fname in set(weight_map.values()):
            if os.path.isabs(fname) or ".." in fname.replace("\\", "/").split("/"):
                raise CheckpointError(f"{index}: file name {fname!r} points outside the model directory")
            if not os.path.isfile(os.path.join(model_dir, fname)):
                raise CheckpointError(f"{index} points at missing file {fname!r}")
        return _tensors_of_shards(model_dir, index, weight_map)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        pickled = sorted(f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth")))
        hint = (
            f" (PyTorch pickles such as {pickled[0]!r} are not read: save the model with transformers' "
            "save_pretrained(..., safe_serialization=True) to get safetensors)"
            if pickled
            else ""
        )
        raise CheckpointError(f"model directory {model_dir!r} has no *.safetensors files{hint}")
    out = {}
    for fname in files:
        for k in SafetensorsFile(os.path.join(model_dir, fname)).keys():
            if k in out:  # without an index nothing says which copy is meant
                raise CheckpointError(
                    f"tensor {k!r} is in both {os.path.basename(out[k])} and {fname} (and there is neither a "
                    "model.safetensors nor a model.safetensors.index.json to say which to use)"
                )
            out[k] = os.path.join(model_dir, fname)
    return out


def _tensors_of_shards(model_dir: str, index: str, weight_map: dict[str, str]) -> dict[str, str]:
    """Tensor name -> file for the shards an index lists, read off the shards' own headers, as
    transformers reads every tensor of every listed shard: a tensor the weight_map leaves out or files
    under another listed shard is found where it is. A tensor held by two shards with different
    values is refused by name (transformers silently takes the later file's, a stale copy left by
    a botched re-shard as often as not); one listed but held by none is missing."""
    out: dict[str, str] = {}
    opened: dict[str, SafetensorsFile] = {}
    for fname in sorted(set(weight_map.values())):
        path = os.path.join(model_dir, fname)
        opened[path] = shard = SafetensorsFile(path)
        for k in shard.keys():
            first = out.setdefault(k, path)
            if first != path and not _same_bytes(opened[first], shard, k):
                raise CheckpointError(
                    f"{index}: tensor {k!r} is in both {os.path.basename(first)} and {fname} with different "
                    "values; remove the stale copy (or its shard from the index)"
                )
    for k, fname in weight_map.items():
        if k not in out:
            raise CheckpointError(f"{index} lists tensor {k!r} in {fname!r}, but no listed shard holds it")
    return out


def _same_bytes(a: SafetensorsFile, b: SafetensorsFile, name: str) -> bool:
    """Whether two files hold the tensor `name` with the same dtype, shape and bytes."""
    ha, hb = a.header[name], b.header[name]
    if (ha["dtype"], ha["shape"]) != (hb["dtype"], hb["shape"]):
        return False
    x, y = a.raw(name), b.raw(name)
    step = 1 << 26  # 64 MiB at a time: no full-size temporaries for a duplicated embedding
    return all(np.array_equal(x[i : i + step], y[i : i + step]) for i in range(0, len(x), step))


def stored_float_dtype(model_dir: str) -> str | None:
    """The dtype a Hugging Face checkpoint stores its weights in ("bfloat16", "float16", ...), read
    from the safetensors headers: the embedding's, else the first floating-point tensor's. transformers'
    dtype="auto" falls back to the stored weights when config.json names no dtype. None when the
    checkpoint has no floating-point tensor."""
    stored = _checkpoint_files(model_dir)
    names = _text_decoder_names(stored)
    embedding = names.get("model.embed_tokens.weight")
    headers: dict[str, dict] = {}
    for name in ([embedding] if embedding else []) + list(stored):
        path = stored[name]
        if path not in headers:
            headers[path] = SafetensorsFile(path).header
        dtype = np.dtype(_ST_DTYPES[headers[path][name]["dtype"]]) if name in headers[path] else None
        if dtype in _FLOAT_DTYPES:
            return dtype.name
    return None


def auto_dtype(model_dir: str) -> str:
    """What dtype="auto" computes a Hugging Face checkpoint in: its config's `dtype` (`torch_dtype`
    before transformers 5), else (as transformers) its weights' dtype; "bfloat16" for bfloat16 and
    float16 (jaxinfer has no float16 path; same memory), else "float32" - also for a directory it
    cannot read, whose load then names what is wrong."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
        stored = hf.get("dtype") or hf.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
        if stored is None:
            stored = stored_float_dtype(model_dir)
    except (OSError, ValueError, RecursionError, AttributeError, CheckpointError):
        return "float32"
    return "bfloat16" if stored in ("bfloat16", "float16") else "float32"


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality of two (memory-mapped) tensors of one shape, a block of rows at a time."""
    rows = max(1, (1 << 24) // max(1, a[0].size * 4)) if a.ndim else 1
    for i in range(0, len(a) if a.ndim else 1, rows):
        x, y = (a[i : i + rows], b[i : i + rows]) if a.ndim else (a, b)
        if not np.array_equal(x.astype(np.float32), y.astype(np.float32)):
            return False
    return True


def _tying_as_stored(model_dir: str, cfg: ModelConfig) -> ModelConfig:
    """The config's tying, checked against what the checkpoint stores (as transformers 5 does).

    A config that ties the LM head to the embedding while the checkpoint stores an `lm_head.weight`
    with different values (a fine-tune that trained the head and kept the flag) is loaded untied, with
    the stored head, and a warning."""
    if not cfg.tie_word_embeddings:
        return cfg
    stored = _checkpoint_files(model_dir)
    names = _text_decoder_names(stored)
    if not {"model.embed_tokens.weight", "lm_head.weight"} <= names.keys():
        return cfg

    def read(name):
        return SafetensorsFile(stored[names[name]]).get(names[name])

    embedding, head = read("model.embed_tokens.weight"), read("lm_head.weight")
    if head.shape != embedding.shape:
        raise CheckpointError(
            f"tensor {names['lm_head.weight']!r} {tuple(head.shape)} does not fit the config (expected "
            f"{tuple(embedding.shape)}, the embedding's shape): wrong shape"
        )
    if _arrays_equal(embedding, head):
        return cfg
    sys.stderr.write(
        f"jaxinfer: {model_dir}: config.json ties the LM head to the embedding (tie_word_embeddings), but the "
        "checkpoint stores an lm_head.weight with different values; using it, untied (as transformers does). "
        "Set tie_word_embeddings to false in config.json to silence this.\n"
    )
    return dataclasses.replace(cfg, tie_word_embeddings=False)


# (HF names, our path, converter): the converter gets the HF arrays (memory-map views: one, or several
# to merge) and the target shape, and returns a LAZY view in our layout: anything with `.shape` and
# numpy indexing. Nothing is read until a shard of it is indexed and made contiguous.
def _linear_in_out(x, shape):  # HF Linear weight [out, in] -> [in, *out_split] (transpose + split: a view)
    out_dim, in_dim = x.shape  # the reshape must only split axes: a transposed matrix of the same size is refused
    if not any(math.prod(shape[:s]) == in_dim and math.prod(shape[s:]) == out_dim for s in range(1, len(shape))):
        raise ValueError("not an [out, in] weight of this shape")
    return x.T.reshape(shape)


def _same(x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError("shape")
    return x


def _heads(x, shape):  # a bias over heads: HF [N * H] -> [N, H]
    if tuple(x.shape) != (math.prod(shape),):
        raise ValueError("shape")
    return x.reshape(shape)


def _transpose(x, shape):
    return x.T


def _gate_up_bias(gate, up, shape):  # two HF [F] -> our [2, F] (gate, up)
    if gate.shape != up.shape or (2, *gate.shape) != tuple(shape):
        raise ValueError("shape")
    return np.stack([gate, up])


class _GateUp:
    """gate_proj and up_proj (two HF [F, D]) seen as our merged [D, 2, F], without stacking them."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, shape: tuple[int, ...]):
        if gate.shape != up.shape or (gate.shape[1], 2, gate.shape[0]) != tuple(shape):
            raise ValueError("gate/up shapes")
        self.parts, self.shape = (gate.T, up.T), tuple(shape)

    def __getitem__(self, idx):
        idx = () if idx is Ellipsis else tuple(idx)
        d, which, f = (idx + (slice(None),) * 3)[:3]
        return np.stack([p[d, f] for p in self.parts[which]], axis=1)


def _hf_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], object]]:
    yield ("model.embed_tokens.weight",), ("embedding",), _same
    yield ("model.norm.weight",), ("final_norm", "scale"), _same
    if not cfg.tie_word_embeddings:
        yield ("lm_head.weight",), ("lm_head",), _transpose
    for i in range(cfg.num_layers):
        pre, ours = f"model.layers.{i}.", f"layer_{i}"
        yield (pre + "input_layernorm.weight",), (ours, "attn_norm", "scale"), _same
        if cfg.post_norms:  # Gemma 2/3: post_attention_layernorm norms the attention OUTPUT
            yield (pre + "post_attention_layernorm.weight",), (ours, "attn_post_norm", "scale"), _same
            yield (pre + "pre_feedforward_layernorm.weight",), (ours, "mlp_norm", "scale"), _same
            yield (pre + "post_feedforward_layernorm.weight",), (ours, "mlp_post_norm", "scale"), _same
        else:
            yield (pre + "post_attention_layernorm.weight",), (ours, "mlp_norm", "scale"), _same
        for hf, me in (("q", "q"), ("k", "k"), ("v", "v")):
            yield (pre + f"self_attn.{hf}_proj.weight",), (ours, "attn", f"w{me}"), _linear_in_out
            if cfg.qkv_bias:
                yield (pre + f"self_attn.{hf}_proj.bias",), (ours, "attn", f"b{me}"), _heads
        # o_proj [D, N*H] -> [N, H, D]
        yield (pre + "self_attn.o_proj.weight",), (ours, "attn", "wo"), _linear_in_out
        if cfg.o_bias:
            yield (pre + "self_attn.o_proj.bias",), (ours, "attn", "bo"), _same
        if cfg.qk_norm:
            yield (pre + "self_attn.q_norm.weight",), (ours, "attn", "q_norm", "scale"), _same
            yield (pre + "self_attn.k_norm.weight",), (ours, "attn", "k_norm", "scale"), _same
        yield (pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"), (ours, "mlp", "w_gate_up"), _GateUp
        yield (pre + "mlp.down_proj.weight",), (ours, "mlp", "w_down"), _transpose
        if cfg.mlp_bias:
            yield (pre + "mlp.gate_proj.bias", pre + "mlp.up_proj.bias"), (ours, "mlp", "b_gate_up"), _gate_up_bias
            yield (pre + "mlp.down_proj.bias",), (ours, "mlp", "b_down"), _same


# Tensors checkpoints carry that hold no parameters of ours.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")

# Vision-language checkpoints (Gemma 3) keep the text decoder under a prefix, next to a vision tower
# and projector that text prompts never use: (prefix in the file, the text-only model's prefix).
_TEXT_DECODER_PREFIXES = (
    ("language_model.model.", "model."),  # what transformers writes (v4 and v5)
    ("model.language_model.", "model."),  # transformers v5's in-memory names
    ("language_model.lm_head.", "lm_head."),
)
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def _text_decoder_names(names) -> dict[str, str]:
    """Maps text-only tensor names to the names stored in the checkpoint (identity for text models).

    For a vision-language checkpoint the vision tensors are left out, so they are neither loaded
    nor reported as unexpected."""
    if not any(n.startswith(tuple(p for p, _ in _TEXT_DECODER_PREFIXES)) for n in names):
        if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names:
            # Written by the base class (LlamaModel: no "model." prefix); transformers' from_pretrained
            # adds the prefix, and so do we.
            return {(n if n.startswith("lm_head.") else f"model.{n}"): n for n in names}
        return {n: n for n in names}
    out = {}
    for n in names:
        if _VISION.match(n):
            continue
        plain = next((new + n[len(old) :] for old, new in _TEXT_DECODER_PREFIXES if n.startswith(old)), n)
        out[plain] = n
    return out


def load_safetensors_params(model_dir: str, cfg: ModelConfig, *, shardings=None):
    """Reads a HF safetensors checkpoint into the parameter pytree, one tensor at a time.

    Args:
        model_dir: directory with `*.safetensors` (optionally `model.safetensors.index.json`).
        cfg: the model config (from the same directory's config.json).
        shardings: optional pytree of shardings matching the parameter tree.

    Raises:
        CheckpointError: naming the tensor or file that is missing, extra, corrupt or misshapen.
    """
    stored = _checkpoint_files(model_dir)
    names = _text_decoder_names(stored)  # our HF-style name -> name in the file
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in names and "lm_head.weight" in names:
        # A tied model saved with only its head (safetensors' save_model keeps one of two shared
        # tensors): the embedding is that tensor, as transformers ties it.
        names["model.embed_tokens.weight"] = names.pop("lm_head.weight")
    files = {n: stored[s] for n, s in names.items()}
    todo = list(_hf_names(cfg))
    # Before tracing the model (~30 ms a layer): a config.json with too many layers fails at once.
    if missing := next((n for hf_names, _, _ in todo for n in hf_names if n not in files), None):
        raise CheckpointError(f"checkpoint in {model_dir!r} is missing tensor {missing!r}")
    abstract = abstract_params(cfg)
    opened: dict[str, SafetensorsFile] = {}
    params: dict = {}
    expected = set()
    target_dtype = np.dtype(cfg.dtype) if cfg.dtype != "bfloat16" else np.dtype(ml_dtypes.bfloat16)
    progress = _Progress(len(todo), f"loading {os.path.basename(os.path.normpath(model_dir))}")
    for hf_names, path, convert in todo:
        raws = []
        for hf_name in hf_names:
            expected.add(hf_name)
            if hf_name not in files:
                raise CheckpointError(f"checkpoint in {model_dir!r} is missing tensor {hf_name!r}")
            fname = files[hf_name]
            if fname not in opened:
                opened[fname] = SafetensorsFile(fname)
            st = opened[fname]
            raw = st.get(names[hf_name])  # `files` comes from the shards' own headers
            if raw.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"tensor {names[hf_name]!r} in {os.path.basename(fname)} holds {raw.dtype} values; weights must be "
                    "float16, bfloat16 or float32 (quantized checkpoints are not supported)"
                )
            raws.append(raw)
        target = abstract
        for key in path:
            target = target[key]
        try:
            view = convert(*raws, target.shape)
        except ValueError:
            view = None
        if view is None or tuple(view.shape) != tuple(target.shape):
            shapes = ", ".join(f"{n!r} {tuple(r.shape)}" for n, r in zip(hf_names, raws))
            raise CheckpointError(
                f"tensor {shapes} does not fit the config (expected {target.shape} after conversion): wrong shape"
            )
        sharding = None
        if shardings is not None:
            sharding = shardings
            for key in path:
                sharding = sharding[key]
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _place(view, target.shape, target_dtype, sharding, list(zip(hf_names, raws)))
        del view, raws
        progress.update(int(np.prod(target.shape)) * target_dtype.itemsize)
    progress.close()
    extra = sorted(
        k
        for k in files
        if k not in expected and not _IGNORED.search(k) and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    )
    if extra:
        raise CheckpointError(
            f"checkpoint has tensors this {cfg.family} config does not use, e.g. {extra[0]!r} in "
            f"{os.path.basename(files[extra[0]])} ({len(extra)} in all); the config may not match the weights"
        )
    return params


def _place(view, shape, dtype, sharding, sources: list[tuple[str, np.ndarray]]) -> jax.Array:
    """One tensor onto its devices; only the slices this process's devices hold are read, and each
    is checked to hold finite values only (`sources`: the checkpoint's tensors it is made of, named
    in the error).

    Blocks until the copy is done, so the host staging buffer is gone before the next tensor is read
    (an asynchronous transfer would otherwise let several of them pile up)."""

    def host(idx):
        a = np.ascontiguousarray(view[idx], dtype=dtype)
        if count := count_nonfinite(a):
            # Which of the tensors read together (gate and up) it is; read whole, only on this path.
            bad = [(n, c) for n, raw in sources if (c := count_nonfinite(np.asarray(raw, dtype=dtype)))]
            name, count = bad[0] if bad else (sources[0][0], count)
            raise CheckpointError(
                f"tensor {name!r} holds {count} NaN or infinite value{'s' if count > 1 else ''}: the "
                "checkpoint's weights are broken (a diverged training run, a bad merge or conversion?)"
            )
        return a

    if sharding is None:
        out = jax.device_put(host(...))
    else:
        out = jax.make_array_from_callback(tuple(shape), sharding, host)
    return out.block_until_ready()


def count_nonfinite(a: np.ndarray, *, block: int = 1 << 22) -> int:
    """How many of float array a's values are NaN or infinite, read `block` values at a time (so no
    temporary the size of a). A weight with one NaN makes every logit NaN downstream: jaxinfer then
    generated token 0 again and again, silently. bfloat16 is read through its bits (all exponent bits
    set), ~3x numpy's isfinite on ml_dtypes' type: ~13 GB/s for float32, ~7 for bfloat16 (2026-12-07, AMD Zen 4)."""
    flat = a.reshape(-1)
    if flat.dtype == ml_dtypes.bfloat16:
        bits, mask = flat.view(np.uint16), np.uint16(0x7F80)
        return sum(int(np.count_nonzero((bits[i : i + block] & mask) == mask)) for i in range(0, flat.size, block))
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + block]))) for i in range(0, flat.size, block))


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal (logs stay clean)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.nbytes = total, label, 0, 0
        self.enabled = sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.nbytes += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done == self.total):
            self.last = now
            width = 30
            filled = width * self.done // max(self.total, 1)
            rate = self.nbytes / max(now - self.start, 1e-9) / 1e6
            sys.stderr.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} tensors, "
                f"{self.nbytes / 1e6:.0f} MB, {rate:.0f} MB/s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def load_hf_checkpoint(model_dir: str, *, dtype: str = "float32", shardings=None):
    """Returns (ModelConfig, params) from a local Hugging Face checkpoint directory.

    `shardings`: a pytree of shardings matching the parameters, or a function of the ModelConfig
    returning one (e.g. `lambda cfg: sharding.param_shardings(cfg, mesh)`); None: one device.
    """
    if not os.path.isdir(model_dir):
        what = "is a file, not a directory" if os.path.exists(model_dir) else "does not exist"
        raise CheckpointError(f"model directory {model_dir!r} {what}")
    from jaxinfer import checkpoint

    if checkpoint.is_checkpoint(model_dir):
        raise CheckpointError(f"{model_dir!r} is already a jaxinfer checkpoint, not a Hugging Face one")
    if os.path.isdir(os.path.join(model_dir, checkpoint.PARAMS_DIR)) and not os.path.exists(
        os.path.join(model_dir, "model.safetensors")
    ):
        raise CheckpointError(
            f"{model_dir!r} holds a jaxinfer {checkpoint.PARAMS_DIR}/ directory but no {checkpoint.MARKER}: an "
            "interrupted `jaxinfer convert`? Remove the directory and convert the Hugging Face checkpoint again."
        )
    cfg = _tying_as_stored(model_dir, load_hf_config(model_dir, dtype=dtype))
    if callable(shardings):
        shardings = shardings(cfg)
    return cfg, load_safetensors_params(model_dir, cfg, shardings=shardings)
