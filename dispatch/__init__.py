"""anymla: FlashMLA's attention kernels (MLA decoding, DeepSeek Sparse Attention) on any accelerator.

A drop-in for ``flash_mla``: the same functions, every KV-cache format FlashMLA has defined, more shapes,
and a dispatcher that picks a tier per device and shape (Triton, hand-written Ascend C, PyTorch reference)::

    import anymla
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(q, kv, indices, sm_scale)
    print(anymla.explain(anymla.flash_mla_sparse_fwd, q, kv, indices, sm_scale))
    with anymla.use_backend("reference"):
        ...
"""

from . import kvcache
from .api import explain, flash_mla_sparse_fwd, flash_mla_with_kvcache
from .debug import debug_checks
from .metadata import FlashMLASchedMeta, get_mla_metadata
from .registry import Backend, get_backend, register_backend, registered_backends, unregister_backend
from .selection import BackendNotSupported, Decision, available_backends, load_tuning, use_backend
from .warmup import WarmupReport, warmup
from . import backends as _register_builtin_backends  # noqa: F401  (registers reference, triton, ascendc, peers)

__version__ = "0.1.0"

__all__ = [
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "FlashMLASchedMeta",
    "explain",
    "warmup",
    "WarmupReport",
    "debug_checks",
    "use_backend",
    "available_backends",
    "load_tuning",
    "Decision",
    "BackendNotSupported",
    "Backend",
    "register_backend",
    "unregister_backend",
    "get_backend",
    "registered_backends",
    "kvcache",
]
