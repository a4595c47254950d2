"""Clients of `jaxinfer serve`: `Client` (blocking) and `AsyncClient` (asyncio).

Both speak jaxinfer.v1 and return the types of the offline API - `RequestOutput` from `generate`,
`StreamDelta`s from `stream` - so code that reads outputs works on either. One difference: a call
takes one prompt (text, or `prompt_token_ids` as one list of ids) and `generate` returns one
RequestOutput, not a list; concurrency is the server's job (send calls from several threads or tasks).

    from jaxinfer.client import Client
    with Client("127.0.0.1:9000") as c:
        print(c.generate("In the beginning", SamplingParams(max_tokens=32)).text)

`generate` and `stream` also take `request_id` (shown in the server's log line) and `cache_salt`:
requests share prefix-cache pages only with requests of the same salt, so a salt per tenant keeps
tenants from probing each other's prompts through the time of cache hits.

A refused or failed call raises `ServerError` with the gRPC status code and the server's message.
Leaving a `stream` early cancels the RPC, which aborts the request on the server. A server that
stops answering (its process frozen, its host gone) is noticed by HTTP/2 keepalive pings: the call
fails with UNAVAILABLE within about twice `keepalive` seconds, instead of waiting forever when no
`timeout` was given. A closed client raises `ClientClosedError`, as does a call its close() ends.

Arguments are checked before any RPC, by the functions both clients share (`_request`, `_seconds`,
`_text`): what the wire cannot carry (an id past int32, a lone surrogate in a string) or what the
offline API refuses (a float or bool as a token id, a bytes prompt) raises `InvalidRequestError`
naming the argument or field, as `LLM` does, never protobuf's or gRPC's own exception.
"""

from __future__ import annotations

import asyncio
import reprlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.errors import InvalidRequestError, JaxinferError
from jaxinfer.limits import check_cache_salt
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta
from jaxinfer.sampling_params import SamplingParams, _is_number, is_finite_number, is_int
from jaxinfer.tokenizer import require_unicode
from jaxinfer.v1 import jaxinfer_pb2 as pb
from jaxinfer.v1 import jaxinfer_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


class ServerError(JaxinferError):
    """The server refused or failed a call. `code` is the gRPC status code's name."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code.name
        self.details = details


class ClientClosedError(JaxinferError):
    """A call on a client after its close(), a stream made before it and read after, or a call in
    flight that the close ended."""


def _server_error(e: grpc.RpcError) -> ServerError:
    return ServerError(e.code(), e.details() or "")


# What each integer field type of the proto can carry: protobuf raises a bare "Value out of range".
_WIRE_INTS = {
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: ("uint32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: ("uint64", 0, 2**64 - 1),
}
INT32_MAX = 2**31 - 1


def _show(value) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _text(value, field: str) -> str:
    """`value` if it is a str that UTF-8 can carry; else InvalidRequestError naming `field`."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string, got {_show(value)}")
    require_unicode(value, field)
    return value


# The longest timeout a call takes: gRPC turns a deadline ~1e10 s away into one already passed (the
# call failed at once with DEADLINE_EXCEEDED, never sent), so a larger one is refused by name.
MAX_TIMEOUT = 1e8  # seconds, about 3 years


def _seconds(
    value, field: str, *, optional: bool = True, default: float | None = None, limit: float = MAX_TIMEOUT
) -> float | None:
    """A positive number of seconds up to `limit` (or None, meaning `default`, when `optional`); else
    InvalidRequestError naming `field`. grpc itself raises a bare TypeError from deep inside."""
    if value is None and optional:
        return default
    if not is_finite_number(value) or value <= 0:
        none = " (or None)" if optional else ""
        raise InvalidRequestError(f"{field} must be a positive number of seconds{none}, got {_show(value)}")
    if value > limit:
        raise InvalidRequestError(f"{field} must be at most {limit:.0f} seconds, got {_show(value)}")
    return float(value)


def _wire_value(field: str, f: FieldDescriptor, value):
    """One value of proto field `f`, checked against the field's wire type and converted to it."""
    if f.type in _WIRE_INTS:
        kind, lo, hi = _WIRE_INTS[f.type]
        if not is_int(value):
            raise InvalidRequestError(f"{field} must be an integer, got {_show(value)}")
        if value > hi:
            raise InvalidRequestError(f"{field} = {value} is beyond the wire format's {kind} limit {hi}")
        if value < lo:
            raise InvalidRequestError(f"{field} = {value} is below the wire format's {kind} limit {lo}")
        return int(value)
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        if not _is_number(value):
            raise InvalidRequestError(f"{field} must be a number, got {_show(value)}")
        return float(value)
    if f.type == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidRequestError(f"{field} must be True or False, got {_show(value)}")
        return bool(value)
    if f.type == FieldDescriptor.TYPE_STRING:
        return _text(value, field)
    raise TypeError(f"the client cannot send {f.full_name} (proto type {f.type})")  # a new kind of field


def _params(p: SamplingParams | None) -> pb.SamplingParams:
    """`p` as the proto, every field checked against its wire type (field by field from the proto's
    descriptor, so a field added to both is covered): SamplingParams checks meaning, not wire limits
    (max_tokens = 2**31 is a fine Python int, but not an int32). None sends no field: the server
    applies the model's defaults, as `LLM.generate` does without SamplingParams."""
    if p is None:
        return pb.SamplingParams()
    if not isinstance(p, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams (or None), got {_show(p)}")
    msg = pb.SamplingParams()
    for f in msg.DESCRIPTOR.fields:
        value, field = getattr(p, f.name), f"sampling_params.{f.name}"
        if f.message_type is not None and f.message_type.GetOptions().map_entry:  # logit_bias
            if value is not None:
                key, val = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                getattr(msg, f.name).update(
                    {
                        _wire_value(f"{field} key", key, k): _wire_value(f"{field}[{k}]", val, v)
                        for k, v in value.items()
                    }
                )
        elif f.is_repeated and value is None:  # allowed_token_ids None: any id
            pass
        elif f.is_repeated:
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise InvalidRequestError(f"{field} must be a list, got {_show(value)}")
            getattr(msg, f.name).extend(_wire_value(f"{field}[{i}]", f, v) for i, v in enumerate(value))
        elif f.name == "max_tokens" and value is None:  # up to the model's length limit: any value past it
            msg.max_tokens = INT32_MAX
        elif value is not None:  # None: unset, the server's default (seed, logprobs)
            setattr(msg, f.name, _wire_value(field, f, value))
    return msg


def _prompt_ids(ids) -> list[int]:
    """One prompt's token ids as a list of ints in [0, INT32_MAX]; refuses what `LLM` refuses (a
    string, bytes, floats, bools, nested lists) instead of converting it."""
    if (
        isinstance(ids, (str, bytes, bytearray))
        or not isinstance(ids, Sequence | np.ndarray)
        or (isinstance(ids, np.ndarray) and ids.ndim != 1)
    ):
        raise InvalidRequestError(f"prompt_token_ids must be one prompt's list of integer ids, got {_show(ids)}")
    out = []
    for i, t in enumerate(ids):
        if not is_int(t):
            flat = " (the client sends one prompt: a flat list of ids)" if isinstance(t, Sequence | np.ndarray) else ""
            raise InvalidRequestError(f"prompt_token_ids[{i}] must be an integer, got {_show(t)}{flat}")
        if not 0 <= t <= INT32_MAX:
            raise InvalidRequestError(
                f"prompt_token_ids[{i}] = {t} is outside [0, {INT32_MAX}]: token ids are non-negative, "
                f"and the wire format's int32 limit is {INT32_MAX}"
            )
        out.append(int(t))
    return out


def _request(prompt, sampling_params, prompt_token_ids, request_id, cache_salt=None) -> pb.GenerateRequest:
    """The request both clients send, every argument checked first (InvalidRequestError names it)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise InvalidRequestError("pass exactly one of prompt or prompt_token_ids")
    check_cache_salt(cache_salt)
    request_id = "" if request_id is None else _text(request_id, "request_id")
    check_request_id(request_id)
    req = pb.GenerateRequest(sampling_params=_params(sampling_params), request_id=request_id)
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if prompt is not None:
        req.text = _text(prompt, "prompt")
    else:
        req.token_ids.ids.extend(_prompt_ids(prompt_token_ids))
    return req


def _logprobs(lps) -> list[Logprob]:
    return [Logprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top}) for lp in lps]


def _prompt_logprobs(req: pb.GenerateRequest, lps) -> list[Logprob | None] | None:
    """RequestOutput.prompt_logprobs from the wire's (which leaves out the first token's None)."""
    return [None, *_logprobs(lps)] if req.sampling_params.HasField("prompt_logprobs") else None


def _output(prompt: str | None, req: pb.GenerateRequest, resp: pb.GenerateResponse) -> RequestOutput:
    want_logprobs = req.sampling_params.HasField("logprobs")
    outputs = [
        CompletionOutput(
            index=c.index,
            token_ids=list(c.token_ids),
            text=c.text,
            finish_reason=_FINISH.get(c.finish_reason, "abort"),
            logprobs=_logprobs(c.logprobs) if want_logprobs else None,
            stop_reason=_stop_reason(c),
            cumulative_logprob=sum(lp.logprob for lp in c.logprobs) if want_logprobs else None,
        )
        for c in resp.completions
    ]
    return RequestOutput(
        request_id=resp.request_id,
        prompt=prompt,
        prompt_token_ids=list(resp.prompt_token_ids),
        outputs=outputs,
        prompt_logprobs=_prompt_logprobs(req, resp.prompt_logprobs),
    )


def _stop_reason(msg) -> int | str | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def _delta(req: pb.GenerateRequest, msg: pb.GenerateStreamResponse, first: bool) -> StreamDelta:
    """One message as a StreamDelta; `first`: sample 0's first (which carries the prompt's logprobs)."""
    return StreamDelta(
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH.get(msg.finish_reason),
        index=msg.index,
        stop_reason=_stop_reason(msg),
        logprobs=_logprobs(msg.logprobs) if req.sampling_params.HasField("logprobs") else None,
        prompt_logprobs=_prompt_logprobs(req, msg.prompt_logprobs) if first else None,
    )


def _model_info(msg: pb.ModelInfo) -> dict:
    """The server's ModelInfo as a dict; `default_sampling_params` as a SamplingParams (what a request's
    unset fields take), and `default_sampling_overrides` the fields of it the model's
    generation_config.json sets, by name."""
    info = {
        f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
    }
    defaults = {
        f.name: dict(v) if isinstance(v, Mapping) else tuple(v) if f.is_repeated else v
        for f, v in msg.default_sampling_params.ListFields()
    }
    info["default_sampling_params"] = SamplingParams(**defaults)
    info["default_sampling_overrides"] = defaults
    return info


# gRPC refuses messages over 4 MiB by default; a valid answer can be larger (n = 64 samples with 20
# logprobs each is ~5 MB), and would otherwise fail only after all its compute was spent.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]
# The shortest keepalive interval a client may ask for; `jaxinfer serve` accepts pings this often.
MIN_KEEPALIVE = 1.0
MAX_KEEPALIVE = (2**31 - 1) // 1000  # gRPC's channel options hold it in milliseconds, an int32
# GenerateRequest.request_id's limit: a label for logs, echoed in every streamed message, so an
# unbounded one let a request multiply what the server sends (a 3 MB id, 100 tokens: 300 MB).
MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> None:
    """Refuses a request_id longer than MAX_REQUEST_ID_CHARS (InvalidRequestError naming it)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )


def _channel_options(keepalive: float | None) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS, plus keepalive pings every `keepalive` seconds while a call is open (also when
    no data flows: a unary call waiting for its answer), each to be answered within as long."""
    if keepalive is None:
        return list(CHANNEL_OPTIONS)
    ms = int(keepalive * 1000)
    return CHANNEL_OPTIONS + [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # keepalive_timeout alone left the wait for an ack at 60 s
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_time_between_pings_ms", ms),
    ]


def _keepalive(value) -> float | None:
    if value is not None and _is_number(value) and value < MIN_KEEPALIVE:
        raise InvalidRequestError(f"keepalive must be at least {MIN_KEEPALIVE} s (or None), got {_show(value)}")
    return _seconds(value, "keepalive", limit=MAX_KEEPALIVE)


# gRPC's own target schemes (a target naming none is HOST:PORT).
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:", "google-c2p:")


def check_target(target: str, what: str = "server address") -> str:
    """A gRPC target: HOST:PORT (an IPv6 host in brackets) or one of gRPC's schemes (unix:PATH,
    dns:///host:port, ...), with a port gRPC can reach. Without a port gRPC dials 443, and it
    silently wraps 70000 to 4464; both are refused, naming `what`."""
    if not isinstance(target, str) or not target:
        raise InvalidRequestError(f"{what} must be HOST:PORT, got {target!r}")
    require_unicode(target, what)
    host, _, port = target.rpartition(":")
    if not target.startswith(_SCHEMES) and (
        not host or not port.isdigit() or (":" in host and not (host.startswith("[") and host.endswith("]")))
    ):
        raise InvalidRequestError(
            f"{what} must be HOST:PORT ([IPv6]:PORT, or a gRPC scheme such as unix:PATH), got {target!r}"
        )
    if port.isdigit() and not 0 < int(port) < 65536:
        raise InvalidRequestError(f"{what} {target!r}: the port must be in [1, 65535]")
    return target


class _Stubs:
    """The stubs of a client's channel, through its `_open()` (which refuses a closed client)."""

    @property
    def _stub(self):
        return self._open()[0]

    @property
    def _health(self):
        return self._open()[1]


class Client(_Stubs):
    """A blocking client. `target` is "host:port"; `timeout` (seconds) is each call's deadline (None:
    none); `keepalive` (seconds, None: off) how often an open call checks that the server answers."""

    def __init__(self, target: str = "127.0.0.1:9000", *, timeout: float | None = None, keepalive: float | None = 30.0):
        self.target = check_target(target)
        self.timeout = _seconds(timeout, "timeout")
        self.keepalive = _keepalive(keepalive)
        self._channel = grpc.insecure_channel(target, options=_channel_options(self.keepalive))
        self._stubs = (pb_grpc.InferenceServiceStub(self._channel), health_pb2_grpc.HealthStub(self._channel))
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _open(self):
        """(inference stub, health stub); ClientClosedError after close()."""
        if self._closed:
            raise ClientClosedError(f"this Client of {self.target} is closed")
        return self._stubs

    def _failure(self, e: grpc.RpcError) -> JaxinferError:
        """A call's error: ClientClosedError when this client's close() ended it (gRPC says CANCELLED,
        which would blame the server), else the server's status."""
        if self._closed:
            return ClientClosedError(f"this Client of {self.target} was closed during the call")
        return _server_error(e)

    def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id, cache_salt)
        timeout = _seconds(timeout, "timeout", default=self.timeout)
        try:
            resp = self._stub.Generate(req, timeout=timeout)
        except grpc.RpcError as e:
            raise self._failure(e) from None
        return _output(prompt, req, resp)

    def _generate_streamed(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """`generate` over the GenerateStream RPC, gathered into the same RequestOutput: no response
        size limit (a unary answer past the server's --max-response-bytes is refused), which is what
        `jaxinfer generate --server` needs to print whatever a local run prints."""
        req = _request(prompt, sampling_params, prompt_token_ids, None, cache_salt)
        resp = pb.GenerateResponse()
        completions: dict[int, pb.Completion] = {}
        texts: dict[int, list[str]] = {}
        for msg in self._messages(req, self.timeout):
            if not resp.request_id:
                resp.request_id = msg.request_id
            resp.prompt_token_ids.extend(msg.prompt_token_ids)
            resp.prompt_logprobs.extend(msg.prompt_logprobs)
            c = completions.setdefault(msg.index, pb.Completion(index=msg.index))
            c.token_ids.extend(msg.token_ids)
            c.logprobs.extend(msg.logprobs)
            texts.setdefault(msg.index, []).append(msg.text)
            if msg.finish_reason:
                c.finish_reason = msg.finish_reason
                wire_stop = msg.WhichOneof("stop_reason")
                if wire_stop is not None:
                    setattr(c, wire_stop, getattr(msg, wire_stop))
        for i in sorted(completions):
            completions[i].text = "".join(texts[i])
            resp.completions.append(completions[i])
        return _output(prompt, req, resp)

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        """The request's deltas as they come; the arguments are checked at this call, the RPC starts
        at the first `next`."""
        req = _request(prompt, sampling_params, prompt_token_ids, request_id, cache_salt)
        timeout = _seconds(timeout, "timeout", default=self.timeout)
        self._open()  # a closed client is refused here, not at the first `next`
        return self._stream(req, timeout)

    def _stream(self, req: pb.GenerateRequest, timeout: float | None) -> Iterator[StreamDelta]:
        first = True  # sample 0's first message not seen yet
        for msg in self._messages(req, timeout):
            yield _delta(req, msg, first and msg.index == 0)
            first = first and msg.index != 0

    def _messages(self, req: pb.GenerateRequest, timeout: float | None) -> Iterator[pb.GenerateStreamResponse]:
        """The GenerateStream RPC's messages; the RPC is cancelled when the iterator is dropped early."""
        try:
            call = self._stub.GenerateStream(req, timeout=timeout)
        except ValueError:  # grpc's "Cannot invoke RPC: Channel closed!": closed since the stream was made
            raise ClientClosedError(f"this Client of {self.target} is closed") from None
        try:
            yield from call
        except grpc.RpcError as e:
            raise self._failure(e) from None
        finally:
            call.cancel()  # a no-op once the stream has ended; aborts the request if it has not

    def tokenize(self, text: str) -> list[int]:
        req = pb.TokenizeRequest(text=_text(text, "text"))
        try:
            return list(self._stub.Tokenize(req, timeout=self.timeout).token_ids)
        except grpc.RpcError as e:
            raise self._failure(e) from None

    def model_info(self) -> dict:
        try:
            return _model_info(self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise self._failure(e) from None

    def health(self, service: str = "") -> str:
        """The standard health check's answer: "SERVING", "NOT_SERVING", "NOT_FOUND" (a service the
        server does not know), or "UNREACHABLE"."""
        req = health_pb2.HealthCheckRequest(service=_text(service, "service"))
        try:
            resp = self._health.Check(req, timeout=5)
        except grpc.RpcError as e:
            return "NOT_FOUND" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Blocks until the server reports SERVING; raises TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + _seconds(timeout, "timeout", optional=False)
        while self.health() != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} was not SERVING after {timeout:.0f} s")
            time.sleep(0.2)


class AsyncClient(_Stubs):
    """The asyncio twin of `Client`. Its channel opens at the first call, in that call's event loop,
    and belongs to that loop: a call from another loop raises InvalidRequestError (make one client
    per loop)."""

    def __init__(self, target: str = "127.0.0.1:9000", *, timeout: float | None = None, keepalive: float | None = 30.0):
        self.target = check_target(target)
        self.timeout = _seconds(timeout, "timeout")
        self.keepalive = _keepalive(keepalive)
        self._channel = None
        self._loop = None
        self._closed = False
        self._opening = threading.Lock()  # first calls racing from several threads' loops open one channel

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        self._closed = True
        if self._channel is None:
            return
        if self._loop is asyncio.get_running_loop():
            await self._channel.close()
        elif self._loop.is_running():  # the channel belongs to another loop: closed there
            asyncio.run_coroutine_threadsafe(self._channel.close(), self._loop)

    def _failure(self, e: grpc.RpcError) -> JaxinferError:
        """As Client._failure: ClientClosedError for a call this client's close() ended."""
        if self._closed:
            return ClientClosedError(f"this AsyncClient of {self.target} was closed during the call")
        return _server_error(e)

    def _open(self):
        """(inference stub, health stub) of this loop's channel, opened at the first call."""
        if self._closed:
            raise ClientClosedError(f"this AsyncClient of {self.target} is closed")
        loop = asyncio.get_running_loop()
        with self._opening:
            if self._channel is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=_channel_options(self.keepalive))
                self._stubs = (pb_grpc.InferenceServiceStub(self._channel), health_pb2_grpc.HealthStub(self._channel))
                self._loop = loop
        if loop is not self._loop:
            raise InvalidRequestError(
                f"this AsyncClient of {self.target} belongs to the event loop of its first call; "
                "make a new AsyncClient in each event loop (e.g. in each asyncio.run)"
            )
        return self._stubs

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        req = _request(prompt, sampling_params, prompt_token_ids, request_id, cache_salt)
        timeout = _seconds(timeout, "timeout", default=self.timeout)
        try:
            resp = await self._stub.Generate(req, timeout=timeout)
        except grpc.RpcError as e:
            raise self._failure(e) from None
        return _output(prompt, req, resp)

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """The request's deltas as they come (`async for`); the arguments are checked at this call,
        the RPC starts at the first step."""
        req = _request(prompt, sampling_params, prompt_token_ids, request_id, cache_salt)
        timeout = _seconds(timeout, "timeout", default=self.timeout)
        return self._stream(req, timeout)

    async def _stream(self, req: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[StreamDelta]:
        call = self._stub.GenerateStream(req, timeout=timeout)  # at the first step: inside the loop
        first = True  # sample 0's first message not seen yet
        try:
            async for msg in call:
                yield _delta(req, msg, first and msg.index == 0)
                first = first and msg.index != 0
        except grpc.RpcError as e:
            raise self._failure(e) from None
        finally:
            call.cancel()

    async def tokenize(self, text: str) -> list[int]:
        req = pb.TokenizeRequest(text=_text(text, "text"))
        try:
            resp = await self._stub.Tokenize(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._failure(e) from None
        return list(resp.token_ids)

    async def model_info(self) -> dict:
        try:
            return _model_info(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise self._failure(e) from None

    async def health(self, service: str = "") -> str:
        req = health_pb2.HealthCheckRequest(service=_text(service, "service"))
        try:
            resp = await self._health.Check(req, timeout=5)
        except grpc.RpcError as e:
            return "NOT_FOUND" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + _seconds(timeout, "timeout", optional=False)
        while await self.health() != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} was not SERVING after {timeout:.0f} s")
            await asyncio.sleep(0.2)
