"""Regenerates the checked-in Python stubs from protos/: `python -m serving.protogen`.

The stubs live inside the `jaxinfer` package (jaxinfer/v1, jaxinfer/jetstream) because the client
needs them as much as the server does. tests/test_protos.py fails when they drift from the .proto
files, so edit a .proto, run this, and commit both.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ("jaxinfer/v1/jaxinfer.proto", "jaxinfer/jetstream/jetstream.proto")


def generate(out_dir: pathlib.Path, *, descriptor_set: pathlib.Path | None = None) -> None:
    """Runs protoc (from grpcio-tools) on every proto, writing the Python and gRPC stubs."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if descriptor_set is not None:
        args.append(f"--descriptor_set_out={descriptor_set}")
    rc = protoc.main([*args, *PROTOS])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


def main() -> int:
    generate(ROOT)
    for p in PROTOS:
        init = ROOT / pathlib.Path(p).parent / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated gRPC stubs (see serving/protogen.py)."""\n')
    print("regenerated:", ", ".join(PROTOS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
