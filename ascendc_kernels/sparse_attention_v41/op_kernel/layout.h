// Buffer layouts (bytes) of the sparse_attention_v41 kernel, the per-core work split, and kernel parameters.
// Sizes must match anymla/ascendc_kernels/tiling.py's plan for Ascend 950 (tests/test_ascendc_layout.py parses
// this file and checks every UbLayout's end against it); the layout model reads the offsets from here too.
#pragma once

#include "data_paths.h"
#include "platform.h"

namespace anymla_ascendc::device {

constexpr uint32_t kKB = 1024;
constexpr float kNegInit = -1.0e30f;  // initial maxima: finite, so m_run - m_use never computes inf - inf
constexpr float kInf = __builtin_inff();

template <KvFormat MAIN, KvFormat EXTRA>
struct UbLayout {
    static constexpr uint32_t kChunk = MAIN == KvFormat::kBf16 ? kGatherChunkBf16 : kGatherChunkFp8;
    static constexpr uint32_t kPitch = RawPitch(MAIN, EXTRA);  // bytes between gathered rows (data_paths.h)
    static constexpr bool kQuantized = MAIN != KvFormat::kBf16;
    static constexpr uint32_t kRows = kHeadsPerVectorCore;
    static constexpr uint32_t kIndexBytes = 1792;
    static constexpr uint32_t kScratchBytes = 4 * 2048 + 256 + 1024;

    static constexpr uint32_t kAcc = 0;                                        // [32, 512] fp32
    static constexpr uint32_t kDrain = kAcc + kRows * kHeadDim * 4;            // 2 x [32, 128] fp32
    static constexpr uint32_t kLogits = kDrain + 2 * kRows * kDrainChunk * 4;  // 2 x [32, 64] fp32
    static constexpr uint32_t kProbs = kLogits + 2 * kRows * kBlockTopk * 4;   // 2 x [4][32][16] bf16 (NZ)
    static constexpr uint32_t kRowState = kProbs + 2 * kRows * kBlockTopk * 2; // 12 x 64 fp32
    static constexpr uint32_t kBroadcast = kRowState + 12 * 64 * 4;            // [32][8] fp32
    static constexpr uint32_t kKeyBias = kBroadcast + kRows * 32;              // per L1 key slot: 64 fp32
    static constexpr uint32_t kMailbox = kKeyBias + kKvStages * kBlockTopk * 4;  // one word, 32 B
    static constexpr uint32_t kIndex = kMailbox + 32;                          // gather parameters (below)
    static constexpr uint32_t kRaw = kIndex + kIndexBytes;                     // 2 x chunk rows at kPitch
    static constexpr uint32_t kNz = kRaw + 2 * kChunk * kPitch;                // 2 x [32][chunk + 1][16] bf16
    static constexpr uint32_t kTables = kNz + 2 * (kHeadDim / 16) * NzRows(kChunk) * kDataBlock;
    static constexpr uint32_t kOffsets = kTables + (kQuantized ? kDecodeTableFloats * 4 : 0);  // 3 x 512 int32
    static constexpr uint32_t kScratch = kOffsets + (kQuantized ? 3 * 512 * 4 : 0);
    static constexpr uint32_t kEnd = kScratch + (kQuantized ? kScratchBytes : 0);
    static_assert(kEnd <= kUbBytes, "UB plan exceeds the 248 KB usable per vector core on Ascend 950");

    // row_state vectors (64 floats each)
    static constexpr uint32_t RowVec(uint32_t i) { return kRowState + i * 256; }
    static constexpr uint32_t MRun(uint32_t parity) { return RowVec(0 + parity); }
    static constexpr uint32_t MUse(uint32_t parity) { return RowVec(2 + parity); }
    static constexpr uint32_t Sum(uint32_t parity) { return RowVec(4 + parity); }
    static constexpr uint32_t Alpha(uint32_t parity) { return RowVec(6 + parity); }
    static constexpr uint32_t kRowMax = kRowState + 8 * 256;
    static constexpr uint32_t kRowSum = kRowState + 9 * 256;
    static constexpr uint32_t kSink = kRowState + 10 * 256;
    static constexpr uint32_t kScale = kRowState + 11 * 256;
    static constexpr uint32_t KeyBias(uint32_t slot) { return kKeyBias + slot * kBlockTopk * 4; }
    // gather parameters of one block (kIndexLanes lanes)
    static constexpr uint32_t kSlots = kIndex;                // int32: the block's indices, then slot or -1
    static constexpr uint32_t kLanes = kIndex + 256;          // int32 0, 1, ..., 63 (filled once)
    static constexpr uint32_t kPages = kIndex + 512;          // int32: slot / page_size, then slot % page_size
    static constexpr uint32_t kLaneMask = kIndex + 768;       // compare bit mask of the 64 lanes
    static constexpr uint32_t kZeros = kIndex + 1024;         // 64 x 0.0f (filled once)
    static constexpr uint32_t kAddresses = kIndex + 1280;     // int64 byte offsets of the own 32 keys' rows
    static constexpr uint32_t kAddressTmp = kIndex + 1536;    // int64 scratch
    // dequant scratch (one row)
    static constexpr uint32_t kCodeOffsets = kScratch;           // 512 uint32 byte offsets into a table
    static constexpr uint32_t kNibbles = kCodeOffsets + 2048;    // 512 uint32 (FP4 low nibbles | high nibbles)
    static constexpr uint32_t kValues = kNibbles + 2048;         // 512 fp32
    static constexpr uint32_t kScales = kValues + 2048;          // 512 fp32
    static constexpr uint32_t kTileScales = kScales + 2048;      // 64 fp32 (FP8: built from their bits in place)
    static constexpr uint32_t kRowBf16 = kTileScales + 256;      // 512 bf16
};

struct L1Layout {
    static constexpr uint32_t kBank = 256 * kKB;
    static constexpr uint32_t kQHalf = kHeadsPerTile * (kHeadDim / 2) * 2;   // 32 KB
    static constexpr uint32_t kKvHalf = kBlockTopk * (kHeadDim / 2) * 2;     // 32 KB
    static constexpr uint32_t kProbsHalf = kHeadsPerTile * (kBlockTopk / 2) * 2;  // 4 KB
    static constexpr uint32_t Q(uint32_t slot, uint32_t half) { return half * kBank + slot * kQHalf; }
    static constexpr uint32_t Kv(uint32_t slot, uint32_t half) { return half * kBank + 2 * kQHalf + slot * kKvHalf; }
    static constexpr uint32_t Probs(uint32_t slot, uint32_t half)
    {
        return half * kBank + 2 * kQHalf + kKvStages * kKvHalf + slot * kProbsHalf;
    }
    static_assert(2 * kQHalf + kKvStages * kKvHalf + 2 * kProbsHalf <= kBank, "L1 plan exceeds a 256 KB bank");
};

struct L0Layout {
    static constexpr uint32_t kOperand = 32 * kKB;  // L0A / L0B ping-pong halves
    static constexpr uint32_t Logits(uint32_t slot) { return slot * kHeadsPerTile * kBlockTopk * 4; }
    static constexpr uint32_t kPartial = 2 * kHeadsPerTile * kBlockTopk * 4;  // [64, 512] fp32 after 2 tiles
    static_assert(kPartial + kHeadsPerTile * kHeadDim * 4 <= 256 * kKB, "L0C plan exceeds 256 KB");
};

// Hardware events used inside one core (ids per event type).
constexpr event_t kEv0 = EVENT_ID0;
constexpr event_t kEv1 = EVENT_ID1;
constexpr event_t kEvProbs0 = EVENT_ID2;  // + parity
constexpr event_t kEvPartial = EVENT_ID4;
__aicore__ inline event_t Ev(uint32_t parity) { return parity ? kEv1 : kEv0; }

struct Work {
    uint32_t first_unit;
    uint32_t units;
    uint32_t blocks_per_unit;
    uint32_t total_blocks;

    __aicore__ inline void Init(const SparseAttentionV41Tiling& t)
    {
        const uint32_t c = GroupIndex();
        first_unit = c * t.units_per_core + (c < t.cores_with_extra_unit ? c : t.cores_with_extra_unit);
        units = t.units_per_core + (c < t.cores_with_extra_unit ? 1 : 0);
        blocks_per_unit = t.main_blocks + t.extra_blocks;
        total_blocks = units * blocks_per_unit;
    }
    __aicore__ inline uint32_t Unit(uint32_t block) const { return first_unit + block / blocks_per_unit; }
    __aicore__ inline uint32_t Local(uint32_t block) const { return block % blocks_per_unit; }
    __aicore__ inline bool Last(uint32_t block) const { return Local(block) + 1 == blocks_per_unit; }
};

__aicore__ inline void LoadParams(SparseAttentionV41Params& p, GM_ADDR params)
{
    const __gm__ uint32_t* src = reinterpret_cast<const __gm__ uint32_t*>(params);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&p);
    for (uint32_t i = 0; i < sizeof(SparseAttentionV41Params) / sizeof(uint32_t); ++i) {
        dst[i] = src[i];
    }
}

}  // namespace anymla_ascendc::device
