"""Clients of `jaxinfer serve`: `Client` (blocking) and `AsyncClient` (asyncio).

Both speak jaxinfer.v1 and return the types of the offline API - `RequestOutput` from `generate`,
`StreamDelta`s from `stream` - so code moves between `LLM` and a server by changing one line:

    from jaxinfer.client import Client
    with Client("127.0.0.1:9000") as c:
        print(c.generate("In the beginning", SamplingParams(max_tokens=32)).text)

A refused or failed call raises `ServerError` with the gRPC status code and the server's message.
Leaving a `stream` early cancels the RPC, which aborts the request on the server.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.engine import Logprob
from jaxinfer.errors import InvalidRequestError, JaxinferError
from jaxinfer.llm import CompletionOutput, RequestOutput, StreamDelta
from jaxinfer.sampling import SamplingParams
from jaxinfer.v1 import jaxinfer_pb2 as pb
from jaxinfer.v1 import jaxinfer_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


class ServerError(JaxinferError):
    """The server refused or failed a call. `code` is the gRPC status code's name."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code.name
        self.details = details


def _server_error(e: grpc.RpcError) -> ServerError:
    return ServerError(e.code(), e.details() or "")


def _params(p: SamplingParams | None) -> pb.SamplingParams:
    p = p or SamplingParams()
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=p.n,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def _request(prompt, sampling_params, prompt_token_ids, request_id) -> pb.GenerateRequest:
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompt or prompt_token_ids")
    req = pb.GenerateRequest(sampling_params=_params(sampling_params), request_id=request_id or "")
    if prompt is not None:
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt_token_ids)
    return req


def _logprobs(lps) -> list[Logprob]:
    return [Logprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top}) for lp in lps]


def _output(prompt: str | None, want_logprobs: bool, resp: pb.GenerateResponse) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=c.index,
            token_ids=list(c.token_ids),
            text=c.text,
            finish_reason=_FINISH.get(c.finish_reason, "abort"),
            logprobs=_logprobs(c.logprobs) if want_logprobs else None,
        )
        for c in resp.completions
    ]
    return RequestOutput(
        request_id=resp.request_id, prompt=prompt, prompt_token_ids=list(resp.prompt_token_ids), outputs=outputs
    )


def _delta(msg: pb.GenerateStreamResponse) -> StreamDelta:
    return StreamDelta(
        token_ids=list(msg.token_ids), text=msg.text, finish_reason=_FINISH.get(msg.finish_reason), index=msg.index
    )


def _model_info(msg: pb.ModelInfo) -> dict:
    return {
        f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
    }


# gRPC refuses messages over 4 MiB by default; a valid answer can be larger (n = 64 samples with 20
# logprobs each is ~5 MB), and would otherwise fail only after all its compute was spent.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]


def _check_target(target: str) -> str:
    """A gRPC target ("host:port", or a scheme such as unix:PATH) whose port, if any, is one gRPC can
    reach: it silently wraps 70000 to 4464."""
    if not isinstance(target, str) or not target:
        raise InvalidRequestError(f"server address must be a non-empty string like host:port, got {target!r}")
    port = target.rpartition(":")[2]
    if port.isdigit() and not 0 < int(port) < 65536:
        raise InvalidRequestError(f"server address {target!r}: the port must be in [1, 65535]")
    return target


class Client:
    """A blocking client. `target` is "host:port"; `timeout` (seconds) is each call's deadline."""

    def __init__(self, target: str = "127.0.0.1:9000", *, timeout: float | None = None):
        self.target = _check_target(target)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id)
        try:
            resp = self._stub.Generate(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise _server_error(e) from None
        return _output(prompt, sampling_params is not None and sampling_params.logprobs is not None, resp)

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id)
        call = self._stub.GenerateStream(req, timeout=self.timeout if timeout is None else timeout)
        try:
            for msg in call:
                yield _delta(msg)
        except grpc.RpcError as e:
            raise _server_error(e) from None
        finally:
            call.cancel()  # a no-op once the stream has ended; aborts the request if it has not

    def tokenize(self, text: str) -> list[int]:
        try:
            return list(self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout).token_ids)
        except grpc.RpcError as e:
            raise _server_error(e) from None

    def model_info(self) -> dict:
        try:
            return _model_info(self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise _server_error(e) from None

    def health(self, service: str = "") -> str:
        """The standard health check's answer: "SERVING", "NOT_SERVING", "NOT_FOUND" (a service the
        server does not know), or "UNREACHABLE"."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as e:
            return "NOT_FOUND" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Blocks until the server reports SERVING; raises TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.health() != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} was not SERVING after {timeout:.0f} s")
            time.sleep(0.2)


class AsyncClient:
    """The asyncio twin of `Client` (create and use it inside a running event loop)."""

    def __init__(self, target: str = "127.0.0.1:9000", *, timeout: float | None = None):
        self.target = _check_target(target)
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id)
        try:
            resp = await self._stub.Generate(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise _server_error(e) from None
        return _output(prompt, sampling_params is not None and sampling_params.logprobs is not None, resp)

    async def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id)
        call = self._stub.GenerateStream(req, timeout=self.timeout if timeout is None else timeout)
        try:
            async for msg in call:
                yield _delta(msg)
        except grpc.RpcError as e:
            raise _server_error(e) from None
        finally:
            call.cancel()

    async def tokenize(self, text: str) -> list[int]:
        try:
            resp = await self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _server_error(e) from None
        return list(resp.token_ids)

    async def model_info(self) -> dict:
        try:
            return _model_info(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise _server_error(e) from None

    async def health(self, service: str = "") -> str:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as e:
            return "NOT_FOUND" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        import asyncio

        deadline = time.monotonic() + timeout
        while await self.health() != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} was not SERVING after {timeout:.0f} s")
            await asyncio.sleep(0.2)
