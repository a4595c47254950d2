"""The public API and CLI: outputs, stopping, batching, and clear errors for bad input."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from jaxinfer import LLM, InvalidRequestError, SamplingParams, default_model
from jaxinfer import model as model_lib
from jaxinfer.cli import main
from jaxinfer.tokenizer import validate_messages


@pytest.fixture(scope="module")
def llm():
    # The engine's mechanics, on the tiny random model (fast to compile); tests/test_default_model.py
    # covers the trained default.
    return LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=4)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def one_step_at_a_time(llm, monkeypatch):
    """The engine reads each step's results before the next step (no async scheduling): for tests
    that interleave streams step by step. tests/test_engine.py checks the async steps' own
    interruptions."""
    monkeypatch.setattr(llm.engine, "async_scheduling", False)
    llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=1))  # reads a step ahead


def test_default_model_generates(llm):
    outs = llm.generate(["Hello", "In the beginning"], GREEDY)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].prompt == "Hello" and outs[0].prompt_token_ids == llm.tokenizer.encode("Hello")
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_batch_gives_same_greedy_tokens_as_alone(llm):
    prompts = [[1, 40 + i] * (i + 1) for i in range(7)]  # mixed lengths, more than max_num_seqs
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert together == alone


_BATCH_VS_ALONE = """
import json
from jaxinfer import LLM, SamplingParams, default_model
llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=4)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
prompts = [[1, 40 + i] * (i + 1) for i in range(7)]
outs = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
outs += llm.generate(prompt_token_ids=prompts, sampling_params=params)
print(json.dumps([[o.token_ids, [lp.logprob for lp in o.logprobs]] for o in outs]))
"""


def test_batches_are_invariant_under_the_librarys_own_compile_settings():
    """The tests compile with LLVM at -O0 and XLA's older fusion emitters (conftest); a user's
    programs get XLA's defaults. Under those, in a process of its own: a batch gives each prompt
    the greedy tokens it gets alone, and log-probabilities that differ at most in float32's last
    bits (a row decoding alone runs XLA's matrix-vector product, which sums in another order than
    the matrix product of several rows: WORKSPACE.md, "Batch invariance")."""
    test_only = ("xla_backend_optimization_level", "xla_cpu_use_fusion_emitters", "xla_cpu_parallel_codegen_split")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not any(name in f for name in test_only)]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    r = subprocess.run([sys.executable, "-c", _BATCH_VS_ALONE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = json.loads(r.stdout.splitlines()[-1])
    alone, together = outs[:7], outs[7:]
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    for (_, got), (_, want) in zip(together, alone, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len({tuple(tokens) for tokens, _ in alone}) > 1  # the prompts really differ


def test_threads_share_one_llm_safely(llm):
    """Several threads calling generate and stream on one LLM: their requests join the same batches
    and each gets exactly its own greedy tokens, text and finish reason. Before, the engine was
    stepped from two threads at once: a step read the cache the other had just donated ("Buffer has
    been deleted or donated"); and a request that another thread's step had ended could be read as
    finished before its last update was filed (a stream lost its last delta)."""
    import threading

    prompts = [[1, 30 + i, 5, 60 - i][: 2 + i % 3] for i in range(6)]
    solo = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].outputs[0] for p in prompts]
    alone = [(o.token_ids, o.text, o.finish_reason) for o in solo]
    got, errors = {}, []
    start = threading.Barrier(len(prompts))

    def work(i):
        try:
            start.wait()
            for _ in range(3):
                if i % 2:
                    deltas = list(llm.stream(prompt_token_ids=prompts[i], sampling_params=GREEDY))
                    ids = [t for d in deltas for t in d.token_ids]
                    out = (ids, "".join(d.text for d in deltas), deltas[-1].finish_reason)
                else:
                    o = llm.generate(prompt_token_ids=[prompts[i]], sampling_params=GREEDY)[0].outputs[0]
                    out = (o.token_ids, o.text, o.finish_reason)
                got.setdefault(i, []).append(out)
        except Exception as e:  # reported below, with the thread
            errors.append((i, f"{type(e).__name__}: {e}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == {i: [alone[i]] * 3 for i in range(len(prompts))}
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_stream_the_garbage_collector_closes_inside_a_step_ends_after_it(llm):
    """A stream abandoned in a reference cycle is closed by the cyclic garbage collector wherever it
    runs - possibly inside another call's engine step, on the thread holding the (reentrant) lock.
    Its abort then ran halfway through the step and broke it (IndexError in the scheduler, or the
    step's bookkeeping on freed pages); it now waits for the step to end."""
    import gc

    prompt = [1, 7, 9]
    expected = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    real = llm.engine._dispatch
    collected = []

    def dispatch(*args):
        out = real(*args)
        if not collected:  # one collection, inside the first step of the generate() below
            collected.append(gc.collect())
        return out

    gc.disable()
    try:
        stream = llm.stream(prompt_token_ids=list(range(3, 33)), sampling_params=long)
        next(stream), next(stream)  # running, two full pages
        cycle = [stream]
        cycle.append(cycle)
        del stream, cycle
        llm.engine._dispatch = dispatch
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    finally:
        del llm.engine._dispatch
        gc.enable()
    assert collected and got == expected
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert not llm._updates


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[[1, 50, 60]], sampling_params=p)[0].token_ids
    batch = llm.generate(
        prompt_token_ids=[[1, 9], [1, 50, 60], [1, 7, 7, 7]],
        sampling_params=[GREEDY, p, SamplingParams(max_tokens=3, temperature=0.5)],
    )
    assert batch[1].token_ids == alone


def test_numpy_numbers_in_sampling_params_act_as_python_ones(llm):
    """A np.uint32 seed passed validation, then overflowed in the engine (seed + sample index, mod 2**32)."""
    want = llm.generate(prompt_token_ids=[[1, 50]], sampling_params=SamplingParams(temperature=1.0, seed=5, n=2))
    for seed in (np.uint32(5), np.int32(5), np.int64(5)):
        p = SamplingParams(temperature=np.float32(1.0), seed=seed, n=np.int32(2), max_tokens=np.uint8(16))
        assert type(p.seed) is int and type(p.temperature) is float and type(p.n) is int
        got = llm.generate(prompt_token_ids=[[1, 50]], sampling_params=p)
        assert [o.token_ids for o in got[0].outputs] == [o.token_ids for o in want[0].outputs]


def test_numpy_prompt_ids_are_taken_when_one_dimensional(llm):
    want = llm.generate(prompt_token_ids=[[1, 50, 60]], sampling_params=GREEDY)[0].token_ids
    got = llm.generate(prompt_token_ids=[np.array([1, 50, 60], np.int32)], sampling_params=GREEDY)[0].token_ids
    assert got == want
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[0\] must be a list of integers, got ndarray"):
        llm.generate(prompt_token_ids=[np.array([[1, 50]])], sampling_params=GREEDY)


def test_engine_add_request_refuses_what_llm_would(llm):
    e = llm.engine
    for prompt, params, message in [
        (np.array([3, 4]), GREEDY, "prompt_ids must be a list of token ids, got ndarray"),
        ([3, 4], None, "params must be a SamplingParams, got NoneType"),
        ([3, 4.5], GREEDY, "prompt_ids must hold integers"),
        ("34", GREEDY, "prompt_ids must be a list"),
        # Too long is refused before the ids are looked at one by one (on a server, on its event loop).
        (["x"] * 10**6, GREEDY, f"prompt has 1000000 tokens; the limit is max_model_len - 1 = {e.max_model_len - 1}"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            e.add_request(prompt, params)
    with pytest.raises(InvalidRequestError, match="request_id must be a string, got int"):
        e.add_request([3, 4], GREEDY, request_id=7)
    assert not e.requests


def test_a_stream_aborted_through_the_engine_ends_with_abort(llm):
    """engine.abort() hands its updates to its caller: the open stream used to end with no finish_reason."""
    gen = llm.stream(prompt_token_ids=[1, 40], sampling_params=SamplingParams(max_tokens=30, n=2, ignore_eos=True))
    next(gen)
    (rid,) = llm.engine.requests
    llm.engine.abort(rid)
    rest = list(gen)
    assert sorted(d.index for d in rest if d.finish_reason == "abort") == [0, 1]
    assert all(d.finish_reason is None for d in rest[:-2])
    stats = llm.stats()
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_unseeded_requests_leave_numpy_global_random_state_alone(llm):
    """Unseeded requests draw their seeds from the engine's own generator: generate() does not advance
    the user's np.random stream, and seeding that stream does not make unseeded samples repeat."""
    p = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        np.random.seed(123)
        state = np.random.get_state()
        runs.append(llm.generate(prompt_token_ids=[[1, 50, 60]] * 2, sampling_params=p))
        after = np.random.get_state()
        assert after[1].tolist() == state[1].tolist() and after[2:] == state[2:]
    assert [o.token_ids for o in runs[0]] != [o.token_ids for o in runs[1]]


def test_an_llm_seed_makes_unseeded_requests_repeat_run_after_run():
    """LLM(seed=S), as vLLM's: unseeded requests draw their seeds from S's stream in the order they
    arrive, so a rerun of the same script samples the same tokens; another S, or none, does not. A
    request's own seed still wins."""
    p = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    prompts = [[1, 50, 60], [1, 50, 60], [1, 7]]

    def script(**kwargs):
        llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=4, **kwargs)
        first = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]
        second = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=p)[0].token_ids
        own = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=dataclasses.replace(p, seed=9))
        return first, second, own[0].token_ids

    a, b, c, free = script(seed=5), script(seed=5), script(seed=6), script()
    assert a == b
    first, second, own = a
    assert first[0] != first[1] and second not in first  # each request its own draw from the stream
    assert c[0] != first and free[0] != first
    assert own == c[2] == free[2]  # SamplingParams.seed is the request's own, whatever the LLM's
    for bad in (-1, 1.5, True, "5"):
        with pytest.raises(InvalidRequestError, match=f"seed must be None or an integer >= 0, got {bad!r}"):
            LLM(default_model.TINY_RANDOM, seed=bad)


def test_an_llm_seed_may_be_a_numpy_integer():
    """As every integer setting and request field: np.int64(5) is the seed 5."""
    p = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = [
        LLM(default_model.TINY_RANDOM, max_model_len=32, num_kv_pages=16, seed=seed)
        .generate(prompt_token_ids=[[1, 50]], sampling_params=p)[0]
        .token_ids
        for seed in (5, np.int64(5))
    ]
    assert runs[0] == runs[1]
    from jaxinfer.engine import Engine  # built directly, too

    llm = LLM(default_model.TINY_RANDOM, max_model_len=32, num_kv_pages=16)
    engine = Engine(llm.cfg, llm.params, max_model_len=32, num_kv_pages=16, seed=np.int64(5))
    assert engine._seeds.integers(2**32) == np.random.default_rng(5).integers(2**32)


def test_stop_token_ids_and_eos(llm):
    free = llm.generate(prompt_token_ids=[[1, 70, 71]], sampling_params=GREEDY)[0].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate(
        prompt_token_ids=[[1, 70, 71]],
        sampling_params=SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first]
    assert out.stop_reason == stop_at  # the stop token that ended it (vLLM's stop_reason)
    # The same token as the model's EOS stops too, unless ignore_eos.
    import dataclasses

    eos_llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=16)
    eos_llm.engine.cfg = dataclasses.replace(eos_llm.engine.cfg, eos_token_ids=(stop_at,))
    out = eos_llm.generate(prompt_token_ids=[[1, 70, 71]], sampling_params=SamplingParams(max_tokens=8, temperature=0))
    assert out[0].finish_reason == "stop" and out[0].token_ids == free[:first]
    assert out[0].stop_reason is None  # EOS has no stop_reason, as in vLLM


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate(
        prompt_token_ids=[[1] + [5] * 60],
        sampling_params=SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.generate([""]), r"prompts\[0\] is empty"),
        (lambda m: m.generate(prompt_token_ids=[[]]), "empty"),
        (lambda m: m.generate(prompt_token_ids=[[1] * 64]), r"64 tokens.*max_model_len - 1 = 63"),
        (lambda m: m.generate(prompt_token_ids=[[1, 259]]), r"259 is outside the vocabulary \[0, 259\)"),
        (lambda m: m.generate(prompt_token_ids=[[1, -1]]), "outside the vocabulary"),
        (lambda m: m.generate(prompt_token_ids=[["a"]]), r"list of integers, but \[0\] is 'a' \(str\)"),
        (lambda m: m.generate(prompt_token_ids=[[1, True]]), r"prompt_token_ids\[0\] .* but \[1\] is True \(bool\)"),
        (lambda m: m.generate(prompt_token_ids=[[1, 2.0]]), r"but \[1\] is 2.0 \(float\)"),
        (lambda m: m.generate(["a", "b"], [GREEDY] * 3), "3 sampling_params for 2 prompts"),
        (lambda m: m.generate(), "exactly one of"),
        (lambda m: m.generate([3]), r"prompts\[0\] must be a string"),
        # What Python makes of invalid UTF-8 bytes (argv, file names): the tokenizer failed natively.
        (lambda m: m.generate(["ok", "a\udcffb"]), r"prompts\[1\] is not valid Unicode: lone surrogate '\\udcff' at"),
        (lambda m: validate_messages([{"role": "user", "content": "\ud800"}]), r"messages\[0\]\.content is not valid"),
        (lambda m: m.generate(prompt_token_ids=[[1, 2], 3]), r"prompt_token_ids\[1\] must be a list of integers"),
        (lambda m: m.generate(prompt_token_ids=7), "prompt_token_ids must be a list"),
        # Were raw TypeErrors ("'int' object is not iterable", "len() of unsized object"):
        (lambda m: m.generate(5), "prompts must be a string, a prompt dict or a list of them, got int"),
        # vLLM-style prompt dicts: one known key, checked as the plain forms are.
        (lambda m: m.generate({"prompt": "a", "multi_modal_data": {}}), r"prompts\[0\]: unsupported prompt field"),
        (lambda m: m.generate([{"prompt": "a", "prompt_token_ids": [1]}]), r"prompts\[0\] must hold exactly one of"),
        (lambda m: m.generate(["a", {}]), r"prompts\[1\] must hold exactly one of"),
        (lambda m: m.generate([{"prompt": ""}]), r"prompts\[0\]\.prompt is empty"),
        (lambda m: m.generate([{"prompt_token_ids": "abc"}]), r"prompts\[0\]\.prompt_token_ids must be a list"),
        (lambda m: m.generate([{"prompt_token_ids": [1, 999]}]), r"prompts\[0\]: .*999 is outside the vocabulary"),
        (lambda m: m.generate("a", 5), "sampling_params must be a SamplingParams or a list of them, got int"),
        (lambda m: m.generate(prompt_token_ids=np.array(5)), "prompt_token_ids must be a list"),
        # stream takes one prompt: its refusals name its own arguments, not generate's lists.
        (lambda m: m.stream(""), r"^prompt is empty"),
        (lambda m: m.stream(prompt_token_ids=[[1, 2]]), r"^prompt_token_ids must be a list of integers"),
        (lambda m: m.stream(prompt_token_ids=[1, 999]), r"^prompt_token_ids: prompt token id 999 is outside"),
        (lambda m: m.stream(), r"^pass exactly one of prompt or prompt_token_ids"),
        (lambda m: m.generate("a", GREEDY, use_tqdm="no"), "use_tqdm must be True or False, got 'no'"),  # drew a bar
        (lambda m: m.generate(prompt_token_ids=[np.ones((2, 2), int)]), r"prompt_token_ids\[0\] must be a list"),
        # Was accepted: an id the model can never produce, in a stop list.
        (
            lambda m: m.generate(["a"], SamplingParams(stop_token_ids=[3, 10**6])),
            r"prompts\[0\]: SamplingParams.stop_token_ids: 1000000 is outside the vocabulary \[0, 259\)",
        ),
        (
            lambda m: m.generate(["a"], SamplingParams(logit_bias={3: 1.0, 259: -1.0})),
            r"prompts\[0\]: SamplingParams.logit_bias: 259 is outside the vocabulary \[0, 259\)",
        ),
        (
            lambda m: m.generate(["a"], SamplingParams(allowed_token_ids=[3, 300])),
            r"SamplingParams.allowed_token_ids: 300 is outside the vocabulary \[0, 259\)",
        ),
        # Would have drawn a token outside the list: every allowed id is held back by min_tokens.
        (
            lambda m: m.generate(["a"], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2)),
            r"SamplingParams.allowed_token_ids holds only ids that end the output .* min_tokens \(2\) forbids",
        ),
        (  # the same with ignore_eos: the stop ids are exactly the allowed ones
            lambda m: m.generate(
                ["a"], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1, ignore_eos=True)
            ),
            r"SamplingParams.allowed_token_ids holds only ids that end the output .* min_tokens \(1\) forbids",
        ),
        (lambda m: validate_messages([{"role": "us\udcffer", "content": "hi"}]), r"messages\[0\]\.role is not valid"),
        (
            lambda m: validate_messages([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
            r"messages\[0\]\.content\[0\]\.text is not valid Unicode",
        ),
    ],
)
def test_bad_requests_are_refused_clearly(llm, call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call(llm)


def test_token_ids_at_the_vocabularys_edges_are_accepted(llm):
    """Ids 0 and vocab_size - 1 in a prompt and in every id-holding field; the draws keep to the
    allowed ids, and the stop id (held back by min_tokens at first) is never shown."""
    last = llm.engine.cfg.vocab_size - 1
    sp = dataclasses.replace(
        GREEDY, stop_token_ids=[last], logit_bias={0: 0.5, last: -0.5}, allowed_token_ids=[0, last], min_tokens=3
    )
    out = llm.generate(prompt_token_ids=[[0, last]], sampling_params=sp)[0]
    assert out.token_ids[:3] == [0, 0, 0] and set(out.token_ids) == {0}


def test_bad_request_loses_nothing(llm):
    """A batch with one bad prompt fails before any work starts; the engine stays usable."""
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[1\]"):
        llm.generate(prompt_token_ids=[[1, 2], [1, 10**6]], sampling_params=GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
    assert len(llm.generate(prompt_token_ids=[[1, 2]], sampling_params=GREEDY)[0].token_ids) == 8


def test_an_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    """Ctrl-C (or any error) mid-generate aborts that call's requests: nothing keeps running, holding
    pages, or joins the next call's batch."""
    prompts = [[1, 40 + i] * 5 for i in range(6)]
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    real_step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == expected


@pytest.mark.parametrize("phase", ["prefill", "decode_step"])
def test_a_step_that_fails_on_the_device_leaves_a_working_engine(llm, monkeypatch, phase):
    """A step that fails while it runs (a GPU out of memory, a device error) has consumed the cache
    donated to it. The engine makes a new one and serves on - before, every later call failed with
    "buffer has been deleted or donated" - and reads nothing from the lost one: the prefix pages
    are forgotten too, so the same prompt gives the same tokens and logprobs, with no cache hit."""
    shared = [1] + [(7 * i) % 120 + 3 for i in range(40)]  # two full pages for the prefix cache
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    before = llm.generate(prompt_token_ids=[shared], sampling_params=params)[0]

    def fault(_):
        raise RuntimeError("injected device fault")

    def failing(params, cache, batch, *, cfg):  # the real step, with a failure inside the program
        logits, cache = model_lib.forward(params, cache, batch, cfg=cfg)
        return logits + io_callback(fault, jax.ShapeDtypeStruct((), jnp.float32), logits[0, 0]), cache

    steps = list(llm.engine._steps)  # (prefill, decode_step)
    steps[phase == "decode_step"] = jax.jit(failing, static_argnames=("cfg",), donate_argnames=("cache",))
    monkeypatch.setattr(llm.engine, "_steps", tuple(steps))
    with pytest.raises(Exception, match="injected device fault"):
        llm.generate(prompt_token_ids=[[1, 5, 6] * 5, shared[:20]], sampling_params=GREEDY)
    monkeypatch.undo()
    stats = llm.stats()
    assert not llm.engine.has_unfinished() and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["kv_pages_cached"] == 0
    hits = stats["prefix_cache_hit_tokens"]
    after = llm.generate(prompt_token_ids=[shared], sampling_params=params)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == hits
    assert after.token_ids == before.token_ids
    for a, b in zip(after.logprobs, before.logprobs, strict=True):
        assert a.top.keys() == b.top.keys() and np.allclose([a.top[t] for t in a.top], [b.top[t] for t in a.top])


def test_a_lost_cache_whose_replacement_fails_is_made_again_at_the_next_step(llm, monkeypatch):
    """The new cache itself can fail (out of memory): the error is raised, and the next step tries
    again instead of running on no cache for good."""
    expected = llm.generate(prompt_token_ids=[[1, 9] * 6], sampling_params=GREEDY)[0].token_ids
    engine, real_new_cache = llm.engine, llm.engine._new_cache

    def new_cache_fails_once():
        monkeypatch.setattr(engine, "_new_cache", real_new_cache)
        raise RuntimeError("RESOURCE_EXHAUSTED: injected allocation failure")

    monkeypatch.setattr(engine, "_new_cache", new_cache_fails_once)
    for leaf in jax.tree.leaves(engine.cache):  # what a failed step leaves of the cache donated to it
        leaf.delete()
    with pytest.raises(RuntimeError, match="injected allocation failure"):
        llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=GREEDY)
    assert llm.generate(prompt_token_ids=[[1, 9] * 6], sampling_params=GREEDY)[0].token_ids == expected
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_an_abort_ends_every_sample_even_when_the_text_cannot_be_decoded(llm, monkeypatch):
    """A request of n samples whose held-back text fails to decode at the abort: every sample still
    ends and frees its pages (sample 1 used to stay running with no request, failing every later
    call)."""
    expected = llm.generate(prompt_token_ids=[[1, 9] * 6], sampling_params=GREEDY)[0].token_ids
    tok, real_decode = llm.tokenizer, llm.tokenizer.decode

    def decode(ids, *args, **kwargs):
        if 6 in ids:
            raise RuntimeError("this tokenizer cannot decode 6")
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", decode)
    with pytest.raises(RuntimeError, match="cannot decode 6"):
        llm.generate(prompt_token_ids=[[1, 5, 6] * 5], sampling_params=dataclasses.replace(GREEDY, n=2))
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
    assert llm.generate(prompt_token_ids=[[1, 9] * 6], sampling_params=GREEDY)[0].token_ids == expected


def test_a_stream_ended_by_a_step_that_then_raised_still_gets_its_last_tokens(llm, monkeypatch, one_step_at_a_time):
    """Stream A's step finishes stream B, then raises (Ctrl-C) while handling A: B's last update,
    held by the engine for its next step, reaches B (B used to end with an empty delta)."""
    from jaxinfer import scheduler as scheduler_lib

    a_params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    b_params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    b_prompt = [1, 9, 20, 33] * 5  # the longer row: handled first in a decode step
    expected = [
        (d.token_ids, d.text, d.finish_reason) for d in llm.stream(prompt_token_ids=b_prompt, sampling_params=b_params)
    ]
    a = llm.stream(prompt_token_ids=[1, 5, 6] * 5, sampling_params=a_params)
    next(a)
    b = llm.stream(prompt_token_ids=b_prompt, sampling_params=b_params)
    got = [next(b)]
    next(a)
    a_id = next(r for r, req in llm.engine.requests.items() if req.params is a_params)
    real = scheduler_lib.Scheduler.register_full_pages

    def interrupted(self, seq):
        if seq.request_id == a_id:
            monkeypatch.setattr(scheduler_lib.Scheduler, "register_full_pages", real)
            raise KeyboardInterrupt
        return real(self, seq)

    monkeypatch.setattr(scheduler_lib.Scheduler, "register_full_pages", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(a)  # one decode step: B's last token, then the interrupt
    a.close()
    got += list(b)
    assert [(d.token_ids, d.text, d.finish_reason) for d in got] == expected
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


@pytest.mark.parametrize("where", ["register_full_pages", "detokenizer"])
def test_a_ctrl_c_during_a_steps_bookkeeping_waits_for_its_end(llm, monkeypatch, where, one_step_at_a_time):
    """A real SIGINT landing while a step books another open stream's token (its chunk counted as
    computed, its token not yet appended; or appended, its text not yet made): the interrupt is
    held back to the end of the step. Before, it tore B's state: B stalled ("scheduler made no
    progress") or lost a token's text."""
    import signal

    from jaxinfer import detokenizer as detokenizer_lib
    from jaxinfer import scheduler as scheduler_lib

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    b_prompt = [1, 9, 20, 33] * 5
    alone = llm.stream(prompt_token_ids=b_prompt, sampling_params=params)
    expected = [(d.token_ids, d.text, d.finish_reason) for d in alone]
    a = llm.stream(prompt_token_ids=[1, 5, 6] * 5, sampling_params=params)
    next(a)
    b = llm.stream(prompt_token_ids=b_prompt, sampling_params=params)
    got = [next(b)]
    next(a)  # A's token from B's prefill step
    b_id = next(r for r, req in llm.engine.requests.items() if req.prompt_ids == b_prompt)
    owner, name = (
        (scheduler_lib.Scheduler, "register_full_pages")
        if where == "register_full_pages"
        else (detokenizer_lib.IncrementalDetokenizer, "add")
    )
    real = getattr(owner, name)

    def interrupted(self, arg, *rest, **kw):
        request_id = arg.request_id if where == "register_full_pages" else None
        if request_id == b_id or (request_id is None and self is b_detok):
            monkeypatch.setattr(owner, name, real)
            signal.raise_signal(signal.SIGINT)  # the handler raises KeyboardInterrupt at the next bytecode
        return real(self, arg, *rest, **kw)

    b_detok = llm.engine.requests[b_id].seqs[0].detok
    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(a)  # one decode step for both streams; the interrupt comes while B's token is booked
    a.close()
    got += list(b)
    assert [(d.token_ids, d.text, d.finish_reason) for d in got] == expected
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


_CTRL_C_MID_COMPILE = """
import os, signal, threading, time
from jaxinfer import LLM, SamplingParams
from jaxinfer import engine as engine_lib

llm = LLM(warmup=False, max_model_len=64, num_kv_pages=16)
compile_step = engine_lib.Engine._compile

def interrupted_compile(self, *args):  # a real SIGINT 50 ms into the step's compilation
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.perf_counter()
    compile_step(self, *args)
    print(f"compiled in {time.perf_counter() - started:.2f} s", flush=True)

engine_lib.Engine._compile = interrupted_compile
try:
    llm.generate("In the beginning", SamplingParams(max_tokens=2))
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_in_the_middle_of_a_compilation_leaves_a_process_that_exits_cleanly():
    """From a review: JAX lets a Ctrl-C end the wait for a compilation, which goes on in XLA's
    threads, and the interpreter's exit then crashed in the runtime's teardown (exit 139, 5 of 11
    interrupted `generate`s). Step programs now compile on a worker thread the main one waits for;
    the process exits after the compilation ends."""
    r = subprocess.run([sys.executable, "-c", _CTRL_C_MID_COMPILE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "interrupted" and lines[1].startswith("compiled in"), lines  # the wait ended first


def test_a_held_back_ctrl_c_is_delivered_once_when_the_outermost_region_ends():
    import signal
    import threading

    from jaxinfer import _interrupts

    handler = signal.getsignal(signal.SIGINT)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupts.deferred():
            with _interrupts.deferred():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                seen.append("inner")
            seen.append("outer")  # the inner region's end delivers nothing
    assert seen == ["inner", "outer"] and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(KeyboardInterrupt):
        with _interrupts.deferred():
            with _interrupts.allowed():  # waiting for the device: Ctrl-C acts at once
                signal.raise_signal(signal.SIGINT)
                seen.append("not reached")
    assert "not reached" not in seen and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(KeyboardInterrupt):
        with _interrupts.deferred():
            signal.raise_signal(signal.SIGINT)  # held back ...
            with _interrupts.allowed():  # ... until the wait for the device begins, not after it
                seen.append("waited")
    assert "waited" not in seen and signal.getsignal(signal.SIGINT) is handler
    # Off the main thread (the server's engine thread) both are no-ops: no signal.signal there, also
    # while the main thread is inside a region of its own.
    errors = []
    thread = threading.Thread(target=lambda: errors.extend(_check_off_main_thread(_interrupts)))
    with _interrupts.deferred():
        thread.start()
        thread.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is handler


def _leaves_nothing(llm) -> None:
    stats = llm.stats()
    assert not llm.engine.requests and not llm._updates and stats["running"] == stats["waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


@pytest.mark.parametrize("api", ["generate", "stream"])
def test_a_ctrl_c_while_a_request_is_added_leaves_nothing_behind(llm, monkeypatch, api):
    """A real SIGINT landing while the engine adds a request: the request is the caller's before the
    interrupt is delivered, so its cleanup ends it. Before, the interrupt left `_start` with the
    request queued in the engine and owned by nobody (it ran inside the next call's batches, and its
    bookkeeping stayed for good)."""
    import signal

    prompts = [[1, 40 + i] * 5 for i in range(3)]
    real, calls = llm.engine.bad_word_ids, []

    def interrupted(words):  # add_request calls it, after validating, before queueing
        calls.append(1)
        if len(calls) == 2 or api == "stream":
            signal.raise_signal(signal.SIGINT)  # held back to the end of the add
        return real(words)

    monkeypatch.setattr(llm.engine, "bad_word_ids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if api == "generate":
            llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        else:
            next(llm.stream(prompt_token_ids=prompts[0], sampling_params=GREEDY))
    _leaves_nothing(llm)


@pytest.mark.parametrize("second", [False, True])
def test_a_ctrl_c_while_generate_cleans_up_ends_every_request(llm, monkeypatch, second):
    """A SIGINT landing while generate ends its requests (the first of two, or the second while it
    cleans up after the first): every request is still ended. Before, the interrupt was delivered
    after the first, and the others stayed: finished ones in memory, unfinished ones holding pages."""
    import signal

    prompts = [[1, 40 + i] * 5 for i in range(4)]
    real_release, real_step, steps = llm.engine.release, llm.engine.step, []
    armed = [not second]

    def release(request_id):
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)
        return real_release(request_id)

    def step():  # the first Ctrl-C, as when it lands while the device runs
        steps.append(1)
        if len(steps) == 3:
            armed[0] = True
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "release", release)
    if second:
        monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    monkeypatch.undo()
    _leaves_nothing(llm)


def test_a_ctrl_c_between_a_steps_donation_and_its_new_cache_keeps_the_cache(
    llm, monkeypatch, caplog, one_step_at_a_time
):
    """A SIGINT landing just after the jitted decode call returns, before the engine keeps the cache
    it returned (the donated one is gone by then): it is held back to the end of the step, so the
    cache survives and an open stream goes on with the same tokens. Before, the interrupt dropped the
    new cache: every sequence started over from an empty one ("a failed step took the KV cache")."""
    import signal

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    b_prompt = [1, 9, 20, 33] * 5
    expected = [d.token_ids for d in llm.stream(prompt_token_ids=b_prompt, sampling_params=params)]
    prefill, real = llm.engine._steps

    def decode_step(*args, **kw):
        out = real(*args, **kw)
        monkeypatch.setattr(llm.engine, "_steps", (prefill, real))
        signal.raise_signal(signal.SIGINT)  # the handler raises KeyboardInterrupt at the next bytecode
        return out

    decode_step.lower = real.lower
    b = llm.stream(prompt_token_ids=b_prompt, sampling_params=params)
    got = [next(b).token_ids]  # its prompt's step
    a = llm.stream(prompt_token_ids=[1, 5, 6] * 5, sampling_params=params)
    next(a)  # A's prompt step, B's first decode
    got.append(next(b).token_ids)
    monkeypatch.setattr(llm.engine, "_steps", (prefill, decode_step))
    with caplog.at_level("ERROR", logger="jaxinfer"), pytest.raises(KeyboardInterrupt):
        next(a)  # a decode step for both
    a.close()
    got += [d.token_ids for d in b]
    assert "took the KV cache" not in caplog.text
    assert got == expected and llm.stats()["num_preemptions"] == 0
    _leaves_nothing(llm)


def test_a_region_the_garbage_collector_nests_anywhere_restores_the_handler():
    """Python may run a finalizer (a stream's cleanup, itself a deferred region) between any two lines
    of `deferred()`: whichever line, the SIGINT handler ends as it was. Before, one landing between
    the depth's decrement and the handler's restore made `_hold` the handler to restore, and every
    later Ctrl-C was held for good."""
    import signal
    import sys

    from jaxinfer import _interrupts

    handler = signal.getsignal(signal.SIGINT)
    code = _interrupts.deferred.__wrapped__.__code__
    lines = set()

    def record(frame, event, arg):
        if frame.f_code is code:
            lines.add(frame.f_lineno)
            return record
        return None

    sys.settrace(record)
    with _interrupts.deferred():
        pass
    sys.settrace(None)
    assert len(lines) > 5
    for line in sorted(lines):
        done = []

        def nest(frame, event, arg, line=line, done=done):
            if frame.f_code is not code:
                return None
            if event == "line" and frame.f_lineno == line and not done:
                done.append(1)
                with _interrupts.deferred():  # the finalizer
                    pass
            return nest

        sys.settrace(nest)
        try:
            with _interrupts.deferred():
                pass
        finally:
            sys.settrace(None)
        assert signal.getsignal(signal.SIGINT) is handler, f"a region nested at line {line} left the handler"
        assert _interrupts._depth == 0


def _check_off_main_thread(_interrupts):
    try:
        with _interrupts.deferred(), _interrupts.allowed():
            pass
    except Exception as e:  # signal.signal raises ValueError off the main thread
        return [e]
    return []


def test_a_huge_text_prompt_is_refused_before_tokenizing(llm):
    # The size bound's message (after tokenizing, the engine would count tokens: "prompt has ...").
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]: 4000000 bytes of text cannot fit in 63 tokens"):
        llm.generate(["fine", "x" * 4_000_000], GREEDY)
    assert llm.tokenizer.max_token_bytes == 1  # the byte tokenizer: one token per byte
    # The bound is not a token shy: as many bytes as tokens fit (NUL is a byte too).
    from jaxinfer.tokenizer import encode_prompt

    text = "\x00" + "x" * 62
    ids = encode_prompt(llm.tokenizer, text, max_tokens=63, field="p", add_special_tokens=False)
    assert len(ids) == 63 and llm.tokenizer.decode(ids) == text
    with pytest.raises(InvalidRequestError, match="p: 64 bytes of text cannot fit in 63 tokens"):
        encode_prompt(llm.tokenizer, text + "x", max_tokens=63, field="p")


def test_a_flat_list_of_ids_is_one_prompt(llm):
    flat = llm.generate(prompt_token_ids=[1, 5, 6], sampling_params=GREEDY)
    nested = llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=GREEDY)
    assert len(flat) == 1 and flat[0].token_ids == nested[0].token_ids and flat[0].prompt_token_ids == [1, 5, 6]


def test_prompt_dicts_as_in_vllm(llm):
    """{"prompt": text} and {"prompt_token_ids": ids} (vLLM's TextPrompt / TokensPrompt) in one list."""
    ids = llm.tokenizer.encode("In the beginning")
    outs = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}, "Hello"], GREEDY)
    assert outs[0].prompt == "Hello" and outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert outs[0].token_ids == outs[2].token_ids == llm.generate("Hello", GREEDY)[0].token_ids
    assert outs[1].token_ids == llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].token_ids
    streamed = [t for d in llm.stream({"prompt_token_ids": ids}, GREEDY) for t in d.token_ids]
    assert streamed == outs[1].token_ids


def test_a_prompt_dicts_cache_salt_separates_its_prefix_pages(llm):
    """{"prompt": ..., "cache_salt": ...} as in vLLM: hits only from prompts of the same salt."""
    ids = [1] + [(13 * i) % 120 + 3 for i in range(40)]  # 2 full pages of 16

    def hits(prompt):
        before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate(prompt, GREEDY)[0]
        return llm.stats()["prefix_cache_hit_tokens"] - before, out.token_ids

    first, tokens = hits({"prompt_token_ids": ids, "cache_salt": "mine"})
    assert first == 0
    assert hits({"prompt_token_ids": ids, "cache_salt": "yours"}) == (0, tokens)
    assert hits({"prompt_token_ids": ids, "cache_salt": "mine"}) == (32, tokens)
    streamed = [t for d in llm.stream({"prompt_token_ids": ids, "cache_salt": "mine"}, GREEDY) for t in d.token_ids]
    assert streamed == tokens
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\].cache_salt must be a non-empty string"):
        llm.generate(["fine", {"prompt": "x", "cache_salt": ""}], GREEDY)
    with pytest.raises(InvalidRequestError, match=r"unsupported prompt field\(s\) \['salt'\]"):
        llm.generate({"prompt": "x", "salt": "s"}, GREEDY)


def test_vllm_call_habits_use_tqdm_and_get_tokenizer(llm, capsys):
    """`use_tqdm=` (vLLM's generate and chat take it) shows a bar over finished prompts and changes
    nothing else; `get_tokenizer()` is the tokenizer."""
    prompts = ["Hello", "In the beginning", "And"]
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err
    barred = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert [o.token_ids for o in barred] == [o.token_ids for o in plain]
    assert "3/3" in capsys.readouterr().err
    assert llm.get_tokenizer() is llm.tokenizer


def _model_with_generation_config(tmp_path, gen: dict):
    from tests.hf_models import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("llama2"), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_generation_config_sets_the_default_sampling_params(tmp_path, capsys):
    """Without SamplingParams, generate() samples as the checkpoint's generation_config.json says (vLLM's
    generation_config="auto"); explicit SamplingParams are used as given; "none" ignores the file."""
    d = _model_with_generation_config(
        tmp_path, {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 5}
    )
    llm = LLM(str(d), num_kv_pages=16)
    assert "generation_config.json: temperature=0.6, top_k=20, top_p=0.95, max_tokens=5" in capsys.readouterr().err
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.6, 20, 0.95, 5)
    assert defaults.min_p == 0.0 and defaults.repetition_penalty == 1.0  # not in the file: SamplingParams'
    out = llm.generate(prompt_token_ids=[[1, 5, 6]])[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    # Explicit SamplingParams are used as given: 16 tokens, not the file's 5 (EOS ignored: the draw is
    # unseeded, and an early EOS made this flaky).
    explicit = SamplingParams(ignore_eos=True)
    assert len(llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=explicit)[0].token_ids) == 16
    plain = LLM(str(d), num_kv_pages=16, generation_config="none")
    assert plain.get_default_sampling_params() == SamplingParams()

    # `jaxinfer generate`: flags left out take the file's values (5 tokens, sampled), given ones win,
    # and --generation-config none falls back to the command's own defaults (greedy, 32 tokens).
    from jaxinfer import cli

    def cli_tokens(*flags):
        argv = ["generate", "--model", str(d), "--prompt-ids", "1,5,6", "--num-kv-pages", "16", "--json", *flags]
        assert cli.main([*argv, "--ignore-eos"]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert len(cli_tokens("--seed", "3")) == 5
    seeded = SamplingParams(**{**vars(defaults), "seed": 3, "ignore_eos": True})
    assert cli_tokens("--seed", "3") == llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=seeded)[0].token_ids
    assert len(cli_tokens("--max-tokens", "7")) == 7
    greedy = cli_tokens("--generation-config", "none")
    assert (
        len(greedy) == 32
        and greedy
        == llm.generate(
            prompt_token_ids=[[1, 5, 6]], sampling_params=SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        )[0].token_ids
    )


@pytest.mark.parametrize(
    "gen, expected",
    [
        # transformers' do_sample=False is greedy: its temperature and filters do not apply.
        (
            {"do_sample": False, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1},
            dict(temperature=0.0, repetition_penalty=1.1),
        ),
        ({"top_k": 50}, dict(top_k=50)),
        ({"bos_token_id": 1, "eos_token_id": 2, "num_beams": 4}, {}),
        # A value SamplingParams refuses is left out (with a warning), not fatal to loading.
        ({"temperature": -1, "top_p": 0.9}, dict(top_p=0.9)),
        ("not a dict", {}),
    ],
)
def test_generation_defaults_read_like_transformers_and_vllm(tmp_path, capsys, gen, expected):
    from jaxinfer.sampling import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert generation_defaults(str(tmp_path)) == expected
    assert ("ignoring" in capsys.readouterr().err) == (gen == {"temperature": -1, "top_p": 0.9})
    (tmp_path / "generation_config.json").write_text("{broken")
    assert generation_defaults(str(tmp_path)) == {}


def test_bad_constructor_arguments():
    with pytest.raises(InvalidRequestError, match="dtype"):
        LLM(dtype="float16")
    with pytest.raises(InvalidRequestError, match="page_size must be a power of two, got 12"):
        LLM(default_model.TINY_RANDOM, page_size=12)
    with pytest.raises(InvalidRequestError, match=r"num_kv_pages must be an integer in \[2, "):
        LLM(default_model.TINY_RANDOM, num_kv_pages=1)  # the scratch page alone
    with pytest.raises(InvalidRequestError, match=r"page_size must be an integer in \[1, 65536\], got 0"):
        LLM(page_size=0)  # was a ZeroDivisionError while sizing the default page count
    with pytest.raises(InvalidRequestError, match="max_num_seqs must be an integer in .*, got True"):
        LLM(max_num_seqs=True)
    # NumPy integers are integers, as SamplingParams takes them (they were refused by name).
    sizes = dict(max_model_len=np.int64(64), page_size=np.int64(16), num_kv_pages=np.int32(8), max_num_seqs=np.uint8(2))
    small = LLM(default_model.TINY_RANDOM, max_num_batched_tokens=np.int64(32), **sizes)
    assert small.stats()["kv_pages_total"] == 7 and small.engine.max_model_len == 64
    assert len(small.generate(prompt_token_ids=[[1, 2]], sampling_params=GREEDY)[0].token_ids) == GREEDY.max_tokens
    # Was a silent hang: the warm-up enumerated a decode shape for every row count up to it.
    with pytest.raises(InvalidRequestError, match=r"max_num_seqs must be an integer in \[1, 16384\], got 1000000000"):
        LLM(max_num_seqs=10**9)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        LLM(max_model_len=10**6)
    # Below 2 (room for a prompt token but none for an output) or not an integer: refused before the
    # weights load; past the model's own limit, once its config is read.
    for bad in (1, "512", 2.0):
        with pytest.raises(InvalidRequestError, match=rf"max_model_len must be None or an integer >= 2, got {bad!r}"):
            LLM("/nonexistent", max_model_len=bad)
    with pytest.raises(InvalidRequestError, match="model must be a directory path"):
        LLM(5)
    with pytest.raises(InvalidRequestError, match=r"generation_config must be one of \('auto', 'none'\), got 'vllm'"):
        LLM(generation_config="vllm")
    with pytest.raises(InvalidRequestError, match="mesh must be a string"):
        LLM(mesh=2)
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching and warmup must be True or False"):
        LLM(enable_prefix_caching="no")  # a non-empty string was truthy
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching and warmup must be True or False"):
        LLM(warmup="no")
    with pytest.raises(InvalidRequestError, match="async_scheduling must be True or False, got 'off'"):
        LLM(async_scheduling="off")


def test_cli_json(capsys):
    assert main(["generate", "--max-tokens", "4", "--json", "--ignore-eos", "hi there"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    obj = json.loads(line)
    assert len(obj["token_ids"]) == 4 and obj["finish_reason"] == "length" and obj["model"] == "jaxinfer-kjv-6m"
    assert main(["generate", "--max-tokens", "3", "--json", "--prompt-ids", "1,5,6", "--prompt-ids", "1,7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(x)["prompt_token_ids"] for x in lines] == [[1, 5, 6], [1, 7]]


def test_cli_defaults_are_the_apis(capsys):
    """Flags left out mean what the Python API's defaults mean: the engine's capacity, min_tokens 0
    (an EOS may come first: the tiny model echoes the prompt's last token, here EOS), special tokens
    skipped in the text unless --keep-special-tokens (the default model's "</s>", forced here)."""
    import inspect

    from jaxinfer import cli

    args = cli._parser().parse_args(["generate", "x"])
    api = inspect.signature(LLM).parameters
    for name, value in cli.engine_kwargs(args).items():
        assert value == api[name].default, name
    assert main(["generate", "--model", default_model.TINY_RANDOM, "--prompt-ids", "1,5,2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == []
    flags = ["--prompt-ids", "1,5,6", "--max-tokens", "2", "--ignore-eos", "--allowed-token-ids", "2", "--json"]
    assert main(["generate", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == ""
    assert main(["generate", *flags, "--keep-special-tokens"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "</s></s>"


def test_cli_prints_each_sample_of_each_prompt(capsys):
    """--n 2: a JSON line per sample with its own tokens and logprobs, as LLM.generate gives them;
    plain output is the prompt and its continuation."""
    flags = ["--max-tokens", "4", "--temperature", "1", "--seed", "4", "--n", "2", "--logprobs", "1", "--ignore-eos"]
    assert main(["generate", *flags, "--json", "And God said"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=4, n=2, logprobs=1, ignore_eos=True)
    ref = LLM(max_model_len=64, num_kv_pages=16).generate("And God said", p)[0]
    assert [x["index"] for x in lines] == [0, 1]
    assert [x["token_ids"] for x in lines] == [o.token_ids for o in ref.outputs]
    assert ref.outputs[0].token_ids != ref.outputs[1].token_ids  # two samples, so the lines tell them apart
    for x, o in zip(lines, ref.outputs):
        assert [lp["token_id"] for lp in x["logprobs"]] == o.token_ids
        assert [lp["logprob"] for lp in x["logprobs"]] == pytest.approx([lp.logprob for lp in o.logprobs], rel=1e-5)
    assert main(["generate", *flags, "And God said"]) == 0
    assert capsys.readouterr().out.splitlines() == ["And God said" + o.text for o in ref.outputs]


def test_min_tokens_holds_back_eos_for_exactly_that_many_tokens(llm):
    """EOS made all but certain (logit_bias): min_tokens=k gives k tokens, then EOS ends it. With
    ignore_eos, EOS is an ordinary token and min_tokens bans only stop_token_ids (vLLM's rule)."""
    eos = llm.cfg.eos_token_ids[0]
    forced = dict(logit_bias={eos: 100.0}, max_tokens=5, temperature=0.0)
    for k in (0, 1, 3):
        out = llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=SamplingParams(min_tokens=k, **forced))[0]
        assert (len(out.token_ids), out.finish_reason) == (k, "stop"), k
        assert eos not in out.token_ids
    kept = SamplingParams(min_tokens=2, ignore_eos=True, **forced)
    assert llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=kept)[0].token_ids == [eos] * 5


def test_logprobs_are_each_rows_own_and_sent_once(llm):
    """In one batch each row's top-n are its own (as run alone); a stream's deltas carry each token's
    logprob once, also when a stop token or EOS ends it with no token of its own, and the prompt's
    logprobs once, on sample 0's first delta (not again on an update ending the sample)."""
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[1, 5, 6, 7], [1, 90, 40]]
    together = llm.generate(prompt_token_ids=prompts, sampling_params=p)
    for prompt, out in zip(prompts, together):
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0]
        for a, b in zip(out.logprobs, alone.logprobs, strict=True):
            assert list(a.top) == list(b.top) and list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-5)
    assert together[0].logprobs[0].top != together[1].logprobs[0].top
    # Stop token 9 made certain but held back one token by min_tokens: one token, then the stop.
    first = together[0].token_ids[0]
    stop = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        logprobs=2,
        prompt_logprobs=1,
        stop_token_ids=[9],
        min_tokens=1,
        logit_bias={9: 100},
    )
    deltas = list(llm.stream({"prompt_token_ids": prompts[0]}, stop))
    assert [t for d in deltas for t in d.token_ids] == [first] and deltas[-1].stop_reason == 9
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [first]
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1 and deltas[0].prompt_logprobs is not None
    two = SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=2, prompt_logprobs=1)
    assert [d.index for d in llm.stream({"prompt_token_ids": prompts[0]}, two) if d.prompt_logprobs] == [0]


def test_presence_penalty_counts_the_output_not_the_prompt(llm):
    """vLLM's rule: presence and frequency penalties count generated tokens only. The echo model
    repeats the prompt's last token; a large presence penalty keeps that first token (it is in
    the prompt only) and then never repeats a token it generated."""
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    free = llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=plain)[0].token_ids
    assert len(set(free)) == 1
    for penalty in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        got = llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=dataclasses.replace(plain, **penalty))[0]
        assert got.token_ids[0] == free[0] and len(set(got.token_ids)) == 5, (penalty, got.token_ids)


def test_a_request_that_exactly_fills_the_kv_cache_runs():
    small = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=5, page_size=16, max_num_seqs=1)
    assert small.stats()["kv_pages_total"] == 4  # 64 tokens
    p = SamplingParams(max_tokens=54, temperature=0.0, ignore_eos=True)
    assert len(small.generate(prompt_token_ids=[list(range(3, 13))], sampling_params=p)[0].token_ids) == 54


def test_an_abort_updates_the_gauges_at_once():
    """Prometheus sees an aborted request's pages free and its slot empty right away, not a step later
    (an idle server takes no next step)."""
    small = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=16, max_num_seqs=2)
    engine, registry = small.engine, small.engine.metrics.registry
    req = engine.add_request([1, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert registry.get_sample_value("jaxinfer_running_sequences") == 1
    engine.abort(req.request_id)
    engine.release(req.request_id)
    assert registry.get_sample_value("jaxinfer_running_sequences") == 0
    assert registry.get_sample_value("jaxinfer_kv_pages_free") == small.stats()["kv_pages_total"]


def test_a_long_row_decodes_beside_a_short_one_as_alone():
    """The decode step's page table is as wide as its longest row needs (rows sorted longest first):
    a 150-token row beside a 3-token one gets the tokens it gets alone."""
    big = LLM(default_model.TINY_RANDOM, max_model_len=256, num_kv_pages=40, max_num_seqs=2)
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[1, *range(3, 153)], [1, 7, 8]]
    together = big.generate(prompt_token_ids=prompts, sampling_params=p)
    alone = [big.generate(prompt_token_ids=[x], sampling_params=p)[0].token_ids for x in prompts]
    assert [o.token_ids for o in together] == alone


def test_an_empty_list_of_prompts_gives_an_empty_list(llm):
    assert llm.generate(prompt_token_ids=[]) == [] and llm.generate([]) == []


def test_default_kv_pages_hold_every_sequence_at_full_length():
    """With memory to spare, num_kv_pages defaults to max_num_seqs full-length sequences, plus the
    scratch page the cache keeps for padding (not counted in kv_pages_total)."""
    small = LLM(default_model.TINY_RANDOM, max_model_len=64, max_num_seqs=4, page_size=16, warmup=False)
    assert small.stats()["kv_pages_total"] == 4 * 64 // 16


def test_bad_words_look_back_into_the_prompt_and_never_appear(llm):
    """With the byte tokenizer and the output held to eight letters: a word made of the prompt's last
    letter and the first output letter changes the first token; a word from inside the output
    changes it where the word would have been completed, not before; neither appears."""
    letters = "abcdefgh"
    sp = SamplingParams(max_tokens=10, temperature=0.0, allowed_token_ids=llm.tokenizer.encode(letters)[1:])
    free = llm.generate(["xy"], sp)[0].text
    assert len(free) == 10 and set(free) <= set(letters)
    across = llm.generate(["xy"], dataclasses.replace(sp, bad_words=["y" + free[0]]))[0].text
    assert across[0] != free[0] and not ("xy" + across).count("y" + free[0])
    word = free[3:5]
    out = llm.generate(["xy"], dataclasses.replace(sp, bad_words=[word, "  zz"]))[0].text
    at = free.index(word) + 1  # where its last letter was drawn
    assert out[:at] == free[:at] and out[at] != free[at] and word not in "xy" + out
    with pytest.raises(InvalidRequestError, match="SamplingParams.bad_words must hold at most 64 non-blank"):
        SamplingParams(bad_words=["ok", " \n"])
    # Each word alone and after a space, leading whitespace dropped first; each encoding once.
    enc = [tuple(llm.tokenizer.encode(w, add_special_tokens=False)) for w in ("ab", " ab")]
    assert llm.engine.bad_word_ids(("ab", "  ab", "ab")) == tuple(enc) and enc[0] != enc[1]


def test_cli_sampling_flags_are_the_sampling_params_fields(capsys):
    """--stop-token-ids, --min-tokens, --logit-bias and --allowed-token-ids give what LLM.generate
    gives with those fields (the default model: the CLI's own)."""
    flags = ["--max-tokens", "6", "--json", "--prompt-ids", "1,1029,261"]
    assert main(["generate", *flags]) == 0
    free = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", *flags, "--cache-salt", "tenant-a"]) == 0  # salted: its own prefix pages
    assert json.loads(capsys.readouterr().out)["token_ids"] == free
    extra = [
        *("--stop-token-ids", f"{free[1]},{free[3]}", "--min-tokens", "2"),
        *("--logit-bias", f"{free[0]}=-100", "--logit-bias", "7=1.5,9=-2"),
        *("--allowed-token-ids", ",".join(map(str, [*free, 7, 9, 300, 301]))),
    ]
    assert main(["generate", *flags, *extra]) == 0
    got = json.loads(capsys.readouterr().out)
    p = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        stop_token_ids=[free[1], free[3]],
        min_tokens=2,
        logit_bias={free[0]: -100.0, 7: 1.5, 9: -2.0},
        allowed_token_ids=[*free, 7, 9, 300, 301],
    )
    ref = LLM(max_model_len=64, num_kv_pages=16).generate(prompt_token_ids=[[1, 1029, 261]], sampling_params=p)[0]
    assert got["token_ids"] == ref.token_ids and got["finish_reason"] == ref.finish_reason
    assert got["token_ids"] != free[: len(got["token_ids"])]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--max-tokens", "0", "x"], "error: --max-tokens must be an integer >= 1"),
        (["generate", "--logit-bias", "5", "x"], "--logit-bias takes comma-separated ID=BIAS pairs"),
        (["generate", "--logit-bias", "5=101", "x"], "error: --logit-bias[5] must be a number in [-100, 100]"),
        (["generate", "--allowed-token-ids", "3,x", "x"], "--allowed-token-ids must be comma-separated integers"),
        (["generate", "--temperature", "-1", "x"], "error: --temperature must be a finite number >= 0"),
        (["generate", "--cache-salt", "", "x"], "--cache-salt must be a non-empty string of at most 1024"),
        (["generate", "--prompt-logprobs", "21", "x"], "error: --prompt-logprobs must be None or an integer"),
        (["generate", "--top-p", "0", "x"], "error: --top-p must be in (0, 1]"),
        # The API's refusals in the flags' names (they said max_model_len, SamplingParams.max_tokens):
        (
            ["generate", "--max-model-len", "5000", "x"],
            "error: --max-model-len must be an integer in [2, 1024 for this model]",
        ),
        (
            ["generate", "--num-kv-pages", "2", "--max-model-len", "512", "--max-tokens", "40", "x"],
            "--max-tokens = 40 with a 3-token prompt needs 3 KV pages; the cache has 1 (--num-kv-pages less",
        ),
        (["generate", "--model", "/no/such/dir", "x"], "does not exist"),
        (["generate", "--model", __file__, "x"], "is a file, not a directory"),
        (["generate", "x\udcff"], "is not valid Unicode"),  # argv bytes that are not UTF-8
        # A cache no machine holds: named, not an allocator failure (or the process killed).
        (["generate", "--num-kv-pages", str(2**30), "--prompt-ids", "1,5"], "the KV cache would take"),
        (["generate", "--page-size", str(2**40), "--prompt-ids", "1,5"], "--page-size must be an integer in [1, 65536"),
        # Before the port is bound and the model loads (it said "listening on ...", then failed).
        (["serve", "--page-size", "0"], "--page-size must be an integer in [1, 65536], got 0"),
        # Named before gRPC logs its own "Failed to add port" line.
        (["serve", "--host", "8.8.8.8", "--port", "0"], "--host '8.8.8.8' is not an address of this machine"),
        (["serve", "--host", "", "--port", "0"], "--host is empty"),
        (["serve", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be an integer in [16, 1048576]"),
        (["generate", "--server", "localhost:70000", "x"], "the port must be in [1, 65535]"),  # not 4464
        (["bench", "load", "/no/such/dir", "--repeats", "0"], "--repeats must be >= 1"),
        (["generate", "--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated integers"),
        # Named as typed, not as the API's prompt dicts ("prompts[1]: ..."):
        (["generate", "--prompt-ids", "1,2", "--prompt-ids", "1,99999"], "error: --prompt-ids 2: prompt token id"),
        (["generate", "ok", "x\udcff"], "error: prompt 2 is not valid Unicode"),
        (["generate", "x\udcff"], "error: prompt is not valid Unicode"),  # the only one: not "prompt 1"
        (["generate", "--stream", "--n", "2", "x"], "--stream takes exactly one prompt and --n 1"),
        (["serve", "--drain-timeout", "nan"], "--drain-timeout must be a finite number of seconds >= 0"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["serve", "--port", "47124", "--metrics-port", "47124"], "--port and --metrics-port must differ"),
        # Falsy, but given: refused by name, not taken for "no multi-host" (a server started instead).
        (["serve", "--num-processes", "0"], "give --coordinator-address, --num-processes and --process-id together"),
        (["serve", "--coordinator-address", ""], "give --coordinator-address, --num-processes and --process-id"),
        (["generate", "--server", "127.0.0.1", "x"], "--server must be HOST:PORT ([IPv6]:PORT"),  # dialled :443
        # Not gRPC's "failed to connect to all addresses; last error: UNKNOWN: ipv4:...".
        (["generate", "--server", "127.0.0.1:1", "x"], "--server 127.0.0.1:1: nothing answers there"),
        (["bench", "serve", "--server", "127.0.0.1:1", "--num-requests", "2"], "--server 127.0.0.1:1: nothing answers"),
        (["generate", "--server", "127.0.0.1:1", "--timeout", "0", "x"], "error: --timeout must be a positive"),
        (["bench", "--repeats", "2", "kernels"], "`jaxinfer bench kernels` takes flags of its own"),
        # Refused before the benchmark runs (the profiler's TypeError came after it, exit 1).
        (["bench", "--profile", "/tmp/p\udcff"], "--profile is not valid Unicode: lone surrogate"),
    ],
)
def test_cli_errors_are_one_line_no_traceback(argv, message):
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if "error:" in line]) == 1, r.stderr
    assert "listening" not in r.stdout  # nothing bound before the flags were checked
    assert "Failed to add port" not in r.stderr


_FLAG_ERRORS_WITHOUT_JAX = """
import sys
from jaxinfer import RequestOutput, SamplingParams, cli
from jaxinfer.client import AsyncClient, Client
SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9, stop=["x"])
for argv in (["generate", "--top-p", "0", "x"], ["generate", "--cache-salt", "", "x"], ["serve", "--port", "70000"],
             ["serve", "--page-size", "0"], ["generate", "--stream", "--n", "2", "x"]):
    assert cli.main(argv) == 2, argv
assert cli.main(["generate", "--server", "127.0.0.1:1", "x"]) == 2  # the client's refusal: nothing listens there
print(sorted(m for m in ("jax", "jaxlib", "flax") if m in sys.modules))
"""


def test_bad_flags_are_answered_before_jax_loads():
    """`generate` and `serve` check their flags (and SamplingParams its fields) with modules that import
    no JAX, so a typo is answered in a fraction of a second, not after the seconds JAX takes to load
    (2.1 s -> 0.4 s per command on the 2-core machine, 2026-12-03); the gRPC client runs without it."""
    r = subprocess.run([sys.executable, "-c", _FLAG_ERRORS_WITHOUT_JAX], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "[]", r.stdout
    assert r.stderr.count("error: ") == 6, r.stderr


@pytest.mark.parametrize(
    "raised, status, line",
    [
        (PermissionError(13, "Permission denied", "/out"), 2, "error: [Errno 13] Permission denied: '/out'"),
        (InvalidRequestError("max_tokens must be >= 1"), 2, "error: max_tokens must be >= 1"),
        (ValueError("bug"), 1, "error: unexpected ValueError: bug (JAXINFER_TRACEBACK=1 shows where)"),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_cli_exit_status_by_what_ended_the_command(raised, status, line, monkeypatch, capsys):
    """Bad input (ours, or a path the OS refused, however deep it was raised) exits 2 in one line; a
    bug 1, its traceback only with JAXINFER_TRACEBACK; Ctrl-C 130."""
    from jaxinfer import cli

    def fail(argv):
        raise raised

    monkeypatch.setattr(cli, "_main", fail)
    monkeypatch.delenv("JAXINFER_TRACEBACK", raising=False)
    assert cli.main(["generate", "x"]) == status
    assert capsys.readouterr().err.splitlines() == ([line] if line else [])
    monkeypatch.setenv("JAXINFER_TRACEBACK", "1")
    if status == 1:
        with pytest.raises(ValueError):
            cli.main(["generate", "x"])
    else:
        assert cli.main(["generate", "x"]) == status


def _bench_args(argv):
    import argparse

    from jaxinfer import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_bench_runs_and_reports(capsys, tmp_path):
    from jaxinfer import bench

    args = _bench_args(
        [
            "--preset",
            "llama-tiny",
            "--prompt-lens",
            "8,16",
            "--batch-sizes",
            "1,2",
            "--new-tokens",
            "4",
            "--context",
            "8",
            "--repeats",
            "1",
            "--vs-hf",
            "--profile",
            str(tmp_path / "trace"),
        ]
    )
    report = bench.run(args)
    out = capsys.readouterr().out
    assert "TTFT" in out and "MBU" in out and "ratio" in out
    assert [r["batch"] for r in report["decode"]] == [1, 2]
    assert all(r["step_s"] > 0 and 0 < r["mbu"] for r in report["decode"])
    assert all(r["tokens_per_s"] == pytest.approx(r["rows_per_step"] / r["step_s"]) for r in report["decode"])
    assert all(r["hf_tokens_per_s"] > 0 for r in report["hf"])
    # Prefill FLOPs, counted by hand for llama-tiny (D 128, F 384, 2 layers, 4 heads / 2 KV heads of
    # 32, V 512): the projections per prompt token, the untied LM head once (only the last token's
    # logits are computed). It charged the head to every token (1.16x too many here, 1.36x at 150M).
    # The norm weights count as a multiply each (2 per layer and the final one; the bench takes every
    # weight but the head's from num_params).
    per_token = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384 + 2 * 128) + 128
    for row in report["ttft"]:
        n = row["prompt_len"]
        attention = 2 * 2 * 2 * 4 * 32 * n * (n + 1) // 2  # QK^T and PV, causal, 2 layers x 4 heads of 32
        assert row["flops"] == 2 * per_token * n + 2 * 512 * 128 + attention
        assert row["gflops"] == pytest.approx(row["flops"] / row["ttft_s"] / 1e9)
        assert row["prompt_logprobs_ttft_s"] > 0
    assert "+prompt_lp ms" in out
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4
    assert "sampler" in out and [r["batch"] for r in report["sampler"]] == [1, 2]
    assert all(r[name] > 0 for r in report["sampler"] for name in bench.SAMPLER_SETTINGS)
    # The profile: each program's executions as the trace saw them are the engine's own call counts,
    # and the decode program's matmuls are among its largest op kinds.
    programs = {r["program"]: r for r in report["profile"]["programs"]}
    calls = report["profile"]["engine_calls"]
    assert calls["decode"] >= 3 and programs["jit__decode"]["runs"] == calls["decode"], (calls, programs)
    assert programs["jit_forward"]["runs"] == calls["prefill"] >= 1
    # (XLA's dots, or the native float32 products' custom calls where the weights are in strips.)
    products = "ffi_call" if report["weight_strips"] else "dot"
    assert products in [o["kind"] for o in programs["jit__decode"]["ops"]]
    assert all(r["wall_ms"] > 0 and r["op_ms"] > 0 for r in programs.values())
    shares = [o["share"] for o in programs["jit__decode"]["ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert "profile of one decode run at batch 1" in out


def test_cli_stream_json_python_m_and_ids_without_a_tokenizer(capsys, tmp_path):
    from hf_models import make_hf_model, save_hf_model

    argv = ["generate", "--max-tokens", "5", "--ignore-eos", "--max-model-len", "64", "--temperature", "0"]
    assert main([*argv, "--stream", "--json", "Hi"]) == 0  # one JSON object per delta, nothing else
    out = capsys.readouterr().out
    deltas = [json.loads(x) for x in out.splitlines()]
    assert out.endswith("}\n")
    assert main([*argv, "--json", "Hi"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--stream", "Hi"]) == 0  # the prompt, then the text as it comes, then one newline
    assert capsys.readouterr().out == "Hi" + whole["text"] + "\n"
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert sum((d["token_ids"] for d in deltas), []) == whole["token_ids"]
    assert deltas[-1]["finish_reason"] == "length" and all(d["finish_reason"] is None for d in deltas[:-1])
    save_hf_model(make_hf_model("llama2"), tmp_path)  # weights only: no tokenizer files
    assert main([*argv, "--model", str(tmp_path), "--json", "--prompt-ids", "1,5,6"]) == 0
    ids = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--model", str(tmp_path), "--prompt-ids", "1,5,6"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, ids))  # the ids, not an empty line
    r = subprocess.run([sys.executable, "-m", "jaxinfer", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generate" in r.stdout


def test_cli_stream_n_and_capacity_flags(capsys):
    assert (
        main(
            [
                "generate",
                "--max-tokens",
                "5",
                "--ignore-eos",
                "--stream",
                "--max-num-seqs",
                "2",
                "--num-kv-pages",
                "16",
                "--max-model-len",
                "64",
                "Hi",
            ]
        )
        == 0
    )
    streamed = capsys.readouterr().out
    assert main(["generate", "--max-tokens", "5", "--ignore-eos", "--json", "--max-model-len", "64", "Hi"]) == 0
    assert streamed.rstrip("\n") == "Hi" + json.loads(capsys.readouterr().out)["text"]
    assert (
        main(
            [
                "generate",
                "--max-tokens",
                "3",
                "--json",
                "--n",
                "2",
                "--temperature",
                "1",
                "--seed",
                "4",
                "--logprobs",
                "2",
                "--prompt-logprobs",
                "1",
                "--prompt-ids",
                "1,5,6",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["index"] for x in lines] == [0, 1] and all(len(x["logprobs"]) == len(x["token_ids"]) for x in lines)
    for x in lines:  # the request's, with each sample
        first, *rest = x["prompt_logprobs"]
        assert first is None and [lp["token_id"] for lp in rest] == [5, 6] and all(len(lp["top"]) == 1 for lp in rest)


def test_decode_timing_counts_the_rows_each_step_really_ran():
    """Prompts prefilled in different calls start decoding steps apart and finish steps apart, so the
    last steps of a 'batch 4' run carry fewer rows: tok/s must count them (it assumed 4)."""
    from jaxinfer.bench import _decode_once

    llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=64, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [[1] + [7 + i] * 15 for i in range(4)]  # 16 tokens each: one prompt per step
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    step, total, rows = _decode_once(llm, prompts, params)
    assert 0 < step < total and 1 < rows < 4


def test_bench_serve_vs_offline_refuses_a_paced_workload(monkeypatch):
    """Refused before minutes of starting a server and loading the offline engine."""
    from jaxinfer import bench
    from serving import loadgen

    def no_server(*args):
        raise AssertionError("a server was started")

    monkeypatch.setattr(loadgen, "_start_server", no_server)
    with pytest.raises(InvalidRequestError, match="--vs-offline compares throughput on the same work"):
        bench.run(_bench_args(["serve", "--vs-offline", "--request-rate", "4"]))


def test_bench_serve_says_why_its_server_did_not_start():
    """The server the bench starts refuses the max_model_len the bench derived from its ranges (the
    default model holds 1024 positions): the bench says so in its flags' terms, not just that the
    server exited."""
    from jaxinfer import bench

    args = _bench_args(["serve", "--num-requests", "2", "--prompt-len-range", "600", "--output-len-range", "600"])
    with pytest.raises(InvalidRequestError) as e:  # (a SystemExit before: exit status 1, a bug's)
        bench.run(args)
    assert (
        "exited with status 2 while starting: max_model_len must be an integer in [2, 1024 for this model], got 1201"
        in str(e.value)
    )
    assert "--prompt-len-range plus that of --output-len-range, plus 1" in str(e.value)


def test_bench_latency_figures_on_fixed_times():
    """Each latency figure and the phase breakdown against a hand count on made-up times (the runs
    above can only check signs and orders of figures that vary with the machine)."""
    from types import SimpleNamespace

    from jaxinfer import bench

    # Request i arrives at 0, has its first token at i and four more, one a second.
    seqs = [
        SimpleNamespace(arrival_time=0.0, first_token_time=float(i), last_token_time=i + 4.0, output_ids=[7] * 5)
        for i in range(1, 11)
    ]
    gaps = [0.1 * i for i in range(1, 11)]
    got = bench.latencies(seqs, gaps)
    ttft = np.arange(1, 11)
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (np.percentile(ttft, 50), np.percentile(ttft, 99))
    assert got["tpot_p50_s"] == got["tpot_p99_s"] == 1.0  # 4 s over the 4 tokens after the first
    assert (got["itl_p50_s"], got["itl_p99_s"]) == (np.percentile(gaps, 50), np.percentile(gaps, 99))
    before = {"prefill": (1.0, 2, 10), "decode": (2.0, 3, 4)}
    after = {"prefill": (3.0, 5, 30), "decode": (7.0, 13, 44)}
    assert bench._phases(before, after, wall=10.0) == dict(
        prefill_s=2.0, prefill_calls=3, prefill_tokens=20, decode_s=5.0, decode_calls=10, decode_rows=40, other_s=3.0
    )


def test_bench_timers_on_a_made_up_clock(monkeypatch, llm):
    """The timers under the bench's figures, on a clock that returns made-up times."""
    from types import SimpleNamespace

    from jaxinfer import bench

    def clock(times):
        monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=iter(times).__next__))

    # The read ceiling: the best of the repeats (the least disturbed one), per kind of read.
    # reduce 3, 1, 2 s; rows 2, 0.5, 1 s; matvec 4, 2, 1.5 s
    clock([0, 3, 10, 11, 20, 22] + [50, 52, 60, 60.5, 70, 71] + [100, 104, 110, 112, 120, 121.5])
    nbytes = 16 * 4096 * 4
    got = bench.measure_read_bandwidth(nbytes, repeats=3)
    assert got == {"reduce": nbytes / 1.0, "rows": nbytes / 0.5, "matvec": nbytes / 1.5}

    # The latency bench's decode window: from the step that gave the last row its first token (the
    # third, at t=3) to the last; seven steps at t = 1..7 made 1, 2, 3, 3, 3, 2, 1 tokens.
    made = [1, 2, 3, 3, 3, 2, 1]
    firsts = [SimpleNamespace(first_token_time=t) for t in (1.0, 2.0, 3.0)]
    engine = SimpleNamespace(
        add_request=lambda prompt, params: SimpleNamespace(seqs=[firsts.pop(0)]),
        has_unfinished=lambda: bool(made),
        step=lambda: [SimpleNamespace(token_ids=[0]) for _ in range(made.pop(0))],
    )
    clock([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    step_s, total_s, rows = bench._decode_once(SimpleNamespace(engine=engine), [[1]] * 3, None)
    assert (step_s, total_s, rows) == (4.0 / 4, 7.0, (3 + 3 + 2 + 1) / 4)

    # The throughput bench's ITL: one gap per token after a sequence's first, from its own previous.
    monkeypatch.setattr(bench, "time", __import__("time"))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5)]
    wall, seqs, gaps = bench.drive_engine(llm.engine, [[5, 6, 7], [8, 9]], params)
    assert [len(s.output_ids) for s in seqs] == [3, 5]
    assert len(gaps) == 2 + 4 and all(0 < g < wall for g in gaps)


def test_bench_mbu_is_the_bytes_a_step_reads_over_the_read_ceiling(monkeypatch, capsys):
    """MBU on made-up ceilings and step times, against the bytes counted by hand for llama-tiny
    (float32, untied): every weight but the embedding table, plus each row's K and V at the decode
    window's mean context, read once per step. Each run is divided by the ceiling measured right
    before it (the median of those ratios), and the median run by the run's best ceiling."""
    from jaxinfer import bench

    # Before the decode runs; before the first and the second run; after them. Per kind of read.
    ceilings = iter([(1e9, 2e9), (2e9, 1e9), (4e9, 3e9), (3e9, 1e9)])

    class Ceiling:
        def measure(self, repeats=5):
            reduce, matvec = next(ceilings)
            return {"reduce": reduce, "matvec": matvec}

    runs = iter([(0.01, 1.0, 1.5), (0.02, 1.0, 1.5)])  # step s, total s, rows per step
    monkeypatch.setattr(bench, "ReadCeiling", Ceiling)
    monkeypatch.setattr(bench, "_decode_once", lambda *a: next(runs))
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 2**30)  # whatever this machine has
    args = ["--preset", "llama-tiny", "--prompt-lens", "8", "--batch-sizes", "2", "--new-tokens", "4"]
    report = bench.run(_bench_args(args + ["--context", "8", "--repeats", "2"]))
    d, f, v, layers = 128, 384, 512, 2
    per_layer = d * d * 2 + d * 64 * 2 + 3 * d * f + 2 * d  # q, o; k, v (2 KV heads of 32); MLP; 2 norms
    weights = 4 * (2 * v * d + layers * per_layer + d)  # embedding, LM head, layers, final norm
    kv_per_token = 2 * layers * 64 * 4  # K and V, all layers
    step_bytes = (weights - 4 * v * d) + 1.5 * kv_per_token * (8 + 4 / 2)
    (row,) = report["decode"]
    assert row["step_s"] == pytest.approx(0.015)
    assert row["GBps"] == pytest.approx(step_bytes / 0.015 / 1e9, rel=1e-12)
    # Run 1 against the better of (2, 1) GB/s, run 2 against the better of (4, 3).
    assert row["mbu"] == pytest.approx((step_bytes / 0.01 / 2e9 + step_bytes / 0.02 / 4e9) / 2, rel=1e-12)
    assert row["paired_ceiling_GBps"] == pytest.approx(3.0)
    assert row["mbu_vs_best"] == pytest.approx(step_bytes / 0.015 / 4e9, rel=1e-12)
    assert report["read_bandwidth_GBps"] == {"reduce": 4.0, "matvec": 3.0}
    assert row["tokens_per_s"] == pytest.approx(1.5 / 0.015)

    # A step that fits in the CPU's last-level cache is flagged: its MBU can pass 100%.
    out = capsys.readouterr().out
    assert "fits in this CPU's" in out, out
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: int(step_bytes) - 1)
    runs, ceilings = iter([(0.01, 1.0, 1.5)] * 2), iter([(1e9, 2e9)] * 4)
    bench.run(_bench_args(args + ["--context", "8", "--repeats", "2"]))
    assert "last-level cache" not in capsys.readouterr().out


def test_last_level_cache_is_read_from_sysfs(monkeypatch, tmp_path):
    from jaxinfer import bench

    for i, size in enumerate(["48K", "2048K", "307200K", "oops"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    real_glob = bench.glob.glob
    monkeypatch.setattr(bench.glob, "glob", lambda pattern: real_glob(str(tmp_path / "index*" / "size")))
    assert bench.last_level_cache_bytes() == 300 * 2**20
    monkeypatch.setattr(bench.glob, "glob", lambda pattern: [])
    assert bench.last_level_cache_bytes() is None


@pytest.mark.parametrize("rounds", [1, 2])
def test_bench_throughput_runs_and_reports(capsys, rounds):
    """With `rounds` 2 the baseline and the continuous run alternate twice and each side's figures are
    the two rounds pooled; --vs-sync reruns the last round's workload."""
    from jaxinfer import bench

    args = _bench_args(
        [
            "throughput",
            "--preset",
            "llama-tiny",
            "--num-requests",
            "8",
            "--prompt-len-range",
            "8,32",
            "--output-len-range",
            "4,8",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--baseline-requests",
            "5",
            "--vs-sync",
            "--penalties",
            "--rounds",
            str(rounds),
        ]
    )
    report = bench.run(args)
    out = capsys.readouterr().out
    assert "continuous batching / one at a time" in out and "XLA compilations after warm-up: 0" in out
    assert "every fourth with repetition 1.2 and frequency 0.3 penalties" in out
    # The same workload again, each step's results read before the next (it checks the outputs match).
    assert "async scheduling / one step at a time: " in out and report["continuous_sync"]["requests"] == 8
    assert report["continuous_sync"]["decode_rows"] * rounds == report["continuous"]["decode_rows"]
    assert (report["continuous"]["requests"], report["one_at_a_time"]["requests"]) == (8 * rounds, 5 * rounds)
    assert "(baseline measured on the first 5 requests)" in out
    assert len(report["round_ratios"]) == rounds and all(r > 0 for r in report["round_ratios"])
    assert ("2 alternating rounds pooled, each round " in out) == (rounds == 2)
    assert report["ratio"] == pytest.approx(
        report["continuous"]["output_tokens_per_s"] / report["one_at_a_time"]["output_tokens_per_s"]
    )
    assert report["continuous"]["ttft_p99_s"] >= report["continuous"]["ttft_p50_s"]
    for r in (report["continuous"], report["one_at_a_time"]):  # ITL per token, TPOT per request
        assert 0 < r["itl_p50_s"] <= r["itl_p99_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
        assert r["itl_p99_s"] >= r["tpot_p50_s"]  # a request's mean gap is never above the largest gaps
    # Where the time went: the prompt tokens and decode rows each mode computed (no prefix cache), the
    # baseline's for the first 5 requests only. The workload's lengths, drawn as the bench draws them:
    rng = np.random.default_rng(0)
    prompt_lens, output_lens = rng.integers(8, 32 + 1, 8), rng.integers(4, 8 + 1, 8)
    assert "where the time went" in out
    base, cb = report["one_at_a_time"], report["continuous"]
    n = rounds  # every figure is the rounds' sum
    assert (base["prefill_tokens"], cb["prefill_tokens"]) == (n * sum(prompt_lens[:5]), n * sum(prompt_lens))
    assert round(cb["output_tokens_per_s"] * cb["wall_s"]) == n * sum(output_lens)
    assert round(base["output_tokens_per_s"] * base["wall_s"]) == n * sum(output_lens[:5])
    # Each first token comes from a prompt call.
    assert (base["decode_rows"], cb["decode_rows"]) == (n * (sum(output_lens[:5]) - 5), n * (sum(output_lens) - 8))
    assert cb["decode_calls"] < base["decode_calls"]  # batched
    for r in (base, cb):
        assert 0 < r["prefill_s"] + r["decode_s"] < r["wall_s"] and r["other_s"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        # Each ran part of a benchmark, or none, then died with an "unexpected ValueError".
        (["throughput", "--prompt-len-range", "100,10"], "--prompt-len-range: expected MIN,MAX with 1 <= MIN <= MAX"),
        (["throughput", "--num-requests", "-1"], "--num-requests: expected a positive integer, got -1"),
        (["--context", "-5"], "--context: expected a positive integer, got -5"),
        (["--prompt-lens", "1,,2"], "--prompt-lens: expected comma-separated integers, got '1,,2'"),  # was [1, 2]
        (["serve", "--request-rate", "nan"], "--request-rate: expected a positive number of requests per second"),
        (["serve", "--duration-limit", "inf"], "--duration-limit: expected a positive, finite number of seconds"),
    ],
)
def test_bench_flags_out_of_range_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        _bench_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_names_the_api_arguments_it_takes_as_flags():
    from jaxinfer.cli import flag_names

    options = {"--max-tokens", "--num-kv-pages", "--model", "--max-model-len"}
    cases = {
        "SamplingParams.max_tokens = 3; lower max_tokens or raise num_kv_pages.": (
            "--max-tokens = 3; lower --max-tokens or raise --num-kv-pages."
        ),
        "model must be a directory; the model's limit is max_model_len": (
            "--model must be a directory; the model's limit is --max-model-len"
        ),
        "SamplingParams.top_p must be in (0, 1]": "SamplingParams.top_p must be in (0, 1]",  # not a flag here
        # Names inside paths and file names stay as they are.
        "cannot read /ckpt/max_tokens/model_dir.json": "cannot read /ckpt/max_tokens/model_dir.json",
        "model_dir.json is missing": "model_dir.json is missing",
    }
    for message, expected in cases.items():
        assert flag_names(message, options) == expected


def test_cli_usage_errors_exit_2_before_loading(capsys):
    assert main(["generate", "--stream", "a", "b"]) == 2
    assert "--stream takes exactly one prompt" in capsys.readouterr().err
    for devices in ("-3", "0", "1025"):  # -3 was a backend crash: "vector::reserve"; 0 ran on no virtual devices
        with pytest.raises(SystemExit) as e:
            main(["bench", "mesh", "--cpu-devices", devices])
        assert e.value.code == 2 and f"--cpu-devices must be in [1, 1024], got {devices}" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [[], ["serve", "--vs-offline"]])
def test_bench_refuses_zero_repeats(mode):
    from jaxinfer import bench

    with pytest.raises(InvalidRequestError, match=r"--repeats must be >= 1, got 0"):
        bench.run(_bench_args(mode + ["--repeats", "0"]))


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["serve", "--rounds", "1"], "--rounds is a flag of the throughput mode; it does nothing in serve mode"),
        (["throughput", "--repeats", "5"], "--repeats is a flag of the latency and serve modes; it does nothing in"),
        (["--vs-offline"], "--vs-offline is a flag of the serve mode; it does nothing in latency mode"),
        (["throughput", "--batch-sizes", "1,2"], "--batch-sizes is a flag of the latency mode; it does nothing in"),
        (["--num-requests", "8"], "--num-requests is a flag of the throughput and serve modes; it does nothing in"),
        (["serve", "--repeats", "5"], "--repeats counts the rounds of --vs-offline; without it it does nothing"),
        (["serve", "--server", "127.0.0.1:1", "--stream-interval", "4"], "--stream-interval configures the server"),
        (["serve", "--server", "127.0.0.1:1", "--max-num-seqs", "8"], "; with --server it does nothing"),
    ],
)
def test_bench_refuses_a_flag_its_mode_does_not_read(argv, refusal):
    """From a review: `bench serve --rounds 1` ran its own warm-up and 3 rounds without a word."""
    from jaxinfer import bench

    with pytest.raises(InvalidRequestError, match=re.escape(refusal)):
        bench.run(_bench_args(argv))
    assert all(dest in vars(_bench_args([])) for flags in bench.MODE_FLAGS.values() for dest in flags)


def test_bench_profile_is_refused_outside_the_latency_mode(tmp_path):
    from jaxinfer import bench

    refusal = r"--profile is a flag of the latency mode; it does nothing in throughput mode"
    with pytest.raises(InvalidRequestError, match=refusal):
        bench.run(_bench_args(["throughput", "--profile", str(tmp_path)]))
    assert not any(tmp_path.iterdir())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(InvalidRequestError, match=r"--profile .*a_file: cannot create the trace directory"):
        bench.run(_bench_args(["--profile", str(tmp_path / "a_file")]))


@pytest.mark.parametrize("model", [None, "embedded:tiny-random", "jaxinfer-checkpoint"])
def test_bench_vs_hf_needs_a_hugging_face_directory_before_it_runs(model, tmp_path):
    """An embedded or orbax model passed the old check, ran the whole benchmark, then died in
    transformers (an 'unexpected ValueError', the results thrown away)."""
    from jaxinfer import bench, checkpoint

    if model == "jaxinfer-checkpoint":  # it has a config.json too: the marker tells them apart
        model = str(tmp_path)
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / checkpoint.MARKER).write_text("{}")
    needs = r"--vs-hf needs a Hugging Face checkpoint \(a directory with config.json\)"
    with pytest.raises(InvalidRequestError, match=needs):
        bench.run(_bench_args(["--vs-hf"] + (["--model", model] if model else [])))


@pytest.mark.parametrize("argv", [["--preset", "llama-tiny"], ["throughput", "--preset", "llama-tiny"]])
def test_bench_without_the_hf_stack_says_which_install_adds_it(argv, tmp_path, monkeypatch):
    """On a base install (no torch): `--preset` died in an 'unexpected ModuleNotFoundError', and
    `--vs-hf` only after the whole jaxinfer half of the benchmark had run."""
    import importlib.util

    from jaxinfer import bench

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    needs = r"--(preset|vs-hf) needs torch \(the Hugging Face reference stack\).*pip install -e \"\.\[test\]\""
    with pytest.raises(InvalidRequestError, match=needs):
        bench.run(_bench_args(argv))
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face directory, as far as the check looks
    with pytest.raises(InvalidRequestError, match=needs.replace("(preset|vs-hf)", "vs-hf")):
        bench.run(_bench_args(["--vs-hf", "--model", str(tmp_path)]))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prompt-lens", "100000"], "--prompt-lens"),
        (["--batch-sizes", "100000"], "--batch-sizes"),
        (["throughput", "--prompt-len-range", "1,5000"], "--prompt-len-range"),
    ],
)
def test_bench_sizes_the_model_refuses_name_the_flags(argv, flag):
    """The bench derives max_model_len and max_num_seqs from its flags; the engine's refusal named
    only those (`max_model_len must be an integer in [2, 1024 for this model], got 100001`)."""
    from jaxinfer import bench

    with pytest.raises(InvalidRequestError, match=r"must be .*, got \d+ \(.*" + flag):
        bench.run(_bench_args(["--model", "embedded:tiny-random", *argv]))


def test_a_stream_open_at_exit_leaves_quietly():
    """Its finalizer ran the abort at interpreter exit, into half-torn-down modules: a TypeError
    traceback from prometheus_client ("Exception ignored in: <generator ...>")."""
    code = (
        "from jaxinfer import LLM, SamplingParams, default_model\n"
        "llm = LLM(default_model.TINY_RANDOM, max_model_len=64, num_kv_pages=16, max_num_seqs=2)\n"
        "g = llm.stream(prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=30, ignore_eos=True))\n"
        "next(g)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens():
    """vLLM's left truncation: the output is the truncated prompt's, and its prompt_token_ids are the
    tokens run; a text far past the prompt limit is tokenized instead of refused for its size."""
    llm = LLM(max_model_len=64, num_kv_pages=16)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = "In the beginning God created the heaven and the earth. " * 200
    with pytest.raises(InvalidRequestError, match="cannot fit in 63 tokens"):
        llm.generate(text, greedy)
    with pytest.raises(InvalidRequestError, match="cannot fit in 63 tokens"):  # kept 64 could not fit: refused unread
        llm.generate(text, dataclasses.replace(greedy, truncate_prompt_tokens=64))
    full = llm.tokenizer.encode(text)
    out = llm.generate(text, dataclasses.replace(greedy, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == full[-5:]
    assert out.token_ids == llm.generate(prompt_token_ids=[full[-5:]], sampling_params=greedy)[0].token_ids
    streamed = llm.stream({"prompt": text}, dataclasses.replace(greedy, truncate_prompt_tokens=5))
    assert [t for d in streamed for t in d.token_ids] == out.token_ids
    ids = list(range(3, 103))
    longest = dataclasses.replace(greedy, truncate_prompt_tokens=-1)
    assert llm.generate(prompt_token_ids=[ids], sampling_params=longest)[0].prompt_token_ids == ids[-63:]
    roomy = dataclasses.replace(greedy, truncate_prompt_tokens=10)
    assert llm.generate(prompt_token_ids=[[5, 6]], sampling_params=roomy)[0].prompt_token_ids == [5, 6]
    with pytest.raises(InvalidRequestError, match=r"prompt has 70 tokens \(its last SamplingParams.truncate_prompt"):
        llm.generate(prompt_token_ids=[ids], sampling_params=dataclasses.replace(greedy, truncate_prompt_tokens=70))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match="SamplingParams.truncate_prompt_tokens must be None, -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert llm.generate([]) == []  # (it raised ValueError from an unpacking)


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["serve"], ["--port PORT", "(default: 9000)", "(default: 256)", "(default: 30.0)", "(default: float32)"]),
        (["bench"], ["(default: 32,128,512)", "(default: 16,256)", "(default: 3)"]),
        (["generate"], ["(default: 16)", "(default: 512)", "(default: auto)"]),
        (["bench", "kernels"], ["(default: 8)", "(default: 1024,4096)", "(default: 32,8)", "(default: bfloat16)"]),
        (["bench", "window-pools"], ["(default: 768)", "(default: 400)", "print the two runs' figures as JSON"]),
    ],
)
def test_help_shows_each_options_default(capsys, argv, shown):
    """`--help` says what an option left out means: its default, as the flag takes it (a list as
    32,128, not Python's [32, 128]); an option whose help already names its default is left as is."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(s in out for s in shown), [s for s in shown if s not in out]
    assert "[16, 256]" not in out and "(default: the embedded default model) (default" not in out
    assert "(default: {})" not in out


def test_a_text_too_long_for_its_truncation_names_truncate_prompt_tokens(llm):
    """A text refused for its size although its request truncates (truncate_prompt_tokens keeps more
    than the prompt limit) names that field, as a token-id prompt's refusal does: the caller asked
    for truncation and must learn why it did not help, not only that the prompt is too long."""
    keep_64 = SamplingParams(max_tokens=2, truncate_prompt_tokens=64)
    # Refused unread (200 bytes cannot be 63 tokens), then once tokenized (BOS + 63 bytes = 64 tokens).
    for text in ("x" * 200, "x" * 63):
        with pytest.raises(InvalidRequestError, match=r"SamplingParams\.truncate_prompt_tokens = 64"):
            llm.generate(text, keep_64)
    with pytest.raises(InvalidRequestError, match=r"prompt has 64 tokens; the limit is max_model_len - 1 = 63$"):
        llm.generate("x" * 63, SamplingParams(max_tokens=2))  # no truncation asked: nothing to name


def test_min_tokens_keeps_a_stop_string_from_ending_its_first_tokens(llm):
    """vLLM (V1's detokenizer) searches for stop strings only in text past the first min_tokens
    tokens, as EOS and stop ids can end the output only after them: min_tokens=1 keeps a stop string
    the first token completes from ending the output with no text (it did: the min_tokens-th token's
    text was searched)."""
    a = 3 + ord("a")  # the tiny model's byte tokenizer: byte + 3
    p = SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=[a], stop=["a"])
    assert llm.generate("x", p)[0].text == ""  # no min_tokens: the first "a" ends it
    for k in (1, 3):
        kept = dataclasses.replace(p, min_tokens=k)
        out = llm.generate("x", kept)[0]
        assert out.token_ids == [a] * (k + 1) and out.text == "a" * k, (k, out)
        assert out.finish_reason == "stop" and out.stop_reason == "a"
        assert "".join(d.text for d in llm.stream("x", kept)) == out.text
        shown = llm.generate("x", dataclasses.replace(kept, include_stop_str_in_output=True))[0]
        assert shown.text == "a" * (k + 1)
    # min_tokens = max_tokens: no stop string can end it.
    assert llm.generate("x", dataclasses.replace(p, min_tokens=6))[0].finish_reason == "length"
