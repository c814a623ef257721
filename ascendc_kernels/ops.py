"""Schema and fake (meta) implementation of the tier's custom op, defined in Python.

The schema lives here, not in the extension library, so shape logic works under FakeTensor and
``torch.compile`` on any machine; only the ``PrivateUse1`` (NPU) implementation lives in the built
library (``sparse_attention_v41/host/binding.cpp``), which registers it with ``TORCH_LIBRARY_IMPL``.

``anymla_ascendc::sparse_attention_v41`` works in the token view of :mod:`.op_args`: q ``[T, h_q, 512]``
bf16; kv / extra_kv paged ``[num_blocks, page_size, 1, row]`` (bf16 rows of 512, or V4.1 FP8 528-byte /
FP4 288-byte rows); indices ``[T, topk]`` / extra_indices ``[T, extra_topk]`` int32; lengths ``[T]``
int32; attn_sink ``[h_q]`` fp32. Returns out ``[T, h_q, 512]`` (q's dtype), max_logits and lse
``[T, h_q]`` fp32 (natural log; empty rows: out 0, max_logits -inf, lse +inf).
"""

from __future__ import annotations

import torch

NAMESPACE = "anymla_ascendc"
OP_NAME = "sparse_attention_v41"
QUALIFIED_NAME = f"{NAMESPACE}::{OP_NAME}"
SCHEMA = (f"{OP_NAME}(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? extra_kv, "
          "Tensor? extra_indices, Tensor? extra_topk_length, Tensor? attn_sink, float sm_scale) "
          "-> (Tensor out, Tensor max_logits, Tensor lse)")

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_LIBRARY.define(SCHEMA)


@torch.library.register_fake(QUALIFIED_NAME)
def _sparse_attention_v41_fake(q, kv, indices, topk_length, extra_kv, extra_indices, extra_topk_length, attn_sink,
                               sm_scale):
    torch._check(q.dim() == 3, lambda: f"q: expected [T, h_q, 512], got {q.dim()} dims")
    torch._check(q.shape[-1] == 512, lambda: f"q: expected d_qk = 512, got {q.shape[-1]}")
    torch._check(kv.dim() == 4, lambda: f"kv: expected [num_blocks, page_size, 1, row], got {kv.dim()} dims")
    torch._check(indices.dim() == 2 and indices.shape[0] == q.shape[0],
                 lambda: f"indices: expected [T, topk] with T = {q.shape[0]}, got {tuple(indices.shape)}")
    torch._check((extra_kv is None) == (extra_indices is None),
                 lambda: "extra_indices: must be given if and only if extra_kv is given")
    tokens, heads, _ = q.shape
    out = q.new_empty(tokens, heads, 512)
    max_logits = q.new_empty(tokens, heads, dtype=torch.float32)
    return out, max_logits, torch.empty_like(max_logits)


def sparse_attention_v41(**args):
    """Call the op with the argument dict of :func:`.op_args.prefill_args` / :func:`.op_args.decode_args`."""
    return torch.ops.anymla_ascendc.sparse_attention_v41(**args)
