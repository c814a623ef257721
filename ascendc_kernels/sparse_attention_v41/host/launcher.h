// The launcher the kernel file exports to the host binding: plain C++, so binding.cpp compiles with g++.
#pragma once

#include <cstdint>

namespace anymla_ascendc {

// Device addresses of one call (nullptr for absent optional tensors). Layouts: see ascendc_kernels/ops.py.
struct SparseAttentionV41Buffers {
    void* q;                  // [T, h_q, 512] bf16, contiguous
    void* kv;                 // main key source (bytes as given by KeySource)
    void* indices;            // [T, topk] int32, contiguous
    void* topk_length;        // [T] int32 or nullptr
    void* extra_kv;
    void* extra_indices;      // [T, extra_topk] int32, contiguous
    void* extra_topk_length;  // [T] int32 or nullptr
    void* attn_sink;          // [h_q] fp32 or nullptr
    void* decode_tables;      // kDecodeTableFloats fp32: the e2m1 code -> value table
    void* out;                // [T, h_q, 512] bf16
    void* max_logits;         // [T, h_q] fp32
    void* lse;                // [T, h_q] fp32
    void* workspace;          // workspace_bytes_per_core x cores, zero-initialised
    void* params;             // one SparseAttentionV41Params
};

}  // namespace anymla_ascendc

// Launches the kernel instantiation for (main_format, extra_format) (KvFormat values) on `cores` AI
// cores of `stream` (an aclrtStream). Returns 0, or -1 for a format pair the kernel is not built for.
extern "C" int anymla_sparse_attention_v41_launch(uint32_t main_format, uint32_t extra_format, uint32_t cores,
                                                  void* stream, const anymla_ascendc::SparseAttentionV41Buffers* buffers);
