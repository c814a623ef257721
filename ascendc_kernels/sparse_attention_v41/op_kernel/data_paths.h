// Parameters of every data movement of the sparse_attention_v41 kernel (GM -> UB row gathers, UB ND -> NZ,
// UB -> L1, GM -> L1 ND2NZ, L1 -> L0A/L0B fractal loads, softmax output to NZ, FixPipe L0C -> UB), as constants
// and one-line constexpr functions of tiling_data.h. The kernel passes exactly these to the Ascend C calls; the
// layout model (../layout_model/) parses this file and layout.h to replay the same movements on numpy memories
// and compare the result with anymla.kvcache and the reference, so a wrong stride or fractal order fails a CPU
// test. Keep every definition a `constexpr` value or a one-`return` constexpr function: the model parses them.
//
// Formats (asc-devkit "关键分形格式详解", Ascend 950): Mmad takes A in L0A as Nz, B in L0B as Zn, and writes C in
// L0C as Nz. Nz of [M, N]: 16-column blocks outer, then rows, 16 values a row (one 512-byte fractal per 16 x 16).
// Zn of [K, N]: fractals ordered (16-row block of K, 16-column block of N), each fractal column-major.
#pragma once

#include "tiling_data.h"

namespace anymla_ascendc {

constexpr uint32_t kDataBlock = 32;      // bytes of a UB / L1 data block: DataCopy and vector strides count these
constexpr uint32_t kFractalRows = 16;    // a bf16 fractal is 16 x 16, 512 bytes (LoadData moves whole fractals)
constexpr uint32_t kFractalBytes = 512;
constexpr uint32_t kBf16PerBlock = kDataBlock / 2;

// Usable bytes of each on-chip memory of an Ascend 950 AI core (tiling.py's SOCS entry): every fixed placement
// of layout.h lies below these, and LocalTensor sizes are bounded by them.
constexpr uint32_t kUbBytes = 248 * 1024;
constexpr uint32_t kL1Bytes = 512 * 1024;
constexpr uint32_t kL0aBytes = 64 * 1024;
constexpr uint32_t kL0bBytes = 64 * 1024;
constexpr uint32_t kL0cBytes = 256 * 1024;

// ---- GM -> UB row gathers (DataCopyPad, Normal padding mode) ----
// Each burst lands padded to 32 bytes ("GMToUB非对齐数据搬运": every block is padded to 32-byte alignment) and
// dstStride counts 32-byte blocks from the end of one padded burst to the start of the next.
__aicore__ constexpr uint32_t GmRowBytes(KvFormat f)
{
    return f == KvFormat::kBf16 ? kHeadDim * 2 : f == KvFormat::kFp8 ? 528 : f == KvFormat::kFp4 ? 288 : 0;
}
__aicore__ constexpr uint32_t UbRowBytes(KvFormat f)
{
    return (GmRowBytes(f) + kDataBlock - 1) / kDataBlock * kDataBlock;
}
// Gathered rows sit at one pitch, the widest row of the instantiation, so row r of a chunk is at r * pitch
// whichever source the block comes from.
__aicore__ constexpr uint32_t RawPitch(KvFormat main, KvFormat extra)
{
    return UbRowBytes(main) > UbRowBytes(extra) ? UbRowBytes(main) : UbRowBytes(extra);
}
// dstStride of a two-row copy ("gather2"): the second row must start one pitch after the first, so the gap is
// the pitch minus the padded row (FP4 rows of 288 B at the 544 B pitch of FP8 + FP4: 8 blocks; FP8 rows: 0).
__aicore__ constexpr uint32_t PairDstGap(KvFormat row, KvFormat main, KvFormat extra)
{
    return (RawPitch(main, extra) - UbRowBytes(row)) / kDataBlock;
}
// Keys whose gather parameters the vector core computes at once: the whole block (every AIV's softmax needs the
// validity of all 64 keys, its gathers the addresses of its own 32).
constexpr uint32_t kIndexLanes = kBlockTopk;

// ---- one decoded bf16 row -> the UB NZ chunk [32 column blocks][chunk + 1 rows][16] (vector Copy, 16-bit) ----
// Column block b of the row goes to column block b of the chunk; the extra row keeps consecutive writes off one
// UB bank (FlashMLA's deep dive).
__aicore__ constexpr uint32_t NzRows(uint32_t chunk) { return chunk + 1; }
constexpr uint32_t kNdToNzMask = 8 * kBf16PerBlock;    // 16-bit values a repeat: 8 blocks
constexpr uint32_t kNdToNzRepeats = kHeadDim / kNdToNzMask;
__aicore__ constexpr uint32_t NdToNzDstBlockStride(uint32_t chunk) { return NzRows(chunk); }
constexpr uint32_t kNdToNzSrcBlockStride = 1;
__aicore__ constexpr uint32_t NdToNzDstRepeatStride(uint32_t chunk) { return 8 * NzRows(chunk); }
constexpr uint32_t kNdToNzSrcRepeatStride = 8;

// ---- UB NZ chunk -> L1 key tile half (DataCopy UB -> L1; blockLen and gaps in 32-byte blocks) ----
// The key tile half is Nz of K [64 keys, 256 d]: 16 column blocks of 64 rows. A chunk fills rows
// [row0, row0 + chunk) of every column block: skip the pad row in UB and the other rows in L1.
constexpr uint32_t kHalfDimBlocks = kHeadDim / 2 / kFractalRows;   // column blocks of a d half (one L1 bank)
constexpr uint32_t kNzToL1BlockCount = kHalfDimBlocks;
__aicore__ constexpr uint32_t NzToL1BlockLen(uint32_t chunk) { return chunk; }
constexpr uint32_t kNzToL1SrcGap = 1;
__aicore__ constexpr uint32_t NzToL1DstGap(uint32_t chunk) { return kBlockTopk - chunk; }

// ---- Q tile GM -> L1 (DataCopy with Nd2NzParams): each d half of [64 heads, 512] becomes Nz [16][64][16] ----
constexpr uint32_t kQNdNum = 1;
constexpr uint32_t kQNValue = kHeadsPerTile;
constexpr uint32_t kQDValue = kHeadDim / 2;
constexpr uint32_t kQSrcDValue = kHeadDim;
constexpr uint32_t kQDstNzC0Stride = kHeadsPerTile;   // 32-byte blocks between column blocks: the tile's rows
constexpr uint32_t kQDstNzNStride = 1;                // 32-byte blocks between rows

// ---- softmax output fp32 [32 rows][64] in UB -> bf16 Nz [4 key blocks][32 rows][16] (Cast, one repeat a row) ----
constexpr uint32_t kProbsCastDstBlkStride = kHeadsPerVectorCore;  // key block k of a row lands k * 32 blocks on
constexpr uint32_t kProbsCastSrcBlkStride = 1;
constexpr uint32_t kProbsCastDstRepStride = 1;                    // row r: one block further
constexpr uint32_t kProbsCastSrcRepStride = kBlockTopk * 4 / kDataBlock;
// UB -> L1: the probs tile half (keys [32 h, 32 h + 32)) is Nz of [64 heads, 32 keys]; an AIV writes its 32 rows.
constexpr uint32_t kProbsToL1BlockCount = kBlockTopk / 2 / kFractalRows;
constexpr uint32_t kProbsToL1BlockLen = kHeadsPerVectorCore;
constexpr uint32_t kProbsToL1SrcGap = 0;
constexpr uint32_t kProbsToL1DstGap = kHeadsPerTile - kHeadsPerVectorCore;

// ---- L1 -> L0A / L0B (LoadData 2D: whole fractals taken at startIndex + i * srcStride, written contiguously —
// the 950 ignores dstGap —, each transposed when ifTranspose is set; "LoadData（2D矩阵搬运）") ----
constexpr uint32_t kHeadBlocks = kHeadsPerTile / kFractalRows;   // 16-row blocks of Q, P and O
constexpr uint32_t kKeyBlocks = kBlockTopk / kFractalRows;       // 16-key blocks of a key tile
// A of Q K^T: the Q half is Nz in L1 and must be Nz in L0A: one load in source order.
constexpr uint32_t kQLoadRepeat = kHeadBlocks * kHalfDimBlocks;
// B of Q K^T: the key half is Nz of K [keys, d], which is exactly Zn of K^T [d, keys]: one load in source order.
constexpr uint32_t kKtLoads = 1;
constexpr uint32_t kKtStartStep = 0;
constexpr uint32_t kKtRepeat = kKeyBlocks * kHalfDimBlocks;
constexpr uint32_t kKtSrcStride = 1;
constexpr uint32_t kKtDstStep = 0;
constexpr uint32_t kKtTranspose = 0;
// A of P V: the two key halves of the probs tile, Nz [2 key blocks][64 heads][16] each, one after the other.
constexpr uint32_t kProbsLoadRepeat = kHeadBlocks * kKeyBlocks / 2;
// B of P V: V [64 keys, 256 d] as Zn needs the fractals key block by key block, each transposed; in the Nz tile
// the 16 fractals of key block kb are kKeyBlocks apart starting at kb. One load per key block, written at
// kb * kHalfDimBlocks fractals.
constexpr uint32_t kVLoads = kKeyBlocks;
constexpr uint32_t kVStartStep = 1;
constexpr uint32_t kVRepeat = kHalfDimBlocks;
constexpr uint32_t kVSrcStride = kKeyBlocks;
constexpr uint32_t kVDstStep = kHalfDimBlocks;
constexpr uint32_t kVTranspose = 1;

// ---- FixPipe L0C (Nz fp32) -> the two vector cores' UB: NZ2ND, dual destination split along M (rows
// [0, M/2) to AIV 0, [M/2, M) to AIV 1, both at the same UB offset) ----
constexpr uint32_t kFixDualDstSplitM = 1;
constexpr uint32_t kFixSrcStride = kHeadsPerTile;   // C0 units between column blocks of L0C: M rounded up to 16
constexpr uint32_t kLogitsFixN = kBlockTopk;
constexpr uint32_t kLogitsFixDstStride = kBlockTopk;  // values a UB row (NZ2ND)
constexpr uint32_t kDrainFixN = kDrainChunk;
constexpr uint32_t kDrainFixDstStride = kDrainChunk;

}  // namespace anymla_ascendc
