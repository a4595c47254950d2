"""jaxinfer checkpoints (orbax): lossless configs, HF -> convert -> LLM parity, sharded restore, and
errors that name the file or tensor."""

import dataclasses
import json
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_models import make_hf_model, save_hf_model, train_sentencepiece

from jaxinfer import LLM, SamplingParams, checkpoint
from jaxinfer.cli import main
from jaxinfer.config import (
    GlobalAttention,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    SlidingWindow,
    YarnRopeScaling,
)
from jaxinfer.errors import CheckpointError
from jaxinfer.loading import load_hf_checkpoint
from jaxinfer.model import abstract_params, init_params
from jaxinfer.tokenizer import load_tokenizer

SMALL = ModelConfig(
    name="small",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_ids=(2, 5),
)


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        dataclasses.replace(
            SMALL,
            rope_scaling=Llama3RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
            ),
            layer_attention=(SlidingWindow(16), GlobalAttention()),
            tie_word_embeddings=True,
            qkv_bias=True,
            qk_norm=True,
        ),
        dataclasses.replace(SMALL, rope_scaling=LinearRopeScaling(factor=4.0), bos_token_id=None, rms_norm_eps=1e-5),
        dataclasses.replace(
            SMALL,
            rope_scaling=YarnRopeScaling(
                factor=4.0, original_max_position_embeddings=64, attention_factor=1.14, truncate=False
            ),
        ),
    ],
)
def test_config_round_trips_through_json(cfg):
    text = json.dumps(checkpoint.config_to_dict(cfg))
    back = checkpoint.config_from_dict(json.loads(text))
    assert back == cfg and hash(back) == hash(cfg)
    assert isinstance(back.layer_attention, tuple) and isinstance(back.eos_token_ids, tuple)


def test_config_from_dict_refuses_unknown_fields_and_types():
    d = checkpoint.config_to_dict(SMALL)
    with pytest.raises(CheckpointError, match="unknown field 'frobnicate'"):
        checkpoint.config_from_dict({**d, "frobnicate": 1})
    with pytest.raises(CheckpointError, match="rope_scaling: unknown type 'YarnScaling'"):
        checkpoint.config_from_dict({**d, "rope_scaling": {"type": "YarnScaling", "factor": 2.0}})
    with pytest.raises(CheckpointError, match=r"num_attention_heads \(3\)"):
        checkpoint.config_from_dict({**d, "num_heads": 3})
    # Edited values that loaded, then generated garbage or failed mid-generation:
    for edit, message in [
        ({"rope_theta": 0.0}, "'rope_theta' must be a positive number"),
        ({"rms_norm_eps": "abc"}, "'rms_norm_eps' must be a positive number"),
        ({"eos_token_ids": "abc"}, "eos token ids"),
        ({"family": "bogus"}, "'family' must be one of"),
        ({"layer_attention": ["x", "y"]}, "layer_attention"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            checkpoint.config_from_dict({**d, **edit})


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_hf_model(make_hf_model("llama3.1", vocab_size=36), path)  # the vocabulary of the tokenizer below
    train_sentencepiece(path, vocab_size=36)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where transformers 5 writes it
    (path / "additional_chat_templates").mkdir()  # and its named ones
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | length }}" + CHAT_TEMPLATE)
    (path / "additional_chat_templates" / "README.md").write_text("not a template")  # left behind
    (path / "additional_chat_templates" / "old.jinja").mkdir()  # a directory, whatever its name
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conv") / "ckpt")
    assert main(["convert", hf_dir, out]) == 0
    return out


def test_convert_writes_marker_config_params_and_tokenizer(converted, hf_dir):
    assert checkpoint.is_checkpoint(converted) and not checkpoint.is_checkpoint(hf_dir)
    assert {"jaxinfer_checkpoint.json", "config.json", "params", "tokenizer.model"} <= set(os.listdir(converted))
    assert load_tokenizer(converted).chat_template == CHAT_TEMPLATE  # llm.chat() works on the converted copy
    assert load_tokenizer(converted).chat_templates == load_tokenizer(hf_dir).chat_templates
    assert set(load_tokenizer(converted).chat_templates) == {"default", "tool_use"}
    assert os.listdir(os.path.join(converted, "additional_chat_templates")) == ["tool_use.jinja"]
    cfg, params = checkpoint.restore(converted)
    hf_cfg, hf_params = load_hf_checkpoint(hf_dir)
    assert cfg == hf_cfg
    assert isinstance(cfg.rope_scaling, Llama3RopeScaling)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_keeps_special_tokens_named_only_in_special_tokens_map(tmp_path):
    """Older checkpoints name BOS and EOS only in special_tokens_map.json: the converted copy must
    keep them (the tokenizer's BOS and EOS ids, hence where generation stops)."""
    from test_tokenizer import _bpe_dir, _edit_config

    from jaxinfer.model import init_params

    src = tmp_path / "src"
    src.mkdir()
    _bpe_dir(src, add_bos_token=True, add_eos_token=True)
    _edit_config(src, bos_token=None, eos_token=None)
    (src / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    cfg = ModelConfig(
        vocab_size=128, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    checkpoint.save(tmp_path / "out", cfg, init_params(cfg), tokenizer_dir=str(src))
    a, b = load_tokenizer(str(src)), load_tokenizer(str(tmp_path / "out"))
    assert a.bos_id is not None and a.eos_ids
    assert (b.special_tokens, b.bos_id, b.eos_ids) == (a.special_tokens, a.bos_id, a.eos_ids)


def test_the_copy_of_a_mistral_tokenizer_encodes_as_the_original(tmp_path):
    """transformers 5 reads a Mistral checkpoint's tokenizer.json as written although it names
    LlamaTokenizer (which Llama 2 checkpoints get rebuilt as): the model_type decides. A jaxinfer copy's
    config.json names the family instead; the copy must encode as the original does."""
    from test_tokenizer import STRINGS, _llama2_style_dir, _spm_dir

    (tmp_path / "spm").mkdir()
    src = _llama2_style_dir(tmp_path / "src", _spm_dir(tmp_path / "spm", tokenizer_config={"add_bos_token": True}))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    (src / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    cfg = dataclasses.replace(SMALL, family="mistral", vocab_size=512)
    checkpoint.save(tmp_path / "out", cfg, init_params(cfg), tokenizer_dir=str(src))
    original, copy = load_tokenizer(str(src)), load_tokenizer(str(tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))
    for text in [*STRINGS, " hello", "<s>[INST] hi [/INST] ok</s>[INST] q [/INST]"]:
        assert copy.encode(text) == original.encode(text) == theirs(text)["input_ids"], text


def test_llm_on_converted_dir_matches_llm_on_hf_dir(converted, hf_dir):
    kw = dict(max_model_len=64, num_kv_pages=32, max_num_seqs=4)
    from_hf, from_orbax = LLM(hf_dir, **kw), LLM(converted, **kw)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [[1, 17, 33, 5, 30], [1, 24, 12, 11, 7, 25, 28, 3, 19]]
    a = from_hf.generate(prompt_token_ids=prompts, sampling_params=greedy)
    b = from_orbax.generate(prompt_token_ids=prompts, sampling_params=greedy)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and len(x.token_ids) == 12
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.top == ly.top  # top-5 log-probabilities: identical, not merely close
    # generation_config.json came along: the same default sampling.
    assert from_orbax.get_default_sampling_params() == from_hf.get_default_sampling_params()
    assert from_hf.get_default_sampling_params() == SamplingParams(temperature=0.7, top_p=0.9)
    # The copied tokenizer works: text prompts encode the same way.
    text = from_orbax.generate(["In the beginning"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert text.prompt_token_ids == from_hf.tokenizer.encode("In the beginning")


def test_bfloat16_conversion_stores_bfloat16_and_restores_any_dtype(hf_dir, tmp_path):
    out = str(tmp_path / "bf16")
    assert main(["convert", hf_dir, out, "--dtype", "bfloat16"]) == 0
    with open(os.path.join(out, checkpoint.MARKER)) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    _, hf16 = load_hf_checkpoint(hf_dir, dtype="bfloat16")
    cfg, p32 = checkpoint.restore(out, dtype="float32")
    assert cfg.dtype == "float32"
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(hf16)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))
    _, p16 = checkpoint.restore(out, dtype="bfloat16")
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(p16))


def test_save_stores_the_dtype_it_is_given(tmp_path):
    """save(..., dtype=) of float32 weights: the arrays orbax wrote (read back by orbax itself), the
    marker and config.json all say bfloat16; the weights restore rounded to bfloat16."""
    import orbax.checkpoint as ocp

    cfg = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    params = init_params(cfg)
    out = tmp_path / "bf16"
    checkpoint.save(out, cfg, params, dtype="bfloat16")
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(str(out / "params")).item_metadata.tree
    assert {leaf.dtype for leaf in jax.tree.leaves(stored)} == {np.dtype(jax.numpy.bfloat16)}
    with open(out / checkpoint.MARKER) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert checkpoint.load_config(out) == dataclasses.replace(cfg, dtype="bfloat16")
    _, p16 = checkpoint.restore(out, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(params), strict=True):
        assert a.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jax.numpy.bfloat16)))


def test_convert_takes_the_tokenizers_eos_into_the_config(hf_dir, tmp_path):
    """config.json and generation_config.json name EOS 7, the tokenizer's is 2: the converted config
    stops at both, as LLM on the Hugging Face directory does (the copy stands alone)."""
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, "eos_token_id": 7}))
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 7}))
    out = str(tmp_path / "out")
    assert main(["convert", str(src), out]) == 0
    assert set(checkpoint.load_config(out).eos_token_ids) == {7, 2}
    assert set(checkpoint.load_config(out).eos_token_ids) == set(LLM(str(src), num_kv_pages=16).cfg.eos_token_ids)


def test_convert_keeps_the_dtype_the_checkpoint_runs_in(tmp_path, capsys):
    """Default --dtype auto: a bfloat16 checkpoint is stored in bfloat16 (not widened to float32), so
    LLM(converted) runs as LLM(hf) does; a float32 one stays float32."""
    hf16 = str(tmp_path / "hf16")
    save_hf_model(make_hf_model("llama3.1", vocab_size=36), hf16, dtype=torch.bfloat16)
    out = str(tmp_path / "bf16")
    assert main(["convert", hf16, out]) == 0
    assert "bfloat16) in" in capsys.readouterr().out
    with open(os.path.join(out, checkpoint.MARKER)) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    a = LLM(hf16, num_kv_pages=16).generate(prompt_token_ids=[[1, 5, 9, 3]], sampling_params=p)[0]
    b = LLM(out, num_kv_pages=16).generate(prompt_token_ids=[[1, 5, 9, 3]], sampling_params=p)[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert checkpoint.load_config(out).dtype == "bfloat16"


def test_a_shardings_tree_of_another_shape_is_named(converted):
    cfg = checkpoint.load_config(converted)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = jax.tree.map(lambda _: dev, abstract_params(cfg))
    del tree["lm_head"]  # one sharding short: blamed on the checkpoint before
    with pytest.raises(ValueError, match=r"shardings: a tree of \d+ shardings"):
        checkpoint.restore(converted, shardings=tree)


def test_restore_lands_on_a_two_device_named_sharding(converted):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    cfg = checkpoint.load_config(converted)
    abstract = jax.eval_shape(lambda: init_params(cfg))

    def spec(x):  # split the first axis over the 2 devices where it divides, else replicate
        return NamedSharding(mesh, PartitionSpec("model") if x.shape[0] % 2 == 0 else PartitionSpec())

    shardings = jax.tree.map(spec, abstract)
    _, sharded = checkpoint.restore(converted, shardings=shardings)
    _, single = checkpoint.restore(converted)
    split = 0
    for x, s, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings), jax.tree.leaves(single)):
        assert x.sharding == s and len(x.devices()) == 2
        split += s.spec == PartitionSpec("model")
        if s.spec == PartitionSpec("model"):
            assert x.addressable_shards[0].data.shape[0] == x.shape[0] // 2
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert split > 0
    assert all(y.devices() == {jax.devices()[0]} for y in jax.tree.leaves(single))


# ----------------------------------------------------------------------------------------------
# Errors name the file or the tensor.


@pytest.fixture
def small_ckpt(tmp_path):
    out = str(tmp_path / "ckpt")
    checkpoint.save(out, SMALL, init_params(SMALL, 0))
    return out


def test_missing_directory_and_not_a_checkpoint(tmp_path, hf_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.restore(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="not a jaxinfer checkpoint.*jaxinfer_checkpoint.json"):
        checkpoint.restore(hf_dir)


def test_a_jaxinfer_checkpoint_read_as_a_hugging_face_one_is_named(converted, tmp_path):
    with pytest.raises(CheckpointError, match="already a jaxinfer checkpoint"):  # `jaxinfer convert` run twice
        load_hf_checkpoint(converted)
    partial = tmp_path / "partial"
    shutil.copytree(converted, partial)
    os.remove(partial / checkpoint.MARKER)  # a conversion interrupted before its marker
    with pytest.raises(CheckpointError, match="interrupted `jaxinfer convert`.* Remove the directory"):
        LLM(str(partial))


def test_missing_or_corrupt_config(small_ckpt):
    path = os.path.join(small_ckpt, "config.json")
    with open(path, "w") as f:
        f.write('{"vocab_size": 96, "hidden')
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt"):
        checkpoint.restore(small_ckpt)
    os.remove(path)
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        checkpoint.restore(small_ckpt)
    # LLM goes through the same path.
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        LLM(small_ckpt)


def test_corrupt_marker(small_ckpt):
    with open(os.path.join(small_ckpt, checkpoint.MARKER), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="jaxinfer_checkpoint.json is corrupt"):
        checkpoint.restore(small_ckpt)
    # A format version this code does not know is refused, not read as its own.
    with open(os.path.join(small_ckpt, checkpoint.MARKER), "w") as f:
        json.dump({"format": checkpoint.FORMAT, "version": checkpoint.VERSION + 1, "params": "params"}, f)
    with pytest.raises(CheckpointError, match=f"expected format .* version {checkpoint.VERSION}, got"):
        checkpoint.restore(small_ckpt)
    with open(os.path.join(small_ckpt, checkpoint.MARKER), "w") as f:  # another format of the same version
        json.dump({"format": "other-orbax", "version": checkpoint.VERSION, "params": "params"}, f)
    with pytest.raises(CheckpointError, match="expected format 'jaxinfer-orbax'"):
        checkpoint.restore(small_ckpt)


def test_missing_tensor_is_named(tmp_path):
    params = init_params(SMALL, 0)
    del params["layer_1"]["mlp"]["w_down"]
    out = str(tmp_path / "ckpt")
    checkpoint.save(out, SMALL, params)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layer_1/mlp/w_down' \(expected shape \(64, 32\)\)"):
        checkpoint.restore(out)


def test_unexpected_tensor_is_named(tmp_path):
    params = init_params(SMALL, 0)
    params["lm_head_extra"] = params["embedding"]
    out = str(tmp_path / "ckpt")
    checkpoint.save(out, SMALL, params)
    with pytest.raises(CheckpointError, match="unexpected tensor 'lm_head_extra'"):
        checkpoint.restore(out)


@pytest.mark.parametrize("value, dtype, sharded", [(np.nan, "float32", False), (-np.inf, "bfloat16", True)])
def test_weights_that_are_not_finite_are_refused_by_name(tmp_path, value, dtype, sharded):
    """As for Hugging Face checkpoints (test_loading): a NaN or an infinity in a weight made every logit
    NaN, and a jaxinfer checkpoint holding one restored without a word."""
    params = jax.tree.map(np.array, init_params(SMALL, 0))  # writable copies
    params["layer_1"]["mlp"]["w_down"].reshape(-1)[[5, -1]] = value
    out = str(tmp_path / "ckpt")
    checkpoint.save(out, SMALL, params, dtype=dtype)
    shardings = None
    if sharded:  # the count runs where the arrays are, split over two devices here
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
        shardings = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with pytest.raises(CheckpointError, match=r"tensor 'layer_1/mlp/w_down' holds 2 NaN or infinite values"):
        checkpoint.restore(out, dtype=dtype, shardings=shardings)
    params["layer_1"]["mlp"]["w_down"].reshape(-1)[[5, -1]] = 0.5  # and the same checkpoint, mended, restores
    checkpoint.save(str(tmp_path / "mended"), SMALL, params, dtype=dtype)
    checkpoint.restore(str(tmp_path / "mended"), dtype=dtype, shardings=shardings)


def test_the_on_device_count_of_non_finite_values_is_numpys():
    """The count accelerators and multi-host jobs use (on the CPU in one process, the host's is)."""
    import jax.numpy as jnp

    from jaxinfer.checkpoint import _nonfinite_counts

    rng = np.random.default_rng(0)
    x = rng.standard_normal(5000).astype(np.float32)
    x[rng.choice(x.size, 23, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], 23)
    leaves = [jnp.asarray(x), jnp.asarray(x, jnp.bfloat16).reshape(50, 100), jnp.ones((3, 4))]
    assert [int(c) for c in _nonfinite_counts(leaves)] == [23, 23, 0]


def test_wrong_shape_is_named(small_ckpt):
    path = os.path.join(small_ckpt, "config.json")
    with open(path) as f:
        d = json.load(f)
    d["intermediate_size"] = 80
    with open(path, "w") as f:
        json.dump(d, f)
    with pytest.raises(
        CheckpointError, match=r"tensor 'layer_0/mlp/w_down' has shape \(64, 32\), the config needs \(80, 32\)"
    ):
        checkpoint.restore(small_ckpt)


def _garble(small_ckpt):
    data = os.path.join(small_ckpt, "params", "d")
    files = [os.path.join(data, f) for f in os.listdir(data)]
    assert files
    for f in files:  # same sizes, garbage content
        size = os.path.getsize(f)
        with open(f, "wb") as fh:
            fh.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


def test_corrupt_array_data(small_ckpt, monkeypatch):
    """One error, and nothing after it: the reads orbax abandons finish on TensorStore's threads into
    its closed event loop - during the failing call as often as after it - and each of those printed
    "Event loop is closed" as an unraisable exception."""
    import gc
    import time

    _garble(small_ckpt)
    leaked = []
    monkeypatch.setattr(sys, "unraisablehook", leaked.append)
    monkeypatch.setattr(checkpoint._OrbaxLeftovers, "read_failed", False)  # as in a fresh process
    with pytest.raises(CheckpointError, match=r"params: cannot read"):
        checkpoint.restore(small_ckpt)
    time.sleep(0.5)
    gc.collect()
    assert [repr(u.exc_value) for u in leaked] == []


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_array_data_is_one_line_from_the_cli(small_ckpt, damage):
    """The reason (TensorStore's one line) and nothing else: the message was orbax's wrapper, cut off
    in a dump of its spec, and orbax's abandoned reads printed tracebacks at exit."""
    import subprocess

    if damage == "truncated":
        data = os.path.join(small_ckpt, "params", "ocdbt.process_0", "d")  # the arrays (params/d: metadata)
        largest = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
        os.truncate(largest, os.path.getsize(largest) // 3)
        reason = "cannot read the parameters (ValueError: OUT_OF_RANGE: Error reading"
    else:
        _garble(small_ckpt)
        reason = "cannot read the orbax metadata (corrupt or incomplete checkpoint)"
    argv = [sys.executable, "-m", "jaxinfer", "generate", "--model", small_ckpt, "--prompt-ids", "1,2"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and reason in errors[0], r.stderr
    assert "TensorStore" not in r.stderr and "tensorstore_spec" not in r.stderr, r.stderr  # no spec dump


def test_missing_params_dir(small_ckpt):
    shutil.rmtree(os.path.join(small_ckpt, "params"))
    with pytest.raises(CheckpointError, match="missing its parameter directory"):
        checkpoint.restore(small_ckpt)


def test_save_refuses_a_non_empty_directory(small_ckpt):
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        checkpoint.save(small_ckpt, SMALL, init_params(SMALL, 0))


def test_cli_convert_error_and_bench_load(tmp_path, hf_dir, small_ckpt, capsys, monkeypatch):
    assert main(["convert", str(tmp_path / "no_such_hf"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # The output directory is checked before anything is loaded: an empty path (abspath made it the
    # working directory, and the checkpoint went there), and a file with a broken source.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["convert", hf_dir, ""]) == 2
    assert "the output directory must be a path, got an empty string" in capsys.readouterr().err
    assert os.listdir(tmp_path / "cwd") == []
    (tmp_path / "a_file").write_text("x")
    assert main(["convert", str(tmp_path / "no_such_hf"), str(tmp_path / "a_file")]) == 2
    assert "output directory" in (err := capsys.readouterr().err) and "is a file" in err
    assert main(["bench", "load", hf_dir, "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hf_s"][0] > 0 and report["orbax_s"][0] > 0
    assert report["params"] == load_hf_checkpoint(hf_dir)[0].num_params
    assert report["bytes"] == report["params"] * {"float32": 4, "bfloat16": 2}[report["dtype"]]
    # --orbax-dir of another model: two unrelated load times were compared.
    assert main(["bench", "load", hf_dir, "--repeats", "1", "--orbax-dir", small_ckpt]) == 2
    assert "holds another model than" in capsys.readouterr().err
    assert main(["bench", "load", hf_dir, "--repeats", "1", "--orbax-dir", str(tmp_path / "a_file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_convert_refuses_an_output_it_cannot_write_before_loading(tmp_path, hf_dir, capsys, monkeypatch):
    """An output path that is not UTF-8 (undecodable bytes in argv) ran into orbax's C++ after the load
    (hundreds of lines of tracebacks, exit 1, a half-written directory); one under a file or /proc
    gave a bare errno line. `bench load` left its temp dir behind when the conversion failed."""
    import tempfile

    undecodable = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff")
    assert main(["convert", hf_dir, undecodable]) == 2
    assert "error: the output directory is not valid Unicode: lone surrogate" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    (tmp_path / "a_file").write_text("x")
    for out in (str(tmp_path / "a_file" / "out"), "/proc/jaxinfer-out"):  # (root may write /proc, until mkdir)
        assert main(["convert", hf_dir, out]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(
            rf"error: (output directory '{re.escape(out)}' cannot be created: .* is not a writable directory"
            rf"|cannot create output directory '{re.escape(out)}': .*)\n",
            err,
        ), err
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert main(["bench", "load", str(tmp_path / "no_such_hf")]) == 2
    assert "does not exist" in capsys.readouterr().err and os.listdir(tmp_path / "tmp") == []


def test_a_save_that_fails_leaves_no_half_written_checkpoint(tmp_path, hf_dir, monkeypatch):
    cfg, params = load_hf_checkpoint(hf_dir)

    def broken(*args):
        raise KeyboardInterrupt  # Ctrl-C while the parameters are written

    monkeypatch.setattr(checkpoint, "_checkpointer", broken)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path / "new", cfg, params)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path / "empty", cfg, params)
    assert os.listdir(tmp_path / "empty") == []
