"""Built-in backends, registered on import."""

from ..registry import register_backend
from .reference import ReferenceBackend
from .triton import TritonBackend

register_backend(ReferenceBackend())
register_backend(TritonBackend())
