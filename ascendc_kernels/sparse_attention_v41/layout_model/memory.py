"""Numpy models of the on-chip memories and data paths of an Ascend 950 AI core that the kernel uses, written from
asc-devkit's documented behaviour (the doc each follows is named; nothing is copied).

A memory is a byte array filled with random bytes (never zeros), so a byte the kernel forgets to write shows up as
a wrong value. Matrices are read back through the fractal formats of "关键分形格式详解": ND (row-major), Nz (16-column
blocks outer, then rows, 16 values a row), Zn (fractals ordered by (row block, column block), each column-major).
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # bytes of a UB / L1 data block
FRACTAL = 16
FRACTAL_BYTES = 512


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bits (CAST_RINT); NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


class Memory:
    """``size`` bytes of one on-chip memory, poisoned with random bytes."""

    def __init__(self, name: str, size: int, rng: np.random.Generator):
        self.name = name
        self.bytes = rng.integers(0, 256, size, dtype=np.uint8)
        self.rng = rng

    def write(self, offset: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).ravel()
        if offset < 0 or offset + data.size > self.bytes.size:
            raise IndexError(f"{self.name}: write of {data.size} B at {offset} leaves the memory ({self.bytes.size} B)")
        self.bytes[offset:offset + data.size] = data

    def read(self, offset: int, size: int) -> np.ndarray:
        if offset < 0 or offset + size > self.bytes.size:
            raise IndexError(f"{self.name}: read of {size} B at {offset} leaves the memory ({self.bytes.size} B)")
        return self.bytes[offset:offset + size].copy()

    def scribble(self, offset: int, size: int) -> None:
        """Bytes a path leaves unspecified (DataCopyPad's dummy padding)."""
        self.write(offset, self.rng.integers(0, 256, size, dtype=np.uint8))


# ---- formats ----

def nz_offsets(rows: int, cols: int, per_block: int = FRACTAL) -> np.ndarray:
    """Element offsets of an Nz [rows, cols] matrix: (c // 16 * rows + r) * 16 + c % 16."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return (c // per_block * rows + r) * per_block + c % per_block


def zn_offsets(rows: int, cols: int) -> np.ndarray:
    """Element offsets of a Zn [rows (K), cols (N)] matrix of 16 x 16 fractals."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    fractal = (r // FRACTAL) * (cols // FRACTAL) + c // FRACTAL
    return fractal * FRACTAL * FRACTAL + (c % FRACTAL) * FRACTAL + r % FRACTAL


def read_matrix(mem: Memory, offset: int, offsets: np.ndarray, dtype) -> np.ndarray:
    item = np.dtype(dtype).itemsize
    raw = mem.read(offset, (int(offsets.max()) + 1) * item).view(dtype)
    return raw[offsets]


# ---- data paths ----

def data_copy_pad(gm: np.ndarray, src: int, ub: Memory, dst: int, block_count: int, block_len: int, src_gap: int,
                  dst_gap: int) -> None:
    """GM -> UB DataCopyPad, Normal padding mode ("GMToUB非对齐数据搬运"): block i is read at
    src + i (block_len + src_gap) bytes and lands 32-byte padded; dst_gap counts 32-byte blocks between the end
    of a padded block and the next. The padding bytes are unspecified."""
    padded = -(-block_len // BLOCK) * BLOCK
    for i in range(block_count):
        s = src + i * (block_len + src_gap)
        d = dst + i * (padded + dst_gap * BLOCK)
        ub.write(d, gm[s:s + block_len])
        if padded > block_len:
            ub.scribble(d + block_len, padded - block_len)


def vector_copy(ub: Memory, dst: int, src: int, blocks_per_repeat: int, repeats: int, dst_block_stride: int,
                src_block_stride: int, dst_repeat_stride: int, src_repeat_stride: int) -> None:
    """UB -> UB Copy with a contiguous mask of whole blocks ("UBToUB掩码式高维数据搬运"): block b of repeat j goes from
    src + (j src_repeat + b src_block) 32 B to dst + (j dst_repeat + b dst_block) 32 B."""
    for j in range(repeats):
        for b in range(blocks_per_repeat):
            data = ub.read(src + (j * src_repeat_stride + b * src_block_stride) * BLOCK, BLOCK)
            ub.write(dst + (j * dst_repeat_stride + b * dst_block_stride) * BLOCK, data)


def data_copy_blocks(src_mem: Memory, src: int, dst_mem: Memory, dst: int, block_count: int, block_len: int,
                     src_gap: int, dst_gap: int) -> None:
    """UB -> L1 DataCopy with DataCopyParams ("UBToL1高维切分数据搬运"): lengths and gaps in 32-byte blocks, a gap
    being from the end of one block to the start of the next."""
    for i in range(block_count):
        data = src_mem.read(src + i * (block_len + src_gap) * BLOCK, block_len * BLOCK)
        dst_mem.write(dst + i * (block_len + dst_gap) * BLOCK, data)


def nd2nz(gm_bf16: np.ndarray, src: int, l1: Memory, dst: int, n_value: int, d_value: int, src_d_value: int,
          c0_stride: int, n_stride: int) -> None:
    """GM -> L1 DataCopy with Nd2NzParams, one ND matrix ("GMToL1随路转换-ND2NZ搬运"): row i, 16-column block j lands
    at dst + (j c0_stride + i n_stride) 32 B; src_d_value is the source row length in elements."""
    for i in range(n_value):
        for j in range(-(-d_value // FRACTAL)):
            row = gm_bf16[src + i * src_d_value + j * FRACTAL: src + i * src_d_value + (j + 1) * FRACTAL]
            l1.write(dst + (j * c0_stride + i * n_stride) * BLOCK, row)


def load_2d(src_mem: Memory, src: int, dst_mem: Memory, dst: int, start: int, repeat: int, src_stride: int,
            transpose: bool) -> None:
    """L1 -> L0A/L0B LoadData 2D of bf16 fractals ("LoadData（2D矩阵搬运）" and its load2d pseudo code): fractal
    start + i src_stride is written as the i-th fractal of dst (the 950 ignores dstGap), turned over when
    ``transpose`` is set."""
    for i in range(repeat):
        frac = src_mem.read(src + (start + i * src_stride) * FRACTAL_BYTES, FRACTAL_BYTES).view(np.uint16)
        frac = frac.reshape(FRACTAL, FRACTAL)
        dst_mem.write(dst + i * FRACTAL_BYTES, frac.T.copy() if transpose else frac)


def mmad(l0a: Memory, a: int, l0b: Memory, b: int, l0c: Memory, c: int, m: int, n: int, k: int, init: bool) -> None:
    """Mmad on the 950 ("Mmad"): C [m, n] (Nz, fp32, 16 x 16 fractals) = A [m, k] (Nz, bf16) x B [k, n] (Zn, bf16)
    (+ C unless ``init``), accumulated in float64 here."""
    with np.errstate(all="ignore"):
        a_mat = bf16_to_f32(read_matrix(l0a, a, nz_offsets(m, k), np.uint16)).astype(np.float64)
        b_mat = bf16_to_f32(read_matrix(l0b, b, zn_offsets(k, n), np.uint16)).astype(np.float64)
    offsets = nz_offsets(m, n)
    with np.errstate(all="ignore"):  # poisoned bytes the kernel forgot to write may be NaN or huge
        acc = a_mat @ b_mat
    if not init:
        acc = acc + read_matrix(l0c, c, offsets, np.float32)
    out = np.empty(m * n, np.float32)
    with np.errstate(all="ignore"):
        out[offsets.ravel()] = acc.astype(np.float32).ravel()
    l0c.write(c, out)


def fixpipe_nz2nd(l0c: Memory, src: int, m: int, n: int, src_stride: int, dst_stride: int, dual_split_m: bool,
                  to_ub: bool, ubs: tuple[Memory, Memory], l1: Memory, dst: int) -> None:
    """FixPipe of an fp32 Nz tile with NZ2ND ("L0C Buffer到UB数据搬运"): column block j starts at src + j src_stride
    C0 units (16 fp32, 64 B); destination rows are dst_stride values apart.
    With isToUB the rows go to UB, split along M over the two vector cores when dual_split_m; without it the 950
    takes the L0C -> L1 path (kernel_operator_fixpipe_intf_impl.h), where the dual destination does not apply."""
    c0 = FRACTAL * 4
    tile = np.empty((m, n), np.float32)
    for j in range(n // FRACTAL):
        block = l0c.read(src + j * src_stride * c0, m * c0).view(np.float32).reshape(m, FRACTAL)
        tile[:, j * FRACTAL:(j + 1) * FRACTAL] = block
    if not to_ub:
        for r in range(m):
            l1.write(dst + r * dst_stride * 4, tile[r])
        return
    halves = (tile[: m // 2], tile[m // 2:]) if dual_split_m else (tile,)
    for core, rows in enumerate(halves):
        for r in range(rows.shape[0]):
            ubs[core].write(dst + r * dst_stride * 4, rows[r])


def cast_f32_to_bf16(ub: Memory, dst: int, src: int, repeats: int, dst_block_stride: int, src_block_stride: int,
                     dst_repeat_stride: int, src_repeat_stride: int) -> None:
    """fp32 -> bf16 Cast (CAST_RINT), 64 values a repeat ("Cast": with operands of different widths the wider type
    sets the repeat; assumed here: destination block b holds values 16 b .. 16 b + 15 of the repeat, i.e. source
    blocks 2 b and 2 b + 1)."""
    for j in range(repeats):
        values = np.concatenate([ub.read(src + (j * src_repeat_stride + b * src_block_stride) * BLOCK, BLOCK)
                                 .view(np.float32) for b in range(8)])
        bits = f32_to_bf16(values)
        for b in range(4):
            ub.write(dst + (j * dst_repeat_stride + b * dst_block_stride) * BLOCK, bits[b * 16:(b + 1) * 16])
