"""Host side of the ``mma_v2`` sparse decoding kernel (``decode.py``) over V3.2 FP8 caches: its tile, its split
count and the launch (a launch plan's, ``DecodeLaunch``, and a standalone call's with the combine of split
partials, ``sparse_decode``). ``serve.py`` says when the dispatcher's plans take it; ``NOTES.md`` what has been
checked and measured.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton

from anymla import buffers

from .. import runtime
from ..launcher import Launcher
from ..splits import Combine, choose_num_splits, workspaces
from .launch import HEADS, K_STEP, check_rows, shared_bytes

ROW_BYTES = 656  # a V3.2 FP8 cache row (anymla.kvcache)
# (BLOCK_N, latent tiles), preferred first; two latent tiles where they fit (block j + 1 dequantized into one
# after block j's P·V from the other, ``decode.py``: 3-7 % faster than one on the sm_90 stand-in, runs 126-127).
# 64 keys fit the 227 KB GPUs (sm_90, sm_100); sm_80's 163 KB takes 32 (without fp8 conversions 64 keys' codes and
# their bit arithmetic spill anyway: 68 B with one tile); the 99 KB GPUs take 16 with one latent tile.
TILES = ((64, 2), (32, 2), (16, 1))
# Also valid (tests, timings): one latent tile, each block dequantized before it is attended.
ONE_TILE = ((64, 1), (32, 1))


def decode_shared_bytes(tile: tuple[int, int]) -> int:
    """Shared memory the kernel allocates with ``tile`` (BLOCK_N, latent tiles): the prefill kernel's with one
    stage at d_qk 576 (q, a latent and a rope tile, P, the reduction scratch), plus the second rope tile and the
    second latent tile if any."""
    block_n, latent = tile
    return shared_bytes(576, block_n, 1) + 2 * block_n * 64 + (latent - 1) * block_n * 1024


def choose_decode_tile(smem_limit: int, native_fp8: bool) -> tuple[int, int]:
    """The first of ``TILES`` that fits ``smem_limit`` bytes (64 keys only with fp8 conversions)."""
    for tile in TILES:
        if decode_shared_bytes(tile) <= smem_limit and (native_fp8 or tile[0] < 64):
            return tile
    raise ValueError(f"no tile of the mma_v2 decoding kernel fits {smem_limit} bytes of shared memory")


@functools.lru_cache(maxsize=None)
def _combine(num_splits: int, h_q: int, has_sink: bool) -> Combine:
    """The merge of one shape's partials: its launcher keeps the first call's integers (heads, strides) and
    whether a sink comes, so it is kept per those."""
    return Combine(num_splits)


def _check(q, kv_cache, indices, topk_length, attn_sink) -> None:
    if q.dim() != 4 or indices.dim() != 3 or kv_cache.dim() != 4:
        raise ValueError("expected q [b, s_q, h_q, 576], kv_cache [blocks, page, 1, 656], indices [b, s_q, topk]")
    b, s_q, h_q, d = q.shape
    if d != 576 or kv_cache.shape[2:] != (1, ROW_BYTES) or tuple(indices.shape[:2]) != (b, s_q):
        raise ValueError(f"shapes q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, indices "
                         f"{tuple(indices.shape)}: V3.2 FP8 only (d_qk 576, 656-byte rows)")
    if q.dtype != torch.bfloat16 or kv_cache.element_size() != 1 or indices.dtype != torch.int32:
        raise ValueError(f"q {q.dtype}, kv_cache {kv_cache.dtype}, indices {indices.dtype}: bf16 q, a byte cache, "
                         f"int32 indices")
    # The codes, scales and rope values are read 16 and 4 bytes at a time from each row's start.
    if kv_cache.stride(1) != ROW_BYTES or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache: rows of 656 bytes back to back within a block, blocks 16-byte aligned")
    check_rows(q=q)
    if topk_length is not None and (topk_length.shape != (b,) or topk_length.dtype != torch.int32):
        raise ValueError("topk_length: expected [b] int32")
    if attn_sink is not None and (attn_sink.shape != (h_q,) or attn_sink.dtype != torch.float32):
        raise ValueError("attn_sink: expected [h_q] fp32")


class DecodeLaunch:
    """The kernel's launch for one call signature, as ``sparse_mla.launch.SparseDecodePlan`` calls a decoding
    launch: ``tokens`` queries of ``h_q`` heads over one V3.2 cache, whether lengths and sinks come, the split
    count; ``tile`` (BLOCK_N, latent tiles) instead of the device's ``choose_decode_tile``, ``native_fp8`` False
    for the bit arithmetic of sm_80/86 on any GPU."""

    def __init__(self, device: torch.device, tokens: int, h_q: int, has_len: bool, has_sink: bool, num_splits: int,
                 tile: Optional[tuple[int, int]] = None, native_fp8: Optional[bool] = None):
        from .decode import sparse_decode_mma_v2_kernel  # Gluon: imported where it can run
        native = runtime.native_fp8(device) if native_fp8 is None else native_fp8
        block_n, latent = tile or choose_decode_tile(runtime.max_shared_memory(device), native)
        self.hb = triton.cdiv(h_q, HEADS)
        self.grid = (tokens * self.hb, num_splits, 1)
        self.constexprs = [has_len, has_sink, num_splits > 1, native, block_n, latent, K_STEP]
        self.launcher = Launcher(sparse_decode_mma_v2_kernel, num_warps=8)

    def __call__(self, call, typed, len_div: int, sm_scale: float, num_splits: int, ws) -> None:
        """``call``: the call's tensors (``sparse_mla.launch.CallTensors``: q ``[b, s_q, h_q, 576]`` viewable as
        ``[tokens, h_q, 576]``, out and lse contiguous); ``typed()``: ``(q, main, extra, out [tokens, h_q, 512],
        lse [tokens, h_q])`` with the cache as a ``Source`` (bytes, paging, indices ``[tokens, 1, topk]``),
        built only when the launcher needs the whole argument list. q is copied where its address is not
        16-byte aligned (its rows are copied 16 bytes at a time; the signature does not key q's address)."""
        c = call
        q = c.q if c.q.data_ptr() % 16 == 0 else c.q.clone()
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = sm_scale * math.log2(math.e)
        values = (q, c.kv, c.indices, c.length, c.sink, c.out, c.lse, po, plse, scale)

        def full():
            _, main, _, out, lse = typed()
            rows, idx = q.reshape(-1, *q.shape[-2:]), main.indices
            return [rows, rows.stride(0), rows.stride(1), main.kv, main.stride_block, main.stride_row, main.page,
                    main.rows, idx, idx.stride(0), idx.shape[-1], main.length, len_div, c.sink, out, out.stride(0),
                    out.stride(1), lse, lse.stride(0), po, plse, rows.shape[1], self.hb, num_splits, scale,
                    *self.constexprs]

        self.launcher.bind(self.grid, values, full)


def sparse_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                  topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                  num_splits: Optional[int] = None, tile: Optional[tuple[int, int]] = None, *,
                  native_fp8: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse ``flash_mla_with_kvcache`` over a V3.2 FP8 paged cache on the ``mma_v2`` kernel: ``(out [b, s_q,
    h_q, 512] bf16, lse [b, h_q, s_q] fp32, natural log: a transposed view of the [b, s_q, h_q] the kernel
    writes, as ``flash_mla_with_kvcache`` returns sparse decoding's)``. ``indices``: slots ``block * page + offset``; -1,
    ``>= blocks * page`` and positions from ``topk_length[b]`` on are skipped. ``num_splits``: key-block splits a
    token (default: enough programs for every multiprocessor, ``splits.choose_num_splits``); ``tile``: (BLOCK_N,
    latent tiles) instead of the device's ``choose_decode_tile``; ``native_fp8``: False decodes the codes with the
    bit arithmetic of sm_80/86 on any GPU (the default is what the device has)."""
    from anymla.kvcache import KVCacheFormat

    from ..sparse_mla.launch import CallTensors, Source
    _check(q, kv_cache, indices, topk_length, attn_sink)
    b, s_q, h_q, _ = q.shape
    tokens, topk = b * s_q, indices.shape[-1]
    out = buffers.empty(b, s_q, h_q, 512, dtype=q.dtype, device=q.device)
    lse = buffers.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
    if tokens == 0 or h_q == 0:
        return out, lse.transpose(1, 2)
    idx = indices.reshape(tokens, 1, topk).contiguous()
    native = runtime.native_fp8(q.device) if native_fp8 is None else native_fp8
    tile = tile or choose_decode_tile(runtime.max_shared_memory(q.device), native)
    # One program a multiprocessor at a time (~250 registers x 256 threads)
    splits = num_splits or choose_num_splits(tokens * triton.cdiv(h_q, HEADS), triton.cdiv(topk, tile[0]),
                                             runtime.num_cores(q.device), 1, False)
    ws = workspaces(splits, tokens, h_q, q.device)
    call = CallTensors(q, kv_cache, idx, topk_length, None, None, None, attn_sink, out, lse, None)

    def typed():
        main = Source.paged(kv_cache, KVCacheFormat.V32_FP8, idx, topk_length)
        return q.reshape(tokens, h_q, 576), main, None, out.view(tokens, h_q, 512), lse.view(tokens, h_q)

    DecodeLaunch(q.device, tokens, h_q, topk_length is not None, attn_sink is not None, splits, tile, native)(
        call, typed, s_q, sm_scale, splits, ws)
    if ws is not None:
        _combine(splits, h_q, attn_sink is not None)(ws, out, lse, 1, (h_q * 512, 0, 512), (h_q, 0, 1), attn_sink)
    return out, lse.transpose(1, 2)
