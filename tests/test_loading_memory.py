"""Peak host memory while loading a safetensors checkpoint stays near its largest tensor, not the model.

A 38M-parameter Llama (152 MB in float32, four shard files) whose largest tensor is 8 MB is loaded
in a fresh process. Two measures:
- tracemalloc over the load: every host buffer NumPy allocates (layout conversions, dtype casts) is
  traced. On CPU, `device_put` may adopt a converted buffer as the device array itself (zero-copy,
  depending on its alignment), so part of what is traced at the end IS the parameters: the peak's
  excess over what is still traced at the end (the transient staging) must stay within a few largest
  tensors, and what is still traced at the end cannot exceed the parameters;
- anonymous resident memory (RssAnon, sampled every 0.5 ms): its peak must not exceed what the
  loaded parameters occupy at the end by more than a few largest tensors. On CPU the "device" is
  host memory, so the parameters themselves are in RSS; the transient above them is the staging.
File pages of the memory map are not anonymous memory and are not counted: they are the page cache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, threading, time, tracemalloc
import jax
from jaxinfer.loading import load_hf_checkpoint

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

jax.numpy.zeros(1).block_until_ready()
base = anon()
peak = [base]
done = threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)

sampler = threading.Thread(target=sample)
sampler.start()
tracemalloc.start()
cfg, params = load_hf_checkpoint(sys.argv[1])
jax.block_until_ready(params)
traced_end, traced_peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
done.set()
sampler.join()
leaves = jax.tree.leaves(params)
print(json.dumps(dict(
    traced_peak=traced_peak,
    traced_end=traced_end,
    anon_peak=peak[0] - base,
    anon_after=anon() - base,
    model=sum(x.nbytes for x in leaves),
    largest=max(x.nbytes for x in leaves),
)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc (Linux only)")
def test_loading_holds_about_one_tensor_of_host_memory(tmp_path):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="50MB")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300, check=True
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print("load memory (bytes):", m)
    assert m["model"] > 15 * m["largest"]  # the premise: the model is much bigger than its largest tensor
    assert m["traced_end"] <= m["model"], m  # nothing but (zero-copy adopted) parameters stays behind
    assert m["traced_peak"] - m["traced_end"] < 3 * m["largest"], m  # host staging: a few tensors, not the model
    assert m["anon_peak"] - m["anon_after"] < 4 * m["largest"], m  # no transient above the loaded params
    assert m["anon_peak"] < m["model"] + 8 * m["largest"], m
