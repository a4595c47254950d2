"""Request parsing that names the bad field, and conversions between protos and jaxinfer types.

protobuf refuses a string field holding invalid UTF-8 with "String field had bad UTF-8", which
names neither the field nor the place. `Parser` parses leniently instead: on failure it re-parses
the bytes with a twin of the message in which every string is `bytes`, and reports the first
field whose bytes are not UTF-8 (`sampling_params.stop[1]: invalid UTF-8 at byte 3`).
"""

from __future__ import annotations

import dataclasses

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from jaxinfer.outputs import Logprob
from jaxinfer.sampling import SamplingParams
from jaxinfer.v1 import jaxinfer_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


@dataclasses.dataclass
class BadMessage:
    """What a request deserializer returns instead of raising: the handler answers INVALID_ARGUMENT."""

    error: str


def _bytes_twin(cls):
    """The message class `cls` with every string field (at any depth) turned into bytes."""
    fdp = descriptor_pb2.FileDescriptorProto()
    cls.DESCRIPTOR.file.CopyToProto(fdp)
    old, new = fdp.package, "lenient." + fdp.package
    fdp.name, fdp.package = "lenient/" + fdp.name, new
    del fdp.service[:]
    del fdp.dependency[:]

    def fix(msgs):
        for m in msgs:
            for f in m.field:
                # A map's key cannot be bytes (health.proto has a map<string, ...>): keys stay strings.
                key = m.options.map_entry and f.name == "key"
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING and not key:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                if f.type_name.startswith(f".{old}."):
                    f.type_name = f".{new}." + f.type_name[len(old) + 2 :]
            fix(m.nested_type)

    fix(fdp.message_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    name = new + cls.DESCRIPTOR.full_name[len(old) :]
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def _first_bad_utf8(msg, path: str = "") -> str | None:
    for field, value in msg.ListFields():
        name = f"{path}{field.name}"
        values = value if field.is_repeated else [value]
        for i, v in enumerate(values):
            where = f"{name}[{i}]" if field.is_repeated else name
            if isinstance(v, bytes):
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"{where}: invalid UTF-8 at byte {e.start}"
            elif isinstance(v, message.Message):
                found = _first_bad_utf8(v, where + ".")
                if found:
                    return found
    return None


class Parser:
    """A request deserializer for `cls` that never raises (see the module docstring)."""

    def __init__(self, cls):
        self.cls = cls
        self._twin = None

    def __call__(self, data: bytes):
        try:
            return self.cls.FromString(data)
        except message.DecodeError as e:
            try:
                if self._twin is None:
                    self._twin = _bytes_twin(self.cls)
                found = _first_bad_utf8(self._twin.FromString(data))
            except message.DecodeError:
                found = None
            return BadMessage(found or f"the request is not a valid {self.cls.DESCRIPTOR.full_name}: {e}")


_OPTIONAL = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "n",
    "truncate_prompt_tokens",
    "skip_special_tokens",
)
_PLAIN = ("presence_penalty", "frequency_penalty", "ignore_eos", "include_stop_str_in_output")


def sampling_params(msg: pb.SamplingParams, defaults: SamplingParams | None = None) -> SamplingParams:
    """The proto's parameters as SamplingParams: unset optionals take `defaults`' values (the model's
    generation_config.json defaults, see `LLM.get_default_sampling_params`), or SamplingParams' own.
    Raises InvalidRequestError naming the field."""
    kw = {f: getattr(msg, f) for f in _OPTIONAL if msg.HasField(f)}
    kw.update({f: getattr(msg, f) for f in _PLAIN})
    return dataclasses.replace(
        defaults or SamplingParams(),
        **kw,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=tuple(msg.allowed_token_ids) or None,
        bad_words=tuple(msg.bad_words),
    )


def sampling_fields_proto(fields: dict) -> pb.SamplingParams:
    """Some SamplingParams fields (by name) as the proto, the others unset: ModelInfo's
    `default_sampling_params` sets just what the checkpoint's generation_config.json sets, so a client
    can tell the model's recommendations from SamplingParams' own defaults."""
    msg = pb.SamplingParams()
    for f, value in fields.items():
        if f in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            getattr(msg, f).extend(value or ())
        elif f == "logit_bias":
            msg.logit_bias.update(value or {})
        elif value is not None:
            setattr(msg, f, value)
    return msg


def set_stop_reason(msg, stop_reason: int | str | None) -> None:
    """Sets a Completion's / GenerateStreamResponse's `stop_reason` oneof (nothing when None)."""
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif stop_reason is not None:
        msg.stop_token_id = stop_reason


def logprobs_proto(lps: list[Logprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],  # most likely first
        )
        for lp in lps
    ]
