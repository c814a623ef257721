// The platform seam of the sparse_attention_v41 kernel: every use of an Ascend C (dav-3510) detail that could
// not be checked without the CANN 9.x headers, so the first build on a CANN machine has one place to fix.
#pragma once

#include "kernel_operator.h"

#include "tiling_data.h"

using namespace AscendC;

namespace anymla_ascendc::device {

// CrossCoreSetFlag mode 2 = a cube and its own two vector cores. Assumed semantics (documented for 2201,
// to confirm on 3510): a cube set releases one wait on each vector core; the cube's wait returns once both
// vector cores have set the flag. Flags count, so one id serves every stage of a ring.
constexpr uint8_t kGroupSync = 2;

enum CrossFlag : uint16_t {
    // vector -> cube
    kKvReady = 0,     // both halves of a key block are in L1
    kProbsReady = 1,  // both halves of bf16 P are in L1 and both rescale bits are in the mailbox
    kLogitsFree = 2,  // the UB logits stage of block j may be overwritten (block j + 2)
    kDrainFree = 3,   // a UB drain stage may be overwritten
    // cube -> vector
    kLogitsReady = 4, // P of block j is in UB
    kDecided = 5,     // the cube has read both rescale bits of block j (so each vector may read its partner's)
    kDrainReady = 6,  // one O_partial column chunk is in UB
    kPvDone = 7,      // the PV of block j finished: its L1 key slot and probability slot are free
};

template <pipe_t PIPE>
__aicore__ inline void Signal(CrossFlag flag) { CrossCoreSetFlag<kGroupSync, PIPE>(flag); }
__aicore__ inline void Await(CrossFlag flag) { CrossCoreWaitFlag(flag); }

// In a mix 1:2 launch the vector cores are numbered 2 * group + sub-block (assumption to confirm).
__aicore__ inline uint32_t GroupIndex()
{
    if ASCEND_IS_AIV {
        return GetBlockIdx() / 2;
    }
    return GetBlockIdx();
}

// A tensor at a fixed byte offset of an on-chip memory. Fixed offsets because the cube FixPipes into the
// vector cores' UB, and because tensors are placed in a chosen L1 bank; both sides use the same layouts.
template <typename T, TPosition POS>
__aicore__ inline LocalTensor<T> At(uint32_t byte_offset)
{
    LocalTensor<T> t;
    t.address_.logicPos = static_cast<uint8_t>(POS);
    t.address_.bufferAddr = byte_offset;
    t.address_.dataLen = 0;
    return t;
}
template <typename T> __aicore__ inline LocalTensor<T> Ub(uint32_t off) { return At<T, TPosition::VECCALC>(off); }
template <typename T> __aicore__ inline LocalTensor<T> L1(uint32_t off) { return At<T, TPosition::A1>(off); }
template <typename T> __aicore__ inline LocalTensor<T> L0a(uint32_t off) { return At<T, TPosition::A2>(off); }
template <typename T> __aicore__ inline LocalTensor<T> L0b(uint32_t off) { return At<T, TPosition::B2>(off); }
template <typename T> __aicore__ inline LocalTensor<T> L0c(uint32_t off) { return At<T, TPosition::CO1>(off); }

// FixPipe an m x n fp32 tile of L0C (NZ, `src_rows` rows per 16-column block) to UB as row-major ND rows of
// `dst_row` floats, rows [0, m/2) into vector core 0's UB and [m/2, m) into vector core 1's, both at `dst`
// (the 950 "dual destination, row split" mode of the L0C -> UB path).
__aicore__ inline void FixpipeRowSplit(const LocalTensor<float>& dst, const LocalTensor<float>& src, uint32_t m,
                                       uint32_t n, uint32_t src_rows, uint32_t dst_row)
{
    FixpipeParamsArch3510<CO2Layout::ROW_MAJOR> p;
    p.mSize = m;
    p.nSize = n;
    p.srcStride = src_rows;
    p.dstStride = dst_row;
    p.dualDstCtl = 1;  // row split
    Fixpipe<float, float, CFG_ROW_MAJOR>(dst, src, p);
}

// L1 -> L0 moves of 16 x 16 bf16 fractals. L1, L0A and (on 3510) L0B-as-loaded all hold NZ tiles
// ([column block][row][16]); `transpose` turns each fractal over, which gives the K-major B operand of
// S V from the token-major key tile.
__aicore__ inline void LoadFractals(const LocalTensor<bfloat16_t>& dst, const LocalTensor<bfloat16_t>& src,
                                    uint32_t fractals, bool transpose)
{
    LoadData2DParams p;
    p.startIndex = 0;
    p.repeatTimes = fractals;
    p.srcStride = 1;
    p.ifTranspose = transpose;
    LoadData(dst, src, p);
}

__aicore__ inline void MatMul(const LocalTensor<float>& c, const LocalTensor<bfloat16_t>& a,
                              const LocalTensor<bfloat16_t>& b, uint16_t m, uint16_t n, uint16_t k, bool init)
{
    MmadParams p;
    p.m = m;
    p.n = n;
    p.k = k;
    p.cmatrixInitVal = init;
    Mmad(c, a, b, p);
}

// The skip-scale mailbox: per AI core, kMailboxSlots x 2 words of one cache line each, in the GM workspace.
// A vector core writes its bit through MTE3 (ordered before its kProbsReady set on the same pipe); readers
// invalidate the line first. The 950 SSBuffer is the faster channel for this (FlashMLA uses it); it is not
// used because its API could not be checked here.
__aicore__ inline uint32_t MailboxWord(uint32_t block, uint32_t vector)
{
    return ((block % kMailboxSlots) * 2 + vector) * (kMailboxEntryBytes / sizeof(uint32_t));
}
__aicore__ inline uint32_t ReadMailbox(const GlobalTensor<uint32_t>& box, uint32_t block, uint32_t vector)
{
    GlobalTensor<uint32_t> word = box[MailboxWord(block, vector)];
    DataCacheCleanAndInvalid<uint32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(word);
    return word.GetValue(0);
}

}  // namespace anymla_ascendc::device
