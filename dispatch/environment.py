"""Reading anymla's environment variables on every call, cheaply.

The dispatcher reads ``ANYMLA_BACKEND``, ``ANYMLA_TUNING`` and ``ANYMLA_DEBUG`` on every call, so that setting
one takes effect at once; ``os.environ.get`` encodes the name each time (~0.8 µs, a few percent of a decode
call's host time). On POSIX, ``os.environ`` keeps the encoded variables in a dict that its own writes update,
which can be read directly (~0.07 µs); elsewhere the public mapping is used. A :func:`reader` encodes its
name once, so a read is one dictionary lookup.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

_DATA = getattr(os.environ, "_data", None)
_BYTES = isinstance(_DATA, dict) and all(isinstance(k, bytes) for k in list(_DATA)[:1])


def reader(name: str) -> Callable[[], Optional[str]]:
    """A function returning ``os.environ.get(name)`` whenever it is called."""
    if not _BYTES:
        return lambda: os.environ.get(name)
    key, get = name.encode(), _DATA.get

    def read() -> Optional[str]:
        value = get(key)
        return None if value is None else value.decode()
    return read
