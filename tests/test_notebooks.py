"""Runs every notebook in notebooks/ top to bottom in a fresh Jupyter kernel, on CPU, with small sizes.

Each notebook's parameter cell (tagged `parameters`) reads JAXINFER_NOTEBOOK_SMALL=1 and shrinks its work.
The kernel is this interpreter (a kernel spec written to a temporary directory points at sys.executable),
so the notebooks run against exactly the jaxinfer the rest of the suite tests. A failing cell fails the
test with the cell's traceback; a notebook that runs past its time limit is stopped.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
# Seconds per notebook on a loaded 2-core CPU (they take about a third of this).
TIME_LIMITS = {"quickstart.ipynb": 240, "anatomy_of_inference.ipynb": 300, "serving.ipynb": 240}


def test_every_notebook_is_listed_and_committed_clean():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(TIME_LIMITS), found
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name}: clear its outputs"
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: exactly one cell tagged 'parameters'"


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    """A kernel spec running this interpreter, whatever `python3` means on this machine."""
    from jupyter_client.kernelspec import KernelSpecManager

    kernels = tmp_path_factory.mktemp("kernels")
    spec = kernels / "jaxinfer-test"
    spec.mkdir()
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "jaxinfer tests",
                "language": "python",
            }
        )
    )
    return KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)


def _kernel_env() -> dict:
    env = dict(os.environ, JAXINFER_NOTEBOOK_SMALL="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # conftest fakes 8 CPU devices for the sharding tests; the notebooks show what a plain machine sees.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _execute(name: str, kernel_spec_manager) -> tuple[object, float]:
    from jupyter_client import KernelManager

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    limit = TIME_LIMITS[name]
    km = KernelManager(kernel_name="jaxinfer-test", kernel_spec_manager=kernel_spec_manager)
    # iopub_timeout: how long nbclient waits for a cell's outputs after the kernel says it is done. Its
    # default (4 s) silently drops outputs that arrive later, which happened once under a loaded
    # 2-core machine (the quickstart's printed refusal went missing); raise instead of dropping.
    client = nbclient.NotebookClient(
        nb, km=km, timeout=limit, resources={"metadata": {"path": str(NOTEBOOKS)}}, allow_errors=False,
        iopub_timeout=60, raise_on_iopub_timeout=True,
    )  # fmt: skip

    def too_slow(signum, frame):
        raise TimeoutError(f"{name} ran past its {limit} s limit")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        client.execute(env=_kernel_env())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if km.has_kernel:  # nbclient leaves a kernel it did not create running
            km.shutdown_kernel()
    seconds = time.perf_counter() - start
    print(f"{name}: {seconds:.0f} s")
    return nb, seconds


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def _expect(nb, *expected: str) -> None:
    """Asserts each string appears in the notebook's outputs; a miss shows every code cell's outputs, so
    a lost output and a wrong one can be told apart."""
    text = _text(nb)
    missing = [e for e in expected if e not in text]
    if missing:
        cells = []
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                outs = [(o.output_type, o.get("text") or o.get("data", {}).get("text/plain", "")) for o in cell.outputs]
                cells.append(f"cell {i} (execution {cell.execution_count}): {outs!r:.600}")
        raise AssertionError(f"missing from the outputs: {missing}\n" + "\n".join(cells))


def test_quickstart(kernel_spec_manager):
    nb, _ = _execute("quickstart.ipynb", kernel_spec_manager)
    _expect(
        nb,
        "picked up: CPU",
        "same seed, same samples: True",
        "rendered prompt:",  # chat through the stand-in's template
        "assistant:",
        "InvalidRequestError: this model has no chat_template",  # the default model's clear refusal
        "same tokens as llm.generate: True",  # prefill + decode_step by hand == the engine
        "= cfg.kv_bytes_per_token",
        "jaxinfer serve --model ",
    )
    assert ": True" in _text(nb)


def test_anatomy_of_inference(kernel_spec_manager):
    nb, _ = _execute("anatomy_of_inference.ipynb", kernel_spec_manager)
    assert _images(nb) >= 6, "one figure per section"
    _expect(
        nb,
        "of the measured matmul ceiling",
        "of the measured bandwidth ceiling",
        "by recomputing",
        "sequences of 8192 tokens",
        "cut the running streams' worst ITL",
        "prefix-cache hit tokens",
    )
    assert _text(nb).count("engine.stats(): prompt calls") == 2  # the engine's own phase split, per budget


def test_serving(kernel_spec_manager):
    nb, _ = _execute("serving.ipynb", kernel_spec_manager)
    _expect(
        nb,
        "health: SERVING",
        "streamed text == unary text: True",
        "deterministic under batching: True",
        "jaxinfer_requests_total",  # the metrics table
        "server exit code 0",
    )
