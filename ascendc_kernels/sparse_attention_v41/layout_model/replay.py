"""Replay one key block of the kernel's data movement on numpy memories and compare every stage with the reference.

The block: a 64-head tile of one token, 64 keys of one source (random indices with invalid, out-of-range, repeated,
adjacent and descending pairs, a topk and a topk_length that end inside the block) in a paged cache with padding
between pages. Stages, with the parameters the kernel passes (``headers.py`` reads them from ``op_kernel/``):
gather parameters -> MTE2 row copies (pairs) -> decode / ND -> NZ -> L1 key tile; Q ND2NZ -> L1; L1 -> L0A/L0B; Q K^T;
FixPipe logits -> both vector cores' UB; bf16 P -> NZ -> L1; L1 -> L0A/L0B; P V; FixPipe drains -> UB. The reference
is ``anymla.kvcache.gather_rows`` for the key rows and float64 products for the logits and O.

``replay_block`` returns the failed checks (empty when the block moves correctly); ``overrides`` replaces named header
values, which is how an older kernel's parameters are replayed (``__main__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from anymla.kvcache import KVCacheFormat, gather_rows, quantize

from . import dequant
from .headers import Headers
from .memory import (Memory, bf16_to_f32, cast_f32_to_bf16, data_copy_blocks, data_copy_pad, f32_to_bf16,
                     fixpipe_nz2nd, load_2d, mmad, nd2nz, nz_offsets, read_matrix, vector_copy)

FORMATS = {1: KVCacheFormat.BF16, 2: KVCacheFormat.V41_FP8, 3: KVCacheFormat.V41_FP4}
INSTANTIATIONS = ((1, 0), (2, 0), (2, 2), (2, 3))  # (MAIN, EXTRA) KvFormat values the kernel is built for
PAGE, BLOCKS, PAD_ROWS = 7, 12, 3  # pages of 7 rows, 3 rows of padding after each page (non-packed blocks)
BLOCK_IN_SOURCE, TOPK, LENGTH = 1, 64 + 50, 64 + 45  # the replayed block: topk and topk_length end inside it
GLOBAL_BLOCK = 1  # the block's place in the core's stream: its L1 key slot is GLOBAL_BLOCK % kKvStages


@dataclass
class Params:
    """Header values, with ``overrides`` taking precedence."""

    headers: Headers
    overrides: dict

    def __getitem__(self, name: str):
        return self.overrides[name] if name in self.overrides else self.headers[name]


def _cache(fmt: KVCacheFormat, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """A paged cache [BLOCKS, PAGE, 1, row] with PAD_ROWS rows of padding after each page, and its bytes."""
    kv = torch.from_numpy(rng.standard_normal((BLOCKS, PAGE, 1, 512)).astype(np.float32) * 2).to(torch.bfloat16)
    dense = kv if fmt is KVCacheFormat.BF16 else quantize(kv, fmt)
    row = dense.shape[-1]
    storage = torch.from_numpy(rng.integers(0, 256, BLOCKS * (PAGE + PAD_ROWS) * row * dense.element_size(),
                                            dtype=np.uint8)).view(dense.dtype)
    cache = storage.as_strided(dense.shape, ((PAGE + PAD_ROWS) * row, row, row, 1))
    cache.copy_(dense)
    return cache, storage.view(torch.uint8).numpy()


def _indices(rng: np.random.Generator, rows: int) -> np.ndarray:
    """The token's indices [TOPK]: random slots, then hand-made cases in the replayed block."""
    idx = rng.integers(0, rows, TOPK).astype(np.int32)
    b = BLOCK_IN_SOURCE * 64
    idx[b + 0], idx[b + 1] = 10, 11        # adjacent rows of one page: a pair with source gap 0
    idx[b + 2], idx[b + 3] = 30, 12        # descending: stored in address order
    idx[b + 4], idx[b + 5] = 5, 5          # the same row twice: two single copies
    idx[b + 6], idx[b + 7] = -1, 3         # invalid first
    idx[b + 8], idx[b + 9] = 2, rows + 4   # out of range second
    idx[b + 34], idx[b + 35] = 40, 41      # a pair of the other vector core
    idx[b + 36], idx[b + 37] = -7, rows    # both invalid
    return idx


def _expected_slots(idx: np.ndarray, valid: np.ndarray, addr: np.ndarray, gm_row: int) -> np.ndarray:
    """Which key each slot of the block holds: pairs of valid keys go in address order (the kernel's gather2)."""
    order = np.arange(64)
    for r in range(0, 64, 2):
        lo, hi = sorted((addr[r], addr[r + 1]))
        if valid[r] and valid[r + 1] and hi - lo >= gm_row and hi - lo - gm_row <= 0xFFFFFFFF and addr[r] > addr[r + 1]:
            order[r], order[r + 1] = r + 1, r
    return order


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    scale = max(float(np.abs(want).max()), 1.0)
    return bool(np.all(np.isfinite(got)) and np.abs(got.astype(np.float64) - want).max() <= 1e-5 * scale)


def replay_block(headers: Headers, fixpipe: tuple[str, bool], main: int, extra: int, from_extra: bool, seed: int = 0,
                 overrides: Optional[dict] = None) -> list[str]:
    """Failed checks of one replayed block of instantiation (main, extra), from its main or extra source."""
    P = Params(headers, overrides or {})
    U = headers.struct("UbLayout", MAIN=main, EXTRA=extra)
    L1L, L0L = headers.struct("L1Layout"), headers.struct("L0Layout")
    rng = np.random.default_rng(seed)
    row_format = extra if from_extra else main
    fmt = FORMATS[row_format]
    cache, gm = _cache(fmt, rng)
    rows = BLOCKS * PAGE
    block_stride, row_stride = cache.stride(0) * cache.element_size(), cache.stride(1) * cache.element_size()
    gm_row = P["GmRowBytes"](row_format)
    idx = _indices(rng, rows)
    q_bits = f32_to_bf16(rng.standard_normal((64, 512)).astype(np.float32))
    probs = rng.random((64, 64)).astype(np.float32)
    ubs = (Memory("UB0", P["kUbBytes"], rng), Memory("UB1", P["kUbBytes"], rng))
    l1, l0a, l0b, l0c = (Memory(n, P[s], rng) for n, s in
                         (("L1", "kL1Bytes"), ("L0A", "kL0aBytes"), ("L0B", "kL0bBytes"), ("L0C", "kL0cBytes")))
    failures = []

    # gather parameters (BuildGatherParams): slot or -1 per lane, 0 / -inf bias, int64 byte offsets
    first = BLOCK_IN_SOURCE * 64
    # lanes past topk hold whatever the copy's padding left (here: random values, some of them valid slots)
    block_idx = np.concatenate([idx[first:first + 64], rng.integers(0, rows, 64 - len(idx[first:first + 64]))])
    block_idx = block_idx.astype(np.int32)
    limit = min(TOPK, LENGTH) - first
    slots = np.where(np.arange(64) < limit, block_idx, -1)
    slots = np.where(slots <= rows - 1, slots, -1)
    slots = np.where(slots >= 0, slots, -1)
    page_of = slots // PAGE  # floor and C division differ only on invalid (-1) lanes, whose offset is unused
    addr = page_of.astype(np.int64) * block_stride + (slots - page_of * PAGE).astype(np.int64) * row_stride
    pos = np.arange(first, first + 64)
    ref_valid = (pos < TOPK) & (pos < LENGTH) & (block_idx >= 0) & (block_idx < rows)  # emulation.py's rule
    if not np.array_equal(slots >= 0, ref_valid):
        failures.append("gather parameters: validity differs from the reference's rule")

    # keys: MTE2 copies -> decode -> ND -> NZ -> L1 key tile (per vector core and chunk)
    chunk, pitch = U["kChunk"], U["kPitch"]
    kv_slot = GLOBAL_BLOCK % P["kKvStages"]
    table = dequant.decode_table(headers)
    nz_bytes = (512 // 16) * P["NzRows"](chunk) * P["kDataBlock"]
    for v, ub in enumerate(ubs):
        for c in range(P["kKeysPerVectorCore"] // chunk):
            stage = c & 1
            raw, nz = U["kRaw"] + stage * chunk * pitch, U["kNz"] + stage * nz_bytes
            lanes = range(v * 32 + c * chunk, v * 32 + (c + 1) * chunk)
            own = np.array(lanes)
            for r in range(0, chunk, 2):
                a0, a1 = addr[own[r]], addr[own[r + 1]]
                v0, v1 = slots[own[r]] >= 0, slots[own[r + 1]] >= 0
                lo, hi = min(a0, a1), max(a0, a1)
                if v0 and v1 and hi - lo >= gm_row and hi - lo - gm_row <= 0xFFFFFFFF:
                    data_copy_pad(gm, int(lo), ub, raw + r * pitch, 2, gm_row, int(hi - lo - gm_row),
                                  P["PairDstGap"](row_format, main, extra))
                    continue
                for k, (ok, a) in enumerate(((v0, a0), (v1, a1))):
                    if ok:
                        data_copy_pad(gm, int(a), ub, raw + (r + k) * pitch, 1, gm_row, 0, 0)
            for r in range(chunk):
                src = raw + r * pitch
                if slots[own[r]] < 0:
                    src = U["kRowBf16"] if U["kQuantized"] else src
                    ub.write(src, np.zeros(512, np.uint16))
                elif U["kQuantized"]:
                    row = ub.read(src, gm_row)
                    with np.errstate(all="ignore"):
                        bits = dequant.decode_fp4_row(row, table) if row_format == 3 else dequant.decode_fp8_row(row)
                    src = U["kRowBf16"]
                    ub.write(src, bits)
                vector_copy(ub, nz + r * P["kDataBlock"], src, P["kNdToNzMask"] // 16, P["kNdToNzRepeats"],
                            P["NdToNzDstBlockStride"](chunk), P["kNdToNzSrcBlockStride"],
                            P["NdToNzDstRepeatStride"](chunk), P["kNdToNzSrcRepeatStride"])
            for half in range(2):
                data_copy_blocks(ub, nz + half * P["kNzToL1BlockCount"] * P["NzRows"](chunk) * P["kDataBlock"], l1,
                                 L1L["Kv"](kv_slot, half) + (v * 32 + c * chunk) * P["kDataBlock"],
                                 P["kNzToL1BlockCount"], P["NzToL1BlockLen"](chunk), P["kNzToL1SrcGap"],
                                 P["NzToL1DstGap"](chunk))

    order = _expected_slots(block_idx, slots >= 0, addr, gm_row)
    held = slots[order]
    ref_rows = gather_rows(cache, torch.from_numpy(np.where(held >= 0, held, 0)).long(), fmt)
    ref_rows = (ref_rows[:, 0] if fmt is KVCacheFormat.BF16 else ref_rows).view(torch.int16).numpy().view(np.uint16)
    tile_ref = np.where((held >= 0)[:, None], ref_rows, 0).astype(np.uint16)
    tile = np.concatenate([read_matrix(l1, L1L["Kv"](kv_slot, h), nz_offsets(64, 256), np.uint16) for h in range(2)], 1)
    if not np.array_equal(tile, tile_ref):
        bad = [int(r) for r in np.nonzero((tile != tile_ref).any(1))[0]]
        failures.append(f"L1 key tile: rows {bad} differ from anymla.kvcache.gather_rows")
    keys = bf16_to_f32(tile_ref).astype(np.float64)
    key_bytes = [l1.read(L1L["Kv"](kv_slot, h), L1L["kKvHalf"]) for h in range(2)]

    # Q: GM ND -> L1 Nz, Q K^T on the cube, FixPipe to both UBs
    q_slot, logits_slot = 0, GLOBAL_BLOCK & 1
    q_gm = q_bits.ravel()
    for half in range(2):
        nd2nz(q_gm, half * P["kQDValue"], l1, L1L["Q"](q_slot, half), P["kQNValue"], P["kQDValue"], P["kQSrcDValue"],
              P["kQDstNzC0Stride"], P["kQDstNzNStride"])
    for half in range(2):
        load_2d(l1, L1L["Q"](q_slot, half), l0a, 0, 0, P["kQLoadRepeat"], 1, False)
        _load_key_operand(P, l1, L1L["Kv"](kv_slot, half), l0b, "Kt")
        mmad(l0a, 0, l0b, 0, l0c, L0L["Logits"](logits_slot), 64, 64, 256, half == 0)
    ub_logits = U["kLogits"] + logits_slot * 32 * 64 * 4
    layout, to_ub = fixpipe
    if layout != "ROW_MAJOR":
        failures.append(f"FixPipe: config layout {layout}, the kernel's UB reads need ROW_MAJOR (NZ2ND)")
    fixpipe_nz2nd(l0c, L0L["Logits"](logits_slot), 64, P["kLogitsFixN"], P["kFixSrcStride"], P["kLogitsFixDstStride"],
                  P["kFixDualDstSplitM"] == 1, to_ub, ubs, l1, ub_logits)
    logits_ref = bf16_to_f32(q_bits).astype(np.float64) @ keys.T
    for v, ub in enumerate(ubs):
        got = ub.read(ub_logits, 32 * 64 * 4).view(np.float32).reshape(32, 64)
        if not _close(got, logits_ref[32 * v:32 * v + 32]):
            failures.append(f"logits in UB of vector core {v}: not Q K^T rows [{32 * v}, {32 * v + 32})")
    for h in range(2):
        if not np.array_equal(l1.read(L1L["Kv"](kv_slot, h), L1L["kKvHalf"]), key_bytes[h]):
            failures.append(f"L1 key tile half {h}: overwritten by the logits FixPipe (it took the L0C -> L1 path)")

    # P: each vector core's fp32 rows -> bf16 Nz in UB -> L1 probs tile; P V on the cube; drains to UB
    probs_ub = U["kProbs"] + logits_slot * 32 * 64 * 2
    for v, ub in enumerate(ubs):
        ub.write(ub_logits, probs[32 * v:32 * v + 32])
        cast_f32_to_bf16(ub, probs_ub, ub_logits, 32, P["kProbsCastDstBlkStride"], P["kProbsCastSrcBlkStride"],
                         P["kProbsCastDstRepStride"], P["kProbsCastSrcRepStride"])
        for half in range(2):
            data_copy_blocks(ub, probs_ub + half * P["kProbsToL1BlockCount"] * 32 * P["kDataBlock"], l1,
                             L1L["Probs"](logits_slot, half) + v * 32 * P["kDataBlock"], P["kProbsToL1BlockCount"],
                             P["kProbsToL1BlockLen"], P["kProbsToL1SrcGap"], P["kProbsToL1DstGap"])
    for half in range(2):
        for keys_half in range(2):
            load_2d(l1, L1L["Probs"](logits_slot, keys_half), l0a, keys_half * P["kProbsLoadRepeat"] * 512, 0,
                    P["kProbsLoadRepeat"], 1, False)
        _load_key_operand(P, l1, L1L["Kv"](kv_slot, half), l0b, "V")
        mmad(l0a, 0, l0b, 0, l0c, L0L["kPartial"] + half * 64 * 256 * 4, 64, 256, 64, True)
    p_bf16 = bf16_to_f32(f32_to_bf16(probs)).astype(np.float64)
    out_ref = p_bf16 @ keys
    drain = P["kDrainChunk"]
    for ch in range(512 // drain):
        dst = U["kDrain"] + (ch & 1) * 32 * drain * 4
        fixpipe_nz2nd(l0c, L0L["kPartial"] + ch * 64 * drain * 4, 64, P["kDrainFixN"], P["kFixSrcStride"],
                      P["kDrainFixDstStride"], P["kFixDualDstSplitM"] == 1, to_ub, ubs, l1, dst)
        for v, ub in enumerate(ubs):
            got = ub.read(dst, 32 * drain * 4).view(np.float32).reshape(32, drain)
            if not _close(got, out_ref[32 * v:32 * v + 32, ch * drain:(ch + 1) * drain]):
                failures.append(f"O drain chunk {ch} in UB of vector core {v}: not bf16(P) V")
    return failures


def _load_key_operand(P: Params, l1: Memory, src: int, l0b: Memory, name: str) -> None:
    """``CubeCore::LoadKeyOperand`` with the K^T ("Kt") or V parameter set."""
    for i in range(P[f"k{name}Loads"]):
        load_2d(l1, src, l0b, i * P[f"k{name}DstStep"] * 512, i * P[f"k{name}StartStep"], P[f"k{name}Repeat"],
                P[f"k{name}SrcStride"], P[f"k{name}Transpose"] != 0)


def replay_kernel(headers: Headers, fixpipe: tuple[str, bool], overrides: Optional[dict] = None,
                  seed: int = 0) -> dict[str, list[str]]:
    """Every instantiation and source: {"FP8+FP4 extra": failures, ...}."""
    names = {1: "BF16", 2: "FP8", 3: "FP4"}
    results = {}
    for main, extra in INSTANTIATIONS:
        for from_extra in ((False, True) if extra else (False,)):
            label = f"{names[main]}{'+' + names[extra] if extra else ''} {'extra' if from_extra else 'main'} block"
            results[label] = replay_block(headers, fixpipe, main, extra, from_extra, seed, overrides)
    return results


