"""Checkpoint and tokenizer loading: good files load, bad files fail naming the file or tensor."""

import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from hf_models import make_hf_model, save_hf_model, train_sentencepiece

from jaxinfer import LLM, CheckpointError, JaxinferError, SamplingParams
from jaxinfer.loading import load_hf_checkpoint
from jaxinfer.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model(make_hf_model("llama2"), path)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite_safetensors(path, edit):
    """Loads a checkpoint's tensors, applies `edit` to the dict, writes it back with safetensors."""
    from safetensors.numpy import load_file, save_file

    f = str(path / "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path))


def test_a_directory_without_safetensors_says_so(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors files$"):
        load_hf_checkpoint(str(d))
    (d / "pytorch_model.bin").write_bytes(b"")  # a PyTorch pickle instead: the message says it is not read
    with pytest.raises(CheckpointError, match=r"'pytorch_model\.bin' are not read.*safe_serialization=True"):
        load_hf_checkpoint(str(d))


def test_malformed_config(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(Exception, match="config.json is not valid JSON"):
        load_hf_checkpoint(str(d))


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON nested past Python's recursion limit


def test_json_nested_too_deep_is_named_or_ignored(ckpt, tmp_path):
    """From a loading audit: json raises RecursionError, not JSONDecodeError, on such a file, and it
    escaped every reader as a traceback. A required file is now "not valid JSON"; the advisory
    generation_config.json is ignored, as a broken one always was."""
    d = _copy(ckpt, tmp_path)
    expected = load_hf_checkpoint(str(d))[0]
    (d / "generation_config.json").write_text(DEEP)
    assert load_hf_checkpoint(str(d))[0] == expected
    for name in ("config.json", "tokenizer_config.json"):
        e = _copy(ckpt, tmp_path / name)
        (e / name).write_text(DEEP)
        with pytest.raises(JaxinferError, match=f"{name} is not valid JSON"):
            LLM(str(e), num_kv_pages=16, max_model_len=32, warmup=False)


def test_generation_config_eos_ids_must_be_ids(ckpt, tmp_path):
    """`"eos_token_id": true` in generation_config.json became token 1 (int(True)); config.json
    refuses it. Entries that are not non-negative integers are now left out."""
    d = _copy(ckpt, tmp_path)
    base = load_hf_checkpoint(str(d))[0].eos_token_ids
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [True, "7", -1, 5, 0]}))
    assert not {0, 5, 6} & set(base) and load_hf_checkpoint(str(d))[0].eos_token_ids == (*base, 5, 0)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 6}))  # one id, not in a list
    assert load_hf_checkpoint(str(d))[0].eos_token_ids == (*base, 6)


def test_too_many_layers_fail_before_the_model_is_traced(ckpt, tmp_path, monkeypatch):
    """A config.json promising far more layers than the files hold (a typo) failed only after tracing
    every layer (~30 ms each: an hour at 100000); the tensor names are now checked first."""
    from jaxinfer import loading

    d = _copy(ckpt, tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))

    def traced(cfg):
        raise AssertionError("the model was traced before the tensor names were checked")

    monkeypatch.setattr(loading, "abstract_params", traced)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.input_layernorm.weight'"):
        load_hf_checkpoint(str(d))


def test_tensor_names_without_the_model_prefix_load(tmp_path):
    """A base-class checkpoint (LlamaModel writes embed_tokens.weight, layers.0..., norm.weight):
    transformers' from_pretrained adds the "model." prefix and loads it; so do we (it was refused as
    missing 'model.embed_tokens.weight')."""
    from safetensors.numpy import load_file, save_file

    save_hf_model(make_hf_model("llama3.2-tied"), tmp_path / "full")
    expected = load_hf_checkpoint(str(tmp_path / "full"))
    d = _copy(tmp_path / "full", tmp_path)
    tensors = load_file(d / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, d / "model.safetensors")
    cfg, params = load_hf_checkpoint(str(d))
    assert cfg == dataclasses.replace(expected[0], name=cfg.name)  # (named after its directory)
    jax.tree.map(np.testing.assert_array_equal, params, expected[1])


def test_missing_tensor_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    _rewrite_safetensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(str(d))


def test_wrong_shape_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)

    _rewrite_safetensors(d, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        load_hf_checkpoint(str(d))


def test_a_tied_checkpoints_head_of_another_shape_is_refused_without_a_tying_warning(tmp_path, capfd):
    """A tied config with a stored lm_head.weight of the wrong shape: refused by name, and not first
    announced as "different values; using it, untied" (a shape mismatch counted as different values)."""
    d = tmp_path / "tied"
    save_hf_model(make_hf_model("llama3.2-tied"), d)
    _rewrite_safetensors(
        d, lambda t: t.update({"lm_head.weight": np.zeros((t["model.embed_tokens.weight"].shape[0], 5), np.float32)})
    )
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' \(\d+, 5\).*wrong shape"):
        load_hf_checkpoint(str(d))
    assert "untied" not in capfd.readouterr().err


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"])
def test_a_transposed_tensor_of_the_right_size_is_refused(ckpt, tmp_path, name):
    """Same element count, axes swapped: reshaping it would load scrambled weights without a word."""
    d = _copy(ckpt, tmp_path)

    def edit(t):
        assert t[name].shape[0] != t[name].shape[1]
        t[name] = np.ascontiguousarray(t[name].T)

    _rewrite_safetensors(d, edit)
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*wrong shape"):
        load_hf_checkpoint(str(d))


def test_integer_weights_are_refused_not_cast(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)

    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].astype(np.int32)

    _rewrite_safetensors(d, edit)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' .* holds int32 values"):
        load_hf_checkpoint(str(d))


@pytest.mark.parametrize(
    "name, value, dtype, mesh",
    [
        ("model.layers.1.mlp.down_proj.weight", np.nan, "float32", None),
        ("model.layers.0.mlp.up_proj.weight", -np.inf, "bfloat16", None),  # read together with gate_proj
        ("model.embed_tokens.weight", np.inf, "float32", "data=1,model=2"),  # a slice per device
    ],
)
def test_weights_that_are_not_finite_are_refused_by_name(ckpt, tmp_path, name, value, dtype, mesh):
    """One NaN or infinity in a weight makes every logit NaN: jaxinfer used to load it and generate
    token 0 over and over without a word. Refused at load, naming the tensor and the count."""
    d = _copy(ckpt, tmp_path)

    def edit(t):
        t[name].reshape(-1)[[3, -1]] = value

    _rewrite_safetensors(d, edit)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r} holds 2 NaN or infinite values")):
        LLM(str(d), dtype=dtype, mesh=mesh, max_model_len=64, num_kv_pages=16)


def test_count_nonfinite_matches_numpy():
    import ml_dtypes

    from jaxinfer.loading import count_nonfinite

    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32) * 1e3
    x[rng.choice(x.size, 37, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], 37)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        a = x.astype(dtype)
        assert count_nonfinite(a, block=999) == int((~np.isfinite(a.astype(np.float32))).sum())
    assert count_nonfinite(np.float32([3.3e38, -3.3e38, 1e-45])) == 0
    assert count_nonfinite(np.zeros((4, 0), ml_dtypes.bfloat16)) == 0


def test_a_tensor_in_two_files_without_an_index_is_refused(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(ckpt, tmp_path)
    os.rename(d / "model.safetensors", d / "weights.safetensors")  # neither model.safetensors nor an index
    tensors = load_file(str(d / "weights.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"] * 2}, str(d / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is in both model-extra\.safetensors and weights"):
        load_hf_checkpoint(str(d))


def test_model_safetensors_is_the_checkpoint_when_present(ckpt, tmp_path):
    """As transformers reads a directory: model.safetensors wins over an index and its shards, and
    other *.safetensors beside it (a PEFT adapter, a Mistral-format copy) are not read."""
    from safetensors.numpy import load_file, save_file

    _, want = load_hf_checkpoint(str(ckpt))
    d = _copy(ckpt, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    adapter = {"base_model.model.lm_head.lora_A.weight": np.ones((2, 3), np.float32)}
    save_file(adapter, str(d / "adapter_model.safetensors"))
    save_file({k: v * 2 for k, v in tensors.items()}, str(d / "model-00001-of-00001.safetensors"))
    index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _, got = load_hf_checkpoint(str(d))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_truncated_file_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_checkpoint(str(d))


def _edit_header(path, edit):
    """Rewrites a safetensors file's JSON header in place (data untouched), as a broken writer would."""
    f = path / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    new = json.dumps(edit(header)).encode()
    new += b" " * (n - len(new)) if len(new) < n else b""
    f.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n :])


def _first(header):
    return next(k for k in header if k != "__metadata__")


def _set(key, value):
    def edit(h):
        h[_first(h)][key] = value
        return h

    return edit


def _negative_start(h):
    begin, end = h[_first(h)]["data_offsets"]
    h[_first(h)]["data_offsets"] = [-16, end - begin - 16]  # the right length, starting in the header
    return h


def _overlap(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    a, b = h[names[0]], h[names[1]]
    size = b["data_offsets"][1] - b["data_offsets"][0]
    if a["data_offsets"][1] - a["data_offsets"][0] >= size:  # point b into a's bytes (same size)
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]
        return h
    a["data_offsets"] = [b["data_offsets"][0], b["data_offsets"][0] + a["data_offsets"][1] - a["data_offsets"][0]]
    return h


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: [1, 2, 3], "not a JSON object"),
        (lambda h: {**h, _first(h): "x"}, "corrupt header entry"),
        (_set("dtype", None), "unsupported dtype None"),
        (_set("dtype", "F8_E4M3"), "unsupported dtype 'F8_E4M3'"),
        (_set("dtype", ["F32"]), r"unsupported dtype \['F32'\]"),  # was a TypeError (unhashable) from the check
        (_set("data_offsets", None), "data_offsets None"),
        (_set("shape", [-4, -16]), "shape"),
        # Silently read the header (a negative start) or a neighbour's bytes (overlap) as weights:
        (_negative_start, "truncated or corrupt"),
        (_overlap, "overlap"),
    ],
)
def test_corrupt_safetensors_headers_are_named(ckpt, tmp_path, edit, message):
    d = _copy(ckpt, tmp_path)
    _edit_header(d, edit)
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(str(d))


@pytest.mark.parametrize(
    "weight_map, message",
    [
        (["a"], "weight_map must map"),
        ({"x": None}, "weight_map must map"),
        ({"x": "../elsewhere.safetensors"}, "outside"),
    ],
)
def test_malformed_index_is_named(ckpt, tmp_path, weight_map, message):
    d = _copy(ckpt, tmp_path)
    os.remove(d / "model.safetensors")  # the index is the checkpoint only without model.safetensors
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(str(d))


def test_index_pointing_at_missing_file(tmp_path):
    save_hf_model(make_hf_model("llama2"), tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(CheckpointError, match=victim):
        load_hf_checkpoint(str(tmp_path))


def _sharded(tmp_path):
    save_hf_model(make_hf_model("llama2"), tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))


def _write_index(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))


def _leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


def test_an_index_is_read_as_transformers_reads_it_every_tensor_of_every_listed_shard(tmp_path):
    """transformers loads every tensor of the shards an index lists, wherever the weight_map files it:
    a tensor sent to the wrong shard, or left out of the map, loads from the shard that holds it
    (jaxinfer refused the first and called the second missing). One that no listed shard holds is
    named."""
    index, files = _sharded(tmp_path)
    _, want = load_hf_checkpoint(str(tmp_path))
    held = {f: [k for k, v in index["weight_map"].items() if v == f] for f in files}
    shared = [f for f in files if len(held[f]) > 1]  # a shard the map still lists with one tensor gone
    moved, dropped = held[shared[0]][0], held[shared[1]][0]
    index["weight_map"][moved] = next(f for f in files if f != shared[0])
    del index["weight_map"][dropped]
    _write_index(tmp_path, index)
    _, got = load_hf_checkpoint(str(tmp_path))
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    index["weight_map"]["model.layers.0.self_attn.q_proj.lora_A"] = files[0]
    _write_index(tmp_path, index)
    with pytest.raises(
        CheckpointError, match=re.escape("'model.layers.0.self_attn.q_proj.lora_A' in") + ".*no listed shard holds it"
    ):
        load_hf_checkpoint(str(tmp_path))


def test_a_tensor_in_two_listed_shards_loads_only_when_the_copies_agree(tmp_path):
    """A stale copy of a tensor in a second shard (a re-shard gone wrong): transformers silently takes
    the later file's. jaxinfer takes either when they are the same bytes and otherwise names both files."""
    from safetensors.numpy import load_file, save_file

    index, files = _sharded(tmp_path)
    _, want = load_hf_checkpoint(str(tmp_path))
    name = "model.embed_tokens.weight"
    holder = index["weight_map"][name]
    other = next(f for f in files if f != holder)
    tensors = load_file(tmp_path / other)
    save_file({**tensors, name: load_file(tmp_path / holder)[name]}, tmp_path / other, metadata={"format": "pt"})
    _, got = load_hf_checkpoint(str(tmp_path))  # an identical copy
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    stale = load_file(tmp_path / holder)[name] + 1
    save_file({**tensors, name: stale}, tmp_path / other, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*in both.*different values"):
        load_hf_checkpoint(str(tmp_path))


def test_config_weight_mismatch_extra_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not use"):
        load_hf_checkpoint(str(d))


def test_a_tied_checkpoint_may_store_its_head_but_nothing_else_extra(tmp_path):
    """A tied model's lm_head.weight (equal to the embedding) is no extra tensor; any other is."""
    d = tmp_path / "tied"
    save_hf_model(make_hf_model("llama3.2-tied"), d)
    _rewrite_safetensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    load_hf_checkpoint(str(d))
    _rewrite_safetensors(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"does not use, e\.g\. 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_hf_checkpoint(str(d))


def _train_bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=120,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld, naïve café ✓"] * 50
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_json_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    _train_bpe(tmp_path)
    ours = load_tokenizer(str(tmp_path), eos_ids=(2,))
    assert isinstance(ours, HFTokenizer)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in ["the lazy fox", "naïve café ✓ over", " leading space"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.encode(text)[0] == 1
        assert ours.decode(ours.encode(text)) == text


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    train_sentencepiece(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, SentencePieceTokenizer)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    text = "the earth was void"
    assert tok.encode(text) == [1] + sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_ids == (2,)


def test_text_prompts_through_llm_with_tokenizer(tmp_path):
    d = tmp_path
    save_hf_model(make_hf_model("llama2", vocab_size=320), d)
    _train_bpe(d)
    llm = LLM(str(d), num_kv_pages=32)
    out = llm.generate(["the quick fox"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("the quick fox")
    assert len(out.token_ids) == 5
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_the_tokenizers_own_eos_stops_the_model_too(tmp_path):
    """config.json says EOS 2, the tokenizer's eos_token is another id: the engine stops at both."""
    save_hf_model(make_hf_model("llama2", vocab_size=320), tmp_path)
    _train_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    llm = LLM(str(tmp_path), num_kv_pages=32)
    assert llm.engine.cfg.eos_token_ids == (2, 3) == llm.tokenizer.eos_ids


def test_an_eos_id_outside_the_vocabulary_is_dropped_and_named(ckpt, tmp_path, capsys):
    """generation_config.json listing an EOS id at or past vocab_size: it can never be sampled, so it
    is left out of the stop set with a line saying so (the request still ends at max_tokens)."""
    d = _copy(ckpt, tmp_path)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    base = load_hf_checkpoint(str(d))[0].eos_token_ids
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab, vocab - 1]}))
    capsys.readouterr()
    llm = LLM(str(d), num_kv_pages=16, max_model_len=32, warmup=False)
    assert llm.engine.cfg.eos_token_ids == (*base, vocab - 1)
    err = capsys.readouterr().err
    assert f"eos_token_id {vocab} is outside the vocabulary (vocab_size {vocab})" in err and "ignoring it" in err
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) <= 4


def test_dtype_auto_follows_the_checkpoint(ckpt, tmp_path):
    """dtype="auto" (vLLM's default): a bfloat16 or float16 checkpoint computes in bfloat16, a float32
    one in float32, a jaxinfer checkpoint (the embedded default model too) in the dtype it stores, the
    generated embedded models in float32."""
    import torch
    import transformers

    from jaxinfer import checkpoint, default_model

    for saved, want in ((torch.bfloat16, "bfloat16"), (torch.float16, "bfloat16")):
        d = tmp_path / str(saved)
        save_hf_model(make_hf_model("llama2"), d, dtype=saved)
        assert json.loads((d / "config.json").read_text()).get("dtype") == str(saved).removeprefix("torch.")
        assert LLM(str(d), dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == want
    # A config.json that names no dtype: the weights' own, as transformers' dtype="auto" reads them.
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")}))
    assert transformers.AutoModelForCausalLM.from_pretrained(d, dtype="auto").dtype == torch.float16
    assert LLM(str(d), dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == "bfloat16"
    converted = tmp_path / "converted"  # a jaxinfer checkpoint: the dtype it stores
    checkpoint.convert_hf(str(ckpt), str(converted), dtype="bfloat16")
    assert LLM(str(converted), dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == "bfloat16"
    assert LLM(str(ckpt), dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == "float32"
    assert LLM(default_model.TINY_RANDOM, dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == "float32"
    assert LLM(dtype="auto", num_kv_pages=16, max_model_len=64).cfg.dtype == "bfloat16"  # the embedded default


def test_safetensors_reader_takes_empty_tensors_and_a_file_of_header_only(tmp_path):
    """Zero-size tensors are valid safetensors (begin == end); a file of only those has no data
    section, so its header ends where the file does."""
    from safetensors.numpy import save_file

    from jaxinfer.loading import SafetensorsFile

    save_file(
        {"empty": np.zeros((0, 4), np.float32), "w": np.arange(6, dtype=np.float32).reshape(2, 3)}, tmp_path / "a"
    )
    f = SafetensorsFile(str(tmp_path / "a"))
    assert f.get("empty").shape == (0, 4)
    np.testing.assert_array_equal(f.get("w"), np.arange(6).reshape(2, 3))
    save_file({"empty": np.zeros((0,), np.float32)}, tmp_path / "b")
    assert SafetensorsFile(str(tmp_path / "b")).get("empty").shape == (0,)


@pytest.mark.parametrize(
    "config",
    [
        {"dtype": "bfloat16"},  # transformers 5
        {"torch_dtype": "float16"},  # transformers 4
        {"text_config": {"dtype": "bfloat16"}},  # a multimodal config's text part
        {"text_config": {"torch_dtype": "bfloat16"}},
        {"torch_dtype": "bfloat16", "text_config": {"dtype": "float32"}},  # the outer one first
    ],
)
def test_dtype_auto_reads_every_place_a_config_names_its_dtype(tmp_path, config):
    """No weights here: the config alone answers (a float32 checkpoint would answer float32)."""
    from jaxinfer.loading import auto_dtype

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert auto_dtype(str(tmp_path)) == "bfloat16"


@pytest.mark.parametrize(
    "family,name,shape",
    [
        ("llama2", "model.layers.0.mlp.up_proj.weight", lambda t: t.T),  # gate right, up transposed
        ("llama2", "model.layers.0.mlp.gate_proj.weight", lambda t: t[:-1]),
        ("llama-bias-linear-rope", "model.layers.0.mlp.up_proj.bias", lambda t: t[:-1]),
        ("llama-bias-linear-rope", "model.layers.0.mlp.gate_proj.bias", lambda t: t[:-1]),
    ],
)
def test_gate_and_up_of_different_shapes_are_refused(tmp_path, family, name, shape):
    """The MLP's gate and up projections merge into one tensor: either one off its shape is refused
    by name, not stacked against the other."""
    d = tmp_path / family
    save_hf_model(make_hf_model(family), d)
    _rewrite_safetensors(d, lambda t: t.update({name: np.ascontiguousarray(shape(t[name]))}))
    stem = re.escape(name.rsplit(".", 2)[0])  # the pair is named together: mlp.gate_proj / mlp.up_proj
    with pytest.raises(CheckpointError, match=stem):
        load_hf_checkpoint(str(d))
