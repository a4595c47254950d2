"""Ctrl-C at safe points only.

A KeyboardInterrupt can land between any two bytecodes of the main thread. Landing inside the
host-side bookkeeping of a step (a sequence counted as computed but its token not yet appended, an
update made but not yet filed under its request) it would leave the engine's state torn: another
open stream then stalls or loses a token. `deferred()` holds SIGINT back over such a region and
delivers it on the way out; `allowed()`, nested inside, lets it through again where waiting is long
and nothing is half done (compiling, waiting for the device).

Python runs signal handlers on the main thread only, so elsewhere (the server's engine thread) both
are no-ops: there is no interrupt to defer.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_depth = 0  # nesting of deferred() on the main thread
_held = None  # the SIGINT handler deferred() replaced, restored on the way out
_pending = False  # a SIGINT arrived while deferred


def _hold(signum, frame) -> None:
    global _pending
    _pending = True


def _deliver() -> None:
    """Re-raises a held-back SIGINT through the real handler (it runs at the next bytecode)."""
    global _pending
    if _pending:
        _pending = False
        signal.raise_signal(signal.SIGINT)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred():
    """SIGINT arriving inside is held back and delivered when the outermost region ends."""
    global _depth, _held
    if not _on_main_thread() or (_depth == 0 and signal.getsignal(signal.SIGINT) is None):
        yield  # not the main thread, or a handler installed outside Python, which cannot be restored
        return
    # The depth counts this region before the handler is swapped and until it is restored: code the
    # garbage collector runs in between (a stream's cleanup, itself deferred) then nests, instead of
    # taking `_hold` for the handler to restore and leaving every later Ctrl-C held for good.
    _depth += 1
    outermost, installed = _depth == 1, False
    try:
        if outermost:
            _held = signal.signal(signal.SIGINT, _hold)
            installed = True
        yield
    finally:
        if not outermost:
            _depth -= 1
        else:
            if installed:
                signal.signal(signal.SIGINT, _held)
            _depth = 0
            _deliver()


@contextlib.contextmanager
def allowed():
    """Inside deferred(): SIGINT acts at once again (and one held back is delivered now)."""
    if not _on_main_thread() or _depth == 0:
        yield
        return
    signal.signal(signal.SIGINT, _held)
    try:
        _deliver()
        yield
    finally:
        signal.signal(signal.SIGINT, _hold)
