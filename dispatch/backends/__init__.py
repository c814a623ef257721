"""Built-in backends, registered on import."""

from ..registry import register_backend
from .ascendc import AscendCBackend
from .flashmla_peer import FlashMLAPeer
from .reference import ReferenceBackend
from .torch_npu_peer import TorchNpuPeer
from .triton import TritonBackend

register_backend(ReferenceBackend())
register_backend(TritonBackend())
register_backend(AscendCBackend())
# External peers: never chosen automatically (see Backend.auto_select).
register_backend(FlashMLAPeer())
register_backend(TorchNpuPeer())
