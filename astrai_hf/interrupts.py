"""Ctrl-C held back while the pool's books change.

A ``KeyboardInterrupt`` is raised between any two bytecodes of the main thread. Landing between a page's
allocation and its record in a row, or between a ref count and the index that holds it, it would leak the page for
good or free it twice. The bookkeeping of a cache (planning a step, selecting rows, releasing) runs inside
:func:`interrupts_deferred`, and a Ctrl-C that arrives there is raised as soon as the books are consistent again.
"""

from __future__ import annotations

import _signal  # signal's C module: the handlers signal's wrappers take and return, without their enum lookups
import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT back for the ``with`` block, then deliver it to the Python handler that was installed (the
    default one raises ``KeyboardInterrupt``).

    A no-op outside the main thread (only it receives signals), where no Python handler is installed (SIGINT
    ignored, left to the system, or set outside Python), or where the handler cannot be changed. Nests.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # (through the C module: signal.signal() and getsignal() look the handler up among their enums, raising and
    # catching a ValueError for every callable one, some 45 us a block, which runs at every decode step)
    previous = _signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    received = []
    try:
        _signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    except (ValueError, TypeError):  # not the main interpreter, or signals unavailable
        yield
        return
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])
