"""Tiling of the Ascend C sparse-attention kernel, as a pure function of the problem shape and the SoC.

This is the CPU-testable core of the tier: it decides the block sizes, the split of the work over AI cores
and the plan of every static on-chip buffer (with its byte size), from the hardware table below. The
kernel's static sizes for Ascend 950 live in ``sparse_attention_v41/op_kernel/tiling_data.h``; the test
suite checks that header against :func:`plan` so the two cannot drift apart.

Work. A *unit* is one query token times one tile of 64 query heads; units are independent (no split-KV,
no combine, so results do not depend on the batch: batch invariant by construction). A unit walks its
keys in blocks of ``B_TOPK = 64``: first the main cache's ``ceil(topk / 64)`` blocks, then the extra
cache's ``ceil(extra_topk / 64)``; the tail of each is masked. Every unit has the same number of blocks
(``topk_length`` only masks), so units are split over the AI cores in contiguous ranges whose sizes differ
by at most one.

Buffers. One AI core = one cube core (AIC) + two vector cores (AIV). The cube keeps Q and the gathered K/V
blocks in L1, computes ``P = Q K^T`` and ``O_partial += S V`` in L0C; each vector core owns 32 of the 64
heads: their softmax state and their ``[32, 512]`` fp32 O accumulator in its own UB (FlashMLA's Ascend
design; L0C cannot be rescaled in place). Each vector core also gathers and dequantizes half of every key
block. Sizes here are per core (per AIV for UB). Figures for the hardware are documentation values
(``shared/reference/ascend_notes.md`` section 2), not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from anymla.kvcache import KVCacheFormat

KB = 1024

HEADS_PER_TILE = 64  # M of both matmuls; the article measures M = 64 as enough to saturate the cube
B_TOPK = 64  # keys per block (N of Q K^T, K of S V)
D_QK = 512  # V4.1 latent width (rope included), K of Q K^T
D_V = 512  # V = the whole latent row
VECTOR_CORES_PER_CUBE = 2
HEADS_PER_VECTOR_CORE = HEADS_PER_TILE // VECTOR_CORES_PER_CUBE  # O / softmax rows owned by one AIV
KEYS_PER_VECTOR_CORE = B_TOPK // VECTOR_CORES_PER_CUBE  # keys of each block one AIV gathers
RESCALE_THRESHOLD = 6.0  # skip-scale threshold, natural log units of the scaled logits
ROW_STATE_VECTORS = 12  # m_run[2], m_use[2], l[2], alpha[2], row max, row sum, sink, scale
MAILBOX_SLOTS = 8  # ring of per-block skip-scale bits (vector -> cube), see the kernel
MAILBOX_ENTRY_BYTES = 64  # one cache line per (slot, vector core): no false sharing between writers

_UB_ALIGN = 32  # UB and L1 addresses are 32-byte aligned
_MAX_KV_STAGES = 5  # cube on blocks j-1 (P V) and j (Q K^T) while the vectors fill j+1 .. j+3
_GATHER_CHUNKS = (32, 16, 8)  # keys gathered per chunk by one AIV, largest first
_DRAIN_CHUNKS = (128, 64)  # columns of O_partial moved L0C -> UB per FixPipe, largest first
_PARTIAL_CHUNKS = (256, 128, 64)  # columns of O_partial held in L0C when it cannot stay resident


@dataclass(frozen=True)
class SocSpec:
    """What the tiling needs to know about one SoC family (documentation values, per core)."""

    name: str
    arch: int  # NpuArch: 3510 (Ascend 950), 2201 (Atlas A2/A3)
    aic_cores: int  # default core count; the host binding asks the runtime for the real one
    ub_bytes: int  # usable UB per vector core
    l1_bytes: int
    l1_banks: int  # independent L1 banks; tensors are split in halves across them when there are two
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    on_chip_exchange: bool  # L0C -> UB (FixPipe) and UB -> L1 paths exist; else via a GM workspace


SOCS: dict[str, SocSpec] = {
    # 950: UB 256 KB physical, 248 KB usable; L0C 256 KB; L1 in two 256 KB banks (FlashMLA's article).
    "Ascend950PR": SocSpec("Ascend950PR", 3510, 32, 248 * KB, 512 * KB, 2, 64 * KB, 64 * KB, 256 * KB, True),
    "Ascend950DT": SocSpec("Ascend950DT", 3510, 32, 248 * KB, 512 * KB, 2, 64 * KB, 64 * KB, 256 * KB, True),
    # A2/A3: UB 192 KB minus 8 KB the ASC runtime reserves; L1 loses 256 B in mix mode; L0C 128 KB.
    "Ascend910B": SocSpec("Ascend910B", 2201, 24, 184 * KB, 512 * KB - 256, 1, 64 * KB, 64 * KB, 128 * KB, False),
    "Ascend910_93": SocSpec("Ascend910_93", 2201, 24, 184 * KB, 512 * KB - 256, 1, 64 * KB, 64 * KB, 128 * KB,
                            False),
}


def soc_spec(soc: str | SocSpec) -> SocSpec:
    """The table entry of ``soc`` (a full SoC name such as ``Ascend950PR_9589`` matches its family)."""
    if isinstance(soc, SocSpec):
        return soc
    for family in sorted(SOCS, key=len, reverse=True):
        if soc.startswith(family):
            return SOCS[family]
    raise ValueError(f"soc: no hardware table entry for {soc!r} (known: {', '.join(SOCS)})")


@dataclass(frozen=True)
class KernelShape:
    """The launch-relevant shape of one call, in the kernel's token view (decode folds s_q into batch)."""

    tokens: int
    heads: int
    topk: int
    main_fmt: KVCacheFormat  # BF16 (prefill) or V41_FP8 (decode)
    extra_topk: int = 0
    extra_fmt: Optional[KVCacheFormat] = None

    @property
    def head_tiles(self) -> int:
        return self.heads // HEADS_PER_TILE

    @property
    def units(self) -> int:
        return self.tokens * self.head_tiles

    @property
    def main_blocks(self) -> int:
        return math.ceil(self.topk / B_TOPK)

    @property
    def extra_blocks(self) -> int:
        return math.ceil(self.extra_topk / B_TOPK)

    @property
    def blocks_per_unit(self) -> int:
        return self.main_blocks + self.extra_blocks

    @property
    def formats(self) -> tuple[KVCacheFormat, ...]:
        return (self.main_fmt,) if self.extra_fmt is None else (self.main_fmt, self.extra_fmt)


def row_bytes(fmt: KVCacheFormat) -> int:
    """Bytes of one gathered latent row in GM (data and scales are adjacent per token in V4.1)."""
    return 2 * D_QK if fmt is KVCacheFormat.BF16 else fmt.spec.bytes_per_token


def _align(n: int, to: int = _UB_ALIGN) -> int:
    return -(-n // to) * to


def ub_row_bytes(fmt: KVCacheFormat) -> int:
    """A gathered row's footprint in UB: MTE2 pads every burst to 32 bytes (528 -> 544)."""
    return _align(row_bytes(fmt))


@dataclass(frozen=True)
class Buffer:
    memory: str  # "L1", "L0A", "L0B", "L0C", "UB" (per vector core) or "GM" (workspace, per AI core)
    name: str
    bytes: int
    bank: Optional[int] = None  # L1 bank on SoCs with two banks


@dataclass(frozen=True)
class Tiling:
    soc: SocSpec
    shape: KernelShape
    kv_stages: int  # key blocks resident in L1 at once
    gather_chunk: int  # keys one AIV gathers, dequantizes and converts ND -> NZ per step
    drain_chunk: int  # O_partial columns per FixPipe L0C -> UB (or -> GM workspace)
    partial_cols: int  # O_partial columns resident in L0C (D_V: accumulates across blocks)
    core_ranges: tuple[tuple[int, int], ...]  # [start, end) of units per used AI core
    buffers: tuple[Buffer, ...]

    @property
    def cores_used(self) -> int:
        return len(self.core_ranges)

    @property
    def partial_resident(self) -> bool:
        """O_partial stays in L0C across blocks (drained only on a rescale or at the end); else every block."""
        return self.partial_cols == D_V

    @property
    def lookahead(self) -> int:
        """Blocks the vector cores gather ahead of the block whose softmax they compute."""
        return self.kv_stages - 2

    def used(self, memory: str, bank: Optional[int] = None) -> int:
        return bytes_used(self.buffers, memory, bank)

    def capacity(self, memory: str, bank: Optional[int] = None) -> int:
        return capacity(self.soc, memory, bank)

    def workspace_bytes(self) -> int:
        """GM workspace the host allocates: the per-core buffers times the cores used."""
        return self.used("GM") * self.cores_used

    def tiling_data(self) -> dict[str, int]:
        """The fields of ``SparseAttentionV41Tiling`` in ``tiling_data.h``, in declaration order."""
        n = self.cores_used
        units = self.shape.units
        return {
            "num_tokens": self.shape.tokens,
            "num_heads": self.shape.heads,
            "head_tiles": self.shape.head_tiles,
            "num_units": units,
            "units_per_core": units // n if n else 0,
            "cores_with_extra_unit": units % n if n else 0,
            "topk": self.shape.topk,
            "extra_topk": self.shape.extra_topk,
            "main_blocks": self.shape.main_blocks,
            "extra_blocks": self.shape.extra_blocks,
            "workspace_bytes_per_core": self.used("GM"),
        }


def split_units(units: int, cores: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges of ``units`` over ``min(units, cores)`` cores, sizes differing by at most one.

    The first ``units % cores`` cores take one extra unit; the kernel computes the same ranges from
    ``units_per_core`` and ``cores_with_extra_unit``.
    """
    if cores < 1:
        raise ValueError(f"cores: need at least one AI core, got {cores}")
    used = min(units, cores)
    if used == 0:
        return ()
    base, extra = divmod(units, used)
    ranges, start = [], 0
    for c in range(used):
        end = start + base + (c < extra)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


def _l1_buffers(soc: SocSpec, kv_stages: int) -> list[Buffer]:
    """Q (two units, so the next unit's Q loads during the current one), K/V blocks, softmax probabilities.

    With two banks every tensor is cut in halves, one per bank (Q and K along d, S along the keys), so
    both banks feed L0A/L0B at once, as FlashMLA's article recommends (bank behaviour unverified).
    """
    tensors = [(f"q[{i}]", HEADS_PER_TILE * D_QK * 2) for i in range(2)]
    tensors += [(f"kv[{i}]", B_TOPK * D_QK * 2) for i in range(kv_stages)]
    tensors += [(f"probs[{i}]", HEADS_PER_TILE * B_TOPK * 2) for i in range(2)]
    if soc.l1_banks == 1:
        return [Buffer("L1", name, size) for name, size in tensors]
    return [Buffer("L1", f"{name}.half{h}", size // 2, bank=h) for name, size in tensors for h in range(2)]


def _l0_buffers(soc: SocSpec, partial_cols: int) -> list[Buffer]:
    """Ping-pong L0A/L0B operands and L0C results.

    L0A holds a 64 x 256 Q half (32 KB) for Q K^T or the 64 x 64 bf16 probabilities for S V; L0B a
    256 x 64 K half or a 64 x 256 V half. L0C holds two 64 x 64 fp32 logit tiles (the cube computes
    block j+1's logits while block j's are moved out) and O_partial.
    """
    half = HEADS_PER_TILE * (D_QK // 2) * 2
    buffers = [Buffer("L0A", f"a[{i}]", half) for i in range(2)] + [Buffer("L0B", f"b[{i}]", half) for i in range(2)]
    buffers += [Buffer("L0C", f"logits[{i}]", HEADS_PER_TILE * B_TOPK * 4) for i in range(2)]
    if partial_cols == D_V:
        buffers.append(Buffer("L0C", "o_partial", HEADS_PER_TILE * D_V * 4))
    else:
        buffers += [Buffer("L0C", f"o_partial_chunk[{i}]", HEADS_PER_TILE * partial_cols * 4) for i in range(2)]
    return buffers


# Gather parameters of one block of 64 keys: indices then slots (int32), lane numbers, page numbers, the compare
# mask, zeros (256 B each), and the own 32 keys' int64 byte offsets plus an int64 scratch (256 B each).
GATHER_PARAMS_BYTES = 5 * 256 + 2 * 256
DECODE_TABLE_FLOATS = 16  # the e2m1 code -> value table (FP8 values and all scales convert natively on the 950)


def _ub_buffers(shape: KernelShape, gather_chunk: int, drain_chunk: int, kv_stages: int) -> list[Buffer]:
    """One vector core's UB: its 32 heads' O accumulator and softmax state, its half of each key block.

    ``kv_nz`` has one padding row per 16-column block (FlashMLA's trick against UB bank conflicts in
    the ND -> NZ copy). The two ``o_drain`` stages also stage the bf16 output in the epilogue. Same order
    and sizes as ``UbLayout`` in ``sparse_attention_v41/op_kernel/layout.h`` (tests compare the two).
    """
    rows = HEADS_PER_VECTOR_CORE
    widest = max(ub_row_bytes(f) for f in shape.formats)
    buffers = [
        Buffer("UB", "o_acc", rows * D_V * 4),
        Buffer("UB", "o_drain (2 stages; epilogue output staging)", 2 * rows * drain_chunk * 4),
        Buffer("UB", "logits[0]", rows * B_TOPK * 4),
        Buffer("UB", "logits[1]", rows * B_TOPK * 4),
        Buffer("UB", "probs_nz[0]", rows * B_TOPK * 2),
        Buffer("UB", "probs_nz[1]", rows * B_TOPK * 2),
        # m_run, m_use, l (per unit parity: a unit's epilogue overlaps the next unit's first softmax),
        # alpha (per block parity), row max, row sum, sink, scale: 64 floats each (one 256 B vector repeat)
        Buffer("UB", "row_state", ROW_STATE_VECTORS * 64 * 4),
        Buffer("UB", "row_broadcast (one 32 B block per row)", HEADS_PER_VECTOR_CORE * _UB_ALIGN),
        Buffer("UB", "key_bias (0 / -inf per key, one per L1 key stage)", kv_stages * B_TOPK * 4),
        Buffer("UB", "mailbox_word", _UB_ALIGN),
        Buffer("UB", "gather_params (one block's slots, lanes, pages, mask, zeros, int64 offsets)",
               GATHER_PARAMS_BYTES),
        Buffer("UB", "kv_raw[0]", gather_chunk * widest),
        Buffer("UB", "kv_raw[1]", gather_chunk * widest),
        Buffer("UB", "kv_nz[0]", (D_QK // 16) * (gather_chunk + 1) * _UB_ALIGN),
        Buffer("UB", "kv_nz[1]", (D_QK // 16) * (gather_chunk + 1) * _UB_ALIGN),
    ]
    if any(f.is_quantized for f in shape.formats):
        buffers.append(Buffer("UB", "decode_table (e2m1)", DECODE_TABLE_FLOATS * 4))
        # gather offsets of the scale of element i (tiles of 32 and 16) and of the FP4 nibble interleave
        buffers.append(Buffer("UB", "dequant_offsets", 3 * D_QK * 4))
        # one row: code offsets, FP4 nibbles (uint32), values, expanded scales (fp32), tile scales, bf16 row
        buffers.append(Buffer("UB", "dequant_scratch", D_QK * (4 + 4 + 4 + 4) + 64 * 4 + D_QK * 2))
    return buffers


def _gm_buffers(soc: SocSpec, kv_stages: int, partial_cols: int) -> list[Buffer]:
    """Per-core workspace: the skip-scale mailbox; without on-chip paths also the cube <-> vector traffic."""
    buffers = [Buffer("GM", "skip_scale_mailbox", MAILBOX_SLOTS * VECTOR_CORES_PER_CUBE * MAILBOX_ENTRY_BYTES)]
    if not soc.on_chip_exchange:
        buffers += [
            Buffer("GM", "logits (2 stages)", 2 * HEADS_PER_TILE * B_TOPK * 4),
            Buffer("GM", "probs (2 stages)", 2 * HEADS_PER_TILE * B_TOPK * 2),
            Buffer("GM", "o_partial chunks (2 stages)", 2 * HEADS_PER_TILE * partial_cols * 4),
            Buffer("GM", "kv blocks in NZ", kv_stages * B_TOPK * D_QK * 2),
        ]
    return buffers


def bytes_used(buffers, memory: str, bank: Optional[int] = None) -> int:
    """Bytes of ``buffers`` in ``memory`` (in one L1 bank when ``bank`` is given)."""
    return sum(b.bytes for b in buffers if b.memory == memory and (bank is None or b.bank == bank))


def capacity(soc: SocSpec, memory: str, bank: Optional[int] = None) -> int:
    """Bytes of ``memory`` on ``soc`` (of one L1 bank when ``bank`` is given)."""
    total = {"L1": soc.l1_bytes, "L0A": soc.l0a_bytes, "L0B": soc.l0b_bytes, "L0C": soc.l0c_bytes,
             "UB": soc.ub_bytes}[memory]
    return total // soc.l1_banks if bank is not None else total


def _fits(buffers: list[Buffer], soc: SocSpec, memory: str) -> bool:
    if memory == "L1" and soc.l1_banks > 1:
        return all(bytes_used(buffers, "L1", b) <= capacity(soc, "L1", b) for b in range(soc.l1_banks))
    return bytes_used(buffers, memory) <= capacity(soc, memory)


def _largest(options, memory: str, soc: SocSpec, make) -> int:
    for option in options:
        if _fits(make(option), soc, memory):
            return option
    raise ValueError(f"tiling: no {memory} plan fits {soc.name} (tried {tuple(options)})")


def plan(shape: KernelShape, soc: str | SocSpec, cores: Optional[int] = None) -> Tiling:
    """The kernel's tiling of ``shape`` on ``soc``; ``cores`` overrides the table's AI core count.

    Each choice takes the largest option that fits its memory: L1 key stages (up to 5), the UB gather
    chunk (32, 16, 8 keys: the widest gathered row decides), the L0C plan (O_partial resident if it fits
    next to two logit tiles, else column chunks drained every block) and the drain chunk.
    """
    soc = soc_spec(soc)
    if shape.heads % HEADS_PER_TILE or shape.heads < HEADS_PER_TILE:
        raise ValueError(f"shape.heads: must be a positive multiple of {HEADS_PER_TILE}, got {shape.heads}")
    kv_stages = _largest(range(_MAX_KV_STAGES, 1, -1), "L1", soc, lambda s: _l1_buffers(soc, s))
    partial_cols = _largest((D_V,) + _PARTIAL_CHUNKS, "L0C", soc, lambda c: _l0_buffers(soc, c))
    drain_chunk = min(partial_cols, _DRAIN_CHUNKS[0])
    gather_chunk = _largest(_GATHER_CHUNKS, "UB", soc, lambda g: _ub_buffers(shape, g, drain_chunk, kv_stages))
    for memory in ("L0A", "L0B"):
        if not _fits(_l0_buffers(soc, partial_cols), soc, memory):
            raise ValueError(f"tiling: the L0 operands do not fit {memory} of {soc.name}")
    buffers = (_l1_buffers(soc, kv_stages) + _l0_buffers(soc, partial_cols)
               + _ub_buffers(shape, gather_chunk, drain_chunk, kv_stages) + _gm_buffers(soc, kv_stages, partial_cols))
    ranges = split_units(shape.units, soc.aic_cores if cores is None else cores)
    return Tiling(soc, shape, kv_stages, gather_chunk, drain_chunk, partial_cols, ranges, tuple(buffers))
