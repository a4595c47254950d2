"""Pallas kernels of jaxinfer; each is checked against a pure-JAX reference (jaxinfer.attention).

- ragged_paged_attention: decode and chunked-prefill attention over the paged KV cache, as a TPU
  (Mosaic) kernel that also runs in Pallas' TPU interpret mode, so it is tested on CPU.
- ragged_paged_attention_gpu: the same contract on GPU (Pallas' Triton lowering); also testable in
  interpret mode.
- ragged_paged_attention_mgpu: its Mosaic GPU (Hopper: TMA + wgmma) variant for bfloat16/float16
  pools, tested in Pallas' GPU interpret mode and compiled and timed on an H200 (2026-11-29/30);
  Hopper steps run through it where it was measured faster (`jaxinfer.attention._gpu_kernel`).
- kv_write: the new tokens' K/V (float or int8 with scales) written into their pages in place (TPU).
- sharded: both under shard_map over the mesh's KV-head axis.

`jaxinfer.attention.paged_attention` is the one dispatch point that picks them (attention_backend
"pallas", the default on TPU and on GPUs from compute capability 8.0 on); `bench` times them against
a measured copy bandwidth.
"""
