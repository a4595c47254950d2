"""The gRPC server of jaxinfer: `jaxinfer serve` (see serving/server.py)."""
