"""Entry points of the backend: problem record -> custom op on the NPU -> the reference's outputs."""

from __future__ import annotations

from anymla.problems import SparseDecode, SparsePrefill

from . import op_args
from .ops import sparse_attention_v41
from .runtime import load_library


def sparse_prefill(p: SparsePrefill):
    """``(out [s_q, h_q, 512], max_logits [s_q, h_q], lse [s_q, h_q])``."""
    load_library()
    return sparse_attention_v41(**op_args.prefill_args(p))


def sparse_decode(p: SparseDecode):
    """``(out [b, s_q, h_q, 512], lse [b, s_q, h_q])``."""
    load_library()
    return op_args.decode_outputs(p, *sparse_attention_v41(**op_args.decode_args(p)))
