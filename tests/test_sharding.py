"""Meshes and the rules table on 8 virtual CPU devices: same greedy tokens as one device, memory per
device shrinking with the `model` axis, the kernels under shard_map inside the model, and bad
meshes refused by name."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer import LLM, InvalidRequestError, SamplingParams, capacity
from jaxinfer.config import GlobalAttention, ModelConfig, SlidingWindow
from jaxinfer.engine import Engine, num_compiles
from jaxinfer.model import init_params
from jaxinfer.sharding import RULES, make_mesh, parse_mesh, spec_for

# GQA with fewer KV heads (2) than the largest `model` axis (8): KV heads must be replicated there.
CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    layer_attention=(SlidingWindow(20), GlobalAttention()),
)
# Every mesh shape once; two of them with the kernels: the Pallas kernel and KV write per device
# under shard_map (interpreted on CPU, so on 3 of the prompts: batch invariance makes them
# comparable), one of those on an int8 cache. The rest run the default "xla" attention under GSPMD.
# The int8 one (and its one-device run) on 16-token pages: 4 pages of a 64-token row per kernel block
# instead of 8, so each interpreted step program is half the operands; XLA compiled its five in 14 s
# instead of 22 (Zen 3, 2026-12-03), the whole engine run 25 s instead of 38.
MESHES = [
    ("data=1,model=8", {}),
    ("data=2,model=4", dict(attention_backend="pallas")),
    ("data=4,model=2", dict(attention_backend="pallas", kv_cache_dtype="int8", page_size=16)),
    ("data=8,model=1", {}),
]


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(lambda x: x * 6 if x.ndim >= 2 else x, init_params(CFG, 11))


def _workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, int(rng.integers(2, 40))).tolist() for _ in range(6)]
    return prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(cfg, params, mesh, page_size: int = 8) -> Engine:
    capacity = dict(max_model_len=64, num_kv_pages=320 // page_size, max_num_seqs=8, max_num_batched_tokens=32)
    return Engine(cfg, params, mesh=mesh, page_size=page_size, **capacity)


def _finish(e: Engine, num_prompts: int = 6) -> list[list[int]]:
    prompts, sp = _workload()
    reqs = [e.add_request(p, sp) for p in prompts[:num_prompts]]
    while e.has_unfinished():
        e.step()
    return [r.seqs[0].output_ids for r in reqs]


def _run(cfg, params, mesh, num_prompts: int = 6, page_size: int = 8):
    e = _engine(cfg, params, mesh, page_size)
    return _finish(e, num_prompts), e


@pytest.fixture(scope="module")
def single(params):
    """Single-device tokens and memory: the float cache, and (on demand) the int8 one."""
    out, e = _run(CFG, params, None)
    assert len({tuple(o) for o in out}) == len(out)  # varied, so agreement means something
    runs = {"float32": (out, e.memory_per_device())}

    def get(kv_dtype: str, backend: str = "auto", page_size: int = 8):
        key = kv_dtype if (backend, page_size) == ("auto", 8) else (kv_dtype, backend, page_size)
        if key not in runs:
            cfg = dataclasses.replace(CFG, kv_cache_dtype=kv_dtype, attention_backend=backend)
            out, e = _run(cfg, params, None, 3, page_size)
            runs[key] = (out, e.memory_per_device())
        return runs[key]

    return get


def test_prompt_logprobs_on_a_mesh_are_the_single_device_ones(params):
    """The prompt-logprobs program under the mesh: its targets split over `data` like the batch,
    its outputs replicated; rows and values as on one device."""
    prompts, sp = _workload()
    sp = dataclasses.replace(sp, prompt_logprobs=3)
    got = {}
    for spec in (None, "data=2,model=4"):
        e = _engine(CFG, params, None if spec is None else make_mesh(spec))
        reqs = [e.add_request(p, sp) for p in prompts]
        while e.has_unfinished():
            e.step()
        got[spec] = [r.seqs[0].prompt_logprobs for r in reqs]
    for prompt, one, mesh in zip(prompts, got[None], got["data=2,model=4"]):
        assert [x.token_id for x in mesh] == [x.token_id for x in one] == prompt[1:]
        assert [list(x.top) for x in mesh] == [list(x.top) for x in one]
        np.testing.assert_allclose([x.logprob for x in mesh], [x.logprob for x in one], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec,options", MESHES, ids=[f"{m}-{o.get('attention_backend', 'xla')}" for m, o in MESHES])
def test_every_mesh_gives_the_single_device_tokens(params, single, spec, options):
    mesh = make_mesh(spec)
    kernels = options.get("attention_backend") == "pallas"
    # An int8 cache is compared with the same kernel on one device: a last-bit difference between two
    # attention implementations can move a value across an int8 rounding boundary (a whole step).
    options = dict(options)
    page_size = options.pop("page_size", 8)
    kv_dtype = options.get("kv_cache_dtype", "float32")
    want, one = single(kv_dtype, options["attention_backend"] if kv_dtype == "int8" else "auto", page_size)
    out, e = _run(dataclasses.replace(CFG, **options), params, mesh, 3 if kernels else 6, page_size)
    assert e.page_size == page_size
    assert out == want[: len(out)]
    wq = e.params["layer_0"]["attn"]["wq"]
    sizes = dict(mesh.shape)
    assert wq.sharding.spec == (P(None, "model", None) if sizes["model"] > 1 else P(None, None, None))
    # 2 KV heads: split over model=2; on model=4 and 8 each head is stored model/2 times, so the axis
    # still splits them and every device holds exactly one head (the one its query heads read).
    k = e.cache.k[0]
    k_spec = (k.values if options.get("kv_cache_dtype") == "int8" else k).sharding.spec
    assert k_spec == (P("model", None, None, None) if sizes["model"] > 1 else P(None, None, None, None))
    if options.get("kv_cache_dtype") == "int8":
        assert k.scales.sharding.spec == P("model", None, None)
    assert e.cfg.num_kv_heads == max(2, sizes["model"])
    assert e.params["layer_0"]["attn"]["wk"].sharding.shard_shape(e.params["layer_0"]["attn"]["wk"].shape)[1] == (
        2 if sizes["model"] == 1 else 1
    )
    mem = e.memory_per_device()
    if sizes["model"] > 1:
        assert mem["param_bytes_per_device"] < one["param_bytes_per_device"] / (sizes["model"] / 2)
        assert mem["kv_cache_bytes_per_device"] == one["kv_cache_bytes_per_device"] // 2


def test_biases_shard_with_their_weights_and_give_the_single_device_tokens():
    """q/k/v, o and MLP biases (Qwen 2, Llama's attention_bias and mlp_bias), all non-zero: each
    split along its weight's output axis (or replicated with it), and the tokens as on one device."""
    cfg = dataclasses.replace(CFG, qkv_bias=True, o_bias=True, mlp_bias=True)
    plain = init_params(cfg, 3)  # biases of zero
    leaves, treedef = jax.tree_util.tree_flatten_with_path(plain)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    biased = [
        x + jax.random.normal(k, x.shape, x.dtype) * 0.5 if str(path[-1].key).startswith("b") else x
        for (path, x), k in zip(leaves, keys)
    ]
    params = jax.tree_util.tree_unflatten(treedef, biased)
    want, _ = _run(cfg, params, None, 3)
    out, e = _run(cfg, params, make_mesh("data=2,model=4"), 3)
    assert out == want
    layer = e.params["layer_0"]
    assert layer["mlp"]["b_gate_up"].sharding.spec == P(None, "model")
    assert layer["mlp"]["b_down"].sharding.spec == P(None)
    assert layer["attn"]["bq"].sharding.spec == P("model", None)
    assert layer["attn"]["bo"].sharding.spec == P(None)
    assert _run(cfg, plain, None, 3)[0] != want  # the biases change the tokens: the check bites


@pytest.mark.parametrize("mesh, copies", [("data=2,model=4", 4), ("data=4,model=2", 4), ("data=8,model=1", 8)])
def test_kv_cache_bytes_count_every_copy_the_mesh_holds(params, mesh, copies):
    """kv_cache_bytes: device memory held, every device's share and copy counted (2x4 and 4x2 both
    hold four copies of this 2-KV-head cache: 2 heads x 2 copies over model=4 on 2 data rows, or 2
    heads whole over model=2 on 4); kv_bytes_per_token: the model's own. Before, 2x4 reported 2
    copies, 4x2 and 8x1 one."""
    e = _engine(CFG, params, make_mesh(mesh))
    logical = capacity.kv_cache_bytes(CFG, num_kv_pages=40, page_size=8)
    stats = e.stats()
    held: dict = {}  # read off the arrays themselves, not computed from their shardings
    for leaf in jax.tree.leaves(e.cache):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert stats["kv_cache_bytes"] == copies * logical == sum(held.values())
    assert stats["kv_bytes_per_token"] == CFG.kv_bytes_per_token
    assert stats["kv_cache_bytes_per_device"] == max(held.values())


def test_the_default_page_count_is_sized_by_what_must_fit_on_the_mesh(monkeypatch):
    """A quarter of the free memory, of what must fit there: on CPU every copy the mesh holds (8
    `data` copies of the cache take 8 times the RAM), on accelerators one device's share (model=2
    halves it, so twice the pages). Before, the mesh was ignored: data=8 on CPU asked for twice the
    host's RAM, and model=8 on accelerators used an eighth of what it could."""
    from jaxinfer import llm as llm_lib

    page = capacity.layer_page_bytes(CFG, 8) * CFG.num_layers
    monkeypatch.setattr(llm_lib, "free_device_bytes", lambda: 4 * 1000 * page)  # a quarter: 1000 pages

    def default(mesh):
        kw = dict(max_num_seqs=10**6, max_model_len=64, page_size=8, window_pages=None)
        return llm_lib._default_num_pages(CFG, **kw, mesh=None if mesh is None else make_mesh(mesh))

    assert default(None) == 1000
    assert default("data=8,model=1") == 125 and default("data=1,model=2") == 1000
    monkeypatch.setattr(capacity, "devices_share_host_memory", lambda: False)
    assert default("data=8,model=1") == 1000 and default("data=1,model=2") == 2000


def test_no_compilation_after_warmup_on_a_mesh(params):
    """Greedy rows, then penalised and biased ones, whose steps run ahead and take each row's last
    token from the device: nothing compiles after the warm-up, and their tokens are those of one
    step at a time."""
    e = _engine(CFG, params, make_mesh("data=2,model=4"))
    e.warmup()
    before = num_compiles()
    warmed = set(e._compiled_shapes)  # its own record: blind to what other tests compiled
    _finish(e)
    prompts, _ = _workload()
    sp = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        frequency_penalty=1.0,
        repetition_penalty=1.5,
        logit_bias={5: 2.0},
        min_tokens=2,
        stop_token_ids=[7],
    )
    got = []
    for mode in (True, False):
        e.async_scheduling = mode
        reqs = [e.add_request(p, sp) for p in prompts]
        while e.has_unfinished():
            e.step()
        got.append([r.seqs[0].output_ids for r in reqs])
    assert e._compiled_shapes == warmed
    assert num_compiles() == before
    assert got[0] == got[1]


def test_bad_meshes_are_refused_by_name(monkeypatch):
    with pytest.raises(InvalidRequestError, match="has 16 devices; only 8 are available"):
        parse_mesh("data=4,model=4")
    assert make_mesh("model=4").devices.tolist() == [jax.devices()[:4]]  # a prefix of the devices is fine
    # `model` varies fastest: a tensor-parallel group is neighbouring devices (one host's, one slice's).
    assert make_mesh("data=2,model=4").devices.tolist() == [jax.devices()[:4], jax.devices()[4:8]]
    assert spec_for("tokens", ("batch", None), (4, 8), make_mesh("data=2,model=4")) == P("data", None)
    with pytest.raises(InvalidRequestError, match="mesh axis 'tensor' is not one of"):
        parse_mesh("tensor=8")
    with pytest.raises(InvalidRequestError, match="mesh must look like"):
        parse_mesh("model:8")
    with pytest.raises(InvalidRequestError, match="mesh axis 'model' must be a positive integer"):
        parse_mesh({"model": 0, "data": 8})
    with pytest.raises(InvalidRequestError, match="names axis 'model' twice"):
        parse_mesh("model=4,model=2")
    # Were raw ValueError / TypeError from int() and the device grid:
    for bad in ("model=--4", "model=²", "model=2.5", {"model": True}):
        with pytest.raises(InvalidRequestError, match="mesh axis 'model' must be a positive integer"):
            parse_mesh(bad)
    assert parse_mesh("model=8") == {"data": 1, "model": 8}
    # NumPy integers, as every other integer argument takes them (were refused); plain ints out.
    sizes = parse_mesh({"model": np.int64(4), "data": np.int32(2)})
    assert sizes == {"data": 2, "model": 4} and all(type(v) is int for v in sizes.values())
    with pytest.raises(InvalidRequestError, match="has 9 devices"):
        LLM(mesh="data=3,model=3")
    # Across processes every device takes part: a mesh on some of them is refused (seen from one of
    # two processes; the two-process tests run full meshes).
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(InvalidRequestError, match="must span all 8 devices of the 2 processes"):
        parse_mesh("model=4")
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}


def test_tensor_parallel_size_is_the_model_axis_as_vllm_names_it():
    """LLM(tensor_parallel_size=n) is LLM(mesh="model=n"): the same mesh, the same tokens; 1 is one
    device; with a mesh as well, or not a positive integer, it is refused by name."""
    kw = dict(max_model_len=64, num_kv_pages=32, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 50, 60], [1, 7, 8, 9, 10]]
    by_mesh = LLM("embedded:tiny-random", mesh="model=2", **kw)
    by_size = LLM("embedded:tiny-random", tensor_parallel_size=2, **kw)
    one = LLM("embedded:tiny-random", tensor_parallel_size=1, **kw)
    assert dict(by_size.engine.mesh.shape) == dict(by_mesh.engine.mesh.shape) == {"data": 1, "model": 2}
    assert one.engine.mesh is None
    tokens = [
        [o.token_ids for o in m.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        for m in (by_mesh, by_size, one)
    ]
    assert tokens[0] == tokens[1] == tokens[2]
    with pytest.raises(InvalidRequestError, match="give mesh or tensor_parallel_size, not both"):
        LLM("embedded:tiny-random", mesh="model=2", tensor_parallel_size=2)
    for bad in (0, True, 2.0, "2"):
        with pytest.raises(
            InvalidRequestError, match=f"tensor_parallel_size must be None or an integer >= 1, got {bad!r}"
        ):
            LLM("embedded:tiny-random", tensor_parallel_size=bad)
    with pytest.raises(InvalidRequestError, match="has 16 devices; only 8 are available"):
        LLM("embedded:tiny-random", tensor_parallel_size=16)


def test_a_tensor_parallel_size_past_the_devices_is_refused_by_its_name():
    """The refusal names tensor_parallel_size, which the caller gave, not only the mesh it stands for."""
    n = jax.device_count()
    with pytest.raises(
        InvalidRequestError, match=rf"^tensor_parallel_size={2 * n}: mesh data=1,model={2 * n} has {2 * n} devices"
    ):
        LLM("embedded:tiny-random", tensor_parallel_size=2 * n)


def test_kv_head_copies_only_when_the_model_axis_is_a_multiple():
    from jaxinfer.sharding import kv_head_copies

    def copies(n, k, spec):
        return kv_head_copies(dataclasses.replace(CFG, num_heads=n, num_kv_heads=k), make_mesh(spec))

    assert copies(8, 2, "model=8") == 4 and copies(8, 2, "model=4") == 2 and copies(8, 1, "model=8") == 8
    assert copies(8, 2, "model=2") == 1 and copies(8, 8, "model=4") == 1  # splits as they are
    assert copies(8, 4, "model=6") == 1  # 6 is no multiple of 4: replicated, as the rules table says
    assert copies(4, 2, "model=8") == 1  # 4 query heads cannot split 8 ways either
    assert copies(8, 2, "data=8") == 1


def test_rules_refuse_two_dims_on_one_mesh_axis_and_replicate_what_does_not_divide():
    mesh = make_mesh("data=2,model=4")
    assert spec_for("wq", ("embed", "q_heads", "head_dim"), (64, 8, 16), mesh) == P(None, "model", None)
    assert spec_for("wk", ("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(None, None, None)
    bad = {**RULES, "head_dim": "model"}
    with pytest.raises(ValueError, match="wq: logical axes 'q_heads' and 'head_dim' both map to mesh axis 'model'"):
        spec_for("wq", ("embed", "q_heads", "head_dim"), (64, 8, 16), mesh, bad)
    with pytest.raises(ValueError, match="logical axis 'experts' has no entry"):
        spec_for("w", ("experts",), (4,), mesh)


def test_hf_checkpoint_is_read_straight_onto_the_mesh(tmp_path, monkeypatch):
    """A transformers-written Qwen2 (q/k/v biases, 2 KV heads, sharded files) read with 2x4 shardings:
    every array lands with its rule's sharding and equals the unsharded load, and the reader only
    ever converts shard-sized slices (the merged gate/up included), never a whole split tensor."""
    from hf_models import make_hf_model, save_hf_model

    from jaxinfer import loading
    from jaxinfer.config import load_hf_config
    from jaxinfer.sharding import param_shardings

    save_hf_model(make_hf_model("qwen2", num_attention_heads=8, num_key_value_heads=2), tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    mesh = make_mesh("data=2,model=4")
    cfg = load_hf_config(str(tmp_path))
    shardings = param_shardings(cfg, mesh)
    reads = []  # (tensor shape, its shard shape, the shapes of the slices the reader cut from the view)
    place = loading._place

    class Recording:
        def __init__(self, view):
            self.view, self.shape, self.cut = view, view.shape, []

        def __getitem__(self, idx):
            part = self.view[idx]
            self.cut.append(part.shape)
            return part

    def spy(view, shape, dtype, sharding, sources):
        rec = Recording(view)
        out = place(rec, shape, dtype, sharding, sources)
        reads.append((tuple(shape), out.sharding.shard_shape(tuple(shape)), rec.cut))
        return out

    monkeypatch.setattr(loading, "_place", spy)
    sharded = loading.load_safetensors_params(str(tmp_path), cfg, shardings=shardings)
    _, plain = loading.load_hf_checkpoint(str(tmp_path))
    for (path, got), want, sh in zip(
        jax.tree_util.tree_leaves_with_path(sharded), jax.tree.leaves(plain), jax.tree.leaves(shardings), strict=True
    ):
        assert got.sharding == sh, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    assert sharded["layer_0"]["mlp"]["w_gate_up"].sharding.spec == P(None, None, "model")
    assert sharded["layer_0"]["attn"]["wq"].sharding.spec == P(None, "model", None)
    assert sum(shard != full for full, shard, _ in reads) > 10  # split tensors exist, so the check below bites
    for full, shard, cut in reads:
        assert cut and all(c == shard for c in cut), (full, shard, cut)

    llm_one = LLM(str(tmp_path), max_model_len=64, num_kv_pages=32)
    llm_mesh = LLM(str(tmp_path), max_model_len=64, num_kv_pages=32, mesh="data=2,model=4")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 33], [1, 7, 7, 7, 8, 90, 100, 3, 4]]
    one = llm_one.generate(prompt_token_ids=prompts, sampling_params=sp)
    many = llm_mesh.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in one] == [o.token_ids for o in many]
    assert llm_mesh.engine.params["embedding"].sharding.spec == P("model", None)


def test_an_llm_over_a_mesh_that_copies_kv_heads_holds_its_weights_once(tmp_path):
    """Over model=8, 2 KV heads are stored 4 times each (`kv_head_copies`): the engine widens the K/V
    weights into new arrays. The LLM kept the unwidened set too, so every weight sat twice on the
    devices (and memory_per_device counted one set). `llm.params` now narrows the engine's on demand,
    to the values loaded."""
    import gc

    from hf_models import make_hf_model, save_hf_model

    from jaxinfer import loading

    save_hf_model(make_hf_model("qwen2", num_attention_heads=8, num_key_value_heads=2), tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, num_kv_pages=32, mesh="data=1,model=8")
    gc.collect()
    attn = llm.engine.params["layer_0"]["attn"]
    assert attn["wk"].shape[1] == attn["bk"].shape[0] == 8  # 2 heads x 4 copies
    narrow = {(attn["wk"].shape[0], 2, attn["wk"].shape[2]), (2, attn["bk"].shape[1])}
    on_mesh = [a for a in jax.live_arrays() if len(a.sharding.device_set) == 8 and a.shape in narrow]
    assert on_mesh == []  # no unwidened K/V weight left beside the engine's
    _, want = loading.load_hf_checkpoint(str(tmp_path))
    got = llm.params
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_a_kv_cache_too_big_for_a_device_is_refused_with_or_without_a_mesh(monkeypatch):
    """What must fit on an accelerator is one device's share: KV heads split over `model` (or
    copied, then split), whole on every `data` device. Before, a mesh skipped the check: a huge
    --num-kv-pages with --mesh was an out-of-memory kill instead of an error. CPU devices share the
    host's RAM, so there all their shares must fit together (before, 8 `data` copies of a cache
    were checked as one)."""

    fits = dict(cfg=CFG, num_kv_pages=64, num_window_pages=None, page_size=8)
    total = capacity.kv_cache_bytes(CFG, num_kv_pages=64, page_size=8)
    monkeypatch.setattr(capacity, "free_device_bytes", lambda: int(total * 0.75))
    with pytest.raises(InvalidRequestError, match=r"num_kv_pages x page_size = 64 x 8 tokens: the KV cache would take"):
        capacity.check_cache_fits(**fits)
    monkeypatch.setattr(capacity, "devices_share_host_memory", lambda: False)  # an accelerator's rule
    capacity.check_cache_fits(**fits, mesh=make_mesh("data=1,model=2"))  # half of it per device
    capacity.check_cache_fits(**fits, mesh=make_mesh("data=1,model=8"))  # 2 heads x 4 copies over 8: half
    with pytest.raises(InvalidRequestError, match="per device"):
        capacity.check_cache_fits(**fits, mesh=make_mesh("data=2,model=1"))  # rows split, the cache whole
    monkeypatch.setattr(capacity, "devices_share_host_memory", lambda: True)  # this machine's rule
    for mesh, copies in (("data=1,model=2", 1), ("data=2,model=1", 2), ("data=1,model=8", 4), ("data=8,model=1", 8)):
        with pytest.raises(InvalidRequestError, match=r"GiB on this process's CPU devices \((2|8), sharing"):
            capacity.check_cache_fits(**fits, mesh=make_mesh(mesh))
        monkeypatch.setattr(capacity, "free_device_bytes", lambda c=copies: total * c)
        capacity.check_cache_fits(**fits, mesh=make_mesh(mesh))
        monkeypatch.setattr(capacity, "free_device_bytes", lambda: int(total * 0.75))
    monkeypatch.undo()
    with pytest.raises(InvalidRequestError, match="GiB on this process's CPU devices"):
        LLM("embedded:tiny-random", mesh="data=1,model=1", max_model_len=64, num_kv_pages=2**30)
