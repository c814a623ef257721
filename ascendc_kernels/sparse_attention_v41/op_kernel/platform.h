// The platform seam of the sparse_attention_v41 kernel: the uses of Ascend C (dav-3510) details that could not
// be checked without a CANN build, so the first build on a CANN machine has one place to look. The documented
// behaviour each relies on is named next to it (asc-devkit's public docs; nothing is copied from them).
#pragma once

#include "kernel_operator.h"

#include "data_paths.h"

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

// A tensor at a fixed byte offset of an on-chip memory, built with the public static-tensor constructor
// LocalTensor(TPosition, addr, tileSize) ("LocalTensor构造函数": addr in bytes, 32-byte aligned; tileSize in
// elements, addr plus the size within the memory), so the tensor has a real length and CPU-debug builds can
// check accesses. Fixed offsets because the cube FixPipes into the vector cores' UB and tensors are placed in a
// chosen L1 bank; both sides use the layouts of layout.h. A tensor reaches to the end of its memory (not of its
// buffer): layout.h's plan, checked against tiling.py, keeps buffers apart.
template <typename T, TPosition POS, uint32_t MEMORY_BYTES>
__aicore__ inline LocalTensor<T> At(uint32_t byte_offset)
{
    return LocalTensor<T>(POS, byte_offset, (MEMORY_BYTES - byte_offset) / sizeof(T));
}
template <typename T> __aicore__ inline LocalTensor<T> Ub(uint32_t off)
{
    return At<T, TPosition::VECCALC, kUbBytes>(off);
}
template <typename T> __aicore__ inline LocalTensor<T> L1(uint32_t off)
{
    return At<T, TPosition::A1, kL1Bytes>(off);
}
template <typename T> __aicore__ inline LocalTensor<T> L0a(uint32_t off)
{
    return At<T, TPosition::A2, kL0aBytes>(off);
}
template <typename T> __aicore__ inline LocalTensor<T> L0b(uint32_t off)
{
    return At<T, TPosition::B2, kL0bBytes>(off);
}
template <typename T> __aicore__ inline LocalTensor<T> L0c(uint32_t off)
{
    return At<T, TPosition::CO1, kL0cBytes>(off);
}

// FixPipe to UB must say so: the Fixpipe doc ("L0C Buffer到UB数据搬运") forbids CFG_ROW_MAJOR / CFG_NZ /
// CFG_COLUMN_MAJOR for this path and asks for a config built with isToUB = true; with isToUB = false the 950
// implementation takes the L0C -> L1 path (kernel_operator_fixpipe_intf_impl.h), which would write the logits
// and drains into L1 over the key tiles and leave UB unwritten. ROW_MAJOR = NZ2ND.
constexpr FixpipeConfig kRowMajorToUb{CO2Layout::ROW_MAJOR, true};

// FixPipe an m x n fp32 tile of L0C (Nz) to UB as row-major ND rows of `dst_row` floats, rows [0, m/2) into
// vector core 0's UB and [m/2, m) into vector core 1's, both at `dst` (dual destination, split along M).
__aicore__ inline void FixpipeRowSplit(const LocalTensor<float>& dst, const LocalTensor<float>& src, uint32_t m,
                                       uint32_t n, uint32_t dst_row)
{
    FixpipeParamsArch3510<CO2Layout::ROW_MAJOR> p;
    p.mSize = m;
    p.nSize = n;
    p.srcStride = kFixSrcStride;
    p.dstStride = dst_row;
    p.dualDstCtl = kFixDualDstSplitM;
    Fixpipe<float, float, kRowMajorToUb>(dst, src, p);
}

// L1 -> L0A/L0B: `fractals` 512-byte fractals taken at `start`, `start + src_stride`, ... and written one after
// the other (LoadData 2D; the 950 ignores dstGap), each turned over when `transpose` is set. The fractal order
// is the caller's: data_paths.h derives it from the Nz / Zn formats Mmad expects.
__aicore__ inline void LoadFractals(const LocalTensor<bfloat16_t>& dst, const LocalTensor<bfloat16_t>& src,
                                    uint32_t start, uint32_t fractals, uint32_t src_stride, bool transpose)
{
    LoadData2DParams p;
    p.startIndex = start;
    p.repeatTimes = fractals;
    p.srcStride = src_stride;
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
