// A vector core of sparse_attention_v41: key gathering and dequantization, softmax with skip scale, the O
// accumulator of its 32 heads, and the epilogue.
#pragma once

#include "layout.h"

namespace anymla_ascendc::device {

// Device-side view of SparseAttentionV41Buffers (minus params).
struct DeviceBuffers {
    GM_ADDR q, kv, indices, topk_length, extra_kv, extra_indices, extra_topk_length, attn_sink, decode_tables, out,
        max_logits, lse, workspace;
};

struct Source {
    GlobalTensor<uint8_t> rows;
    GlobalTensor<int32_t> indices;
    GlobalTensor<int32_t> length;
    KeySource desc;
};

template <KvFormat MAIN, KvFormat EXTRA>
class VectorCore {
    using U = UbLayout<MAIN, EXTRA>;
    static constexpr uint32_t kChunk = U::kChunk;

public:
    __aicore__ inline void Init(const SparseAttentionV41Params& p, const DeviceBuffers& b)
    {
        params_ = p;
        work_.Init(p.tiling);
        vector_ = GetSubBlockIdx();
        InitSource(main_, p.main, b.kv, b.indices, b.topk_length);
        if constexpr (EXTRA != KvFormat::kNone) {
            InitSource(extra_, p.extra, b.extra_kv, b.extra_indices, b.extra_topk_length);
        }
        sink_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(b.attn_sink));
        out_.SetGlobalBuffer(reinterpret_cast<__gm__ bfloat16_t*>(b.out));
        max_logits_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(b.max_logits));
        lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(b.lse));
        mailbox_.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(
            b.workspace + static_cast<uint64_t>(GroupIndex()) * p.tiling.workspace_bytes_per_core));
        if constexpr (U::kQuantized) {
            LoadDecodeTables(b.decode_tables);
        }
        CreateVecIndex(Ub<int32_t>(U::kLanes), 0, kIndexLanes);
        Duplicate(Ub<float>(U::kZeros), 0.0f, kIndexLanes);
        Duplicate(Ub<float>(U::kAcc), 0.0f, kHeadsPerVectorCore * kHeadDim);
    }

    __aicore__ inline void Run()
    {
        SetFlag<HardEvent::V_MTE2>(kEv0);
        SetFlag<HardEvent::V_MTE2>(kEv1);
        SetFlag<HardEvent::MTE3_V>(kEv0);
        SetFlag<HardEvent::MTE3_V>(kEv1);
        SetFlag<HardEvent::MTE3_V>(kEvProbs0);
        SetFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvProbs0 + 1));
        const uint32_t lookahead = kKvStages - 2;  // the cube holds blocks g - 1 and g
        uint32_t gathered = 0;
        for (uint32_t g = 0; g < work_.total_blocks; ++g) {
            for (; gathered < work_.total_blocks && gathered <= g + lookahead; ++gathered) {
                GatherBlock(gathered);
            }
            Softmax(g);
            if (g > 0) {
                Decide(g - 1);
            }
        }
        if (work_.total_blocks > 0) {
            Decide(work_.total_blocks - 1);
        }
        AwaitPvDone(work_.total_blocks);  // consume every kPvDone the cube set
        WaitFlag<HardEvent::V_MTE2>(kEv0);
        WaitFlag<HardEvent::V_MTE2>(kEv1);
        WaitFlag<HardEvent::MTE3_V>(kEv0);
        WaitFlag<HardEvent::MTE3_V>(kEv1);
        WaitFlag<HardEvent::MTE3_V>(kEvProbs0);
        WaitFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvProbs0 + 1));
    }

private:
    __aicore__ inline void InitSource(Source& s, const KeySource& d, GM_ADDR rows, GM_ADDR indices, GM_ADDR length)
    {
        s.desc = d;
        s.rows.SetGlobalBuffer(reinterpret_cast<__gm__ uint8_t*>(rows));
        s.indices.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(indices));
        s.length.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(length));
    }

    // Which source and which of its blocks a unit-local block is: main blocks first, then extra.
    __aicore__ inline Source& SourceOf(uint32_t local, uint32_t& block)
    {
        if (local < params_.tiling.main_blocks) {
            block = local;
            return main_;
        }
        block = local - params_.tiling.main_blocks;
        return extra_;
    }

    // How many leading positions of `block` are attended at most: topk and topk_length cut the list (one scalar
    // read of GM per block; the indices themselves are never read by the scalar core from GM).
    __aicore__ inline int32_t PositionLimit(const Source& s, uint32_t token, uint32_t block)
    {
        int64_t limit = s.desc.topk;
        if (s.desc.has_length) {
            const int64_t length = s.length.GetValue(token);
            limit = length < limit ? length : limit;
        }
        limit -= static_cast<int64_t>(block) * kBlockTopk;
        return limit < 0 ? 0 : limit > kBlockTopk ? kBlockTopk : static_cast<int32_t>(limit);
    }

    // The gather parameters of `block` (global block g), computed by vector instructions, as FlashMLA's deep
    // dive does so the scalar core never waits on index reads from GM: one MTE2 copy brings the block's 64
    // indices to UB; then per lane: slot = index if the position is below the limit and 0 <= index < num_rows,
    // else -1; the key bias 0 / -inf of the block (kept per L1 key slot for the softmax); and for this core's
    // 32 keys the byte offset (index / page) * block_stride + (index % page) * row_stride in int64.
    __aicore__ inline void BuildGatherParams(const Source& s, uint32_t token, uint32_t block, uint32_t g)
    {
        LocalTensor<int32_t> slots = Ub<int32_t>(U::kSlots);
        LocalTensor<int32_t> pages = Ub<int32_t>(U::kPages);
        LocalTensor<uint8_t> mask = Ub<uint8_t>(U::kLaneMask);
        const uint32_t first = block * kBlockTopk;
        const uint32_t count = s.desc.topk - first < kBlockTopk ? s.desc.topk - first : kBlockTopk;
        DataCopyExtParams p{1, count * static_cast<uint32_t>(sizeof(int32_t)), 0, 0, 0};
        DataCopyPad(slots, s.indices[static_cast<uint64_t>(token) * s.desc.topk + first], p,
                    DataCopyPadExtParams<int32_t>{false, 0, 0, 0});
        const int32_t limit = PositionLimit(s, token, block);
        const int64_t last_row = s.desc.num_rows - 1;
        const int32_t max_index = last_row > 0x7FFFFFFF ? 0x7FFFFFFF : static_cast<int32_t>(last_row);
        SetFlag<HardEvent::MTE2_V>(kEv0);
        WaitFlag<HardEvent::MTE2_V>(kEv0);
        // positions at or past the limit (lanes >= limit; their copied values may be padding) -> -1
        Compares(mask, Ub<int32_t>(U::kLanes), limit, CMPMODE::LT, kIndexLanes);
        Select(slots, mask, slots, -1, SELMODE::VSEL_TENSOR_SCALAR_MODE, kIndexLanes);
        Compares(mask, slots, max_index, CMPMODE::LE, kIndexLanes);
        Select(slots, mask, slots, -1, SELMODE::VSEL_TENSOR_SCALAR_MODE, kIndexLanes);
        Compares(mask, slots, 0, CMPMODE::GE, kIndexLanes);
        Select(slots, mask, slots, -1, SELMODE::VSEL_TENSOR_SCALAR_MODE, kIndexLanes);
        Select(Ub<float>(U::KeyBias(g % kKvStages)), mask, Ub<float>(U::kZeros), -kInf,
               SELMODE::VSEL_TENSOR_SCALAR_MODE, kIndexLanes);
        // byte offsets of the own 32 keys (an invalid lane's value is never used)
        const LocalTensor<int32_t> own = slots[vector_ * kKeysPerVectorCore];
        LocalTensor<int64_t> addr = Ub<int64_t>(U::kAddresses);
        LocalTensor<int64_t> tmp = Ub<int64_t>(U::kAddressTmp);
        const int32_t page = static_cast<int32_t>(s.desc.page_size);
        Duplicate(pages, page, kKeysPerVectorCore);
        Div(pages, own, pages, kKeysPerVectorCore);                                   // index / page
        Cast(tmp, pages, RoundMode::CAST_NONE, kKeysPerVectorCore);
        Muls(tmp, tmp, static_cast<int64_t>(s.desc.block_stride_bytes), kKeysPerVectorCore);
        Muls(pages, pages, page, kKeysPerVectorCore);
        Sub(pages, own, pages, kKeysPerVectorCore);                                   // index % page
        Cast(addr, pages, RoundMode::CAST_NONE, kKeysPerVectorCore);
        Muls(addr, addr, static_cast<int64_t>(s.desc.row_stride_bytes), kKeysPerVectorCore);
        Add(addr, addr, tmp, kKeysPerVectorCore);
        SetFlag<HardEvent::V_S>(kEv1);  // the scalar core reads slots and addresses from UB next
        WaitFlag<HardEvent::V_S>(kEv1);
    }

    // ---- gather: GM -> UB (pairs of rows per copy), dequantize, ND -> NZ, UB -> L1 ----

    __aicore__ inline void GatherBlock(uint32_t g)
    {
        if (g >= kKvStages) {
            AwaitPvDone(g - kKvStages + 1);  // the PV that last read this L1 slot has finished
        }
        uint32_t block;
        const uint32_t local = work_.Local(g);
        Source& src = SourceOf(local, block);
        const uint32_t token = work_.Unit(g) / params_.tiling.head_tiles;
        const bool from_main = local < params_.tiling.main_blocks;
        BuildGatherParams(src, token, block, g);
        for (uint32_t c = 0; c < kKeysPerVectorCore / kChunk; ++c, ++chunks_) {
            const uint32_t stage = chunks_ & 1;
            WaitFlag<HardEvent::V_MTE2>(Ev(stage));  // the dequant of chunk - 2 has read kv_raw[stage]
            const uint32_t valid = IssueRowCopies(src, c * kChunk, stage);
            SetFlag<HardEvent::MTE2_V>(Ev(stage));
            WaitFlag<HardEvent::MTE2_V>(Ev(stage));
            WaitFlag<HardEvent::MTE3_V>(Ev(stage));  // chunk - 2 has left kv_nz[stage] for L1
            ConvertChunk(stage, valid, from_main);
            SetFlag<HardEvent::V_MTE2>(Ev(stage));
            SetFlag<HardEvent::V_MTE3>(Ev(stage));
            WaitFlag<HardEvent::V_MTE3>(Ev(stage));
            CopyChunkToL1(stage, g % kKvStages, vector_ * kKeysPerVectorCore + c * kChunk);
            SetFlag<HardEvent::MTE3_V>(Ev(stage));
        }
        Signal<PIPE_MTE3>(kKvReady);
    }

    // Starts the MTE2 copies of a chunk's valid rows (own keys [lane0, lane0 + chunk), parameters from UB);
    // returns a bit mask of the valid rows. Two rows go in one copy ("gather2": burst count 2, source gap = the
    // distance between them) when the second lies after the first; the pair is then stored in address order,
    // which permutes two attended keys of the block - harmless, since P's columns and V's rows come from the
    // same slot and both keys' bias is 0.
    __aicore__ inline uint32_t IssueRowCopies(const Source& s, uint32_t lane0, uint32_t stage)
    {
        const KvFormat format = static_cast<KvFormat>(s.desc.format);
        const uint32_t gm_row = GmRowBytes(format);
        const uint32_t pair_gap = PairDstGap(format, MAIN, EXTRA);
        const uint32_t raw = U::kRaw + stage * kChunk * U::kPitch;
        const LocalTensor<int32_t> slots = Ub<int32_t>(U::kSlots)[vector_ * kKeysPerVectorCore + lane0];
        const LocalTensor<int64_t> addresses = Ub<int64_t>(U::kAddresses)[lane0];
        uint32_t valid = 0;
        for (uint32_t r = 0; r < kChunk; r += 2) {
            const bool v0 = slots.GetValue(r) >= 0;
            const bool v1 = slots.GetValue(r + 1) >= 0;
            const uint64_t a0 = static_cast<uint64_t>(addresses.GetValue(r));
            const uint64_t a1 = static_cast<uint64_t>(addresses.GetValue(r + 1));
            valid |= (v0 ? 1u : 0u) << r | (v1 ? 1u : 0u) << (r + 1);
            const uint64_t lo = a0 < a1 ? a0 : a1;
            const uint64_t hi = a0 < a1 ? a1 : a0;
            if (v0 && v1 && hi - lo >= gm_row && hi - lo - gm_row <= 0xFFFFFFFFull) {
                CopyRows(s, lo, raw + r * U::kPitch, 2, static_cast<uint32_t>(hi - lo - gm_row), pair_gap, gm_row);
                continue;
            }
            if (v0) {
                CopyRows(s, a0, raw + r * U::kPitch, 1, 0, 0, gm_row);
            }
            if (v1) {
                CopyRows(s, a1, raw + (r + 1) * U::kPitch, 1, 0, 0, gm_row);
            }
        }
        return valid;
    }

    // `rows` rows of gm_row bytes from GM, src_gap bytes apart, into UB at `ub`; DataCopyPad pads each to 32 B
    // and leaves dst_gap 32-byte blocks after it (data_paths.h: PairDstGap keeps both rows at the pitch).
    __aicore__ inline void CopyRows(const Source& s, uint64_t addr, uint32_t ub, uint16_t rows, uint32_t src_gap,
                                    uint32_t dst_gap, uint32_t gm_row)
    {
        DataCopyExtParams p{rows, gm_row, src_gap, dst_gap, 0};
        DataCopyPadExtParams<uint8_t> pad{false, 0, 0, 0};
        DataCopyPad(Ub<uint8_t>(ub), s.rows[addr], p, pad);
    }

    // kv_raw[stage] -> kv_nz[stage]: invalid rows become zeros (never read: NaN in unreferenced memory must
    // not reach a product), quantized rows are decoded to bf16, then each row is scattered into the NZ
    // tile [32 column blocks][chunk + 1][16] (the extra row keeps the writes off one UB bank).
    __aicore__ inline void ConvertChunk(uint32_t stage, uint32_t valid, bool from_main)
    {
        const uint32_t raw = U::kRaw + stage * kChunk * U::kPitch;
        const uint32_t nz = U::kNz + stage * (kHeadDim / 16) * NzRows(kChunk) * kDataBlock;
        for (uint32_t r = 0; r < kChunk; ++r) {
            uint32_t row_bf16 = raw + r * U::kPitch;  // bf16 rows are used as gathered
            if (((valid >> r) & 1) == 0) {
                row_bf16 = U::kQuantized ? U::kRowBf16 : row_bf16;
                Duplicate(Ub<uint16_t>(row_bf16), static_cast<uint16_t>(0), kHeadDim);
            } else if constexpr (U::kQuantized) {
                if (from_main || EXTRA == KvFormat::kFp8) {
                    DecodeFp8Row(raw + r * U::kPitch);
                } else {
                    DecodeFp4Row(raw + r * U::kPitch);
                }
                row_bf16 = U::kRowBf16;
            }
            // 512 bf16 = 32 blocks of 32 B; block b goes to column block b, row r of the NZ tile.
            CopyRepeatParams rp;
            rp.dstStride = NdToNzDstBlockStride(kChunk);
            rp.srcStride = kNdToNzSrcBlockStride;
            rp.dstRepeatSize = NdToNzDstRepeatStride(kChunk);
            rp.srcRepeatSize = kNdToNzSrcRepeatStride;
            Copy(Ub<uint16_t>(nz + r * kDataBlock), Ub<uint16_t>(row_bf16), kNdToNzMask, kNdToNzRepeats, rp);
        }
    }

    // NZ chunk rows -> L1 key tile slot rows [row0, row0 + chunk): column blocks [0, 16) to bank 0, [16, 32)
    // to bank 1; skipping the pad row in UB and the other rows of the 64-row tile in L1.
    __aicore__ inline void CopyChunkToL1(uint32_t stage, uint32_t slot, uint32_t row0)
    {
        const uint32_t nz = U::kNz + stage * (kHeadDim / 16) * NzRows(kChunk) * kDataBlock;
        for (uint32_t half = 0; half < 2; ++half) {
            DataCopyParams p;
            p.blockCount = kNzToL1BlockCount;
            p.blockLen = NzToL1BlockLen(kChunk);
            p.srcGap = kNzToL1SrcGap;
            p.dstGap = NzToL1DstGap(kChunk);
            DataCopy(L1<uint16_t>(L1Layout::Kv(slot, half) + row0 * kDataBlock),
                     Ub<uint16_t>(nz + half * kNzToL1BlockCount * NzRows(kChunk) * kDataBlock), p);
        }
    }

    // ---- dequantization: the 950's native e4m3 -> fp32 conversion ("Cast" data types of Ascend 950:
    // fp8_e4m3fn_t -> float, CAST_NONE) for FP8 values and FP4 scales; e8m0 scales by placing the byte in an fp32
    // exponent (u8 -> u32 Cast, << 23); e2m1 codes through the 16-entry table the host uploads (the 950 also
    // converts fp4x2_e2m1_t -> bfloat16_t natively, but which nibble comes first is not documented where it
    // could be checked, and the table keeps that order in our hands) ----

    __aicore__ inline void LoadDecodeTables(GM_ADDR tables)
    {
        GlobalTensor<float> t;
        t.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(tables));
        DataCopy(Ub<float>(U::kTables), t, kDecodeTableFloats);
        // Byte offsets of the scale of element i: tiles of 32 (FP8) and 16 (FP4), and the FP4 interleave
        // (element 2i is the low nibble of byte i, 2i + 1 the high one; low nibbles first in kNibbles).
        LocalTensor<int32_t> tile32 = Ub<int32_t>(U::kOffsets);
        LocalTensor<int32_t> tile16 = Ub<int32_t>(U::kOffsets + 2048);
        LocalTensor<int32_t> interleave = Ub<int32_t>(U::kOffsets + 4096);
        LocalTensor<int32_t> half_index = Ub<int32_t>(U::kCodeOffsets);
        CreateVecIndex(tile32, 0, kHeadDim);
        ShiftRight(half_index, tile32, 1, kHeadDim);            // i / 2
        ShiftLeft(interleave, half_index, 1, kHeadDim);         // 2 (i / 2)
        Sub(interleave, tile32, interleave, kHeadDim);          // i % 2
        ShiftLeft(interleave, interleave, 8, kHeadDim);         // 256 (i % 2)
        Add(interleave, interleave, half_index, kHeadDim);      // 256 (i % 2) + i / 2
        ShiftLeft(interleave, interleave, 2, kHeadDim);         // as byte offsets
        ShiftRight(tile16, tile32, 4, kHeadDim);
        ShiftLeft(tile16, tile16, 2, kHeadDim);
        ShiftRight(tile32, tile32, 5, kHeadDim);
        ShiftLeft(tile32, tile32, 2, kHeadDim);
        SetFlag<HardEvent::MTE2_V>(kEv0);  // the table has landed before the first lookup
        WaitFlag<HardEvent::MTE2_V>(kEv0);
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void Lookup(uint32_t out, uint32_t table, uint32_t offsets, uint32_t count)
    {
        Gather(Ub<float>(out), Ub<float>(table), Ub<uint32_t>(offsets), 0u, count);
    }

    // values * scales (per element) -> bf16 row, exact: e4m3/e2m1 times a power of two or an e4m3 scale
    // has at most 8 significant bits, so the fp32 product rounds to bf16 without error (as kvcache.py does).
    __aicore__ inline void ScaleToBf16(uint32_t tile_offsets)
    {
        Lookup(U::kScales, U::kTileScales, tile_offsets, kHeadDim);
        Mul(Ub<float>(U::kValues), Ub<float>(U::kValues), Ub<float>(U::kScales), kHeadDim);
        Cast(Ub<bfloat16_t>(U::kRowBf16), Ub<float>(U::kValues), RoundMode::CAST_RINT, kHeadDim);
    }

    // V4.1 FP8 row: 512 e4m3 | 16 e8m0 scales (tile 32).
    __aicore__ inline void DecodeFp8Row(uint32_t row)
    {
        Cast(Ub<float>(U::kValues), Ub<fp8_e4m3fn_t>(row), RoundMode::CAST_NONE, kHeadDim);
        LocalTensor<uint32_t> scale_bits = Ub<uint32_t>(U::kTileScales);  // read back as fp32 by ScaleToBf16
        Cast(scale_bits, Ub<uint8_t>(row + kHeadDim), RoundMode::CAST_NONE, kHeadDim / 32);
        ShiftLeft(scale_bits, scale_bits, static_cast<uint32_t>(23), kHeadDim / 32);
        ScaleToBf16(U::kOffsets);
    }

    // V4.1 FP4 row: 256 bytes of e2m1 pairs | 32 e4m3 scales (tile 16).
    __aicore__ inline void DecodeFp4Row(uint32_t row)
    {
        LocalTensor<uint32_t> nibbles = Ub<uint32_t>(U::kNibbles);
        LocalTensor<uint32_t> high = nibbles[kHeadDim / 2];
        LocalTensor<uint32_t> codes = Ub<uint32_t>(U::kCodeOffsets);
        Cast(nibbles, Ub<uint8_t>(row), RoundMode::CAST_NONE, kHeadDim / 2);          // the 256 bytes
        ShiftRight(high, nibbles, static_cast<uint32_t>(4), kHeadDim / 2);             // high nibbles
        ShiftLeft(codes, high, static_cast<uint32_t>(4), kHeadDim / 2);
        Sub(nibbles, nibbles, codes, kHeadDim / 2);                                     // low nibbles
        ShiftLeft(nibbles, nibbles, static_cast<uint32_t>(2), kHeadDim);               // table byte offsets
        Gather(codes, nibbles, Ub<uint32_t>(U::kOffsets + 4096), 0u, kHeadDim);       // in element order
        Lookup(U::kValues, U::kTables, U::kCodeOffsets, kHeadDim);
        Cast(Ub<float>(U::kTileScales), Ub<fp8_e4m3fn_t>(row + kHeadDim / 2), RoundMode::CAST_NONE, kHeadDim / 16);
        ScaleToBf16(U::kOffsets + 2048);
    }

    // ---- softmax of the owned 32 rows of block g ----

    // One 32 B block per row holding that row's value, for row-wise broadcasts in vector instructions.
    __aicore__ inline LocalTensor<float> BroadcastRows(uint32_t vec)
    {
        Brcb(Ub<float>(U::kBroadcast), Ub<float>(vec), kHeadsPerVectorCore / 8, {1, 8});
        return Ub<float>(U::kBroadcast);
    }

    __aicore__ inline void Softmax(uint32_t g)
    {
        const uint32_t slot = g & 1;
        const uint32_t parity = (work_.Unit(g) - work_.first_unit) & 1;
        const uint32_t rows = kHeadsPerVectorCore;
        const uint32_t n = rows * kBlockTopk;
        if (work_.Local(g) == 0) {  // a new unit: fresh statistics (the other parity may still be finishing)
            Duplicate(Ub<float>(U::MRun(parity)), kNegInit, 64);
            Duplicate(Ub<float>(U::MUse(parity)), kNegInit, 64);
            Duplicate(Ub<float>(U::Sum(parity)), 0.0f, 64);
        }
        Await(kLogitsReady);
        LocalTensor<float> x = Ub<float>(U::kLogits + slot * n * 4);
        LocalTensor<float> m_run = Ub<float>(U::MRun(parity));
        LocalTensor<float> m_use = Ub<float>(U::MUse(parity));
        LocalTensor<float> sum = Ub<float>(U::Sum(parity));
        LocalTensor<float> alpha = Ub<float>(U::Alpha(slot));
        LocalTensor<float> row_max = Ub<float>(U::kRowMax);
        LocalTensor<float> row_sum = Ub<float>(U::kRowSum);

        Muls(x, x, params_.sm_scale, n);
        // + key bias (BuildGatherParams), the same 64-float row for every head (source-1 repeat stride 0)
        Add(x, x, Ub<float>(U::KeyBias(g % kKvStages)), kBlockTopk, rows, {1, 1, 1, 8, 8, 0});
        WholeReduceMax(row_max, x, kBlockTopk, rows, 1, 1, 8, ReduceOrder::ORDER_ONLY_VALUE);
        Max(row_max, row_max, m_run, rows);  // the new running max
        Sub(row_sum, row_max, m_use, rows);  // how far the lagging max trails
        ReduceMax(row_sum, row_sum, Ub<float>(U::kScale), rows, false);
        SetFlag<HardEvent::V_S>(kEv0);
        WaitFlag<HardEvent::V_S>(kEv0);
        const bool rescale = row_sum.GetValue(0) > kRescaleThreshold;  // FlashMLA's skip scale
        if (rescale) {
            Sub(alpha, m_use, row_max, rows);
            Exp(alpha, alpha, rows);
            Mul(sum, sum, alpha, rows);
            Adds(m_use, row_max, 0.0f, rows);
        } else {
            Duplicate(alpha, 1.0f, rows);
        }
        Adds(m_run, row_max, 0.0f, rows);
        bits_[slot] = rescale ? 1 : 0;

        // p = exp(x - m_use), row sums into l
        Sub(x, x, BroadcastRows(U::MUse(parity)), kBlockTopk, rows, {1, 1, 0, 8, 8, 1});
        Exp(x, x, n);
        WholeReduceSum(row_sum, x, kBlockTopk, rows, 1, 1, 8);
        Add(sum, sum, row_sum, rows);

        // bf16 P straight into NZ ([4 key blocks][32 rows][16]): per row, 4 destination blocks 32 rows apart.
        WaitFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvProbs0 + slot));
        LocalTensor<bfloat16_t> probs = Ub<bfloat16_t>(U::kProbs + slot * n * 2);
        Cast(probs, x, RoundMode::CAST_RINT, kBlockTopk, rows,
             {kProbsCastDstBlkStride, kProbsCastSrcBlkStride, kProbsCastDstRepStride, kProbsCastSrcRepStride});
        Signal<PIPE_V>(kLogitsFree);
        if (g >= 2) {
            AwaitPvDone(g - 1);  // PV(g - 2) has read L1 probability slot `slot`
        }
        SetFlag<HardEvent::V_MTE3>(kEv0);
        WaitFlag<HardEvent::V_MTE3>(kEv0);
        for (uint32_t half = 0; half < 2; ++half) {  // keys [0, 32) to bank 0, [32, 64) to bank 1
            DataCopyParams p;
            p.blockCount = kProbsToL1BlockCount;  // key column blocks in this half
            p.blockLen = kProbsToL1BlockLen;      // 32 rows of 32 B
            p.srcGap = kProbsToL1SrcGap;
            p.dstGap = kProbsToL1DstGap;          // skip the other vector core's rows
            DataCopy(L1<bfloat16_t>(L1Layout::Probs(slot, half) + vector_ * rows * kDataBlock),
                     probs[half * kProbsToL1BlockCount * rows * kBf16PerBlock], p);
        }
        SetFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvProbs0 + slot));
        PublishBit(g, rescale);
        Signal<PIPE_MTE3>(kProbsReady);
    }

    __aicore__ inline void PublishBit(uint32_t g, bool rescale)
    {
        LocalTensor<uint32_t> word = Ub<uint32_t>(U::kMailbox);
        SetFlag<HardEvent::MTE3_S>(kEv0);  // the previous block's bit has left the word
        WaitFlag<HardEvent::MTE3_S>(kEv0);
        word.SetValue(0, rescale ? 1u : 0u);
        SetFlag<HardEvent::S_MTE3>(kEv0);
        WaitFlag<HardEvent::S_MTE3>(kEv0);
        DataCopyExtParams p{1, sizeof(uint32_t), 0, 0, 0};
        DataCopyPad(mailbox_[MailboxWord(g, vector_)], word, p);
    }

    // ---- drains and the epilogue ----

    // After the cube has read both bits of block g: fold the drain it issued (if any), and finish the unit.
    __aicore__ inline void Decide(uint32_t g)
    {
        Await(kDecided);
        const uint32_t partner = ReadMailbox(mailbox_, g, vector_ ^ 1);
        if (work_.Local(g) > 0 && (bits_[g & 1] | partner) != 0) {
            Fold(false, U::Alpha(g & 1));
        }
        if (work_.Last(g)) {
            Fold(true, 0);
            Epilogue(g);
        }
    }

    // acc = (acc + O_partial) * alpha, chunk by chunk as the cube FixPipes them. The final drain of a unit
    // is not scaled (O_partial already uses the final m_use) and keeps its last two stages until the
    // epilogue has used them to stage the output.
    __aicore__ inline void Fold(bool final_drain, uint32_t alpha_vec)
    {
        const uint32_t rows = kHeadsPerVectorCore;
        if (!final_drain) {
            BroadcastRows(alpha_vec);
        }
        for (uint32_t chunk = 0; chunk < kHeadDim / kDrainChunk; ++chunk, ++drains_) {
            const uint32_t stage = drains_ & 1;
            Await(kDrainReady);
            LocalTensor<float> part = Ub<float>(U::kDrain + stage * rows * kDrainChunk * 4);
            for (uint32_t q = 0; q < kDrainChunk / 64; ++q) {  // 64 columns = one repeat per row
                LocalTensor<float> acc = Ub<float>(U::kAcc + (chunk * kDrainChunk + q * 64) * 4);
                Add(acc, acc, part[q * 64], 64, rows, {1, 1, 1, kHeadDim / 8, kHeadDim / 8, kDrainChunk / 8});
                if (!final_drain) {
                    Mul(acc, acc, Ub<float>(U::kBroadcast), 64, rows, {1, 1, 0, kHeadDim / 8, kHeadDim / 8, 1});
                }
            }
            if (!final_drain || chunk + 2 < kHeadDim / kDrainChunk) {
                Signal<PIPE_V>(kDrainFree);
            }
        }
    }

    __aicore__ inline void Epilogue(uint32_t g)
    {
        const uint32_t unit = work_.Unit(g);
        const uint32_t parity = (unit - work_.first_unit) & 1;
        const uint32_t rows = kHeadsPerVectorCore;
        const uint32_t token = unit / params_.tiling.head_tiles;
        const uint32_t head0 = (unit % params_.tiling.head_tiles) * kHeadsPerTile + vector_ * rows;
        const uint64_t row0 = static_cast<uint64_t>(token) * params_.tiling.num_heads + head0;
        LocalTensor<float> sum = Ub<float>(U::Sum(parity));
        LocalTensor<float> lse = Ub<float>(U::kRowMax);
        LocalTensor<float> scale = Ub<float>(U::kScale);
        LocalTensor<float> t = Ub<float>(U::kRowSum);

        Ln(lse, sum, 64);
        Add(lse, lse, Ub<float>(U::MUse(parity)), 64);  // natural-log lse (-inf for an empty row)
        Duplicate(scale, 1.0f, 64);
        Div(scale, scale, sum, 64);
        if (params_.has_sink) {  // out *= 1 / (1 + exp(sink - lse))
            DataCopyExtParams p{1, rows * 4, 0, 0, 0};
            DataCopyPad(Ub<float>(U::kSink), sink_[head0], p, DataCopyPadExtParams<float>{false, 0, 0, 0});
            SetFlag<HardEvent::MTE2_V>(kEv0);
            WaitFlag<HardEvent::MTE2_V>(kEv0);
            Sub(t, Ub<float>(U::kSink), lse, rows);
            Exp(t, t, rows);
            Adds(t, t, 1.0f, rows);
            Div(scale, scale, t, rows);
        }
        // Rows without an attended key (l = 0): out 0, lse +inf, max_logits -inf.
        LocalTensor<uint8_t> attended = Ub<uint8_t>(U::kBroadcast);
        CompareScalar(attended, sum, 0.0f, CMPMODE::GT, 64);
        Select(scale, attended, scale, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);
        Select(lse, attended, lse, kInf, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);
        Select(t, attended, Ub<float>(U::MRun(parity)), -kInf, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);

        LocalTensor<float> acc = Ub<float>(U::kAcc);
        LocalTensor<float> scale_rows = BroadcastRows(U::kScale);
        for (uint32_t q = 0; q < kHeadDim / 64; ++q) {
            Mul(acc[q * 64], acc[q * 64], scale_rows, 64, rows, {1, 1, 0, kHeadDim / 8, kHeadDim / 8, 1});
        }
        LocalTensor<bfloat16_t> staged = Ub<bfloat16_t>(U::kDrain);  // both drain stages: 32 KB
        Cast(staged, acc, RoundMode::CAST_RINT, rows * kHeadDim);
        Duplicate(acc, 0.0f, rows * kHeadDim);  // the next unit's accumulator
        SetFlag<HardEvent::V_MTE3>(kEv1);
        WaitFlag<HardEvent::V_MTE3>(kEv1);
        DataCopy(out_[row0 * kHeadDim], staged, rows * kHeadDim);
        DataCopyExtParams p{1, rows * 4, 0, 0, 0};
        DataCopyPad(lse_[row0], lse, p);
        DataCopyPad(max_logits_[row0], t, p);
        Signal<PIPE_MTE3>(kDrainFree);  // the two drain stages held back by the final Fold
        Signal<PIPE_MTE3>(kDrainFree);
        SetFlag<HardEvent::MTE3_V>(kEvPartial);  // row vectors read by MTE3 are reused by the next epilogue
        WaitFlag<HardEvent::MTE3_V>(kEvPartial);
    }

    // kPvDone counts completed PVs; wait until at least `count` have completed.
    __aicore__ inline void AwaitPvDone(uint32_t count)
    {
        for (; pv_done_ < count; ++pv_done_) {
            Await(kPvDone);
        }
    }

    SparseAttentionV41Params params_;
    Work work_;
    uint32_t vector_ = 0;
    Source main_;
    Source extra_;
    GlobalTensor<float> sink_;
    GlobalTensor<bfloat16_t> out_;
    GlobalTensor<float> max_logits_;
    GlobalTensor<float> lse_;
    GlobalTensor<uint32_t> mailbox_;
    uint32_t bits_[2] = {0, 0};  // own rescale bit per block parity, until Decide() uses it
    uint32_t chunks_ = 0;
    uint32_t drains_ = 0;
    uint32_t pv_done_ = 0;
};

}  // namespace anymla_ascendc::device
