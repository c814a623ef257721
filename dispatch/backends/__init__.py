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
# External peers: in no priority list; chosen by name, by a tuning file or where measured faster
# (Backend.auto_select, Backend.measured_faster).
register_backend(FlashMLAPeer())
register_backend(TorchNpuPeer())
