"""Debug mode: the checks that read the tensors' contents, on every call.

Index ranges and block tables long enough for ``cache_seqlens`` can only be checked by reading the data,
which costs a device round trip per call (and cannot run inside CUDA-graph capture), so by default they are
off: the kernels then skip out-of-range indices and bad block ids and cut a length to its block-table row,
reading nothing out of bounds either way. Turn the checks on with ``ANYMLA_DEBUG=1`` or, for a block of
code, ``with anymla.debug_checks():``; a failing check raises ``ValueError`` naming the argument, the
element and its value. Off, they cost one context-variable read per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

from .environment import reader

ENV_DEBUG = "ANYMLA_DEBUG"
_read_debug = reader(ENV_DEBUG)
_SCOPED: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("anymla_debug", default=None)


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Run the data checks of every call inside the block (``enabled=False``: none, whatever the env says)."""
    token = _SCOPED.set(bool(enabled))
    try:
        yield
    finally:
        _SCOPED.reset(token)


def debug_enabled() -> bool:
    scoped = _SCOPED.get()
    return _read_debug() == "1" if scoped is None else scoped
