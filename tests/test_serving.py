"""The gRPC server on loopback: real grpc.aio server, real clients, the same engine as offline.

Most tests share one in-process server (its own thread and event loop) over the embedded default
model; the SIGTERM test runs `jaxinfer serve` as a subprocess. Outputs are compared with offline
`LLM.generate` on the same model: the engine is batch invariant, so every request must get exactly
the tokens it gets alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from jax.experimental import io_callback

from jaxinfer import LLM, InvalidRequestError, SamplingParams, default_model
from jaxinfer import model as model_lib
from jaxinfer.client import AsyncClient, Client, ServerError
from jaxinfer.jetstream import jetstream_pb2 as js
from jaxinfer.jetstream import jetstream_pb2_grpc as js_grpc
from jaxinfer.v1 import jaxinfer_pb2 as pb
from jaxinfer.v1 import jaxinfer_pb2_grpc as pb_grpc
from serving.server import Server, ServerConfig

# The tiny random model (fast to compile): these tests are about the server, not the model's text.
ENGINE = dict(
    model=default_model.TINY_RANDOM,
    max_model_len=128,
    page_size=16,
    num_kv_pages=160,
    max_num_seqs=8,
    max_num_batched_tokens=64,
)


class ServerThread:
    """A `Server` on its own event loop in a daemon thread, for tests in this (synchronous) process."""

    def __init__(self, llm: LLM, **config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(ServerConfig(port=0, **config), llm=llm)
        self.port = self.run(self.server.start())
        self.run(self.server.ready.wait(), timeout=300)
        assert self.server.state == "serving"
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop(drain_timeout=5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Waits for the engine to hold no sequence and no page; returns its stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.server.llm.stats()
            if stats["running"] == 0 and stats["waiting"] == 0 and self.server.async_engine.num_in_flight == 0:
                used = stats["kv_pages_total"] - stats["kv_pages_free"]
                if used == 0:
                    return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {stats}")
            time.sleep(0.02)


@pytest.fixture(scope="module")
def llm():
    """The offline reference. Never the server's own LLM: its engine belongs to the server's thread."""
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def server():
    s = ServerThread(LLM(**ENGINE))  # same weights and shapes as `llm`: compiled once, shared by both
    yield s
    s.stop()


def _prompts(k: int) -> list[str]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "far"]
    rng = np.random.default_rng(k)
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(k)]


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(max_tokens=6 + i % 11, temperature=0.0)
    return SamplingParams(max_tokens=6 + i % 11, temperature=0.8, top_k=40, seed=1000 + i)


def test_health_reflection_and_model_info(server):
    channel = grpc.insecure_channel(server.address)
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "jaxinfer.v1.InferenceService", "jetstream_proto.Orchestrator"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # List (the health protocol's newer method, which reflection advertises) answers every service.
    listed = stub.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {name: r.status for name, r in listed.items()} == {
        name: health_pb2.HealthCheckResponse.SERVING
        for name in ("", "jaxinfer.v1.InferenceService", "jetstream_proto.Orchestrator")
    }
    with Client(server.address) as c:
        assert c.health() == "SERVING" and c.health("no.such.Service") == "NOT_FOUND"

    async def async_twin():
        c = AsyncClient(server.address, timeout=30)
        await c.wait_ready(timeout=10)  # SERVING already: returns at once
        answers = await c.health(), await c.health("no.such.Service")
        await c.close()
        return answers, c._channel.get_state()

    answers, state = asyncio.run(async_twin())
    assert answers == ("SERVING", "NOT_FOUND")
    assert state == grpc.ChannelConnectivity.SHUTDOWN  # close() closed the channel

    # A reflection client (the one grpcurl-like tools build on) sees every service and its methods.
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {"jaxinfer.v1.InferenceService", "jetstream_proto.Orchestrator", "grpc.health.v1.Health"} <= services
    from google.protobuf.descriptor_pool import DescriptorPool

    pool = DescriptorPool(db)
    svc = pool.FindServiceByName("jaxinfer.v1.InferenceService")
    assert {m.name for m in svc.methods} == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo"}
    decode = pool.FindServiceByName("jetstream_proto.Orchestrator").FindMethodByName("Decode")
    assert decode.input_type.fields_by_name["token_content"].number == 6

    with Client(server.address) as c:
        info = c.model_info()
        assert info["model_name"] == server.server.llm.cfg.name
        assert info["max_model_len"] == ENGINE["max_model_len"]
        assert info["vocab_size"] == server.server.llm.cfg.vocab_size
        assert info["kv_pages_total"] == ENGINE["num_kv_pages"] - 1 and info["kv_window_pages_total"] == 0
        assert info["kv_cache_bytes"] == server.server.llm.engine.cache.nbytes
        cfg = server.server.llm.cfg
        assert (info["family"], info["dtype"]) == (cfg.family, cfg.dtype)
        assert info["eos_token_ids"] == list(cfg.eos_token_ids)
        assert (info["max_num_seqs"], info["max_num_batched_tokens"], info["page_size"]) == (
            ENGINE["max_num_seqs"],
            ENGINE["max_num_batched_tokens"],
            ENGINE["page_size"],
        )
        assert info["kv_bytes_per_token"] == cfg.kv_bytes_per_token and info["has_tokenizer"] is True
        assert c.tokenize("fox") == server.server.llm.tokenizer.encode("fox")
        # An empty text is no prompt, but Tokenize answers what the tokenizer makes of it (as vLLM's
        # /tokenize and `tokenizer.encode("")` do), while Generate still refuses it.
        assert c.tokenize("") == server.server.llm.tokenizer.encode("")
        with pytest.raises(ServerError, match="text: the prompt is empty"):
            c.generate("", SamplingParams(max_tokens=1))
    channel.close()


def test_64_concurrent_streams_match_offline(server, llm):
    prompts = _prompts(64)
    params = [_params(i) for i in range(64)]

    async def one(client, prompt, p):
        ids, text, reasons = [], [], []
        async for d in client.stream(prompt, p):
            ids += d.token_ids
            text.append(d.text)
            reasons.append(d.finish_reason)
        return ids, "".join(text), reasons

    async def all_of_them():
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(one(client, pr, p) for pr, p in zip(prompts, params)))

    served = asyncio.run(all_of_them())
    server.wait_idle()  # every page back, nothing left running
    offline = llm.generate(prompts, params)
    for i, ((ids, text, reasons), ref) in enumerate(zip(served, offline)):
        assert ids == ref.token_ids, i
        assert text == ref.text, i
        assert reasons[-1] == ref.finish_reason and all(r is None for r in reasons[:-1]), i


def test_unary_generate_with_logprobs_and_samples(server, llm):
    p = SamplingParams(max_tokens=7, temperature=1.0, seed=7, n=3, logprobs=3, stop=["zz"])
    with Client(server.address) as c:
        got = c.generate("over the lazy dog", p, request_id="client-42")
        by_ids = c.generate(prompt_token_ids=llm.tokenizer.encode("over the lazy dog"), sampling_params=p)
    ref = llm.generate("over the lazy dog", p)[0]
    assert got.request_id == "client-42"  # the caller's id comes back; without one, the server's own
    assert by_ids.request_id and by_ids.request_id != "client-42"
    assert len(got.outputs) == 3
    for a, b, r in zip(got.outputs, by_ids.outputs, ref.outputs):
        assert a.token_ids == r.token_ids == b.token_ids
        assert a.text == r.text and a.finish_reason == r.finish_reason
        assert [x.token_id for x in a.logprobs] == r.token_ids
        np.testing.assert_allclose([x.logprob for x in a.logprobs], [x.logprob for x in r.logprobs], rtol=1e-5)
        assert all(len(x.top) == 3 for x in a.logprobs)
    assert got.prompt_token_ids == ref.prompt_token_ids


def test_outputs_over_the_wire_are_offline_outputs(server, llm):
    """Field for field what LLM.generate returns, without logprobs asked (None, not empty) and with
    them: the prompt text, the samples, their logprobs and cumulative log-probabilities. The
    asyncio client's stream carries the prompt's logprobs on sample 0's first delta as well."""
    prompt = "over the lazy dog"
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=2, logprobs=2, prompt_logprobs=1)
    with Client(server.address) as c:
        got = c.generate(prompt, plain)
        ref = llm.generate(prompt, plain)[0]
        assert (got.prompt, got.outputs) == (ref.prompt, ref.outputs) == (prompt, ref.outputs)
        assert ref.outputs[0].logprobs is None and ref.outputs[0].cumulative_logprob is None
        assert all(d.logprobs is None for d in c.stream(prompt, plain))
        got = c.generate(prompt, scored)
    ref = llm.generate(prompt, scored)[0]
    for a, b in zip(got.outputs, ref.outputs, strict=True):
        assert a.token_ids == b.token_ids
        _same_logprobs(a.logprobs, b.logprobs)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-5)

    async def streamed():
        async with AsyncClient(server.address, timeout=60) as client:
            return [d async for d in client.stream(prompt, scored)]

    carrying = [d for d in asyncio.run(streamed()) if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0
    _same_logprobs(carrying[0].prompt_logprobs, ref.prompt_logprobs)


def _same_logprobs(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and list(a.top) == list(b.top)
            np.testing.assert_allclose([a.logprob, *a.top.values()], [b.logprob, *b.top.values()], rtol=1e-5)


def test_prompt_logprobs_and_streamed_logprobs_cross_the_wire(server, llm):
    """prompt_logprobs as offline: in a unary response, and on sample 0's first streamed message
    (only there); a stream's messages carry their tokens' logprobs too."""
    prompt = "the quick brown fox jumps"
    p = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2, logprobs=1, prompt_logprobs=2)
    ref = llm.generate(prompt, p)[0]
    assert len(ref.prompt_logprobs) == len(ref.prompt_token_ids) > 2
    with Client(server.address) as c:
        got = c.generate(prompt, p)
        deltas = list(c.stream(prompt, p))
    _same_logprobs(got.prompt_logprobs, ref.prompt_logprobs)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0 and carrying[0] is next(d for d in deltas if d.index == 0)
    _same_logprobs(carrying[0].prompt_logprobs, ref.prompt_logprobs)
    for o in ref.outputs:
        _same_logprobs([lp for d in deltas if d.index == o.index for lp in d.logprobs], o.logprobs)
    offline = [d for d in llm.stream(prompt, dataclasses.replace(p, n=1))]
    _same_logprobs(offline[0].prompt_logprobs, ref.prompt_logprobs)
    assert all(d.prompt_logprobs is None for d in offline[1:])
    _same_logprobs([lp for d in offline for lp in d.logprobs], ref.outputs[0].logprobs)


def test_clients_read_prompt_logprobs_off_sample_0s_first_message_whatever_comes_before():
    """The protocol puts the prompt's logprobs on sample 0's first message. Ours sends that message
    first; another server may not. A stand-in server on loopback sends sample 1's first."""

    class SampleOneFirst(pb_grpc.InferenceServiceServicer):
        def GenerateStream(self, request, context):
            lp = pb.TokenLogprob(token_id=5, logprob=-1.5)
            stop = pb.FINISH_REASON_LENGTH
            yield pb.GenerateStreamResponse(index=1, token_ids=[7])
            yield pb.GenerateStreamResponse(index=0, token_ids=[8], prompt_logprobs=[lp])
            yield pb.GenerateStreamResponse(index=1, token_ids=[9], finish_reason=stop)
            yield pb.GenerateStreamResponse(index=0, token_ids=[10], finish_reason=stop)

    stand_in = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    pb_grpc.add_InferenceServiceServicer_to_server(SampleOneFirst(), stand_in)
    address = f"127.0.0.1:{stand_in.add_insecure_port('127.0.0.1:0')}"
    stand_in.start()
    try:
        p = SamplingParams(max_tokens=2, n=2, prompt_logprobs=0)
        with Client(address, timeout=30) as c:
            synced = list(c.stream(prompt_token_ids=[4, 5], sampling_params=p))

        async def collect():
            async with AsyncClient(address, timeout=30) as c:
                return [d async for d in c.stream(prompt_token_ids=[4, 5], sampling_params=p)]

        for deltas in (synced, asyncio.run(collect())):
            assert [(d.index, d.token_ids) for d in deltas] == [(1, [7]), (0, [8]), (1, [9]), (0, [10])]
            got = [d.prompt_logprobs for d in deltas]
            assert got[0] is None and got[2:] == [None, None]
            assert got[1][0] is None and got[1][1].token_id == 5 and got[1][1].logprob == -1.5
    finally:
        stand_in.stop(0)


def test_truncate_prompt_tokens_crosses_the_wire(server, llm):
    """A text past the prompt limit's size, refused without truncation, runs its last tokens with
    it (tokenized off the event loop), as offline; the response names the tokens run."""
    text = "the quick brown fox jumps over the lazy dog. " * 300
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=6)
    ref = llm.generate(text, p)[0]
    assert ref.prompt_token_ids == llm.tokenizer.encode(text)[-6:]
    with Client(server.address) as c:
        got = c.generate(text, p)
        streamed = [t for d in c.stream(text, p) for t in d.token_ids]
        with pytest.raises(ServerError, match="cannot fit in 127 tokens") as refused:
            c.generate(text, dataclasses.replace(p, truncate_prompt_tokens=None))
    assert refused.value.code == "INVALID_ARGUMENT"
    assert got.prompt_token_ids == ref.prompt_token_ids
    assert got.token_ids == streamed == ref.token_ids


def test_prompt_texts_are_tokenized_off_the_event_loop(server, monkeypatch):
    """Every RPC that takes a text (Generate, GenerateStream, Tokenize, JetStream's Decode) has it
    tokenized on the tokenize pool: a text may be megabytes, which on the event loop would hold up
    every other stream for a second."""
    tok = server.server.llm.tokenizer
    threads = []

    def encode(text, **kw):
        threads.append(threading.current_thread())
        return type(tok).encode(tok, text, **kw)

    monkeypatch.setattr(tok, "encode", encode)
    p = SamplingParams(max_tokens=2, temperature=0.0)
    with Client(server.address) as c:
        c.generate("the lazy dog", p)
        list(c.stream("the lazy dog", p))
        c.tokenize("the lazy dog")
    req = js.DecodeRequest(max_tokens=2, text_content=js.DecodeRequest.TextContent(text="the lazy dog"))
    with grpc.insecure_channel(server.address) as ch:
        list(js_grpc.OrchestratorStub(ch).Decode(req, timeout=60))
    assert len(threads) == 4
    assert server.thread not in threads
    assert all(t.name.startswith("jaxinfer-tokenize") for t in threads), [t.name for t in threads]


def test_a_served_request_is_validated_once(server, monkeypatch):
    """The server validates a request on its event loop; the engine's thread, which runs every step,
    does not scan the prompt a second time."""
    engine = server.server.llm.engine
    calls = []

    def validate(*args):
        calls.append(threading.current_thread())
        return type(engine).validate(engine, *args)

    monkeypatch.setattr(engine, "validate", validate)
    with Client(server.address) as c:
        c.generate(prompt_token_ids=list(range(5, 105)), sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
    assert calls == [server.thread]


def test_min_tokens_crosses_the_wire(server, llm):
    """SamplingParams.min_tokens reaches the server's engine: the request's first token, made a stop
    token, ends it at once without min_tokens and only after min_tokens with it, as offline."""
    prompt = [5, 9, 14, 20]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=one)[0]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=list(first.token_ids))
    with Client(server.address) as c:
        assert c.generate(prompt_token_ids=prompt, sampling_params=p).outputs[0].token_ids == []
        got = c.generate(prompt_token_ids=prompt, sampling_params=dataclasses.replace(p, min_tokens=5)).outputs[0]
    ref = llm.generate(prompt_token_ids=[prompt], sampling_params=dataclasses.replace(p, min_tokens=5))[0].outputs[0]
    assert got.token_ids == ref.token_ids and len(got.token_ids) >= 5 and first.token_ids[0] not in got.token_ids[:5]


def test_logit_bias_and_allowed_token_ids_cross_the_wire(server, llm):
    """Both reach the server's engine, on the sync and the asyncio client: the first token banned by
    a -100 bias, the rest drawn from a short list, the same tokens as offline."""
    prompt = [5, 9, 14, 20]
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, temperature=0.0))[0]
    banned = first.outputs[0].token_ids[0]
    p = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        logit_bias={banned: -100.0, 17: 2.0},
        allowed_token_ids=[banned, 17, 30, 41, 52],
        bad_words=["\x1b&"],  # ids 30, 41 (the byte tokenizer's): 41 never follows 30
    )
    ref = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0].outputs[0]
    assert ref.token_ids[0] != banned and set(ref.token_ids) <= {banned, 17, 30, 41, 52}
    assert "30, 41" not in str(ref.token_ids)
    with Client(server.address) as c:
        assert c.generate(prompt_token_ids=prompt, sampling_params=p).outputs[0].token_ids == ref.token_ids

    async def streamed():
        async with AsyncClient(server.address) as c:
            return [t async for d in c.stream(prompt_token_ids=prompt, sampling_params=p) for t in d.token_ids]

    assert asyncio.run(streamed()) == ref.token_ids


def test_a_bad_request_found_only_by_the_engine_thread_is_invalid_argument(server, monkeypatch):
    """The server validates before queueing; an InvalidRequestError that only `Engine.add_request`
    raises (on its own thread) is still the request's fault, not INTERNAL, and the server stays up."""
    engine = server.server.llm.engine

    def refuse(*args, **kwargs):
        raise InvalidRequestError("SamplingParams.example: refused by the engine thread")

    monkeypatch.setattr(engine, "add_request", refuse)
    with Client(server.address) as c:
        for call in (lambda: c.generate("hi"), lambda: list(c.stream("hi"))):
            with pytest.raises(ServerError, match="refused by the engine thread") as e:
                call()
            assert e.value.code == "INVALID_ARGUMENT"
        monkeypatch.undo()
        assert c.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True)).outputs[0].finish_reason == "length"


def test_include_stop_str_in_output_crosses_the_wire(server, llm):
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = llm.generate(["the quick brown"], sp)[0].outputs[0].text
    stop = free[4:7]
    p = dataclasses.replace(sp, stop=[stop], include_stop_str_in_output=True)
    with Client(server.address) as c:
        got = c.generate("the quick brown", p).outputs[0]
        streamed = "".join(d.text for d in c.stream("the quick brown", p))
    assert got.text == streamed == free[: free.index(stop) + len(stop)] and got.stop_reason == stop


def test_max_tokens_none_generates_up_to_the_length_limit_here_and_over_the_wire(server, llm):
    """vLLM's `max_tokens=None`: up to the model's length limit, prompt included (the client sends it
    as a value past the limit). Before, None was refused."""
    prompt = [5, 6, 7, 8, 9]
    p = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0].outputs[0]
    assert len(ref.token_ids) == ENGINE["max_model_len"] - len(prompt) and ref.finish_reason == "length"
    with Client(server.address) as c:
        got = c.generate(prompt_token_ids=prompt, sampling_params=p).outputs[0]
    assert got.token_ids == ref.token_ids and got.finish_reason == "length"


def test_unset_fields_take_the_models_generation_config_and_stop_reasons_cross_the_wire(tmp_path, capsys):
    """A request's unset sampling fields take the checkpoint's generation_config.json values (as vLLM's
    server does); set ones win. ModelInfo shows the defaults; stop_reason reaches the client. The
    model has no tokenizer: `jaxinfer generate --server` prints its token ids, as it does locally."""
    from tests.hf_models import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("llama2"), tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "max_new_tokens": 4, "repetition_penalty": 1.3})
    )
    engine = dict(max_model_len=64, num_kv_pages=32, max_num_seqs=4)
    offline = LLM(str(tmp_path), **engine)
    expected_defaults = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3)
    assert offline.get_default_sampling_params() == expected_defaults
    prompt = [1, 17, 33, 9]
    s = ServerThread(LLM(str(tmp_path), **engine))
    try:
        with Client(s.address) as c:
            info = c.model_info()
            assert info["default_sampling_params"] == expected_defaults and info["has_tokenizer"] is False
            got = c.generate(prompt_token_ids=prompt)  # no SamplingParams: nothing set, all defaults
            ref = offline.generate(prompt_token_ids=[prompt])[0]
            assert got.token_ids == ref.token_ids and (len(got.token_ids) == 4 or got.finish_reason == "stop")
            raw = pb_grpc.InferenceServiceStub(grpc.insecure_channel(s.address)).Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt), sampling_params=pb.SamplingParams(max_tokens=9, ignore_eos=True)
                ),
                timeout=60,
            )
            longer = offline.generate(
                prompt_token_ids=[prompt],
                sampling_params=SamplingParams(**{**vars(expected_defaults), "max_tokens": 9, "ignore_eos": True}),
            )[0]
            assert list(raw.completions[0].token_ids) == longer.token_ids and len(longer.token_ids) == 9
            # stop_reason: the stop token that ended it, on the unary answer and the stream's last message.
            stop_at = longer.token_ids[2]
            p = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
            assert c.generate(prompt_token_ids=prompt, sampling_params=p).stop_reason == stop_at
            deltas = list(c.stream(prompt_token_ids=prompt, sampling_params=p))
            assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop_at
            assert offline.generate(prompt_token_ids=[prompt], sampling_params=p)[0].stop_reason == stop_at
            # ModelInfo sets just the file's fields, so a client can tell them from SamplingParams' own.
            assert c.model_info()["default_sampling_overrides"] == offline.generation_overrides
            # bad_words need a tokenizer: refused before the engine thread sees the request.
            with pytest.raises(ServerError, match="bad_words needs the model's tokenizer") as e:
                c.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(bad_words=["x"]))
            assert e.value.code == "INVALID_ARGUMENT"
        from jaxinfer import cli

        # `jaxinfer generate --server` samples as `jaxinfer generate --model` does: flags given, else
        # the served model's generation_config.json (here its repetition penalty), else greedy.
        capsys.readouterr()
        ignore = ["--ignore-eos"]
        local = ["generate", "--model", str(tmp_path), "--prompt-ids", "1,17,33,9", *ignore]
        for flags in ([], ["--generation-config", "none"], ["--max-tokens", "5", "--stream"]):
            argv = ["generate", "--server", s.address, "--prompt-ids", "1,17,33,9", *ignore, *flags]
            assert cli.main(argv) == 0
            out = capsys.readouterr().out.strip().strip(",")
            assert cli.main([*local, *[f for f in flags if f != "--stream"], "--num-kv-pages", "32"]) == 0
            assert out == capsys.readouterr().out.strip(), flags
            penalty = 1.0 if "none" in flags else 1.3
            max_tokens = {(): 4, ("--generation-config", "none"): 32}.get(tuple(flags), 5)
            p = SamplingParams(max_tokens=max_tokens, temperature=0, repetition_penalty=penalty, ignore_eos=True)
            want = offline.generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids
            assert out == ",".join(map(str, want)), flags
    finally:
        s.stop()


def _long(max_tokens=100) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _aborted(server) -> int:
    return server.server.llm.stats()["finished_sequences"]["abort"]


def _request_logs(caplog) -> list[dict]:
    """The server's one-line-per-request JSON logs so far."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event": "request"')]


def _wait_for_log(caplog, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in _request_logs(caplog):
            if predicate(line):
                return line
        time.sleep(0.02)
    raise AssertionError(f"no such request log line: {_request_logs(caplog)}")


def test_request_log_line_and_cumulative_logprob(server, llm, caplog):
    """The one log line of a finished request says what it did; the client's cumulative_logprob
    (summed client-side from the streamed logprobs) is the offline engine's."""
    caplog.set_level("INFO", logger="jaxinfer.serving")
    p = SamplingParams(max_tokens=5, temperature=1.0, seed=4, ignore_eos=True, n=2, logprobs=1)
    with Client(server.address) as c:
        out = c.generate("the quick fox", p, request_id="log-me")
    line = _wait_for_log(caplog, lambda x: x["client_request_id"] == "log-me")
    assert (line["method"], line["code"], line["n"], line["max_tokens"]) == ("Generate", "OK", 2, 5)
    assert line["prompt_tokens"] == len(out.prompt_token_ids) and line["completion_tokens"] == 10
    assert line["finish_reasons"] == ["length", "length"]
    assert 0 < line["ttft_s"] <= line["latency_s"]
    offline = llm.generate("the quick fox", p)[0]
    # A first token that is a stop token is made, though not sent: it has a TTFT, as in the engine.
    first = offline.outputs[0].token_ids[0]
    stop_at_once = SamplingParams(max_tokens=5, temperature=1.0, seed=4, stop_token_ids=[first])
    with Client(server.address) as c:
        assert c.generate("the quick fox", stop_at_once, request_id="stop-1").outputs[0].token_ids == []
    line = _wait_for_log(caplog, lambda x: x["client_request_id"] == "stop-1")
    assert line["finish_reasons"] == ["stop"] and line["completion_tokens"] == 0
    assert 0 < line["ttft_s"] <= line["latency_s"]
    for got, want in zip(out.outputs, offline.outputs, strict=True):
        assert got.token_ids == want.token_ids
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-5)
    # A streamed request echoes the caller's id on every message; a refused one logs why; JetStream's
    # Decode is logged (and counted) as itself.
    with grpc.insecure_channel(server.address) as ch:
        req = pb.GenerateRequest(text="fox", request_id="stream-7", sampling_params=pb.SamplingParams(max_tokens=3))
        assert {m.request_id for m in pb_grpc.InferenceServiceStub(ch).GenerateStream(req, timeout=60)} == {"stream-7"}
        with pytest.raises(grpc.RpcError):
            pb_grpc.InferenceServiceStub(ch).Generate(pb.GenerateRequest(text="", request_id="empty-1"), timeout=60)
        decode = js.DecodeRequest(max_tokens=2, text_content=js.DecodeRequest.TextContent(text="fox"))
        list(js_grpc.OrchestratorStub(ch).Decode(decode, timeout=60))
    refused = _wait_for_log(caplog, lambda x: x["client_request_id"] == "empty-1")
    assert refused["code"] == "INVALID_ARGUMENT" and "text: the prompt is empty" in refused["error"]
    assert _wait_for_log(caplog, lambda x: x["method"] == "Decode")["code"] == "OK"


def test_cancel_and_deadline_free_pages(server, caplog):
    caplog.set_level("INFO", logger="jaxinfer.serving")
    aborted = _aborted(server)
    with Client(server.address) as c:
        stream = c.stream("a long story", _long(), timeout=60)  # a cancel long before the deadline
        first = [next(stream) for _ in range(3)]
        assert all(d.token_ids for d in first)
        assert server.server.llm.stats()["running"] == 1
        stream.close()  # cancels the RPC
        stats = server.wait_idle()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        assert _aborted(server) == aborted + 1  # aborted in the engine, not run to its end
        line = _wait_for_log(caplog, lambda x: x["code"] == "CANCELLED")
        assert line["completion_tokens"] < 100 and line["finish_reasons"] == ["abort"]  # was [null]

        # The tiny model makes its 115 tokens in ~35 ms on an idle machine: each step is slowed to
        # 2 ms, so the 50 ms deadline surely comes first (the test failed when run alone).
        engine = server.server.llm.engine
        real_step = engine.step
        engine.step = lambda: (time.sleep(0.002), real_step())[1]
        try:
            with pytest.raises(ServerError) as e:
                c.generate("a long story", _long(120), timeout=0.05)
            with Client(server.address, timeout=0.05) as hasty, pytest.raises(ServerError) as e2:
                hasty.generate("a long story", _long(120))  # the client's own deadline, for every call
        finally:
            del engine.step  # the class's own again
        assert e.value.code == e2.value.code == "DEADLINE_EXCEEDED"
        server.wait_idle()
        assert _aborted(server) == aborted + 3
        line = _wait_for_log(caplog, lambda x: x["code"] == "DEADLINE_EXCEEDED")
        assert line["completion_tokens"] < 120 and line["finish_reasons"] == ["abort"]

        # A deadline before the first token (the prompt's step takes 0.3 s): no time to first token.
        engine.step = lambda: (time.sleep(0.3), real_step())[1]
        try:
            with pytest.raises(ServerError) as e:
                c.generate("a long story", _long(120), timeout=0.1, request_id="before-first-token")
        finally:
            del engine.step
        server.wait_idle()
        line = _wait_for_log(caplog, lambda x: x["client_request_id"] == "before-first-token")
        assert (line["code"], line["completion_tokens"], line["ttft_s"]) == ("DEADLINE_EXCEEDED", 0, None)
        still = c.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))
        assert still.outputs[0].finish_reason == "length"


def test_engine_failure_fails_its_requests_not_the_server(server):
    engine = server.server.llm.engine

    def broken():
        del engine.step  # fails once, then the class's step again
        raise RuntimeError("injected fault")

    engine.step = broken
    try:
        with Client(server.address) as c:
            with pytest.raises(ServerError) as e:
                c.generate("doomed", SamplingParams(max_tokens=4))
            assert e.value.code == "INTERNAL" and "injected fault" in e.value.details
            server.wait_idle()
            assert c.health() == "SERVING"
            assert len(c.generate("fine", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3
    finally:
        engine.__dict__.pop("step", None)


def test_a_bug_in_a_handler_is_internal_and_the_server_serves_on(server, monkeypatch, caplog):
    """An exception no handler expected (a bug of ours, not the request's) ends its call with
    INTERNAL, naming the exception, and is logged with its traceback; the next call is answered."""
    caplog.set_level("INFO", logger="jaxinfer.serving")

    def broken(*args, **kwargs):
        raise KeyError("injected handler bug")

    monkeypatch.setattr(server.server, "_tokenize", broken)
    with Client(server.address) as c:
        with pytest.raises(ServerError) as e:
            c.tokenize("anything")
        assert e.value.code == "INTERNAL" and e.value.details == "KeyError: 'injected handler bug'"
        failed = [r for r in caplog.records if r.getMessage() == "Tokenize failed"]
        assert failed and failed[0].exc_info[0] is KeyError
        monkeypatch.undo()
        assert c.tokenize("anything") == server.server.llm.tokenizer.encode("anything")


def test_a_unary_answer_past_its_deadline_is_counted_as_such_and_not_sent(server, monkeypatch, caplog):
    """A unary handler that returns after gRPC core has ended its call (the deadline passed while it
    ran) sent its reply all the same: grpc.aio logged an ExecuteBatchError traceback, and the call
    was counted OK though the client saw DEADLINE_EXCEEDED."""
    caplog.set_level("INFO")
    tokenize = server.server._tokenize

    async def slow(*args, **kwargs):  # holds the event loop, so gRPC's cancellation of the call cannot land first
        time.sleep(0.6)
        return tokenize(*args, **kwargs)

    def count() -> float:
        labels = {"method": "Tokenize", "code": "DEADLINE_EXCEEDED"}
        return server.server.registry.get_sample_value("jaxinfer_requests_total", labels) or 0.0

    before = count()
    monkeypatch.setattr(server.server, "_tokenize_off_loop", slow)
    with Client(server.address, timeout=0.2) as c:
        with pytest.raises(ServerError) as e:
            c.tokenize("anything")
        assert e.value.code == "DEADLINE_EXCEEDED"
    deadline = time.monotonic() + 10
    while count() != before + 1:  # the handler ends after the client gave up
        assert time.monotonic() < deadline, count()
        time.sleep(0.05)
    time.sleep(0.2)  # grpc.aio's failed send, if any, is logged as the handler returns
    assert "ExecuteBatchError" not in caplog.text and "Traceback" not in caplog.text


def test_a_device_fault_fails_the_requests_in_flight_and_the_server_serves_on(server, monkeypatch):
    """A step that fails on the device consumes the KV cache donated to it: the engine makes a new
    one (tests/test_llm.py checks what it holds) and the server keeps answering with the same
    tokens as before, instead of INTERNAL for every request from then on."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Client(server.address) as c:
        expected = c.generate("before the fault", params).token_ids
        fired = threading.Event()

        def fault(_):
            if not fired.is_set():
                fired.set()
                raise RuntimeError("injected device fault")
            return np.float32(0)

        def failing(params, cache, batch, *, cfg):
            logits, cache = model_lib.forward(params, cache, batch, cfg=cfg)
            return logits + io_callback(fault, jax.ShapeDtypeStruct((), jnp.float32), logits[0, 0]), cache

        engine = server.server.llm.engine
        failing_decode = jax.jit(failing, static_argnames=("cfg",), donate_argnames=("cache",))
        monkeypatch.setattr(engine, "_steps", (engine._steps[0], failing_decode))
        with pytest.raises(ServerError) as e:
            c.generate("doomed", SamplingParams(max_tokens=4, ignore_eos=True))
        assert e.value.code == "INTERNAL" and "injected device fault" in e.value.details
        monkeypatch.undo()
        server.wait_idle()
        assert c.health() == "SERVING"
        assert c.generate("before the fault", params).token_ids == expected


def test_an_engine_thread_that_dies_takes_the_server_out_of_service():
    """Something other than an Exception out of a step (SystemExit here) ends the engine's thread:
    the requests in flight fail with UNAVAILABLE at once and health says NOT_SERVING (before, they
    waited for their deadlines while health said SERVING)."""
    # (The config's dtype is what a load of its own would ask for; ModelInfo says the model's.)
    s = ServerThread(LLM(**ENGINE), dtype="bfloat16")
    engine = s.server.llm.engine

    def dies():
        raise SystemExit("injected")

    engine.step = dies
    try:
        with Client(s.address) as c:
            assert c.model_info()["dtype"] == "float32" and c.tokenize("ab") == [1, 100, 101]
            with pytest.raises(ServerError) as e:
                c.generate("in flight", SamplingParams(max_tokens=4), timeout=20)
            assert e.value.code == "UNAVAILABLE" and "engine thread stopped on SystemExit" in e.value.details
            assert c.health() == "NOT_SERVING"
            with grpc.insecure_channel(s.address) as channel:
                listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
            assert {r.status for r in listed.statuses.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING}
            for call in (lambda: c.generate("later", SamplingParams(max_tokens=4), timeout=20), c.model_info):
                with pytest.raises(ServerError) as e:
                    call()
                assert e.value.code == "UNAVAILABLE"
            with pytest.raises(ServerError) as e:
                c.tokenize("ab")
            assert e.value.code == "UNAVAILABLE"
    finally:
        s.stop()


def test_an_event_loop_closed_without_shutdown_stops_the_engine_thread_quietly(llm, caplog, monkeypatch):
    """An owner whose event loop ends without `shutdown()` (a notebook cell, a test fixture): the
    engine thread's next delivery finds the loop closed. It stops, aborting what it ran so the
    engine's pages come back, and logs no critical "engine thread stopped" (before: it died on the
    RuntimeError with that log and left the request's pages held)."""
    from serving.async_engine import AsyncEngine

    engine = llm.engine
    ae = AsyncEngine(engine)
    loop = asyncio.new_event_loop()
    # Steps wait for the loop's close: on a loaded machine the whole request could otherwise finish
    # (its deltas queued on the idle loop) before it, and nothing would be delivered after it.
    gate = threading.Event()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (gate.wait(60), step())[1])

    async def start():
        ae.start()
        ae.submit([5, 6, 7, 8], SamplingParams(max_tokens=100, ignore_eos=True))

    loop.run_until_complete(start())
    while not engine.has_unfinished():  # the engine thread has taken the request
        time.sleep(0.01)
    loop.close()
    with caplog.at_level("INFO", logger="jaxinfer.serving"):
        gate.set()
        ae._thread.join(timeout=60)
    assert not ae._thread.is_alive()
    assert not [r for r in caplog.records if r.levelname == "CRITICAL"], caplog.text
    assert "the event loop has closed" in caplog.text
    stats = llm.stats()
    assert not engine.has_unfinished() and not engine.requests
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_cache_salt_keeps_tenants_out_of_each_others_prefix_pages(server):
    """GenerateRequest.cache_salt reaches the engine: the same long prompt hits the prefix cache only
    from a request with the same salt, and the tokens are the same either way."""
    prompt = [1] + [(11 * i) % 200 + 3 for i in range(70)]  # 4 full pages of 16
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def hits(c, **salt):
        before = server.wait_idle()["prefix_cache_hit_tokens"]
        out = c.generate(prompt_token_ids=prompt, sampling_params=params, timeout=60, **salt)
        return server.wait_idle()["prefix_cache_hit_tokens"] - before, out.token_ids

    with Client(server.address) as c:
        first, tokens = hits(c, cache_salt="tenant-a")  # no other test uses these salts
        assert first == 0 and len(tokens) == 4
        assert hits(c, cache_salt="tenant-b") == (0, tokens)
        assert hits(c, cache_salt="tenant-a") == (64, tokens)
        with pytest.raises(InvalidRequestError, match="cache_salt must be a string"):
            c.generate("hi", params, cache_salt=b"bytes")


def _raw_call(address: str, method: str, payload: bytes):
    """Sends hand-made bytes, as a client with a different (or broken) encoder would."""
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return call(payload, timeout=10)


BAD = [
    (dict(text=""), "text: the prompt is empty"),
    (dict(), "prompt: set one of text or token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (dict(token_ids=pb.TokenIds(ids=[5, 100000])), "token_ids: prompt token id 100000 is outside the vocabulary"),
    (dict(token_ids=pb.TokenIds(ids=[-1])), "token id -1 is outside the vocabulary"),
    (dict(token_ids=pb.TokenIds(ids=[5] * 400)), "limit is max_model_len - 1 = 127"),
    (dict(text="x" * 400), "400 bytes of text cannot fit in 127 tokens"),
    # Refused before tokenizing (megabytes of text held up the event loop for seconds).
    (dict(text="x" * 3_000_000), "3000000 bytes of text cannot fit in 127 tokens"),
    (dict(text="hi", sampling_params=pb.SamplingParams(stop=["a"] * 65)), "SamplingParams.stop must hold at most 64"),
    (dict(text="hi", sampling_params=pb.SamplingParams(stop_token_ids=[7] * 257)), "at most 256 ids"),
    (dict(text="hi", sampling_params=pb.SamplingParams(temperature=-1)), "SamplingParams.temperature"),
    (dict(text="hi", sampling_params=pb.SamplingParams(top_p=0)), "SamplingParams.top_p must be in (0, 1]"),
    (dict(text="hi", sampling_params=pb.SamplingParams(max_tokens=0)), "SamplingParams.max_tokens"),
    (dict(text="hi", sampling_params=pb.SamplingParams(logprobs=21)), "SamplingParams.logprobs"),
    (dict(text="hi", sampling_params=pb.SamplingParams(prompt_logprobs=-1)), "SamplingParams.prompt_logprobs"),
    (dict(text="hi", sampling_params=pb.SamplingParams(truncate_prompt_tokens=0)), "truncate_prompt_tokens"),
    (dict(text="", sampling_params=pb.SamplingParams(truncate_prompt_tokens=5)), "text: the prompt is empty"),
    (
        dict(token_ids=pb.TokenIds(ids=[5] * 400), sampling_params=pb.SamplingParams(truncate_prompt_tokens=200)),
        "prompt has 200 tokens (its last SamplingParams.truncate_prompt_tokens = 200)",
    ),
    (dict(text="hi", sampling_params=pb.SamplingParams(n=0)), "SamplingParams.n"),
    (dict(text="hi", sampling_params=pb.SamplingParams(min_p=float("nan"))), "SamplingParams.min_p"),
    (dict(text="hi", sampling_params=pb.SamplingParams(stop=[""])), "SamplingParams.stop"),
    (dict(text="hi", sampling_params=pb.SamplingParams(max_tokens=1000)), None),  # fine: stops at the length
    (
        dict(text="hi", sampling_params=pb.SamplingParams(min_tokens=5, max_tokens=2)),
        "sampling_params: SamplingParams.min_tokens must be at most",
    ),
    (dict(text="hi", sampling_params=pb.SamplingParams(logit_bias={-4: 1.0})), "SamplingParams.logit_bias keys"),
    (
        dict(text="hi", sampling_params=pb.SamplingParams(logit_bias={4: 101})),
        "logit_bias[4] must be a number in [-100, 100]",
    ),
    (dict(text="hi", sampling_params=pb.SamplingParams(logit_bias={10**6: 1})), "logit_bias: 1000000 is outside"),
    (dict(text="hi", sampling_params=pb.SamplingParams(allowed_token_ids=[-3])), "SamplingParams.allowed_token_ids"),
    (dict(text="hi", sampling_params=pb.SamplingParams(allowed_token_ids=[4, 10**6])), "1000000 is outside"),
    (dict(text="hi", sampling_params=pb.SamplingParams(bad_words=["ok", ""])), "SamplingParams.bad_words must hold"),
    (dict(text="hi", cache_salt=""), "at most 1024 characters, got 0 characters"),
    (dict(text="hi", cache_salt="s" * 1025), "cache_salt must be a non-empty string of at most 1024"),
    (dict(text="hi", cache_salt="tenant"), None),
    (dict(text="hi", request_id="r" * 257), "request_id must be at most 256 characters, got 257"),
    (dict(text="hi", request_id="r" * 256), None),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_requests_get_invalid_argument(server, fields, message):
    with grpc.insecure_channel(server.address) as ch:
        for method in ("Generate", "GenerateStream"):
            call = getattr(ch, "unary_unary" if method == "Generate" else "unary_stream")(
                f"/jaxinfer.v1.InferenceService/{method}",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=lambda b: b,
            )
            if message is None:
                list(call(pb.GenerateRequest(**fields), timeout=60)) if method == "GenerateStream" else call(
                    pb.GenerateRequest(**fields), timeout=60
                )
                continue
            with pytest.raises(grpc.RpcError) as e:
                r = call(pb.GenerateRequest(**fields), timeout=10)
                if method == "GenerateStream":
                    list(r)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
            assert message in e.value.details(), e.value.details()


def test_invalid_utf8_is_named(server):
    good = pb.GenerateRequest(text="ab", sampling_params=pb.SamplingParams(stop=["ok", "cd"])).SerializeToString()
    for bad_bytes, field in ((good.replace(b"ab", b"a\xff"), "text"), (good.replace(b"cd", b"c\xc3"), "stop[1]")):
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(server.address, "/jaxinfer.v1.InferenceService/Generate", bad_bytes)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details() and "invalid UTF-8" in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "/jaxinfer.v1.InferenceService/Generate", b"\xff\xff\xff")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server.address, "/jaxinfer.v1.InferenceService/Tokenize", b"\x0a\x01\xfe")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text: invalid UTF-8" in e.value.details()
    with Client(server.address) as c:  # and the server is unharmed
        assert c.health() == "SERVING"
        assert c.generate("fine", SamplingParams(max_tokens=2)).outputs[0].token_ids


# What a random request may get back: an answer, a named refusal, or the end its client asked for.
_FUZZ_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# The fields a refusal of one of these requests opens with (the oneof prompt's, sampling parameters',
# JetStream's max_tokens, the request's own id and salt).
_REQUEST_FIELD = (
    r"(sampling_params: SamplingParams\.[a-z_]+|text|token_ids|text_content\.text|token_content|max_tokens"
    r"|request_id|cache_salt)\b"
)


def _fuzz_request(rng: np.random.Generator, vocab: int) -> pb.GenerateRequest:
    """A request whose fields are now and then (one time in twenty or ten) set to a value inside or just
    past its limits."""
    edges = {
        "max_tokens": [1, 4, 12, 0, -1, 2**31 - 1],
        "temperature": [0.0, 0.7, 1.5, -1.0, float("nan"), float("inf")],
        "top_k": [0, -1, 1, 5, -2, 2**31 - 1],
        "top_p": [0.5, 1.0, 0.0, 1.5, float("nan")],
        "min_p": [0.0, 0.2, 1.0, -0.1, 2.0],
        "presence_penalty": [0.5, -2.0, 2.0, 2.5, float("-inf")],
        "frequency_penalty": [0.5, -2.0, 2.0, -2.5, float("nan")],
        "repetition_penalty": [1.2, 2.0, 0.0, 2.01, -1.0],
        "seed": [0, 7, 2**32 - 1],
        "logprobs": [0, 3, 20, 21, -1],
        "prompt_logprobs": [0, 2, 20, 21, -1],
        "n": [1, 2, 3, 0, -1, 65],
        "min_tokens": [0, 2, 5, 1000, -1],
        "truncate_prompt_tokens": [-1, 1, 8, 0, -2, 10**6],
    }
    sp = pb.SamplingParams()
    for field, values in edges.items():
        if rng.random() < 0.05:
            setattr(sp, field, values[rng.integers(len(values))])
    for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if rng.random() < 0.1:
            setattr(sp, field, bool(rng.integers(2)))
    if rng.random() < 0.08:
        sp.stop.extend([["a"], ["the", " "], [""], ["x" * 1025]][rng.integers(4)])
    if rng.random() < 0.08:
        sp.stop_token_ids.extend([[3], [vocab - 1, 4], [vocab], [-1]][rng.integers(4)])
    if rng.random() < 0.05:
        sp.logit_bias[int([3, vocab - 1, vocab, -5][rng.integers(4)])] = [5.0, -100.0, 101.0, float("nan")][
            rng.integers(4)
        ]
    if rng.random() < 0.05:
        sp.allowed_token_ids.extend([[3, 4, 5], [vocab], [-1], [7] * 4097][rng.integers(4)])
    if rng.random() < 0.05:
        sp.bad_words.extend([["the"], [""], ["y" * 257]][rng.integers(3)])
    req = pb.GenerateRequest(sampling_params=sp)
    if rng.random() < 0.5:
        req.text = ["to be or not", "once upon a time", "", " ", "é" * 40, "\x00", "abc " * 40][rng.integers(7)]
    else:
        length = int(rng.choice([1, 5, 40, 127, 0, 128, 300], p=[0.25, 0.25, 0.2, 0.1, 0.1, 0.05, 0.05]))
        odd = [vocab, -1, 2**31 - 1] if rng.random() < 0.05 else []
        req.token_ids.ids.extend(int(t) for t in rng.choice([1, 5, 17, 33, vocab - 1, *odd], size=length))
    if rng.random() < 0.05:
        req.request_id = ["r", "\n", "r" * 257][rng.integers(3)]
    if rng.random() < 0.05:
        req.cache_salt = ["", "tenant", "s" * 1025][rng.integers(3)]
    return req


def test_random_requests_never_hurt_the_server(server):
    """200 seeded random requests, in and just past every limit, 16 at a time over every RPC (unary,
    stream cancelled part-way or read to the end, JetStream Decode, Tokenize), some under deadlines
    shorter than a step: each gets an answer, a refusal naming what was wrong, or the end its client
    asked for; nothing else. Afterwards no page is held and the server answers as before."""
    with grpc.insecure_channel(server.address) as ch:
        stub, js_stub = pb_grpc.InferenceServiceStub(ch), js_grpc.OrchestratorStub(ch)
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
        rng = np.random.default_rng(37)
        calls = []
        for _ in range(200):
            kind = rng.choice(["unary", "stream", "jetstream", "tokenize"], p=[0.4, 0.4, 0.1, 0.1])
            if kind == "jetstream":
                req = js.DecodeRequest(max_tokens=int(rng.choice([0, 1, 5, -1])))
                if rng.random() < 0.5:
                    req.text_content.text = str(rng.choice(["hi", "", "é"]))
                else:
                    req.token_content.token_ids.extend(
                        int(t) for t in rng.choice([1, 2, vocab, -1], size=rng.integers(4))
                    )
            elif kind == "tokenize":
                req = pb.TokenizeRequest(text=str(rng.choice(["", "x", "é" * 500, "a " * 200])))
            else:
                req = _fuzz_request(rng, vocab)
            calls.append((kind, req, float(rng.choice([0.02, 60.0], p=[0.1, 0.9])), int(rng.integers(-4, 4))))

        def run(call) -> tuple[grpc.StatusCode, str]:
            kind, req, timeout, cancel_after = call
            try:
                if kind == "unary":
                    stub.Generate(req, timeout=timeout)
                elif kind == "tokenize":
                    stub.Tokenize(req, timeout=timeout)
                else:
                    stream = (
                        stub.GenerateStream(req, timeout=timeout)
                        if kind == "stream"
                        else js_stub.Decode(req, timeout=timeout)
                    )
                    for i, _ in enumerate(stream):
                        if i == cancel_after:  # negative: read to the end
                            stream.cancel()
                            break
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details() or ""

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(run, calls))
    codes = [code for code, _ in outcomes]
    assert set(codes) <= _FUZZ_CODES, [(c, d) for c, d in outcomes if c not in _FUZZ_CODES]
    assert codes.count(grpc.StatusCode.OK) >= 50 and codes.count(grpc.StatusCode.INVALID_ARGUMENT) >= 50, codes
    for code, details in outcomes:
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # opens with the field of the request at fault
            assert re.match(_REQUEST_FIELD, details) and "Traceback" not in details, details
    server.wait_idle()
    with Client(server.address) as c:
        assert c.health() == "SERVING"
        assert c.generate("still fine", SamplingParams(max_tokens=2, ignore_eos=True)).outputs[0].token_ids


def test_malformed_health_requests_get_invalid_argument(server, caplog):
    """Health checks parse like every other RPC: bad bytes are INVALID_ARGUMENT naming the problem,
    not UNKNOWN with a DecodeError traceback in the server's log."""
    garbage, bad_service = b"\xff\xff", health_pb2.HealthCheckRequest(service="ab").SerializeToString()[:-1] + b"\xff"
    cases = [
        ("/grpc.health.v1.Health/Check", garbage, "not a valid grpc.health.v1.HealthCheckRequest"),
        ("/grpc.health.v1.Health/Check", bad_service, "service: invalid UTF-8 at byte 1"),
        ("/grpc.health.v1.Health/Watch", garbage, "not a valid grpc.health.v1.HealthCheckRequest"),
        ("/grpc.health.v1.Health/Watch", bad_service, "service: invalid UTF-8 at byte 1"),
        ("/jetstream_proto.Orchestrator/HealthCheck", garbage, "not a valid jetstream_proto.HealthCheckRequest"),
        (
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            b"\xff\xff\xff\xff",
            "not a valid grpc.reflection.v1alpha.ServerReflectionRequest",
        ),
    ]
    with grpc.insecure_channel(server.address) as ch:
        for path, payload, message in cases:
            with pytest.raises(grpc.RpcError) as e:
                if path.endswith("ServerReflectionInfo"):
                    call = ch.stream_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
                    list(call(iter([payload]), timeout=10))
                else:
                    kind = ch.unary_stream if path.endswith("Watch") else ch.unary_unary
                    call = kind(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
                    r = call(payload, timeout=10)
                    if path.endswith("Watch"):
                        list(r)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, e.value.code(), e.value.details())
            assert message in e.value.details(), (path, e.value.details())
        # The stock stubs (grpc_health_probe and the like) still get the statuses the server sets.
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="jaxinfer.v1.InferenceService"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert js_grpc.OrchestratorStub(ch).HealthCheck(js.HealthCheckRequest(), timeout=5).is_live
    assert not [r for r in caplog.records if "raised by servicer method" in r.getMessage()]


def _block_loop(server, seconds: float) -> None:
    """Holds the server's event loop (as a burst of work would) while the engine thread goes on."""

    async def hold():
        time.sleep(seconds)

    asyncio.run_coroutine_threadsafe(hold(), server.loop)


def test_usage_is_on_the_last_message_only_when_the_handler_lags(server):
    """With n samples, `usage` goes on the stream's last message only, even when the engine has
    finished every sample before the handler sends their last messages."""
    params = pb.SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=4, ignore_eos=True)
    with grpc.insecure_channel(server.address) as ch:
        call = pb_grpc.InferenceServiceStub(ch).GenerateStream(
            pb.GenerateRequest(text="the quick brown fox", sampling_params=params), timeout=60
        )
        first = next(call)
        _block_loop(server, 1.5)  # the engine finishes all four samples meanwhile
        msgs = [first, *call]
    assert sum(m.finish_reason != pb.FINISH_REASON_UNSPECIFIED for m in msgs) == 4
    assert [m.HasField("usage") for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert msgs[-1].usage.completion_tokens == 24


def test_queue_full_is_resource_exhausted(llm):
    # Another engine over the same weights, with room for one running request and one queued.
    small = LLM(
        default_model.TINY_RANDOM, max_model_len=128, num_kv_pages=40, max_num_seqs=1, max_num_batched_tokens=64
    )
    s = ServerThread(small, max_queued_requests=1)
    # Holds the engine's steps, so nothing finishes while the queue fills. The wait's own limit is only
    # a backstop (`finally` opens the gate): at 30 s, on a loaded machine the held step could go on
    # before the third request came, finish the first stream and make room for it.
    gate = threading.Event()
    step = small.engine.step
    small.engine.step = lambda: (gate.wait(300), step())[1]
    try:
        # A deadline on every call: admitted where it should be refused, a call would wait on the
        # gate (and the test hang) instead of failing.
        with Client(s.address, timeout=60) as c, grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            req = pb.GenerateRequest(text="one", sampling_params=pb.SamplingParams(max_tokens=20, temperature=0))
            # One at a time: the second reaches the engine only if its thread takes both commands
            # in one go, before the held step (a loaded machine): the queue would then hold two.
            a = stub.GenerateStream(req)
            deadline = time.monotonic() + 60
            while not small.engine.scheduler.waiting:
                assert time.monotonic() < deadline, "the first stream did not reach the engine"
                time.sleep(0.01)
            b = stub.GenerateStream(req)
            while s.server.async_engine.num_in_flight < 2:
                in_flight = s.server.async_engine.num_in_flight
                assert time.monotonic() < deadline, f"{in_flight} of 2 streams reached the engine"
                time.sleep(0.01)
            with pytest.raises(ServerError) as e:
                c.generate("three", SamplingParams(max_tokens=2))
            assert e.value.code == "RESOURCE_EXHAUSTED", (e.value.code, e.value.details)
            gauges = {
                n: s.server.registry.get_sample_value(n)
                for n in ("jaxinfer_queue_depth", "jaxinfer_requests_in_flight")
            }
            assert gauges == {"jaxinfer_queue_depth": 1, "jaxinfer_requests_in_flight": 2}, gauges  # one waits
            assert "admission queue is full" in e.value.details and "max_queued_requests (1)" in e.value.details
            gate.set()
            lengths = [sum(len(m.token_ids) for m in stream) for stream in (a, b)]
            assert lengths == [20, 20], lengths
            s.wait_idle()
            four = c.generate("four", SamplingParams(max_tokens=2, ignore_eos=True))  # sampled: EOS could come first
            assert four.outputs[0].finish_reason == "length"
    finally:
        gate.set()
        s.stop()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_a_unary_response_past_max_response_bytes_is_refused_as_soon_as_it_passes(llm, capsys):
    """A unary response larger than the client's receive limit (gRPC's default: 4 MiB) reached the
    client as an error only after all the work, and the server counted it OK. It now ends with
    RESOURCE_EXHAUSTED naming the limit once past it, and frees its pages; streams are not limited.
    Also here, on a small cache: JetStream's Decode names its own fields, not SamplingParams'."""
    from jaxinfer import cli

    small = LLM(default_model.TINY_RANDOM, max_model_len=128, num_kv_pages=6, max_num_seqs=2, max_num_batched_tokens=64)
    s = ServerThread(small, max_response_bytes=4096)
    try:
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            big = pb.SamplingParams(max_tokens=75, temperature=0, ignore_eos=True, logprobs=20)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling_params=big)
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "max_response_bytes of 4096" in e.value.details() and "GenerateStream" in e.value.details()
            s.wait_idle()
            # Ended once past the limit (~21 tokens here, seen at 33: a unary handler takes 16 at once).
            assert s.server.registry.get_sample_value("jaxinfer_generation_tokens_total") < 50
            streamed = [t for m in stub.GenerateStream(req, timeout=60) for t in m.token_ids]
            ref = llm.generate(
                prompt_token_ids=[[5, 6, 7]],
                sampling_params=SamplingParams(max_tokens=75, temperature=0, ignore_eos=True),
            )
            assert streamed == ref[0].outputs[0].token_ids
            small_req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling_params=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2),
            )
            reply = stub.Generate(small_req, timeout=60)
            assert list(reply.completions[0].token_ids) == ref[0].outputs[0].token_ids[:4]
            assert reply.ByteSize() <= 4096
        # `jaxinfer generate --server` gathers the stream instead (a review: past the limit it failed
        # where a local run prints); what it gathers is what a unary reply says, field by field.
        argv = ["--prompt-ids", "5,6,7", "--max-tokens", "75", "--temperature", "0", "--ignore-eos"]
        assert cli.main(["generate", "--server", s.address, *argv, "--logprobs", "20", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == ref[0].outputs[0].token_ids and len(out["logprobs"]) == 75
        assert out["prompt_token_ids"] == [5, 6, 7] and out["finish_reason"] == "length"
        p = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=2, prompt_logprobs=1, stop=["a"])
        with Client(s.address, timeout=60) as c:
            unary = c.generate(prompt_token_ids=[5, 6, 7, 8], sampling_params=p, request_id="same")
            gathered = c._generate_streamed(prompt_token_ids=[5, 6, 7, 8], sampling_params=p)
        assert dataclasses.replace(gathered, request_id="same") == unary
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            body = s.server.registry.get_sample_value(
                "jaxinfer_requests_total", {"method": "Generate", "code": "RESOURCE_EXHAUSTED"}
            )
            assert body == 1.0

            decode = js.DecodeRequest(max_tokens=100, token_content=js.DecodeRequest.TokenContent(token_ids=[5, 6, 7]))
            with pytest.raises(grpc.RpcError) as e:
                list(js_grpc.OrchestratorStub(ch).Decode(decode, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("max_tokens = 100 with a 3-token prompt needs 7 KV pages"), (
                e.value.details()
            )
    finally:
        s.stop()


def test_jetstream_decode(server, llm):
    stub = js_grpc.OrchestratorStub(grpc.insecure_channel(server.address))
    assert stub.HealthCheck(js.HealthCheckRequest(), timeout=5).is_live

    prompt_ids = llm.tokenizer.encode("the lazy dog")
    ref = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(max_tokens=12, temperature=0))[0]

    # Token ids in, token ids out; field numbers as JetStream published them, encoded by hand:
    # max_tokens = 4 (varint), token_content = 6 { token_ids = 1 (packed) }.
    packed = b"".join(_varint(t) for t in prompt_ids)
    token_content = b"\x0a" + _varint(len(packed)) + packed
    raw = b"\x20" + _varint(12) + b"\x32" + _varint(len(token_content)) + token_content
    assert (
        raw
        == js.DecodeRequest(
            max_tokens=12, token_content=js.DecodeRequest.TokenContent(token_ids=prompt_ids)
        ).SerializeToString()
    )
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_stream(
            "/jetstream_proto.Orchestrator/Decode",
            request_serializer=lambda b: b,
            response_deserializer=js.DecodeResponse.FromString,
        )
        msgs = list(call(raw, timeout=60))
    assert msgs and all(len(m.stream_content.samples) == 1 for m in msgs)
    assert all(m.stream_content.samples[0].token_ids and not m.stream_content.samples[0].text for m in msgs)
    assert [t for m in msgs for t in m.stream_content.samples[0].token_ids] == ref.token_ids

    # Text in, text out, two samples per message.
    req = js.DecodeRequest(max_tokens=9, text_content=js.DecodeRequest.TextContent(text="the lazy dog"), num_samples=2)
    msgs = list(stub.Decode(req, timeout=60))
    ref = llm.generate("the lazy dog", SamplingParams(max_tokens=9, temperature=0))[0]
    assert msgs and all(len(m.stream_content.samples) == 2 for m in msgs)
    for i in range(2):
        assert "".join(m.stream_content.samples[i].text for m in msgs) == ref.text
        assert [t for m in msgs for t in m.stream_content.samples[i].token_ids] == ref.token_ids
    # Text held back: this model answers "café" with nine 0xA9 bytes, no character until the end
    # decides them. Their ids wait with the text: no message goes out without text.
    req = js.DecodeRequest(max_tokens=9, text_content=js.DecodeRequest.TextContent(text="café"))
    msgs = list(stub.Decode(req, timeout=60))
    ref = llm.generate("café", SamplingParams(max_tokens=9, temperature=0))[0]
    assert [t - 3 for t in ref.token_ids] == [0xA9] * 9 and ref.text == "\ufffd" * 9
    assert [(s.text, list(s.token_ids)) for m in msgs for s in m.stream_content.samples] == [(ref.text, ref.token_ids)]

    for bad, why in (
        (js.DecodeRequest(max_tokens=0, text_content=js.DecodeRequest.TextContent(text="x")), "max_tokens"),
        (js.DecodeRequest(max_tokens=4), "content"),
        (js.DecodeRequest(max_tokens=4, token_content=js.DecodeRequest.TokenContent(token_ids=[10**6])), "token"),
        (
            js.DecodeRequest(max_tokens=4, text_content=js.DecodeRequest.TextContent(text="x"), num_samples=99),
            "num_samples",
        ),
        (
            js.DecodeRequest(max_tokens=4, text_content=js.DecodeRequest.TextContent(text="x"), num_samples=-5),
            "num_samples must be >= 0",
        ),
    ):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(bad, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details(), e.value.details()


def test_cli_generate_against_server(server, llm, capsys):
    from jaxinfer import cli

    rc = cli.main(
        ["generate", "--server", server.address, "fox and dog", "--max-tokens", "5", "--temperature", "0", "--json"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip())
    ref = llm.generate("fox and dog", SamplingParams(max_tokens=5, temperature=0))[0]
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text

    # --cache-salt reaches the server: a prompt's pages are shared with the same salt only.
    ids = ",".join(str(3 + i % 200) for i in range(40))  # two full 16-token pages

    def hits(salt: str) -> int:
        before = server.server.llm.stats()["prefix_cache_hit_tokens"]
        argv = ["generate", "--server", server.address, "--prompt-ids", ids, "--max-tokens", "1", "--json"]
        assert cli.main([*argv, "--cache-salt", salt]) == 0
        capsys.readouterr()
        return server.server.llm.stats()["prefix_cache_hit_tokens"] - before

    hits("cli-tenant-a")
    assert (hits("cli-tenant-b"), hits("cli-tenant-a")) == (0, 32)

    rc = cli.main(["generate", "--server", server.address, "", "--max-tokens", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "INVALID_ARGUMENT" in err and "empty" in err

    # The server's model and engine serve a --server call: local-only flags are refused by name, and
    # an empty --server (an unset $SERVER) does not quietly generate locally.
    rc = cli.main(["generate", "--server", server.address, "hi", "--model", "/elsewhere", "--max-num-seqs", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--model, --max-num-seqs: the server's model and engine settings apply" in err
    assert cli.main(["generate", "--server", "", "hi"]) == 2
    assert "--server must be HOST:PORT" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--timeout", "5"]) == 2
    assert "--timeout applies to --server calls only" in capsys.readouterr().err

    # As locally: a --max-tokens past the wire's int32 runs to the model's length limit, and a
    # refusal the client finds names the flag typed.
    big = ["generate", "--server", server.address, "--prompt-ids", "5,6,7", "--ignore-eos", "--json"]
    assert cli.main([*big, "--max-tokens", str(10**20), "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert (len(out["token_ids"]), out["finish_reason"]) == (128 - 3, "length")  # max_model_len 128
    assert cli.main(["generate", "--server", server.address, "--prompt-ids", "5,99999999999"]) == 2
    assert capsys.readouterr().err.startswith("error: --prompt-ids[1] = 99999999999 is outside")


def _serve(*args: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_serve_cli_metrics_and_sigterm_drain():
    proc = _serve("--metrics-port", "0", "--max-model-len", "64", "--max-num-seqs", "2", "--num-kv-pages", "16")
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+), metrics on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        address, metrics_port = f"127.0.0.1:{m.group(1)}", int(m.group(2))
        with Client(address) as c:
            # Health answers at once: NOT_SERVING while the model loads and compiles.
            early = c.health()
            assert early in ("NOT_SERVING", "SERVING")
            if early == "NOT_SERVING":  # still loading: calls are refused, not queued or hung
                with pytest.raises(ServerError) as e:
                    c.generate("too early", SamplingParams(max_tokens=2))
                assert e.value.code == "UNAVAILABLE" and "loading" in e.value.details
            c.wait_ready(timeout=240)
            assert c.generate("hello", SamplingParams(max_tokens=3)).outputs[0].token_ids
            # A server that stops answering (here: its process frozen) fails the call by keepalive,
            # with no deadline set, instead of leaving it waiting forever.
            with Client(address, keepalive=1) as frozen:
                assert frozen.health() == "SERVING"  # connected
                proc.send_signal(signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    with pytest.raises(ServerError) as e:
                        frozen.generate("anyone there?", SamplingParams(max_tokens=3))
                    assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 30, e.value
                finally:
                    proc.send_signal(signal.SIGCONT)
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            assert 'jaxinfer_requests_total{code="OK",method="Generate"} 1.0' in body
            stream = c.stream("drain me", _long(40))
            got = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            got += list(stream)  # the request in flight finishes
            assert sum(len(d.token_ids) for d in got) == 40 and got[-1].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        reqs = [x for x in lines if x.get("event") == "request"]
        codes = [r["code"] for r in reqs]
        # The frozen client's call reaches the server after its client gave up, or never (a race in
        # the HTTP/2 layer after SIGCONT): a CANCELLED line for it, or none.
        if codes.count("CANCELLED") == 1 and codes.index("CANCELLED") == len(codes) - 2:
            codes.remove("CANCELLED")
        assert codes == (["UNAVAILABLE"] if early == "NOT_SERVING" else []) + ["OK", "OK"]
        assert reqs[-1]["completion_tokens"] == 40
        assert all(r["id"] for r in reqs)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_while_loading_exits_cleanly(sig):
    """Stopped before the model is ready: exit 0 at once (the load thread, inside JAX, used to make
    the interpreter's teardown abort the process). Ctrl-C stops the server as SIGTERM does."""
    proc = _serve("--max-model-len", "64", "--max-num-seqs", "2", "--num-kv-pages", "16")
    try:
        assert "loading the model" in proc.stdout.readline()
        time.sleep(0.5)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        assert "stopped while loading the model" in proc.stdout.read()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_metrics_endpoint_and_stream_interval(llm):
    s = ServerThread(LLM(**ENGINE), metrics_port=0, stream_interval=4)  # fresh counters
    try:
        with Client(s.address) as c:
            c.generate("count me", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            # The first token at once, then messages of 4, and the rest with the end: [1, 4, 4, 2]. A
            # handler that falls behind (a loaded machine) merges what is queued, so messages may end
            # only at those release points.
            p = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
            deltas = list(c.stream("count me", p))
            ends = np.cumsum([len(d.token_ids) for d in deltas]).tolist()
            assert set(ends) <= {1, 5, 9, 11} and ends[-1] == 11, ends
            # Merged deltas keep every token's logprobs, and the prompt's once.
            offline = llm.generate("count me", p)[0]
            assert [t for d in deltas for t in d.token_ids] == offline.outputs[0].token_ids
            streamed = [(lp.token_id, sorted(lp.top)) for d in deltas for lp in d.logprobs]
            assert streamed == [(lp.token_id, sorted(lp.top)) for lp in offline.outputs[0].logprobs]
            assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
            assert len(deltas[0].prompt_logprobs) == len(offline.prompt_logprobs)
            with pytest.raises(ServerError):
                c.generate("", SamplingParams(max_tokens=4))
        # Another service's method of the same name is no call of ours: UNIMPLEMENTED, and not counted
        # as received (it was, by its bare name).
        with grpc.insecure_channel(s.address) as channel:
            for path in (
                "/nope.Service/Generate",
                "/grpc.health.v1.Health/Generate",
                "/jetstream_proto.Orchestrator/Generate",
            ):
                with pytest.raises(grpc.RpcError) as e:
                    channel.unary_unary(path)(b"", timeout=10)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, path
        body = urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
        for name in (
            "jaxinfer_time_to_first_token_seconds_bucket",
            "jaxinfer_inter_token_latency_seconds_bucket",
            "jaxinfer_request_latency_seconds_bucket",
            "jaxinfer_queue_depth",
            "jaxinfer_running_sequences",
            "jaxinfer_kv_pages_used",
            "jaxinfer_kv_pages_free",
            "jaxinfer_prefix_cache_hit_tokens_total",
            "jaxinfer_preemptions_total",
        ):
            assert name in body, name
        assert 'jaxinfer_requests_total{code="OK",method="Generate"} 1.0' in body
        assert 'jaxinfer_requests_total{code="INVALID_ARGUMENT",method="Generate"} 1.0' in body
        assert 'jaxinfer_requests_total{code="OK",method="GenerateStream"} 1.0' in body
        assert re.search(r"^jaxinfer_generation_tokens_total 15\.0$", body, re.M)
        # Counted on arrival too (a call ended by its deadline before its handler ran counts only here).
        assert 'jaxinfer_requests_received_total{method="Generate"} 2.0' in body
        assert 'jaxinfer_requests_received_total{method="GenerateStream"} 1.0' in body
    finally:
        s.stop()


def test_stream_interval_holds_each_samples_tokens_until_it_has_enough():
    """`RequestStream._offer` alone (the server test above allows for a handler that lags, so it
    cannot tell a stream held back to one message from a prompt one): with interval 4, each sample's
    first token goes at once, then messages of 4, and the end with whatever is left; a delta with no
    token before the first is passed on and does not count as the start; samples do not mix."""
    from jaxinfer.llm import StreamDelta
    from serving.async_engine import RequestStream

    stream = RequestStream(
        request_id="r", prompt_ids=[1], params=SamplingParams(n=2), arrival=0.0, queue=asyncio.Queue(), interval=4
    )
    offered = [StreamDelta(token_ids=[], text="", index=1)]
    for i in range(11):
        offered.append(StreamDelta(token_ids=[i], text=f"{i} ", finish_reason="length" if i == 10 else None))
        if i < 3:
            offered.append(
                StreamDelta(token_ids=[100 + i], text="x", index=1, finish_reason="stop" if i == 2 else None)
            )
    for d in offered:
        stream._offer(d)
    sent = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    got = [(d.index, d.token_ids, d.finish_reason) for d in sent]
    assert got == [
        (1, [], None),
        (0, [0], None),
        (1, [100], None),
        (1, [101, 102], "stop"),
        (0, [1, 2, 3, 4], None),
        (0, [5, 6, 7, 8], None),
        (0, [9, 10], "length"),
    ]
    assert "".join(d.text for d in sent if d.index == 0) == "".join(f"{i} " for i in range(11))
    assert stream.held == {}


def test_load_generator_figures_on_fixed_outcomes(monkeypatch):
    """The serve bench's figures against hand counts on made-up outcomes (its smoke run can only
    check signs): TTFT from arrival, TPOT over the gaps after the first token, errors by code,
    Poisson arrivals at the asked rate, and the round comparison (served / offline, the warm-up
    round left out of the median, identical outputs counted over every round)."""
    import argparse

    from serving import loadgen
    from serving.loadgen import Outcome

    outcomes = [
        Outcome(sent=1.0, arrival=0.0, first=2.0, done=6.0, tokens=[5] * 5),
        Outcome(sent=0.0, arrival=0.0, first=1.0, done=3.0, tokens=[5] * 3),
        Outcome(sent=0.0, arrival=0.0, first=0.5, done=0.5, tokens=[5]),  # one token: no gap, no TPOT
        Outcome(sent=0.5, code="RESOURCE_EXHAUSTED"),
        Outcome(sent=float("nan"), code="NOT SENT"),
    ]
    got = loadgen.summarize(outcomes, wall=10.0)
    assert (got["requests_ok"], got["output_tokens"], got["output_tokens_per_s"]) == (3, 9, 0.9)
    assert (got["ttft_p50_s"], got["tpot_p50_s"], got["tpot_p99_s"]) == (1.0, 1.0, 1.0)
    assert got["errors"] == {"RESOURCE_EXHAUSTED": 1, "NOT SENT": 1}

    args = argparse.Namespace(
        prompt_len_range=[4, 8], output_len_range=[2, 4], num_requests=4000, request_rate=50.0, vs_offline=False
    )
    gaps = np.diff([0.0, *loadgen.workload(args, vocab_size=100)[2]])
    assert (gaps >= 0).all() and gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: as wide as its mean

    served_rates = iter([10.0, 30.0, 20.0])  # warm-up, round 1, round 2; offline 10 each time
    wrong_round = 1  # one output differs from offline in round 1 only
    order = []

    def serve_round(prompts, params, arrivals):
        order.append("served")
        served = {"output_tokens_per_s": next(served_rates), "errors": {}}
        return [Outcome(sent=0.0, tokens=[1]) for _ in prompts], served

    rounds = iter(range(3))

    def offline_run(llm, prompts, params):
        order.append("offline")
        r = next(rounds)
        ids = [[2] if r == wrong_round and i == 0 else [1] for i in range(len(prompts))]
        return {"output_tokens_per_s": 10.0, "token_ids": ids}

    monkeypatch.setattr(loadgen, "_offline_run", offline_run)
    args = argparse.Namespace(
        prompt_len_range=[4, 8],
        output_len_range=[2, 4],
        num_requests=3,
        request_rate=float("inf"),
        vs_offline=True,
        repeats=2,
    )
    report, _ = loadgen._compare(args, 100, serve_round, llm=None)
    assert report["ratio"] == 2.5 and report["warmup_ratio"] == 1.0  # median of 3.0 and 2.0
    assert report["identical_outputs"] == 2
    assert order == ["served", "offline", "offline", "served", "served", "offline"]  # who goes first alternates


def _bench_args(argv):
    from jaxinfer import cli

    return cli._parser().parse_args(["bench", *argv])  # as `jaxinfer bench` parses them


def test_bench_serve_starts_its_server_as_it_configures_the_offline_engine():
    """The served and offline sides of `bench serve --vs-offline` compare the same engine: every
    workload and capacity flag reaches both, through the server's own command line (a flag dropped on
    the way would compare, say, bfloat16 served against float32 offline)."""
    from jaxinfer import cli
    from serving import loadgen, main

    def both(*flags):
        args = _bench_args(["serve", "--num-requests", "9", *flags])
        served = main.server_config(cli._parser().parse_args(loadgen.serve_argv(args, "DIR", 77)))
        return args, served, loadgen.offline_kwargs(args, "DIR", 77)

    flags = ["--dtype", "bfloat16", "--max-num-seqs", "5", "--max-num-batched-tokens", "48", "--concurrency", "3"]
    for prefix in ([], ["--prefix-caching"]):
        args, served, offline = both(*flags, "--stream-interval", "4", *prefix)
        assert (served.host, served.port, served.model, served.dtype) == ("127.0.0.1", 0, "DIR", "bfloat16")
        assert (served.max_queued_requests, served.stream_interval) == (9, 4)  # every request queued at once
        engine = {k: served.engine[k] for k in offline if k not in ("model", "dtype")}
        assert engine == {k: v for k, v in offline.items() if k not in ("model", "dtype")} | {"max_num_seqs": 5}
        assert (offline["model"], offline["dtype"], offline["max_model_len"]) == ("DIR", "bfloat16", 77)
        assert offline["max_num_batched_tokens"] == 48 and offline["enable_prefix_caching"] == bool(prefix)
        # The server runs at most --concurrency requests at once, as it is only ever sent that many.
        assert offline["max_num_seqs"] == 3
    assert both("--max-num-seqs", "2")[2]["max_num_seqs"] == 2


def test_bench_serve_workload_spans_its_ranges_and_ignores_eos():
    """Prompt and output lengths are drawn from the closed ranges (a range of one value included),
    and every request is greedy with EOS ignored, so its output length is the work asked for."""
    from serving import loadgen

    args = _bench_args(["serve", "--num-requests", "400", "--prompt-len-range", "2,4", "--output-len-range", "5,6"])
    prompts, params, arrivals = loadgen.workload(args, vocab_size=50)
    assert {len(p) for p in prompts} == {2, 3, 4} and {p.max_tokens for p in params} == {5, 6}
    assert all(p.temperature == 0.0 and p.ignore_eos for p in params) and arrivals == [0.0] * 400
    assert all(3 <= t < 50 for p in prompts for t in p)
    args = _bench_args(["serve", "--num-requests", "3", "--prompt-len-range", "7", "--output-len-range", "2"])
    prompts, params, _ = loadgen.workload(args, vocab_size=50)
    assert [len(p) for p in prompts] == [7] * 3 and [p.max_tokens for p in params] == [2] * 3


def test_load_generator_keeps_to_its_concurrency_and_counts_errors_by_code(server):
    """drive() on the server: never more than --concurrency streams open at once; TTFT counts from
    the arrival, so a request that waited for a slot has its wait in it; a refused request is counted
    under its gRPC code."""
    from serving import loadgen

    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = [5, 10**6]  # a token id outside the vocabulary: INVALID_ARGUMENT
    engine = server.server.llm.engine
    real_step = engine.step
    engine.step = lambda: (time.sleep(0.01), real_step())[1]
    try:
        outcomes, wall = asyncio.run(
            loadgen.drive(server.address, [[5, 6]] * 4 + [bad], [long] * 5, [0.0] * 5, concurrency=2, duration_limit=60)
        )
    finally:
        del engine.step
    assert [o.code for o in outcomes] == ["OK"] * 4 + ["INVALID_ARGUMENT"]
    assert all(len(o.tokens) == 12 for o in outcomes[:4])
    ends = [o.done if o.done is not None else o.sent for o in outcomes]
    open_at = [sum(o.sent <= t < e for o, e in zip(outcomes, ends)) for t in (o.sent for o in outcomes)]
    assert max(open_at) == 2, open_at
    start = outcomes[0].arrival
    assert all(o.arrival == start <= o.sent for o in outcomes)
    waited = max(outcomes[:4], key=lambda o: o.sent)  # sent only when an earlier one finished
    assert waited.sent - start > 0.1 and waited.first - waited.arrival > waited.sent - waited.arrival
    assert loadgen.summarize(outcomes, wall)["errors"] == {"INVALID_ARGUMENT": 1}
    stats = server.wait_idle()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_load_generator_times_the_first_token_at_its_first_message(server, monkeypatch):
    """TTFT ends at the first message that carries tokens, not a later one. A clock that ticks once per
    reading makes the readings countable: the first token message is read once, then the end; a later
    message read again would push `first` past the first token (the engine is slowed so that each
    token is a message of its own)."""
    from serving import loadgen

    class Ticks:
        now = 0.0

        @classmethod
        def perf_counter(cls):
            cls.now += 1.0
            return cls.now

    monkeypatch.setattr(loadgen, "time", Ticks)
    engine = server.server.llm.engine
    real_step = engine.step
    engine.step = lambda: (time.sleep(0.02), real_step())[1]
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outcomes, _ = asyncio.run(
            loadgen.drive(server.address, [[5, 6]], [params], [0.0], concurrency=1, duration_limit=60)
        )
        (o,) = outcomes
    finally:
        del engine.step
    assert o.code == "OK" and len(o.tokens) == 6
    assert (o.first - o.sent, o.done - o.first) == (1.0, 1.0)


def test_bench_serve_drives_a_given_server(server, capsys):
    """`bench serve --server` at a server that is already SERVING drives it (no wait, no refusal)."""
    from jaxinfer import cli

    args = ["bench", "serve", "--server", server.address, "--num-requests", "5", "--concurrency", "2"]
    args += ["--prompt-len-range", "3,9", "--output-len-range", "2,5", "--json"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["served"]["requests_ok"] == 5 and report["errors"] == {}
    assert 2 * 5 <= report["served"]["output_tokens"] <= 5 * 5
    stats = server.wait_idle()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_bench_serve_waits_for_a_given_server_still_loading():
    """`--server` at a `jaxinfer serve` still loading its model (NOT_SERVING): the bench waits for
    SERVING; it has no process of its own to watch."""
    from serving import loadgen

    answers = iter(["NOT_SERVING", "NOT_SERVING", "SERVING"])

    class Loading:
        target = "127.0.0.1:1"

        def health(self):
            return next(answers)

    loadgen._wait_serving(Loading(), None)  # two polls, 0.2 s apart
    assert next(answers, "asked again") == "asked again"


def test_load_generator_stops_at_its_duration_limit(server):
    """drive() on the server: what is open at --duration-limit is cancelled (and aborted in the
    engine), what has not arrived by then is never sent, and the wall time runs from the first send
    to the last finish."""
    from serving import loadgen

    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine = server.server.llm.engine
    real_step = engine.step
    engine.step = lambda: (time.sleep(0.02), real_step())[1]  # 120 tokens: 2.4 s, past the 1 s limit
    t = time.perf_counter()
    try:
        outcomes, wall = asyncio.run(
            loadgen.drive(
                server.address,
                [[5, 6, 7]] * 3,
                [short, _long(120), short],
                [0.0, 0.0, 30.0],
                concurrency=4,
                duration_limit=1.0,
            )
        )
    finally:
        del engine.step  # the class's own again
    assert 1.0 <= time.perf_counter() - t < 1.9  # cancelled at the limit, not a second later
    assert [o.code for o in outcomes] == ["OK", "CANCELLED (duration limit)", "NOT SENT"]
    # Each step sleeps 20 ms: by the 1 s limit no more than ~50 tokens can have been made.
    assert len(outcomes[0].tokens) == 2 and 0 < len(outcomes[1].tokens) <= 55
    assert wall == outcomes[0].done - min(outcomes[0].sent, outcomes[1].sent)
    stats = server.wait_idle()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_bench_serve_smoke(capsys):
    from jaxinfer import cli

    args = ["bench", "serve", "--model", default_model.TINY_RANDOM, "--num-requests", "8"]
    args += ["--prompt-len-range", "4,24", "--output-len-range", "2,9"]
    # --concurrency below --max-num-seqs: the offline engine is capped to 3 as well (same work on both sides).
    args += ["--max-num-seqs", "4", "--concurrency", "3", "--vs-offline", "--json"]
    # A --duration-limit shorter than the server's start (~20 s here) bounds the load, not the wait
    # for SERVING (which it used to cut short: "not SERVING after 8 s").
    args += ["--repeats", "1", "--duration-limit", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["served"]["requests_ok"] == 8 and report["served"]["errors"] == {}
    assert report["identical_outputs"] == 8  # served over gRPC == offline, token for token
    assert report["served"]["output_tokens"] == report["offline"]["output_tokens"] > 0
    assert report["ratio"] > 0 and "served / offline" in out
    assert len(report["rounds"]) == 1  # the measured round, after an uncounted warm-up round
    assert all(r["identical_outputs"] == 8 for r in report["rounds"])


def test_bench_serve_says_at_once_when_nothing_answers(capsys):
    """--server at a port nobody listens on: an error naming it (exit 2, a usage error's), not a
    silent --duration-limit wait."""
    from jaxinfer import cli

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    t = time.monotonic()
    assert cli.main(["bench", "serve", "--server", address, "--num-requests", "2", "--duration-limit", "300"]) == 2
    assert f"error: --server {address}: nothing answers there" in capsys.readouterr().err
    assert time.monotonic() - t < 60


def test_drain_refuses_new_calls_and_finishes_old_ones():
    llm = LLM(**ENGINE)
    s = ServerThread(llm)
    gate = threading.Event()  # holds the steps while the drain starts; 300 s: a backstop only (`finally`)
    step = llm.engine.step
    llm.engine.step = lambda: (gate.wait(300), step())[1]
    # A call that passed the serving check as the drain started: held in its tokenization meanwhile.
    tokenizing, tokenize = threading.Event(), s.server._tokenize

    def held_tokenize(text, *args, **kw):
        if text == "late":
            tokenizing.set()
            gate.wait(300)
        return tokenize(text, *args, **kw)

    s.server._tokenize = held_tokenize
    try:
        # A deadline on every call: admitted where it should be refused, a call would wait on the
        # gate (and the test hang) instead of failing.
        with (
            Client(s.address, timeout=60) as c,
            grpc.insecure_channel(s.address) as ch,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            stub = pb_grpc.InferenceServiceStub(ch)
            req = pb.GenerateRequest(text="old", sampling_params=pb.SamplingParams(max_tokens=12, ignore_eos=True))
            old = stub.GenerateStream(req)
            while s.server.async_engine.num_in_flight < 1:
                time.sleep(0.01)
            late = pool.submit(stub.Generate, pb.GenerateRequest(text="late"), timeout=60)
            assert tokenizing.wait(30)
            stopping = asyncio.run_coroutine_threadsafe(s.server.stop(drain_timeout=30), s.loop)
            while s.server.state != "draining":
                time.sleep(0.01)
            assert c.health() == "NOT_SERVING"
            jetstream = js_grpc.OrchestratorStub(ch)
            assert jetstream.HealthCheck(js.HealthCheckRequest(), timeout=5).is_live is False  # JetStream's own check
            with pytest.raises(ServerError) as e:
                c.generate("new", SamplingParams(max_tokens=2))
            assert e.value.code == "UNAVAILABLE" and "draining" in e.value.details
            with pytest.raises(ServerError) as e:
                c.tokenize("new")
            assert e.value.code == "UNAVAILABLE" and "draining" in e.value.details
            gate.set()
            assert sum(len(m.token_ids) for m in old) == 12  # the old request ran to its end
            with pytest.raises(grpc.RpcError) as e:  # refused at admission, not served or aborted in the drain
                late.result(30)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
            assert stopping.result(30) is True  # drained in time
    finally:
        gate.set()
        s.loop.call_soon_threadsafe(s.loop.stop)


def test_drain_timeout_ends_what_is_left_with_abort(caplog):
    """Requests still running or queued when the drain time is up end with finish reason 'abort' (a
    message the client can read), at once: not cut off by the transport seconds later. One that never
    left the queue is logged with no TTFT: the abort made no token."""
    llm = LLM(**ENGINE | {"max_num_seqs": 1})
    s = ServerThread(llm)
    step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.05), step())[1]  # 100 tokens take ~5 s
    caplog.set_level("INFO", logger="jaxinfer.serving")
    try:
        with grpc.insecure_channel(s.address) as ch:
            params = pb.SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)
            stub = pb_grpc.InferenceServiceStub(ch)
            stream = stub.GenerateStream(pb.GenerateRequest(text="left over", sampling_params=params), timeout=60)
            got = [next(stream)]
            queued = stub.GenerateStream(pb.GenerateRequest(text="queued", sampling_params=params), timeout=60)
            while s.server.async_engine.num_in_flight < 2:
                time.sleep(0.01)
            t0 = time.monotonic()
            assert s.run(s.server.stop(drain_timeout=0.3)) is False  # not drained in time
            got += list(stream)
            assert time.monotonic() - t0 < 3
            made = sum(len(m.token_ids) for m in got)
            assert got[-1].finish_reason == pb.FINISH_REASON_ABORT and 0 < made < 100
            assert got[-1].usage.completion_tokens == made  # the abort itself is no token
            (last,) = list(queued)
            assert last.finish_reason == pb.FINISH_REASON_ABORT and not last.token_ids
        assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
        lines = [json.loads(r.message) for r in caplog.records if r.message.startswith("{")]
        assert sorted((x["completion_tokens"], x["ttft_s"] is None) for x in lines) == [(0, True), (made, False)]
        assert "drain time (0.3 s) is up: aborting 2 requests" in caplog.text
        with Client(s.address) as c:
            assert c.health() == "UNREACHABLE"  # stop() closed the port
    finally:
        s.loop.call_soon_threadsafe(s.loop.stop)


CLIENT_THAT_DIES = """
import sys, grpc
ch = grpc.insecure_channel(sys.argv[1])
call = ch.unary_stream("/jaxinfer.v1.InferenceService/GenerateStream",
                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
for _ in call(bytes.fromhex(sys.argv[2])):
    print("got a message", flush=True)
    input()  # blocks: the test kills this process here, mid-stream
"""


def test_client_disconnect_frees_pages(server, caplog):
    caplog.set_level("INFO", logger="jaxinfer.serving")
    aborted = _aborted(server)
    req = pb.GenerateRequest(
        request_id="dies", text="bye", sampling_params=pb.SamplingParams(max_tokens=100, ignore_eos=True)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_THAT_DIES, server.address, req.SerializeToString().hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "got a message"
        proc.kill()  # no cancel, no goodbye: the connection just drops
        proc.wait(10)
        stats = server.wait_idle(timeout=20)
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        assert _aborted(server) == aborted + 1
        assert _wait_for_log(caplog, lambda x: x["client_request_id"] == "dies")["code"] == "CANCELLED"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_port_in_use_is_a_clear_error(server):
    async def start():
        return await Server(ServerConfig(port=server.port)).start()

    with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{server.port}: the port is in use"):
        asyncio.run(start())


def test_every_serve_flag_reaches_the_server_config():
    """A flag dropped between the command line and the server would leave it at its default without
    a word: each is set here to something other than its default. The ranges admit their edges: no
    queue beyond --max-num-seqs, and a stop that does not wait."""
    from jaxinfer import cli
    from serving import main
    from serving.server import ServerConfig

    argv = ["serve", "--model", "m", "--dtype", "bfloat16", "--host", "::1", "--port", "7", "--metrics-port", "8"]
    argv += ["--max-queued-requests", "0", "--drain-timeout", "0", "--stream-interval", "3", "--max-num-seqs", "4"]
    argv += ["--generation-config", "none", "--warmup-prompt-logprobs", "--peer-timeout", "5"]
    argv += ["--peer-startup-timeout", "6", "--max-response-bytes", "5000"]
    args = cli._parser().parse_args(argv)
    main.check_flags(args)
    config = main.server_config(args)
    assert config.engine == cli.engine_kwargs(args) | {"generation_config": "none"}
    assert config.engine["max_num_seqs"] == 4
    assert config == ServerConfig(
        model="m",
        dtype="bfloat16",
        host="::1",
        port=7,
        metrics_port=8,
        max_queued_requests=0,
        drain_timeout=0.0,
        stream_interval=3,
        max_response_bytes=5000,
        peer_timeout=5.0,
        peer_startup_timeout=6.0,
        warmup_prompt_logprobs=True,
        engine=config.engine,
    )
    # And with no flags, the server's own defaults (the API's, for the engine: tests/test_llm.py).
    defaults = main.server_config(cli._parser().parse_args(["serve"]))
    assert defaults == ServerConfig(engine=defaults.engine | {"generation_config": "auto"})


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARNING", "ERROR"])
def test_log_level_sets_jaxinfers_loggers_and_keeps_other_libraries_at_warning(level, monkeypatch):
    """`--log-level WARNING` silences the per-request lines; other libraries' INFO chatter stays out
    unless DEBUG is asked for."""
    import logging

    from jaxinfer import cli
    from serving import main

    seen = []

    def spy(lvl):
        seen.append(lvl)
        raise KeyboardInterrupt  # stop `run` here: nothing binds or loads

    monkeypatch.setattr(main, "configure_logging", spy)
    with pytest.raises(KeyboardInterrupt):
        main.run(cli._parser().parse_args(["serve", "--log-level", level]))
    assert seen == [level]
    monkeypatch.undo()

    root, ours = logging.getLogger(), logging.getLogger("jaxinfer")
    saved = root.handlers[:], root.level, ours.level
    root.handlers[:] = []  # pytest's own capture handlers would make basicConfig a no-op
    try:
        main.configure_logging(level)
        request_log = logging.getLogger("jaxinfer.serving")
        assert request_log.isEnabledFor(logging.INFO) == (level in ("DEBUG", "INFO"))
        assert request_log.isEnabledFor(logging.ERROR)
        assert logging.getLogger("absl").isEnabledFor(logging.INFO) == (level == "DEBUG")
        assert logging.getLogger("orbax").isEnabledFor(logging.WARNING)
        assert [h.stream for h in root.handlers] == [sys.stderr]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])  # setLevel, not the attribute: it clears the loggers' level caches
        ours.setLevel(saved[2])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stream-interval", "0"], "--stream-interval must be in [1, 1000000], got 0"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be in [0, 1000000], got -1"),
        (["--drain-timeout", "inf"], "--drain-timeout must be a finite number of seconds >= 0, got inf"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a finite number of seconds >= 0, got -1.0"),
        (["--peer-timeout", "inf"], "--peer-timeout must be a finite number of seconds > 0, got inf"),
        (["--peer-startup-timeout", "0"], "--peer-startup-timeout must be a finite number of seconds > 0, got 0.0"),
        (["--metrics-port", "65536"], "--metrics-port must be in [0, 65535], got 65536"),
        (["--max-response-bytes", "1000"], "--max-response-bytes must be in [1024, 2147483647], got 1000"),
    ],
)
def test_serve_flags_out_of_range_are_named(flags, message):
    from jaxinfer import cli
    from serving import main

    with pytest.raises(InvalidRequestError) as e:
        main.check_flags(cli._parser().parse_args(["serve", *flags]))
    assert str(e.value) == message


def test_only_loopback_hosts_count_as_private():
    """`serve` warns when bound beyond this machine, and a multi-host coordinator listens on loopback
    only where its address is there: any loopback address is private, names and wildcards are not."""
    from jaxinfer.distributed import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.7", "example.com", "localhost.example.com"]))


def test_serve_on_a_port_in_use_is_one_error_line():
    """Checked before gRPC binds: gRPC's own log line ("Failed to add port") came first, then ours."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "jaxinfer.cli",
            "serve",
            "--model",
            default_model.TINY_RANDOM,
            "--port",
            str(port),
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: cannot bind 127.0.0.1:{port}: the port is in use"


def test_metrics_port_in_use_is_a_clear_error(server):
    """--metrics-port taken: the message names the flag, the address and the reason; the gRPC port it
    had bound is released, and `jaxinfer serve` exits 2 without asyncio's teardown noise."""
    taken = server.port  # the module server's gRPC port: in use
    expected = f"--metrics-port {taken}: cannot listen on 127.0.0.1:{taken} (address already in use)"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        grpc_port = sock.getsockname()[1]  # free: for the gRPC server the failed start must not keep

    async def start():
        return await Server(ServerConfig(port=grpc_port, metrics_port=taken)).start()

    with pytest.raises(OSError, match=re.escape(expected)):
        asyncio.run(start())
    with socket.socket() as sock:  # nothing left bound
        sock.bind(("127.0.0.1", grpc_port))

    proc = _serve("--metrics-port", str(taken))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert err.strip() == f"error: {expected}", err
    assert "Exception ignored" not in err and "never awaited" not in err


def test_serve_load_failure_is_one_error_line_in_flag_names():
    """A size the model refuses (known only once it loads): one structured log line for log readers,
    one `error:` line naming the flag (it printed the API's `max_model_len` twice), status 2."""
    proc = _serve("--max-model-len", "5000")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --max-model-len must be an integer in [2, 1024 for this model], got 5000"], err
    (logged,) = [json.loads(x) for x in err.splitlines() if x.startswith('{"event": "load_failed"')]
    assert (
        logged["error"] == "InvalidRequestError: max_model_len must be an integer in [2, 1024 for this model], got 5000"
    )


@pytest.mark.parametrize("where", ["warmup", "engine thread"])
def test_a_load_that_fails_late_fails_the_server_instead_of_hanging_it(monkeypatch, capsys, where):
    """Two ways the server stayed "loading" for good, answering every call UNAVAILABLE "retry soon":
    - the load thread hands its error to the event loop in a future, and a future refuses
      StopIteration (a stray `next()` raises it; found when a mutated sampling-device lookup raised
      it in a multi-host leader, which then waited 35 minutes until killed);
    - starting the engine's thread after the load raised in the loading task, whose error nobody saw.
    """
    from jaxinfer import cli
    from serving import async_engine

    llm = LLM(**ENGINE)

    def fail(*args, **kw):
        raise StopIteration("no device of this process in the mesh")

    if where == "warmup":
        monkeypatch.setattr(llm.engine, "warmup", fail)
        message = "StopIteration: no device"
    else:
        monkeypatch.setattr(llm.engine, "warmup", lambda **kw: 0)  # nothing to wait for
        monkeypatch.setattr(async_engine.AsyncEngine, "start", lambda self: fail())
        message = "no device"
    server = Server(ServerConfig(port=0), llm=llm)

    async def go():
        await server.start()
        try:
            await asyncio.wait_for(server.ready.wait(), 30)
            async with AsyncClient(f"127.0.0.1:{server.port}", timeout=10) as c:
                health = await c.health()
                with pytest.raises(ServerError, match=f"UNAVAILABLE: the server cannot serve: {message}"):
                    await c.generate("hi")
            # `jaxinfer generate --server` says the same: the server answers, so not "nothing answers there".
            argv = ["generate", "--server", f"127.0.0.1:{server.port}", "hi"]
            assert await asyncio.to_thread(cli.main, argv) == 2
            err = capsys.readouterr().err
            assert f"the server cannot serve: {message}" in err and "nothing answers" not in err
        finally:
            await server.stop()
        return health

    assert asyncio.run(go()) == "NOT_SERVING"
    assert server.state == "stopped"


JETSTREAM_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # JetStream's own published stubs

stub = jetstream_pb2_grpc.OrchestratorStub(grpc.insecure_channel(sys.argv[2]))
live = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
ids = [int(x) for x in sys.argv[3].split(",")]
req = jetstream_pb2.DecodeRequest(max_tokens=7, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids))
by_ids = [[list(s.token_ids) for s in r.stream_content.samples] for r in stub.Decode(req, timeout=60)]
req = jetstream_pb2.DecodeRequest(max_tokens=7, text_content=jetstream_pb2.DecodeRequest.TextContent(text=sys.argv[4]))
by_text = [[s.text for s in r.stream_content.samples] for r in stub.Decode(req, timeout=60)]
print(json.dumps({"live": live, "by_ids": by_ids, "by_text": by_text}))
"""


@pytest.fixture(scope="module")
def jetstream_wheel(tmp_path_factory):
    """JetStream's published wheel, unpacked (downloaded from the package index, not vendored)."""
    import zipfile

    d = tmp_path_factory.mktemp("jetstream")
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "google-jetstream==0.2.2", "--no-deps", "-d", str(d), "-q"],
            check=True,
            timeout=180,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"JetStream's published wheel could not be downloaded from the package index: {e}")
    (wheel,) = d.glob("*.whl")
    zipfile.ZipFile(wheel).extractall(d / "site")
    return d / "site"


def test_jetstream_published_client(server, llm, jetstream_wheel):
    """JetStream's own generated stubs (google-jetstream 0.2.2), in their own process, against us."""
    ids = llm.tokenizer.encode("the quick fox")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            JETSTREAM_CLIENT,
            str(jetstream_wheel),
            server.address,
            ",".join(map(str, ids)),
            "the quick fox",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ref = llm.generate("the quick fox", SamplingParams(max_tokens=7, temperature=0))[0]
    assert got["live"] is True
    assert all(len(m) == 1 for m in got["by_ids"]) and [t for m in got["by_ids"] for t in m[0]] == ref.token_ids
    assert all(len(m) == 1 for m in got["by_text"]) and "".join(m[0] for m in got["by_text"]) == ref.text


def _one_row_llm(*, eos: int | None = None, tokenizer=None) -> LLM:
    """The tiny random model, one row at a time, its engine rebuilt with another EOS or tokenizer."""
    from jaxinfer.engine import Engine

    sizes = dict(max_model_len=64, num_kv_pages=8, max_num_seqs=1, max_num_batched_tokens=16)
    small = LLM(default_model.TINY_RANDOM, **sizes)
    if eos is not None:
        small.cfg = dataclasses.replace(small.cfg, eos_token_ids=(eos,))
    if tokenizer is not None:
        small.tokenizer = tokenizer
    small.engine = Engine(small.cfg, small.params, small.tokenizer, **sizes)
    return small


def test_jetstream_never_sends_the_stop_token(llm):

    # The tiny random model greedily echoes one token; make that token its EOS. A server that
    # forwarded the stop token would then send it; a correct one ends the stream with nothing.
    prompt = llm.tokenizer.encode("the lazy dog")
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[prompt], sampling_params=free)[0].token_ids
    eos = ref[0]
    expected = ref[: ref.index(eos)]
    s = ServerThread(_one_row_llm(eos=eos))
    try:
        stub = js_grpc.OrchestratorStub(grpc.insecure_channel(s.address))
        req = js.DecodeRequest(max_tokens=6, token_content=js.DecodeRequest.TokenContent(token_ids=prompt))
        msgs = list(stub.Decode(req, timeout=60))
        assert all(eos not in m.stream_content.samples[0].token_ids for m in msgs)
        assert all(m.stream_content.samples[0].token_ids for m in msgs)  # none left empty by the drop
        assert [t for m in msgs for t in m.stream_content.samples[0].token_ids] == expected
        assert s.server.llm.stats()["finished_sequences"]["stop"] == 1  # it did stop on EOS
    finally:
        s.stop()


def test_jetstream_text_mode_sends_ids_that_make_no_text(llm):
    """Text in, but the tokens made have no text (special tokens skipped in the text, as a chat
    model's markers are): their ids still reach the client, in one message at the end."""
    from jaxinfer.tokenizer import ByteTokenizer

    echoed = llm.generate("the lazy dog", SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]

    class Skipping(ByteTokenizer):  # the echoed byte as a special token
        def __init__(self):
            super().__init__()
            self.skipped_ids = self.skipped_ids | {echoed}

    s = ServerThread(_one_row_llm(tokenizer=Skipping()))
    try:
        stub = js_grpc.OrchestratorStub(grpc.insecure_channel(s.address))
        req = js.DecodeRequest(max_tokens=5, text_content=js.DecodeRequest.TextContent(text="the lazy dog"))
        msgs = list(stub.Decode(req, timeout=60))
        assert [(m.text, list(m.token_ids)) for x in msgs for m in x.stream_content.samples] == [("", [echoed] * 5)]
    finally:
        s.stop()


@pytest.mark.parametrize("stop_reason", [0, 7, "END", None])
def test_stop_reason_crosses_the_wire_as_set(stop_reason):
    """Token id 0 is a stop reason too (a pad or <unk> named in stop_token_ids), not "none"."""
    from jaxinfer.client import _stop_reason
    from serving import wire

    for msg in (pb.Completion(), pb.GenerateStreamResponse()):
        wire.set_stop_reason(msg, stop_reason)
        assert _stop_reason(type(msg).FromString(msg.SerializeToString())) == stop_reason


def test_every_sampling_param_crosses_the_wire_as_sent():
    """The client's message read back by the server is the SamplingParams the caller made, for every
    field set away from its default (a field the proto lacks, or the server's reader skips, fails)."""
    from jaxinfer.client import _params
    from serving import wire

    p = SamplingParams(
        max_tokens=9,
        min_tokens=2,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=4,
        stop=["a"],
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        ignore_eos=True,
        skip_special_tokens=False,
        logprobs=3,
        prompt_logprobs=2,
        n=2,
        truncate_prompt_tokens=-1,
        logit_bias={5: 1.5},
        allowed_token_ids=[1, 2, 3],
        bad_words=["x"],
    )
    defaults = SamplingParams()
    assert [f.name for f in dataclasses.fields(p) if getattr(p, f.name) == getattr(defaults, f.name)] == []
    assert wire.sampling_params(_params(p)) == p
    assert wire.sampling_params(_params(defaults)) == defaults
    # ModelInfo.default_sampling_params: just the fields given (the checkpoint's generation_config).
    given = {
        f: getattr(p, f) for f in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "top_k")
    }
    msg = wire.sampling_fields_proto(given)
    assert {f.name for f, _ in msg.ListFields()} == set(given)
    assert wire.sampling_params(msg) == dataclasses.replace(defaults, **given)


def test_warmup_prompt_logprobs_leaves_nothing_to_compile():
    """--warmup-prompt-logprobs: the warm-up compiles the prompt-logprobs programs too, so a request
    with prompt_logprobs compiles nothing (by default the first at each prefill shape compiles one)."""
    jax.clear_caches()  # programs another test compiled would hide a missing warm-up
    small = dict(ENGINE, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_pages=16)
    s = ServerThread(LLM(**small), warmup_prompt_logprobs=True)
    try:
        before = s.server.llm.stats()["num_compiles"]
        p = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
        with Client(s.address) as c:
            outs = [c.generate(prompt_token_ids=list(range(5, 5 + n)), sampling_params=p) for n in (40, 20, 7)]
        assert [len(o.prompt_logprobs) for o in outs] == [40, 20, 7]
        assert s.server.llm.stats()["num_compiles"] == before
    finally:
        s.stop()


def test_truncating_texts_of_calls_that_ended_are_never_tokenized(server):
    """A truncating request's text is tokenized (whatever its size) on a pool of its own: work queued
    for calls that ended meanwhile (here: deadlines) is dropped unrun, not done for nobody while
    later calls, and the server's shutdown, wait behind it."""
    from serving.server import _TOKENIZE_THREADS

    started = []
    real = server.server._tokenize

    def slow(*args, **kwargs):
        started.append(args[0][:1])
        time.sleep(0.5)  # a few megabytes' worth
        return real(*args, **kwargs)

    server.server._tokenize = slow
    try:
        p = SamplingParams(max_tokens=2, truncate_prompt_tokens=8)
        with Client(server.address) as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(c.generate, f"{i} some text", p, timeout=0.1) for i in range(8)]
            codes = [f.exception(timeout=30).code for f in calls]
        assert codes == ["DEADLINE_EXCEEDED"] * 8
        time.sleep(1.2)  # what started has finished; nothing else starts
        assert 1 <= len(started) <= _TOKENIZE_THREADS, started
    finally:
        server.server._tokenize = real
    server.wait_idle()
    with Client(server.address) as c:  # and the pool serves the next call
        assert len(c.generate("a fine prompt", p).prompt_token_ids) == 8
