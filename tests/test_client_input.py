"""`Client` / `AsyncClient` refuse bad arguments before any RPC, with InvalidRequestError naming the field.

No server: the clients point at a loopback port where nothing listens, so a request that got as far
as the wire would fail with ServerError (UNAVAILABLE), not InvalidRequestError. `test_valid_input_*`
checks that premise: good input does reach the wire. Deadlines are short, so nothing can hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import threading

import numpy as np
import pytest
from test_sampling import AT_THE_LIMITS

from jaxinfer.client import AsyncClient, Client, ClientClosedError, ServerError
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingParams

TIMEOUT = 2.0  # seconds; a refused connection fails at once, this only bounds the worst case


@pytest.fixture(scope="module")
def address() -> str:
    """127.0.0.1 and a port nothing listens on (bound once for a free number, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def _forced(p: SamplingParams, **fields) -> SamplingParams:
    """`p` with `fields` set past SamplingParams' own checks (a frozen dataclass): the client must
    not rely on them to keep the protobuf encoder from raising."""
    p = dataclasses.replace(p)
    for k, v in fields.items():
        object.__setattr__(p, k, v)
    return p


BIG = 2**31  # one past int32

# (keyword arguments of generate/stream, a regex the message must match)
BAD_GENERATE = {
    "max_tokens_int32": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), max_tokens=BIG)},
        r"sampling_params\.max_tokens = 2147483648 is beyond the wire format's int32 limit 2147483647",
    ),
    "top_k_int32": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), top_k=BIG)},
        r"sampling_params\.top_k = 2147483648 is beyond the wire format's int32 limit 2147483647",
    ),
    "top_k_below_int32": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), top_k=-BIG - 1)},
        r"sampling_params\.top_k = -2147483649 is below the wire format's int32 limit -2147483648",
    ),
    "stop_token_ids_int32": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), stop_token_ids=(7, BIG))},
        r"sampling_params\.stop_token_ids\[1\] = 2147483648 is beyond the wire format's int32 limit",
    ),
    "seed_uint32": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), seed=2**32)},
        r"sampling_params\.seed = 4294967296 is beyond the wire format's uint32 limit 4294967295",
    ),
    "max_tokens_float": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), max_tokens=3.5)},
        r"sampling_params\.max_tokens must be an integer, got float 3\.5",
    ),
    "temperature_str": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), temperature="hot")},
        r"sampling_params\.temperature must be a number, got str 'hot'",
    ),
    "ignore_eos_int": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), ignore_eos=1)},
        r"sampling_params\.ignore_eos must be True or False, got int 1",
    ),
    "stop_lone_surrogate": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), stop=("ok", "a\udcff"))},
        r"sampling_params\.stop\[1\] is not valid Unicode: lone surrogate",
    ),
    "stop_bytes": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), stop=(b"end",))},
        r"sampling_params\.stop\[0\] must be a string, got bytes",
    ),
    "stop_not_a_list": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), stop="end")},
        r"sampling_params\.stop must be a list, got str 'end'",
    ),
    "stop_ids_not_a_list": (
        {"prompt": "x", "sampling_params": _forced(SamplingParams(), stop_token_ids=5)},
        r"sampling_params\.stop_token_ids must be a list, got int 5",
    ),
    "sampling_params_dict": (
        {"prompt": "x", "sampling_params": {"max_tokens": 4}},
        r"sampling_params must be a SamplingParams \(or None\), got dict",
    ),
    "prompt_id_int32": (
        {"prompt_token_ids": [1, BIG]},
        r"prompt_token_ids\[1\] = 2147483648 is outside \[0, 2147483647\].*int32 limit",
    ),
    "prompt_id_negative": (
        {"prompt_token_ids": [1, 2, -1]},
        r"prompt_token_ids\[2\] = -1 is outside \[0, 2147483647\]",
    ),
    "prompt_ids_float": (
        {"prompt_token_ids": [1.9, 2.2]},
        r"prompt_token_ids\[0\] must be an integer, got float 1\.9",
    ),
    "prompt_ids_numpy_float": (
        {"prompt_token_ids": np.array([1.0, 2.0])},
        r"prompt_token_ids\[0\] must be an integer, got float64",
    ),
    "prompt_ids_str": (
        {"prompt_token_ids": "12"},
        r"prompt_token_ids must be one prompt's list of integer ids, got str '12'",
    ),
    "prompt_ids_bytes": (
        {"prompt_token_ids": b"\x01\x02"},
        r"prompt_token_ids must be one prompt's list of integer ids, got bytes",
    ),
    "prompt_ids_bool": (
        {"prompt_token_ids": [True, 5]},
        r"prompt_token_ids\[0\] must be an integer, got bool True",
    ),
    "prompt_ids_none": (
        {"prompt_token_ids": [None]},
        r"prompt_token_ids\[0\] must be an integer, got NoneType None",
    ),
    "prompt_ids_nested": (
        {"prompt_token_ids": [[1, 2]]},
        r"prompt_token_ids\[0\] must be an integer, got list \[1, 2\] \(the client sends one prompt",
    ),
    "prompt_ids_scalar": (
        {"prompt_token_ids": 5},
        r"prompt_token_ids must be one prompt's list of integer ids, got int 5",
    ),
    "prompt_ids_2d_array": (
        {"prompt_token_ids": np.array([[1, 2]])},
        r"prompt_token_ids must be one prompt's list of integer ids, got ndarray",
    ),
    "prompt_bytes": (
        {"prompt": b"In the beginning"},
        r"prompt must be a string, got bytes",
    ),
    "prompt_lone_surrogate": (
        {"prompt": "In the \udcff"},
        r"prompt is not valid Unicode: lone surrogate '\\udcff' at character 7",
    ),
    "both_prompts": (
        {"prompt": "x", "prompt_token_ids": [1]},
        r"pass exactly one of prompt or prompt_token_ids",
    ),
    "no_prompt": ({}, r"pass exactly one of prompt or prompt_token_ids"),
    "request_id_int": (
        {"prompt": "x", "request_id": 5},
        r"request_id must be a string, got int 5",
    ),
    "request_id_too_long": (
        {"prompt": "x", "request_id": "r" * 257},
        r"request_id must be at most 256 characters, got 257",
    ),
    "request_id_lone_surrogate": (
        {"prompt": "x", "request_id": "r\udcff"},
        r"request_id is not valid Unicode",
    ),
    "timeout_str": (
        {"prompt": "x", "timeout": "x"},
        r"timeout must be a positive number of seconds \(or None\), got str 'x'",
    ),
    "timeout_negative": (
        {"prompt": "x", "timeout": -1},
        r"timeout must be a positive number of seconds \(or None\), got int -1",
    ),
    "timeout_nan": (
        {"prompt": "x", "timeout": float("nan")},
        r"timeout must be a positive number of seconds \(or None\), got float nan",
    ),
    "timeout_huge": (  # gRPC made it a deadline already passed: DEADLINE_EXCEEDED, nothing sent
        {"prompt": "x", "timeout": 1e10},
        r"timeout must be at most 100000000 seconds, got float 10000000000\.0",
    ),
}


def _sync_errors(address: str, kwargs: dict) -> list[str]:
    """The messages of Client.generate and Client.stream for `kwargs`; each must raise InvalidRequestError."""
    messages = []
    with Client(address, timeout=TIMEOUT) as c:
        with pytest.raises(InvalidRequestError) as e:
            c.generate(**kwargs)
        messages.append(str(e.value))
        with pytest.raises(InvalidRequestError) as e:
            c.stream(**kwargs)  # refused at the call, before the first next()
        messages.append(str(e.value))
    return messages


def _async_errors(address: str, kwargs: dict) -> list[str]:
    async def run():
        messages = []
        async with AsyncClient(address, timeout=TIMEOUT) as c:
            with pytest.raises(InvalidRequestError) as e:
                await c.generate(**kwargs)
            messages.append(str(e.value))
            with pytest.raises(InvalidRequestError) as e:
                c.stream(**kwargs)  # refused at the call, before `async for` starts the RPC
            messages.append(str(e.value))
        return messages

    return asyncio.run(run())


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_bad_generate_input_is_refused_by_both_clients(address, case):
    kwargs, pattern = BAD_GENERATE[case]
    messages = _sync_errors(address, kwargs) + _async_errors(address, kwargs)
    assert re.search(pattern, messages[0]), messages[0]
    assert messages == [messages[0]] * 4  # one validation, shared by generate and stream of both clients


def test_natural_sampling_params_past_int32_are_refused_by_name(address):
    """As a user writes them (not forced): whichever layer refuses, SamplingParams or the client, the
    error is InvalidRequestError naming the field, never protobuf's "Value out of range"."""
    with Client(address, timeout=TIMEOUT) as c:
        for field, kw in [
            ("max_tokens", {"max_tokens": BIG}),
            ("top_k", {"top_k": BIG}),
            ("stop_token_ids", {"stop_token_ids": [BIG]}),
        ]:
            with pytest.raises(InvalidRequestError, match=field) as e:
                c.generate("x", SamplingParams(**kw))
            assert "Value out of range" not in str(e.value)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("a\udcff", r"text is not valid Unicode: lone surrogate '\\udcff' at character 1"),
        (b"abc", r"text must be a string, got bytes"),
        (None, r"text must be a string, got NoneType"),
    ],
)
def test_bad_tokenize_input_is_refused_by_both_clients(address, text, pattern):
    with Client(address, timeout=TIMEOUT) as c:
        with pytest.raises(InvalidRequestError, match=pattern):
            c.tokenize(text)

    async def run():
        async with AsyncClient(address, timeout=TIMEOUT) as c:
            with pytest.raises(InvalidRequestError, match=pattern):
                await c.tokenize(text)

    asyncio.run(run())


def test_bad_constructor_and_health_arguments(address):
    for timeout, shown in [("x", "str 'x'"), (True, "bool True"), (0, "int 0"), (float("inf"), "float inf")]:
        with pytest.raises(
            InvalidRequestError, match=re.escape(f"timeout must be a positive number of seconds (or None), got {shown}")
        ):
            Client(address, timeout=timeout)
    with pytest.raises(InvalidRequestError, match=r"timeout must be at most 100000000 seconds, got float 1e\+300"):
        Client(address, timeout=1e300)
    with pytest.raises(InvalidRequestError, match=r"keepalive must be at most 2147483 seconds, got int 2147484"):
        Client(address, keepalive=2147484)  # gRPC's channel options hold it in int32 milliseconds
    with pytest.raises(InvalidRequestError, match=r"server address is not valid Unicode"):
        Client("127.0.0.1:\udcff")
    for port in (0, 65536):  # gRPC would wrap 65536 to 0
        with pytest.raises(InvalidRequestError, match=r"the port must be in \[1, 65535\]"):
            Client(f"127.0.0.1:{port}")
    with Client(address, timeout=TIMEOUT) as c:
        with pytest.raises(InvalidRequestError, match=r"service must be a string, got int 5"):
            c.health(5)
        with pytest.raises(InvalidRequestError, match=r"timeout must be a positive number of seconds, got str"):
            c.wait_ready("soon")

    async def run():
        with pytest.raises(InvalidRequestError, match=r"timeout must be a positive number of seconds"):
            AsyncClient(address, timeout="x")
        async with AsyncClient(address, timeout=TIMEOUT) as c:
            with pytest.raises(InvalidRequestError, match=r"service must be a string, got int 5"):
                await c.health(5)

    asyncio.run(run())


@pytest.mark.parametrize("kw", AT_THE_LIMITS, ids=lambda kw: ",".join(kw))
def test_sampling_params_at_their_limits_cross_the_wire_unchanged(kw):
    """Each SamplingParams value at its documented limit passes the client's wire checks and comes
    out of the server's conversion as it went in (max_tokens=None travels as int32's largest)."""
    from jaxinfer.client import INT32_MAX, _params
    from serving.wire import sampling_params

    p = SamplingParams(**kw)
    sent = p if p.max_tokens is not None else dataclasses.replace(p, max_tokens=INT32_MAX)
    assert sampling_params(_params(p)) == sent


def test_valid_input_reaches_the_wire(address):
    """The premise of the tests above: good input, numpy ints included, passes validation and fails
    only at the connection (nothing listens), as ServerError."""
    from jaxinfer.client import MAX_KEEPALIVE, MAX_TIMEOUT, MIN_KEEPALIVE

    p = SamplingParams(max_tokens=np.int64(2**31 - 1), top_k=2**31 - 1, seed=2**32 - 1, stop_token_ids=[2**31 - 1])
    with Client(address, timeout=TIMEOUT, keepalive=MIN_KEEPALIVE) as c:  # the limits themselves pass
        for kwargs in [
            {"prompt": "In the beginning", "sampling_params": p, "request_id": "r" * 256},
            {"prompt_token_ids": [0, 1, 2**31 - 1], "sampling_params": p},
            {"prompt_token_ids": np.array([3, 4], dtype=np.int32), "timeout": 1},
            {"prompt_token_ids": (5, np.int64(6))},
            {"prompt_token_ids": [7], "timeout": MAX_TIMEOUT},
        ]:
            with pytest.raises(ServerError) as e:
                c.generate(**kwargs)
            assert e.value.code == "UNAVAILABLE"
            with pytest.raises(ServerError) as e:
                list(c.stream(**kwargs))
            assert e.value.code == "UNAVAILABLE"
        with pytest.raises(ServerError) as e:
            c.tokenize("In the beginning")
        assert e.value.code == "UNAVAILABLE"
        assert c.health() == "UNREACHABLE"
    with Client(address, timeout=MAX_TIMEOUT, keepalive=MAX_KEEPALIVE) as c, pytest.raises(ServerError) as e:
        c.generate("In the beginning")
    assert e.value.code == "UNAVAILABLE"

    async def run():
        async with AsyncClient(address, timeout=TIMEOUT) as c:
            with pytest.raises(ServerError) as e:
                await c.generate(prompt_token_ids=[1, 2], sampling_params=p)
            assert e.value.code == "UNAVAILABLE"
            with pytest.raises(ServerError) as e:
                async for _ in c.stream("x", p):
                    pass
            assert e.value.code == "UNAVAILABLE"

    asyncio.run(run())


def test_cli_generate_server_names_the_bad_field(address, capsys):
    """`jaxinfer generate --server` goes through the client: one `error:` line naming the flag, exit 2.
    (A --max-tokens past int32 is not refused: as locally, it runs to the length limit.)"""
    from jaxinfer import cli

    for argv, pattern in [
        (["--prompt-ids", "1,2147483648"], r"error: --prompt-ids\[1\] = 2147483648 is outside"),
        (["In the \udcff"], r"error: prompt is not valid Unicode: lone surrogate"),
    ]:
        assert cli.main(["generate", "--server", address, *argv]) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err), err
        assert "Traceback" not in err and "unexpected" not in err


def test_a_closed_client_says_so(address):
    """After close(), calls raise ClientClosedError (a JaxinferError), not gRPC's own exceptions."""
    c = Client(address, timeout=TIMEOUT)
    c.close()
    c.close()  # twice is fine
    for call in (lambda: c.generate("hi"), lambda: c.stream("hi"), c.model_info, lambda: c.tokenize("hi"), c.health):
        with pytest.raises(ClientClosedError, match="is closed"):
            call()
    # A stream made before the close starts its RPC at the first `next`: gRPC's "Cannot invoke RPC:
    # Channel closed!" ValueError came out of it.
    c = Client(address, timeout=TIMEOUT)
    made = c.stream("hi")
    c.close()
    with pytest.raises(ClientClosedError, match="is closed"):
        next(made)

    async def closed_async():
        a = AsyncClient(address, timeout=TIMEOUT)
        await a.close()
        with pytest.raises(ClientClosedError, match="is closed"):
            await a.generate("hi")
        with pytest.raises(ClientClosedError, match="is closed"):
            await a.health()

    asyncio.run(closed_async())


def test_an_async_client_belongs_to_the_loop_of_its_first_call(address):
    """Made outside any loop, it works in the loop of its first call; from another loop it says to
    make a client per loop (gRPC's own error named neither the client nor the fix)."""
    a = AsyncClient(address, timeout=TIMEOUT)

    async def call():
        with pytest.raises(ServerError, match="UNAVAILABLE"):  # reached the wire: nothing listens there
            await a.generate("hi")

    asyncio.run(call())
    with pytest.raises(InvalidRequestError, match="make a new AsyncClient in each event loop"):
        asyncio.run(call())
    # First calls from four threads' loops at once: one opens the channel, the others are refused
    # (unlocked, each opened a channel of its own and close() reached only the last).
    a = AsyncClient(address, timeout=TIMEOUT)
    start = threading.Barrier(4)
    outcomes = []

    async def first_call():
        start.wait()
        try:
            await a.generate("hi")
        except Exception as e:  # noqa: BLE001 - the outcome is the exception's type
            outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=asyncio.run, args=(first_call(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["InvalidRequestError"] * 3 + ["ServerError"], outcomes


def test_keepalive_is_checked(address):
    with pytest.raises(InvalidRequestError, match=r"keepalive must be at least 1.0 s"):
        Client(address, keepalive=0.1)
    with pytest.raises(InvalidRequestError, match="keepalive must be a positive number"):
        AsyncClient(address, keepalive="30")


@pytest.mark.parametrize(
    "target, refusal",
    [
        ("127.0.0.1:9000", None),
        ("[::1]:50051", None),
        ("unix:/tmp/jaxinfer.sock", None),
        ("dns:///localhost:9000", None),
        ("127.0.0.1", "must be HOST:PORT"),  # gRPC dialled port 443
        ("::1", "must be HOST:PORT"),  # an unbracketed IPv6 address reads as host ":" port 1
        ("localhost:", "must be HOST:PORT"),
        (":9000", "must be HOST:PORT"),
        ("localhost:70000", r"the port must be in \[1, 65535\]"),  # gRPC wraps it to 4464
    ],
)
def test_server_addresses_are_host_port_or_a_grpc_scheme(target, refusal):
    from jaxinfer.client import check_target

    if refusal is None:
        assert check_target(target) == target
        Client(target).close()  # no connection is made until a call
    else:
        with pytest.raises(InvalidRequestError, match=refusal):
            Client(target)
