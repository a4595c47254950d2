"""Generated gRPC stubs (see serving/protogen.py)."""
