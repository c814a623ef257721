"""The gather floor of a sparse decoding call: how long a kernel that only reads the call's KV rows takes.

The byte floor (``model.py``) prices a call's bytes at the device's copy rate, which streams memory in order. A
sparse decoding call reads scattered rows of a few hundred bytes instead (``b x s_q x topk`` of them), and
DRAM serves scattered rows more slowly than a stream. This measures what the device gives such reads: a
read-only Triton kernel gathers the rows the call counts (its index lists, within ``topk_length``; the extra
cache's too) in the call's order, each as ``bytes_per_token`` contiguous bytes at ``slot x bytes_per_token`` of
the cache's own memory, and reduces them to one word a program, so that nothing but the reads costs time. For
the row-contiguous formats (V3.2, V4.1 FP8 and FP4, bf16) those are the rows themselves; MODEL1 keeps a
token's 576 data bytes and its 8 scale bytes apart, which this does not imitate. Of a few tiles the fastest
counts (a floor, like the matmul ceiling's best tile). Accelerators only: on the CPU it would time Triton's
interpreter.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from anymla.kvcache import detect_format

from .model import _counted

# (rows a program, warps): many small programs keep many rows in flight; the best of these counts.
TILES = ((8, 4), (16, 4), (32, 8))


@triton.jit
def _read_rows_kernel(words, slots, n, out, ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    """Program i sums the words of rows ``slots[i * BLOCK_R : (i + 1) * BLOCK_R]``, each folded to 16 bits (both
    halves, so every byte is used: no compiler may narrow the loads) so that the sum cannot overflow."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots + r, mask=r < n, other=0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    x = tl.load(words + slot[:, None] * ROW_WORDS + w[None, :], mask=(r < n)[:, None] & (w < ROW_WORDS)[None, :],
                other=0)
    folded = (x ^ (x >> 16)) & 0xFFFF
    tl.store(out + pid, tl.sum(tl.sum(folded, axis=1), axis=0))


class RowReads:
    """The read-only gather of one call's rows: ``reads()`` launches it, ``checksum()`` its expected result."""

    def __init__(self, args: dict, block_r: int = 16, num_warps: int = 4):
        self.parts = []  # (the cache's memory as int32 words, counted slots, words a row)
        for cache, idx, length in ((args["k_cache"], args["indices"], args.get("topk_length")),
                                   (args.get("extra_k_cache"), args.get("extra_indices_in_kvcache"),
                                    args.get("extra_topk_length"))):
            if cache is None:
                continue
            row_bytes = detect_format(cache).spec.bytes_per_token * cache.element_size()
            if row_bytes % 4:
                raise ValueError(f"rows of {row_bytes} bytes: the gather reads 4-byte words")
            slots_total = cache.shape[0] * cache.shape[1]
            words = cache.view(torch.uint8).reshape(-1)[: slots_total * row_bytes].view(torch.int32)
            slots = idx[_counted(idx, slots_total, length)].to(torch.int32).contiguous()
            self.parts.append((words, slots, row_bytes // 4))
        self.rows = sum(s.numel() for _, s, _ in self.parts)
        self.bytes = sum(s.numel() * w * 4 for _, s, w in self.parts)
        self.block_r, self.num_warps = block_r, num_warps
        self.sinks = [torch.empty(max(1, triton.cdiv(s.numel(), block_r)), dtype=torch.int32, device=s.device)
                      for _, s, _ in self.parts]

    def reads(self) -> None:
        for (words, slots, row_words), sink in zip(self.parts, self.sinks):
            n = slots.numel()
            if n:
                _read_rows_kernel[(triton.cdiv(n, self.block_r),)](
                    words, slots, n, sink, ROW_WORDS=row_words, BLOCK_R=self.block_r,
                    BLOCK_W=triton.next_power_of_2(row_words), num_warps=self.num_warps)

    def sums(self) -> list[int]:
        """What the kernel's programs computed, summed per cache."""
        return [int(sink[: triton.cdiv(s.numel(), self.block_r)].long().sum()) if s.numel() else 0
                for (_, s, _), sink in zip(self.parts, self.sinks)]

    def checksum(self) -> list[int]:
        """The same sums computed by torch, for checking the kernel."""
        out = []
        for words, slots, row_words in self.parts:
            x = words.view(-1, row_words)[slots.long()]
            out.append(int(((x ^ (x >> 16)) & 0xFFFF).long().sum()))
        return out


def gather_floor_us(args: dict, measure: Callable[[Callable[[], object]], float]) -> Optional[float]:
    """The fastest of :data:`TILES` at gathering the rows of the sparse decoding call ``args`` (the public
    function's keyword arguments), timed by ``measure`` (a callable's median µs); None when it reads no row."""
    best = None
    for block_r, num_warps in TILES:
        reads = RowReads(args, block_r, num_warps)
        if not reads.rows:
            return None
        t = measure(reads.reads)
        best = t if best is None else min(best, t)
    return best
