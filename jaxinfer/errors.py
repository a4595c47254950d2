"""Errors meant for people: each names the field, the value and the limit."""


class JaxinferError(Exception):
    """Base class of every error jaxinfer raises on purpose."""


class InvalidRequestError(JaxinferError, ValueError):
    """A request (prompt or sampling parameters) is malformed; the message names the field."""


class UnsupportedModelError(JaxinferError, ValueError):
    """A checkpoint uses an architecture or option this version does not implement."""


class CheckpointError(JaxinferError, OSError):
    """A checkpoint directory is missing, incomplete or inconsistent; names the file or tensor."""
