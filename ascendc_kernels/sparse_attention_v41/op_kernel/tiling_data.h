// Tiling and launch parameters shared by the host binding (host/binding.cpp, g++) and the kernel
// (sparse_attention_v41.asc, bisheng). Plain C++ with fixed-width PODs only, so both compilers lay the
// structs out identically; the host uploads one SparseAttentionV41Params to GM per call.
//
// The constants are the Ascend 950 plan of anymla/ascendc_kernels/tiling.py; tests/test_ascendc_tier.py
// parses this file and checks them (and the SparseAttentionV41Tiling fields) against tiling.plan().
#pragma once

#include <cstdint>

namespace anymla_ascendc {

constexpr uint32_t kHeadsPerTile = 64;       // M of both matmuls
constexpr uint32_t kBlockTopk = 64;          // keys per block (B_TOPK)
constexpr uint32_t kHeadDim = 512;           // d_qk = d_v (V4.1 latent, rope included)
constexpr uint32_t kHeadsPerVectorCore = 32; // rows of P and O owned by one AIV
constexpr uint32_t kKeysPerVectorCore = 32;  // keys of every block one AIV gathers
constexpr uint32_t kKvStages = 5;            // key blocks resident in L1
constexpr uint32_t kGatherChunkBf16 = 16;    // keys per gather step, bf16 rows (prefill)
constexpr uint32_t kGatherChunkFp8 = 32;     // keys per gather step, V4.1 FP8 main cache (decode)
constexpr uint32_t kDrainChunk = 128;        // O_partial columns per FixPipe drain
constexpr uint32_t kMailboxSlots = 8;        // ring of skip-scale bits, per AI core
constexpr uint32_t kMailboxEntryBytes = 64;  // one cache line per (slot, AIV)
constexpr float kRescaleThreshold = 6.0f;    // skip-scale threshold on scaled natural logits
constexpr uint32_t kDecodeTableFloats = 16;  // the e2m1 code -> value table the host uploads (FP4 values)

// Row formats of a key source. The values are the kernel's template arguments.
enum class KvFormat : uint32_t {
    kNone = 0,  // no extra cache
    kBf16 = 1,  // 512 x bf16 (prefill kv)
    kFp8 = 2,   // V4.1 FP8: 512 x e4m3 | 16 x e8m0 (tile 32), 528 bytes
    kFp4 = 3,   // V4.1 FP4: 256 bytes of e2m1 pairs | 32 x e4m3 (tile 16), 288 bytes
};

// The work split (mirrors Tiling.tiling_data() in tiling.py, same fields in the same order).
// Core c of the launch takes units [c * units_per_core + min(c, extra), ...), one more if c < extra.
struct SparseAttentionV41Tiling {
    uint32_t num_tokens;
    uint32_t num_heads;
    uint32_t head_tiles;
    uint32_t num_units;  // num_tokens * head_tiles; unit = token * head_tiles + tile
    uint32_t units_per_core;
    uint32_t cores_with_extra_unit;
    uint32_t topk;
    uint32_t extra_topk;
    uint32_t main_blocks;  // ceil(topk / 64)
    uint32_t extra_blocks; // ceil(extra_topk / 64)
    uint32_t workspace_bytes_per_core;
};

// One paged key source [num_blocks, page_size, 1, row] in bytes; indices [T, topk] int32 (contiguous).
struct KeySource {
    uint64_t block_stride_bytes;
    uint64_t row_stride_bytes;
    int64_t num_rows;       // num_blocks * page_size: an index is valid iff 0 <= index < num_rows
    uint32_t page_size;
    uint32_t topk;
    uint32_t has_length;    // a [T] int32 length tensor masks positions >= length
    uint32_t format;        // KvFormat
};

struct SparseAttentionV41Params {
    SparseAttentionV41Tiling tiling;
    KeySource main;
    KeySource extra;   // format kNone without an extra cache
    float sm_scale;
    uint32_t has_sink;
};

}  // namespace anymla_ascendc
