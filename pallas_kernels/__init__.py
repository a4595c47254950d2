"""Pallas kernels of jaxinfer; each is checked against a pure-JAX reference (jaxinfer.attention).

- ragged_paged_attention: decode and chunked-prefill attention over the paged KV cache, as a TPU
  (Mosaic) kernel that also runs in Pallas' TPU interpret mode, so it is tested on CPU.
"""
