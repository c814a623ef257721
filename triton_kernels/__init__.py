"""The Triton tier: MLA kernels that run on NVIDIA GPUs, on Ascend NPUs (triton-ascend) and on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests them).

``sparse_mla/`` serves DeepSeek Sparse Attention prefill and decoding (one kernel, every cache format),
``dense_decode/`` serves MLA decoding over a paged bf16/fp16 cache, and ``common.py`` holds what both share
(format decoders, the skip-scale online softmax, epilogues, the split-KV combine). ``runtime.py`` knows the
device (interpreter or not, multiprocessor count, native fp8) and ``tuning.py`` the tile configurations.
Importing this package does not import triton; :func:`unavailable_reasons` says why the tier cannot run.
"""

from .runtime import unavailable_reasons

__all__ = ["unavailable_reasons"]
