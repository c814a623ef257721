"""Host side of the Hopper kernels: whether a call fits them, and their launches.

They serve sm_90 GPUs with Triton 3.6 or 3.7 (Gluon), for 64-row tiles (the compute-bound regime) and their
few-head forms (8, 16 or 32 heads a program: tensor-parallel head counts), one kv head and 16-bit values (sparse
decoding: V3.2, V4.1 and MODEL1 quantized caches, and bf16/fp16 caches whose blocks lie back to back); everything
else keeps the portable kernels. ``tuning.forced(warp_specialized=...)`` turns them off or insists on them (an error when the call does
not fit).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from anymla.kvcache import KVCacheFormat

from .. import runtime
from ..launcher import LatestDescriptors, Launcher
from ..splits import choose_num_splits
from ..tuning import (HOPPER_FEWEST_ROWS, TileConfig, forced_splits, forced_tma, forced_warp_specialized,
                      hopper_program_heads, warp_specialized_config)


def _device_reasons(device: torch.device, tile: TileConfig, op: str = "") -> list[str]:
    """Why the Hopper kernels cannot take this device or tile (empty: they can). ``op``'s entry of
    ``tuning.HOPPER_FEWEST_ROWS`` says from which of the portable tile's row blocks on they take a call (their
    64-row tile masks the rows past h_q); forcing them takes any call whatever it says (sweeps)."""
    if forced_warp_specialized() is False:
        return ["turned off (tuning.forced(warp_specialized=False), or ANYMLA_HOPPER_KERNELS=0)"]
    kind = runtime.device_kind(device)
    if kind != "cuda_sm90":
        here = {"interpret": "Triton's interpreter", "npu": "an Ascend NPU", "rocm": "an AMD GPU"}.get(kind)
        return [f"they run on sm_90 GPUs only, this is {here or 'sm_%d%d' % torch.cuda.get_device_capability(device)}"]
    if not runtime.gluon_hopper():
        return [f"Triton {triton.__version__}'s Gluon is not a version they were checked with (3.6, 3.7)"]
    if warp_specialized_config() is None:
        return ["a tile of the portable kernel is forced"]
    fewest, why = HOPPER_FEWEST_ROWS.get(op, (64, ""))
    if tile.block_h < fewest and not forced_warp_specialized():
        return [f"at most {tile.block_h} query rows a kv head: the portable kernel's small tiles are faster here "
                f"({why})"]
    return []


def _value_reasons(q: torch.Tensor, kv: torch.Tensor, h_kv: int) -> list[str]:
    reasons = [] if h_kv == 1 else [f"h_kv {h_kv}: they take one kv head"]
    if q.dtype != kv.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"q {q.dtype} and cache {kv.dtype}: they take bf16 or fp16, the same for both")
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or kv.data_ptr() % 16:
        reasons.append("q or the cache is not contiguous along its last dimension, or the cache not 16-byte aligned")
    return reasons


def dense_decode_reasons(p, tile: TileConfig) -> list[str]:
    """Why the Hopper dense kernel does not serve this call (empty: it does). Besides the device and values:
    pages of whole key blocks and cache rows the TMA can address flat."""
    reasons = _device_reasons(p.device, tile, "dense_decode")
    if reasons:
        return reasons
    kv = p.k_cache
    num_blocks, page, h_kv, d = kv.shape
    reasons = _value_reasons(p.q, kv, h_kv)
    block_n = warp_specialized_config().block_n
    if page % block_n:
        reasons.append(f"page size {page} is not a multiple of {block_n} keys")
    if kv.stride(1) != d or kv.stride(0) != page * d or num_blocks * page >= 2 ** 31:
        reasons.append("cache blocks not packed (block stride > page x row) or over 2^31 rows")
    if forced_tma() is False:
        reasons.append("tensor-memory copies turned off (tuning.forced(tma=False))")
    return reasons


def sparse_prefill_reasons(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, tile: TileConfig) -> list[str]:
    """Why the Hopper prefill kernel does not serve this call (empty: it does). Besides the device and
    values: rows the 16-byte copies can address."""
    reasons = _device_reasons(q.device, tile, "sparse_prefill") or _value_reasons(q, kv, kv.shape[1])
    if not reasons and (kv.stride(0) * kv.element_size() % 16 or indices.stride(-1) != 1):
        reasons.append("kv rows not 16-byte aligned, or indices not contiguous along topk")
    return reasons


def sparse_decode_reasons(p, tile: TileConfig) -> list[str]:
    """Why the Hopper decoding kernel does not serve this sparse ``flash_mla_with_kvcache`` call (empty: it
    does). Besides the device: a V3.2 FP8 cache alone, a V4.1 FP8 cache with or without a V4.1 (FP8 or FP4)
    extra cache, or a MODEL1 FP8 cache with or without a MODEL1 FP8 extra cache; bf16 queries; rows the 16-byte
    copies can address."""
    reasons = _device_reasons(p.device, tile, "sparse_decode")
    if reasons:
        return reasons
    F = KVCacheFormat
    extras = {F.V41_FP8: (F.V41_FP8, F.V41_FP4), F.MODEL1_FP8: (F.MODEL1_FP8,)}
    if p.fmt is F.V32_FP8 and p.extra_k_cache is not None:
        reasons.append("a V32_FP8 cache with an extra cache: it reads a V3.2 cache alone")
    elif p.fmt not in (F.V32_FP8, *extras):
        reasons.append(f"a {p.fmt.name} cache: it dequantizes V32_FP8, V41_FP8 and MODEL1_FP8 main caches")
    elif p.extra_k_cache is not None and p.extra_fmt not in extras[p.fmt]:
        reasons.append(f"a {p.extra_fmt.name} extra cache with a {p.fmt.name} cache: it pairs V41_FP8 caches with "
                       "V41_FP8 or V41_FP4 extra caches and MODEL1_FP8 caches with MODEL1_FP8 ones")
    if p.q.dtype != torch.bfloat16 or p.q.stride(-1) != 1:
        reasons.append(f"q {p.q.dtype}: it takes bf16, contiguous along its last dimension")
    for kv, fmt in ((p.k_cache, p.fmt), (p.extra_k_cache, p.extra_fmt)):
        if kv is None:
            continue
        # MODEL1 rows lie 576 bytes apart in their block, whatever the row stride of the container view (584).
        row_bytes = 576 if fmt is F.MODEL1_FP8 else kv.stride(1) * kv.element_size()
        if kv.data_ptr() % 16 or (kv.stride(0) * kv.element_size()) % 16 or row_bytes % 16:
            reasons.append("cache blocks or rows not 16-byte aligned")
            break
    return reasons


def bf16_decode_through_prefill(h_q: int) -> bool:
    """Whether a bf16/fp16 sparse decoding call's Hopper kernel is the prefill kernel (64-head programs: the
    decoding kernel's 64-head form dequantizes) rather than the decoding kernel's few-head form."""
    return hopper_program_heads("sparse_decode", h_q)[0] == 64


def bf16_decode_reasons(p, tile: TileConfig, cores: int) -> list[str]:
    """Why no Hopper kernel serves this sparse decoding call over a bf16/fp16 cache (empty: one does, which
    :func:`bf16_decode_through_prefill` tells). Both read the cache as one flat kv of ``num_blocks x page``
    rows, a slot being its row, by 16-byte copies, so its blocks must lie back to back. At most 32 heads: the
    decoding kernel's few-head form, whose workers gather the rows as prefill's do (no conversion), with its
    usual splits. More: the prefill kernel, the call's ``b x s_q`` tokens as its queries (invalid slots are
    skipped and empty tokens give out 0, lse +inf alike); it has no split along the keys, so it takes a call
    where the decoding kernels would not split either (``cores`` multiprocessors, one program each), and any
    call when forced."""
    b, s_q, h_q, _ = p.q.shape
    through_prefill = bf16_decode_through_prefill(h_q)
    reasons = _device_reasons(p.device, tile, "sparse_prefill" if through_prefill else "sparse_decode")
    if reasons:
        return reasons
    kv = p.k_cache
    num_blocks, page, h_kv, _ = kv.shape
    if p.extra_k_cache is not None:
        reasons.append("an extra cache: they gather bf16 rows from one cache")
    reasons += _value_reasons(p.q, kv, h_kv)
    if kv.stride(0) != page * kv.stride(1) or num_blocks * page >= 2 ** 31 or kv.stride(1) * kv.element_size() % 16:
        reasons.append("cache blocks not packed (block stride > page x row), over 2^31 rows, or rows not 16-byte "
                       "aligned")
    if num_blocks * page == 0 or p.indices.shape[-1] == 0:
        reasons.append("no row to attend (an empty cache or a top-k of 0)")
    if not through_prefill:
        return reasons
    splits = forced_splits()
    if splits not in (None, 1):
        reasons.append(f"{splits} splits forced: the prefill kernel, which takes bf16 decoding at {h_q} heads, "
                       "does not split the keys")
    elif splits is None and not forced_warp_specialized():
        programs = b * s_q * triton.cdiv(h_q, hopper_program_heads("sparse_prefill", h_q)[0])
        if choose_num_splits(programs, triton.cdiv(p.indices.shape[-1], tile.block_n), cores, 1,
                             p.batch_invariant) > 1:
            reasons.append(f"{programs} programs of one token each leave most of {cores} multiprocessors idle: "
                           "the portable kernel splits the keys to fill them")
    return reasons


def use(reasons: list[str]) -> bool:
    """Whether to launch a Hopper kernel; a forced one that cannot run raises with every reason."""
    if reasons and forced_warp_specialized():
        raise ValueError("the warp-specialized Hopper kernel was forced, but: " + "; ".join(reasons))
    return not reasons


def describe(reasons: list[str], portable: str, tile: TileConfig, num_splits: int, form: str = "") -> str:
    """``explain()``'s kernel line: which kernel the Triton tier runs (the Hopper kernel's ``form`` where it
    has several) and why not the other, its tile (the portable kernel's as planned; a first launch may shrink
    it to fit) and its split count."""
    if not reasons:
        text = "the warp-specialized Hopper kernel (triton_kernels/hopper/)" + (f", {form}" if form else "")
    else:
        text = (f"the portable {portable} kernel (tile {tile.block_h} rows x {tile.block_n} keys, "
                f"{tile.num_stages} stages, {tile.num_warps} warps); not the Hopper one: " + "; ".join(reasons))
    return text + (f"; {num_splits} splits along the keys" if num_splits > 1 else "")


def _shared_layout(block, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


class DenseDecodeLaunch:
    """The Hopper dense decoding kernel's launch for one plan (``p``: a validated DenseDecode of its signature)."""

    def __init__(self, p, causal: bool, split: bool):
        from .kernels import BLOCK_H, REGS, dense_decode_hopper_kernel
        b, s_q, h_q, d = p.q.shape
        self.tile = warp_specialized_config()
        self.rb = triton.cdiv(s_q * h_q, BLOCK_H.value)
        self.grid_rows = b * self.rb
        self.constexprs = [d, causal, p.attn_sink is not None, split, self.tile.num_stages]
        self.launcher = Launcher(dense_decode_hopper_kernel, num_warps=4, maxnreg=REGS.value)
        self.descriptors = LatestDescriptors(self._make_descriptors)

    def _make_descriptors(self, kv: torch.Tensor):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        d = kv.shape[-1]
        flat = kv.view(kv.shape[0] * kv.shape[1], d)
        n = self.tile.block_n
        make = lambda cols: TensorDescriptor.from_tensor(flat, [n, cols], _shared_layout([n, cols], kv.dtype))  # noqa: E731
        return make(512), make(64) if d == 576 else None

    def __call__(self, p, num_splits: int, ws, out, lse) -> None:
        _, s_q, h_q, _ = p.q.shape
        kv, q, bt = p.k_cache, p.q, p.block_table
        k_desc, r_desc = self.descriptors(kv)
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = p.sm_scale * math.log2(math.e)
        self.launcher.bind((self.grid_rows, num_splits, 1),
                           (q, k_desc, r_desc, bt, p.cache_seqlens, p.attn_sink, out, lse, po, plse, scale), lambda: [
            q, q.stride(0), q.stride(1), q.stride(2), k_desc, r_desc, kv.shape[1], kv.shape[0],
            bt, bt.stride(0), bt.shape[1] * kv.shape[1], p.cache_seqlens, p.attn_sink,
            out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0), lse.stride(2), lse.stride(1),
            po, plse, s_q, h_q, self.rb, num_splits, scale, *self.constexprs])


class SparsePrefillLaunch:
    """The Hopper sparse prefill kernel's launch for one plan (``tile.block_h``: heads a program,
    ``program_shape``)."""

    def __init__(self, tile: TileConfig, q: torch.Tensor, kv: torch.Tensor, has_len: bool, has_sink: bool):
        from .kernels import REGS, sparse_prefill_hopper_kernel
        s_q, h_q, d = q.shape
        self.hb = triton.cdiv(h_q, tile.block_h)
        self.grid = (s_q * self.hb, 1, 1)
        self.constexprs = [d, has_len, has_sink, tile.block_n, tile.num_stages,
                           _shared_layout([tile.block_n, 512], kv.dtype), _shared_layout([tile.block_n, 64], kv.dtype),
                           tile.block_h]
        self.launcher = Launcher(sparse_prefill_hopper_kernel, num_warps=4, maxnreg=REGS.value)

    def __call__(self, q, kv, indices, topk_length, sink, sm_scale: float, out, lse, max_logits,
                 len_div: int = 1) -> None:
        """q ``[tokens, h_q, d_qk]``, kv ``[rows, 1, d_qk]``, indices ``[tokens, 1, topk]`` rows of kv, topk_length
        ``[tokens // len_div]``; out ``[tokens, h_q, 512]``, lse and max_logits ``[tokens, h_q]`` contiguous."""
        scale = sm_scale * math.log2(math.e)
        self.launcher.bind(self.grid, (q, kv, indices, topk_length, sink, out, lse, max_logits, scale), lambda: [
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], indices, indices.stride(0),
            indices.shape[-1], topk_length, len_div, sink, out, out.stride(0), out.stride(1), lse, max_logits,
            q.shape[1], self.hb, scale, *self.constexprs])


def program_shape(op: str, h_q: int) -> tuple[TileConfig, str]:
    """The programs of the Hopper ``op`` ("sparse_decode" or "sparse_prefill") kernel for ``h_q`` heads a token
    (their heads as ``block_h``) and which form of it that is, with why (``tuning.hopper_program_heads``)."""
    heads, why = hopper_program_heads(op, h_q)
    tile = dataclasses.replace(warp_specialized_config(), block_h=heads)
    if heads == 64:
        return tile, "64 heads a program"
    return tile, f"its few-head form (hopper/few_heads.py), {heads} heads a program: {why}"


class SparseDecodeLaunch:
    """The Hopper sparse decoding kernel's launch for one plan: ``q [tokens, h_q, d_qk]`` (``dtype``) over the
    slots of a quantized cache (or, in the few-head form, a bf16/fp16 one) and, if given, those of an extra cache
    (``sparse_mla.launch.Source``: bytes, paging, indices, lengths indexed by ``token // len_div``); out
    ``[tokens, h_q, 512]`` and lse ``[tokens, h_q]``, or the split workspaces. ``tile.block_h``: heads a program
    (``program_shape``)."""

    def __init__(self, tile: TileConfig, tokens: int, h_q: int, d: int, main_code: int, x_code: int, has_x: bool,
                 has_len: bool, has_x_len: bool, has_sink: bool, split: bool, dtype: torch.dtype):
        from .few_heads import launch_regs
        from .kernels import REGS, sparse_decode_hopper_kernel
        self.hb = triton.cdiv(h_q, tile.block_h)
        self.grid_rows = tokens * self.hb
        self.constexprs = [d, main_code, x_code, has_x, has_len, has_x_len, has_sink, split, tile.block_n,
                           _shared_layout([tile.block_n, 512], dtype), _shared_layout([tile.block_n, 64], dtype),
                           tile.block_h]
        regs = REGS.value if tile.block_h == 64 else launch_regs(tile.block_h, main_code)
        self.launcher = Launcher(sparse_decode_hopper_kernel, num_warps=4, maxnreg=regs)

    def __call__(self, call, typed, len_div: int, sm_scale: float, num_splits: int, ws) -> None:
        """``call``: the call's tensors (``sparse_mla.launch.CallTensors``); ``typed()``: ``(q, main, extra, out,
        lse)`` as the kernel is compiled for, built only when the launcher needs the whole argument list."""
        c = call
        x_kv, x_idx, x_len = c.x_source()
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = sm_scale * math.log2(math.e)
        values = (c.q, c.kv, c.indices, c.length, x_kv, x_idx, x_len, c.sink, c.out, c.lse, po, plse, scale)

        def full():
            q, main, extra, out, lse = typed()
            x = extra or main
            h_q = q.shape[1]
            idx, x_idx = (s.indices.reshape(q.shape[0], s.indices.shape[-1]) for s in (main, x))
            return [
                q, q.stride(0), q.stride(1), main.kv, main.stride_block, main.stride_row, main.page, main.rows, idx,
                idx.stride(0), idx.shape[-1], main.length,
                x.kv, x.stride_block, x.stride_row, x.page, x.rows, x_idx, x_idx.stride(0), x_idx.shape[-1], x.length,
                len_div, c.sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), po, plse,
                h_q, self.hb, num_splits, scale, *self.constexprs]

        self.launcher.bind((self.grid_rows, num_splits, 1), values, full)
