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

    // Whether key `pos` of `token` is attended, and its byte address when it is.
    __aicore__ inline bool Locate(const Source& s, uint32_t token, uint32_t pos, uint64_t& addr)
    {
        if (pos >= s.desc.topk) {
            return false;
        }
        if (s.desc.has_length && static_cast<int64_t>(pos) >= s.length.GetValue(token)) {
            return false;
        }
        const int64_t index = s.indices.GetValue(static_cast<uint64_t>(token) * s.desc.topk + pos);
        if (index < 0 || index >= s.desc.num_rows) {
            return false;
        }
        const uint64_t page = s.desc.page_size;
        addr = (index / page) * s.desc.block_stride_bytes + (index % page) * s.desc.row_stride_bytes;
        return true;
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
        for (uint32_t c = 0; c < kKeysPerVectorCore / kChunk; ++c, ++chunks_) {
            const uint32_t stage = chunks_ & 1;
            const uint32_t first = block * kBlockTopk + vector_ * kKeysPerVectorCore + c * kChunk;
            WaitFlag<HardEvent::V_MTE2>(Ev(stage));  // the dequant of chunk - 2 has read kv_raw[stage]
            const uint32_t valid = IssueRowCopies(src, token, first, stage);
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

    // Starts the MTE2 copies of a chunk's valid rows; returns a bit mask of the valid rows. Two rows go in
    // one copy ("gather2": burst count 2, source gap = the distance between them) when the second lies
    // after the first; the pair is then stored in address order, which permutes two attended keys of the
    // block - harmless, since P's columns and V's rows come from the same slot.
    __aicore__ inline uint32_t IssueRowCopies(const Source& s, uint32_t token, uint32_t first, uint32_t stage)
    {
        const uint32_t gm_row = GmRowBytes(static_cast<KvFormat>(s.desc.format));
        const uint32_t raw = U::kRaw + stage * kChunk * U::kRow;
        uint32_t valid = 0;
        for (uint32_t r = 0; r < kChunk; r += 2) {
            uint64_t a0 = 0;
            uint64_t a1 = 0;
            const bool v0 = Locate(s, token, first + r, a0);
            const bool v1 = Locate(s, token, first + r + 1, a1);
            valid |= (v0 ? 1u : 0u) << r | (v1 ? 1u : 0u) << (r + 1);
            const uint64_t lo = a0 < a1 ? a0 : a1;
            const uint64_t hi = a0 < a1 ? a1 : a0;
            if (v0 && v1 && hi - lo >= gm_row && hi - lo - gm_row <= 0xFFFFFFFFull) {
                CopyRows(s, lo, raw + r * U::kRow, 2, static_cast<uint32_t>(hi - lo - gm_row), gm_row);
                continue;
            }
            if (v0) {
                CopyRows(s, a0, raw + r * U::kRow, 1, 0, gm_row);
            }
            if (v1) {
                CopyRows(s, a1, raw + (r + 1) * U::kRow, 1, 0, gm_row);
            }
        }
        return valid;
    }

    __aicore__ inline void CopyRows(const Source& s, uint64_t addr, uint32_t ub, uint16_t rows, uint32_t gap,
                                    uint32_t gm_row)
    {
        DataCopyExtParams p{rows, gm_row, gap, 0, 0};  // UB rows padded to 32 B by the copy
        DataCopyPadExtParams<uint8_t> pad{false, 0, 0, 0};
        DataCopyPad(Ub<uint8_t>(ub), s.rows[addr], p, pad);
    }

    // kv_raw[stage] -> kv_nz[stage]: invalid rows become zeros (never read: NaN in unreferenced memory must
    // not reach a product), quantized rows are decoded to bf16, then each row is scattered into the NZ
    // tile [32 column blocks][chunk + 1][16] (the extra row keeps the writes off one UB bank).
    __aicore__ inline void ConvertChunk(uint32_t stage, uint32_t valid, bool from_main)
    {
        const uint32_t raw = U::kRaw + stage * kChunk * U::kRow;
        const uint32_t nz = U::kNz + stage * (kHeadDim / 16) * (kChunk + 1) * 32;
        for (uint32_t r = 0; r < kChunk; ++r) {
            uint32_t row_bf16 = raw + r * U::kRow;  // bf16 rows are used as gathered
            if (((valid >> r) & 1) == 0) {
                row_bf16 = U::kQuantized ? U::kRowBf16 : row_bf16;
                Duplicate(Ub<uint16_t>(row_bf16), static_cast<uint16_t>(0), kHeadDim);
            } else if constexpr (U::kQuantized) {
                if (from_main || EXTRA == KvFormat::kFp8) {
                    DecodeFp8Row(raw + r * U::kRow);
                } else {
                    DecodeFp4Row(raw + r * U::kRow);
                }
                row_bf16 = U::kRowBf16;
            }
            // 512 bf16 = 32 blocks of 32 B; block b goes to column block b, row r of the NZ tile.
            CopyRepeatParams rp;
            rp.dstStride = kChunk + 1;
            rp.srcStride = 1;
            rp.dstRepeatSize = 8 * (kChunk + 1);
            rp.srcRepeatSize = 8;
            Copy(Ub<uint16_t>(nz + r * 32), Ub<uint16_t>(row_bf16), 128, kHeadDim / 128, rp);
        }
    }

    // NZ chunk rows -> L1 key tile slot rows [row0, row0 + chunk): column blocks [0, 16) to bank 0, [16, 32)
    // to bank 1; skipping the pad row in UB and the other rows of the 64-row tile in L1.
    __aicore__ inline void CopyChunkToL1(uint32_t stage, uint32_t slot, uint32_t row0)
    {
        const uint32_t nz = U::kNz + stage * (kHeadDim / 16) * (kChunk + 1) * 32;
        const uint32_t half_blocks = kHeadDim / 32;  // 16 column blocks per bank half
        for (uint32_t half = 0; half < 2; ++half) {
            DataCopyParams p;
            p.blockCount = half_blocks;
            p.blockLen = kChunk;  // rows of 32 B
            p.srcStride = 1;      // the pad row
            p.dstStride = kBlockTopk - kChunk;
            DataCopy(L1<uint16_t>(L1Layout::Kv(slot, half) + row0 * 32),
                     Ub<uint16_t>(nz + half * half_blocks * (kChunk + 1) * 32), p);
        }
    }

    // ---- dequantization by table lookups (no reliance on fp8 / fp4 conversion instructions) ----

    __aicore__ inline void LoadDecodeTables(GM_ADDR tables)
    {
        GlobalTensor<float> t;
        t.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(tables));
        DataCopy(Ub<float>(U::kTables), t, 576);
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
        PipeBarrier<PIPE_V>();
    }

    // `count` bytes at `bytes` -> byte offsets into a 4-byte table (code * 4).
    __aicore__ inline void CodeOffsets(uint32_t out, uint32_t bytes, uint32_t count)
    {
        Cast(Ub<half>(U::kCodesHalf), Ub<uint8_t>(bytes), RoundMode::CAST_NONE, count);
        Cast(Ub<int32_t>(out), Ub<half>(U::kCodesHalf), RoundMode::CAST_RINT, count);
        ShiftLeft(Ub<int32_t>(out), Ub<int32_t>(out), 2, count);
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
        CodeOffsets(U::kCodeOffsets, row, kHeadDim);
        Lookup(U::kValues, U::kTables, U::kCodeOffsets, kHeadDim);
        CodeOffsets(U::kCodeOffsets, row + kHeadDim, kHeadDim / 32);
        Lookup(U::kTileScales, U::kTables + 256 * 4, U::kCodeOffsets, kHeadDim / 32);
        ScaleToBf16(U::kOffsets);
    }

    // V4.1 FP4 row: 256 bytes of e2m1 pairs | 32 e4m3 scales (tile 16).
    __aicore__ inline void DecodeFp4Row(uint32_t row)
    {
        LocalTensor<int32_t> nibbles = Ub<int32_t>(U::kNibbles);
        LocalTensor<int32_t> high = nibbles[kHeadDim / 2];
        Cast(Ub<half>(U::kCodesHalf), Ub<uint8_t>(row), RoundMode::CAST_NONE, kHeadDim / 2);
        Cast(nibbles, Ub<half>(U::kCodesHalf), RoundMode::CAST_RINT, kHeadDim / 2);
        ShiftRight(high, nibbles, 4, kHeadDim / 2);                 // high nibble
        ShiftLeft(Ub<int32_t>(U::kCodeOffsets), high, 4, kHeadDim / 2);
        Sub(nibbles, nibbles, Ub<int32_t>(U::kCodeOffsets), kHeadDim / 2);  // low nibble
        ShiftLeft(nibbles, nibbles, 2, kHeadDim);                   // table byte offsets
        // interleave low/high into element order, then look the codes up in the e2m1 table
        Gather(Ub<int32_t>(U::kCodeOffsets), nibbles, Ub<uint32_t>(U::kOffsets + 4096), 0u, kHeadDim);
        Lookup(U::kValues, U::kTables + 512 * 4, U::kCodeOffsets, kHeadDim);
        CodeOffsets(U::kCodeOffsets, row + kHeadDim / 2, kHeadDim / 16);
        Lookup(U::kTileScales, U::kTables, U::kCodeOffsets, kHeadDim / 16);  // e4m3 scales
        ScaleToBf16(U::kOffsets + 2048);
    }

    // ---- softmax of the owned 32 rows of block g ----

    // 0 for attended keys of the block, -inf otherwise (all 64 keys: every row sees every key).
    __aicore__ inline void BuildKeyBias(uint32_t g, uint32_t slot)
    {
        uint32_t block;
        const Source& src = SourceOf(work_.Local(g), block);
        const uint32_t token = work_.Unit(g) / params_.tiling.head_tiles;
        LocalTensor<float> bias = Ub<float>(U::kKeyBias + slot * kBlockTopk * 4);
        for (uint32_t k = 0; k < kBlockTopk; ++k) {
            uint64_t unused;
            bias.SetValue(k, Locate(src, token, block * kBlockTopk + k, unused) ? 0.0f : -kInf);
        }
        SetFlag<HardEvent::S_V>(kEv0);
        WaitFlag<HardEvent::S_V>(kEv0);
    }

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
        BuildKeyBias(g, slot);
        Await(kLogitsReady);
        LocalTensor<float> x = Ub<float>(U::kLogits + slot * n * 4);
        LocalTensor<float> m_run = Ub<float>(U::MRun(parity));
        LocalTensor<float> m_use = Ub<float>(U::MUse(parity));
        LocalTensor<float> sum = Ub<float>(U::Sum(parity));
        LocalTensor<float> alpha = Ub<float>(U::Alpha(slot));
        LocalTensor<float> row_max = Ub<float>(U::kRowMax);
        LocalTensor<float> row_sum = Ub<float>(U::kRowSum);

        Muls(x, x, params_.sm_scale, n);
        // + key bias, the same 64-float row for every head (source-1 repeat stride 0)
        Add(x, x, Ub<float>(U::kKeyBias + slot * kBlockTopk * 4), kBlockTopk, rows, {1, 1, 1, 8, 8, 0});
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
        Cast(probs, x, RoundMode::CAST_RINT, kBlockTopk, rows, {static_cast<uint16_t>(rows), 1, 1, 8});
        Signal<PIPE_V>(kLogitsFree);
        if (g >= 2) {
            AwaitPvDone(g - 1);  // PV(g - 2) has read L1 probability slot `slot`
        }
        SetFlag<HardEvent::V_MTE3>(kEv0);
        WaitFlag<HardEvent::V_MTE3>(kEv0);
        for (uint32_t half = 0; half < 2; ++half) {  // keys [0, 32) to bank 0, [32, 64) to bank 1
            DataCopyParams p;
            p.blockCount = 2;     // key column blocks in this half
            p.blockLen = rows;    // 32 rows of 32 B
            p.srcStride = 0;
            p.dstStride = kHeadsPerTile - rows;  // skip the other vector core's rows
            DataCopy(L1<bfloat16_t>(L1Layout::Probs(slot, half) + vector_ * rows * 32),
                     probs[half * 2 * rows * 16], p);
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
