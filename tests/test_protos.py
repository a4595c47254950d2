"""The checked-in stubs (jaxinfer/v1, jaxinfer/jetstream) must be what protoc makes of protos/."""

from __future__ import annotations

import importlib

import pytest
from google.protobuf import descriptor_pb2

from serving import protogen


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    desc = out / "descriptors.pb"
    protogen.generate(out, descriptor_set=desc)
    files = descriptor_pb2.FileDescriptorSet.FromString(desc.read_bytes()).file

    def drop_json_names(messages):  # protoc adds them to descriptor sets, not to generated code
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            drop_json_names(m.nested_type)

    for f in files:
        drop_json_names(f.message_type)
    return out, {f.name: f for f in files}


@pytest.mark.parametrize("proto", protogen.PROTOS)
def test_checked_in_stubs_match_the_proto(fresh, proto):
    out, descriptors = fresh
    module = importlib.import_module(proto.removesuffix(".proto").replace("/", ".") + "_pb2")
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert checked_in == descriptors[proto], f"{proto} changed: run `python -m serving.protogen` and commit"

    # The gRPC stubs: same services and methods (ignoring the generator's version stamp).
    def strip(text: str) -> list[str]:
        return [line for line in text.splitlines() if "GENERATED_VERSION" not in line and "grpc_version" not in line]

    grpc_file = proto.removesuffix(".proto") + "_pb2_grpc.py"
    assert strip((protogen.ROOT / grpc_file).read_text()) == strip((out / grpc_file).read_text()), grpc_file


def test_jetstream_field_numbers():
    """The numbers JetStream published (jetstream/core/proto/jetstream.proto), written out here."""
    from jaxinfer.jetstream import jetstream_pb2 as js

    req = js.DecodeRequest.DESCRIPTOR.fields_by_name
    assert {k: req[k].number for k in req} == {
        "max_tokens": 4,
        "text_content": 5,
        "token_content": 6,
        "metadata": 7,
        "num_samples": 8,
    }
    resp = js.DecodeResponse.DESCRIPTOR.fields_by_name
    assert {k: resp[k].number for k in resp} == {"initial_content": 2, "stream_content": 3}
    sample = js.DecodeResponse.StreamContent.Sample.DESCRIPTOR.fields_by_name
    assert (sample["text"].number, sample["token_ids"].number) == (1, 2)
    assert js.HealthCheckResponse.DESCRIPTOR.fields_by_name["is_live"].number == 1
    assert js.DESCRIPTOR.package == "jetstream_proto"
    svc = js.DESCRIPTOR.services_by_name["Orchestrator"]
    assert [m.name for m in svc.methods] == ["Decode", "HealthCheck"]
    assert svc.methods_by_name["Decode"].server_streaming
