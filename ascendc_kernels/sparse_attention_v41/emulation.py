"""fp32 emulation of ``sparse_attention_v41.asc``'s exact blocking order, to test the algorithm on CPU.

Same signature and outputs as ``anymla_ascendc::sparse_attention_v41`` (see :mod:`anymla.ascendc_kernels.ops`).
It follows the kernel step by step, on the tiling of :func:`anymla.ascendc_kernels.tiling.plan`:

- the units of each AI core's range (token x 64-head tile); a core's units are independent, so they are
  emulated as one batch;
- per unit, key blocks of 64: the main cache's, then the extra cache's; vector core v gathers keys
  ``[32 v, 32 v + 32)`` of a block, dequantized to bf16 exactly as ``anymla.kvcache.gather_rows`` does,
  and zeroes (never reads) invalid rows;
- cube: ``P = Q K^T`` in fp32 from bf16 operands;
- vector core v owns heads ``[32 v, 32 v + 32)``: logits ``* sm_scale``, masked keys ``-inf``, running max
  ``m_run``, lagging max ``m_use``; when some owned row has ``m_run - m_use > 6`` it rescales (``alpha``,
  ``l``, ``m_use = m_run`` for all its rows) and publishes that bit; ``p = exp(x - m_use)``; ``l`` sums
  the fp32 ``p``; the cube receives ``p`` rounded to bf16;
- cube: ``O_partial += bf16(p) V`` in fp32 (L0C). Before block j's product, if either vector core set its
  bit (and the partial is not empty), O_partial is drained: each vector core folds its rows,
  ``acc = (acc + partial) * alpha`` (``alpha = 1`` for a core that did not rescale), and the cube restarts
  O_partial. Without a resident O_partial (tiling on A2/A3) the drain happens every block;
- epilogue per vector core: final drain, ``out = acc / l`` times the sink factor ``1 / (1 + e^(sink - lse))``,
  ``lse = m_use + ln l``, ``max_logits = m_run``; rows without a valid key: out 0, lse +inf, max -inf.

The order of additions inside one matrix product is not modelled (the cube's is undocumented), so the
emulation matches the kernel's numerics up to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from anymla.kvcache import KVCacheFormat, detect_format, gather_rows

from ..op_args import kernel_shape
from ..tiling import (B_TOPK, D_QK, D_V, HEADS_PER_TILE, HEADS_PER_VECTOR_CORE, KEYS_PER_VECTOR_CORE, RESCALE_THRESHOLD,
                      VECTOR_CORES_PER_CUBE, Tiling, plan)

NEG = -1.0e30  # initial running maxima: finite, so m_run - m_use never computes inf - inf


@dataclass(frozen=True)
class _Source:
    """One key source (the main or the extra cache) in the token view."""

    cache: torch.Tensor
    fmt: KVCacheFormat
    indices: torch.Tensor  # [T, topk] int32
    length: Optional[torch.Tensor]  # [T] int32
    rows: int  # num_blocks * page_size: indices at or beyond it are invalid

    @property
    def topk(self) -> int:
        return self.indices.shape[-1]

    def gather_quarter(self, tokens: torch.Tensor, block: int, core: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Vector core ``core``'s keys of ``block`` for ``tokens``: bf16 ``[U, 32, 512]`` and validity ``[U, 32]``."""
        pos = block * B_TOPK + core * KEYS_PER_VECTOR_CORE + torch.arange(KEYS_PER_VECTOR_CORE)
        in_topk = pos < self.topk
        idx = self.indices[tokens][:, pos.clamp(max=self.topk - 1)].long()
        valid = in_topk & (idx >= 0) & (idx < self.rows)
        if self.length is not None:
            valid &= pos < self.length[tokens, None].long()
        keys = torch.zeros(*valid.shape, D_QK, dtype=torch.bfloat16)
        if valid.any():
            rows = gather_rows(self.cache, idx[valid], self.fmt)
            keys[valid] = rows[:, 0] if self.fmt is KVCacheFormat.BF16 else rows
        return keys, valid


class _VectorCore:
    """One AIV's state for a batch of units: 32 heads' softmax statistics and O accumulator."""

    def __init__(self, index: int, units: int):
        self.rows = slice(index * HEADS_PER_VECTOR_CORE, (index + 1) * HEADS_PER_VECTOR_CORE)
        shape = (units, HEADS_PER_VECTOR_CORE)
        self.m_run = torch.full(shape, NEG)
        self.m_use = torch.full(shape, NEG)
        self.l = torch.zeros(shape)
        self.alpha = torch.ones(shape)
        self.acc = torch.zeros(*shape, D_V)

    def softmax(self, logits: torch.Tensor, bias: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Block softmax of the owned rows; returns (bf16 probabilities, rescale bit per unit)."""
        x = logits[:, self.rows] * sm_scale + bias[:, None, :]
        m_new = torch.maximum(self.m_run, x.amax(-1))
        rescale = (m_new - self.m_use > RESCALE_THRESHOLD).any(-1)
        self.alpha = torch.where(rescale[:, None], torch.exp(self.m_use - m_new), 1.0)
        self.l = self.l * self.alpha
        self.m_use = torch.where(rescale[:, None], m_new, self.m_use)
        self.m_run = m_new
        p = torch.exp(x - self.m_use[..., None])
        self.l = self.l + p.sum(-1)
        return p.to(torch.bfloat16), rescale

    def fold(self, partial: torch.Tensor, drain: torch.Tensor, alpha: torch.Tensor) -> None:
        """A drain of O_partial (L0C -> UB): acc = (acc + partial) * alpha where ``drain``."""
        folded = (self.acc + partial[:, self.rows]) * alpha[..., None]
        self.acc = torch.where(drain[:, None, None], folded, self.acc)

    def epilogue(self, sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out, max_logits, lse) of the owned rows; ``sink`` is ``[U, 64]`` (the units' heads) or None."""
        empty = self.l == 0
        l_safe = torch.where(empty, 1.0, self.l)
        lse = self.m_use + torch.log(l_safe)
        scale = 1.0 / l_safe
        if sink is not None:
            scale = scale / (1.0 + torch.exp(sink[:, self.rows] - lse))
        out = torch.where(empty[..., None], 0.0, self.acc * scale[..., None])
        return (out, torch.where(empty, float("-inf"), self.m_run), torch.where(empty, float("inf"), lse))


def _run_core(q_tiles: torch.Tensor, tokens: torch.Tensor, sources: list[tuple[_Source, int]], sm_scale: float,
              sink: Optional[torch.Tensor], partial_resident: bool):
    """All blocks of one core's units (batched): out, max_logits, lse of their 64-head tiles.

    ``q_tiles [U, 64, 512]`` fp32, ``tokens [U]``, ``sink [U, 64]`` or None."""
    units = q_tiles.shape[0]
    vector_cores = [_VectorCore(v, units) for v in range(VECTOR_CORES_PER_CUBE)]
    partial = torch.zeros(units, HEADS_PER_TILE, D_V)
    first = True
    for source, blocks in sources:
        for block in range(blocks):
            quarters = [source.gather_quarter(tokens, block, v) for v in range(VECTOR_CORES_PER_CUBE)]
            keys = torch.cat([k for k, _ in quarters], 1).float()
            valid = torch.cat([m for _, m in quarters], 1)
            logits = q_tiles @ keys.transpose(1, 2)
            bias = torch.where(valid, 0.0, float("-inf"))
            results = [vc.softmax(logits, bias, sm_scale) for vc in vector_cores]
            probs = torch.cat([p for p, _ in results], 1).float()
            rescale = torch.stack([r for _, r in results]).any(0)
            drain = (rescale | (not partial_resident)) & (not first)
            for vc in vector_cores:
                vc.fold(partial, drain, vc.alpha)
            partial = torch.where(drain[:, None, None], 0.0, partial) + probs @ keys  # V = the whole row
            first = False
    for vc in vector_cores:  # the final drain: the partial already uses the final m_use
        vc.fold(partial, torch.ones(units, dtype=torch.bool), torch.ones_like(vc.alpha))
    parts = [vc.epilogue(sink) for vc in vector_cores]
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(3))


def sparse_attention_v41(q, kv, indices, topk_length=None, extra_kv=None, extra_indices=None, extra_topk_length=None,
                         attn_sink=None, sm_scale=1.0, *, soc: str = "Ascend950PR", cores: Optional[int] = None,
                         tiling: Optional[Tiling] = None):
    """Emulate the op on CPU tensors; ``tiling`` defaults to :func:`plan` on ``soc`` with ``cores`` cores."""
    tiling = tiling or plan(kernel_shape(q, kv, indices, extra_kv, extra_indices), soc, cores)
    shape = tiling.shape
    sources = [(_Source(kv, detect_format(kv), indices, topk_length, kv.shape[0] * kv.shape[1]), shape.main_blocks)]
    if extra_kv is not None:
        sources.append((_Source(extra_kv, detect_format(extra_kv), extra_indices, extra_topk_length,
                                extra_kv.shape[0] * extra_kv.shape[1]), shape.extra_blocks))
    tokens, heads, _ = q.shape
    out = torch.full((tokens, heads, D_V), float("nan"))
    max_logits = torch.full((tokens, heads), float("nan"))
    lse = torch.full((tokens, heads), float("nan"))
    for start, end in tiling.core_ranges:
        unit = torch.arange(start, end)
        token, tile = unit // shape.head_tiles, unit % shape.head_tiles
        head = tile[:, None] * HEADS_PER_TILE + torch.arange(HEADS_PER_TILE)
        q_tiles = q[token[:, None], head].float()
        sink = None if attn_sink is None else attn_sink[head].float()
        core_out = _run_core(q_tiles, token, sources, sm_scale, sink, tiling.partial_resident)
        out[token[:, None], head], max_logits[token[:, None], head], lse[token[:, None], head] = core_out
    return out.to(q.dtype), max_logits, lse
