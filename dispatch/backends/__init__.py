"""Built-in backends, registered on import."""

from ..registry import register_backend
from .ascendc import AscendCBackend
from .reference import ReferenceBackend
from .triton import TritonBackend

register_backend(ReferenceBackend())
register_backend(TritonBackend())
register_backend(AscendCBackend())
