"""The hand-written Ascend C tier: FlashMLA's Ascend 950 sparse-attention design, written from scratch.

One kernel, ``sparse_attention_v41/``, serves DeepSeek Sparse Attention prefill (bf16 ``kv``) and decoding
(V4.1 FP8 main cache, optional FP8/FP4 extra cache) for d_qk = 512 and tiles of 64 query heads
(:mod:`.hot_shapes` says exactly which calls). Its tiling is a pure function (:mod:`.tiling`), the op's
schema and fake implementation are Python (:mod:`.ops`), and an fp32 emulation of the kernel's blocking
order (``sparse_attention_v41/emulation.py``) is tested against the reference on CPU, and a numpy model of its data
movement (``sparse_attention_v41/layout_model/``), driven by the kernel's headers, against ``anymla.kvcache``.

The device code has never been compiled or run here (no CANN, no NPU): the tier stays off until a run on
hardware is recorded in ``verification_manifest.json`` for the current sources (:mod:`.manifest`), unless
``ANYMLA_ASCENDC_ALLOW_UNVERIFIED=1``. The extension library (``ANYMLA_ASCENDC_LIB`` or ``lib/`` next to
this package) is loaded on the first kernel call, never at ``import anymla``.
"""

from .runtime import load_library, unavailable_reasons

__all__ = ["unavailable_reasons", "load_library"]
