// NPU implementation of anymla_ascendc::sparse_attention_v41 (schema and fake impl: ascendc_kernels/ops.py).
// Plain C++ against torch and torch_npu headers: checks the arguments, computes the work split (the same rule
// as tiling.py's split_units), uploads the parameters, and launches the kernel through torch_npu's op queue
// so it is ordered with the other NPU ops of the stream. NEVER BUILT OR RUN here (no CANN, no NPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <acl/acl.h>

#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "../op_kernel/tiling_data.h"
#include "launcher.h"

namespace anymla_ascendc {
namespace {

KvFormat RowFormat(const at::Tensor& kv, const char* name)
{
    TORCH_CHECK(kv.dim() == 4, name, ": expected [num_blocks, page_size, 1, row], got ", kv.dim(), " dims");
    TORCH_CHECK(kv.size(2) == 1, name, ": expected one latent row per slot (dim 2 = 1), got ", kv.size(2));
    TORCH_CHECK(kv.stride(3) == 1, name, ": the row must be contiguous (stride 1), got stride ", kv.stride(3));
    if (kv.scalar_type() == at::kBFloat16) {
        TORCH_CHECK(kv.size(3) == kHeadDim, name, ": bf16 rows must hold ", kHeadDim, " values, got ", kv.size(3));
        return KvFormat::kBf16;
    }
    TORCH_CHECK(kv.scalar_type() == at::kByte || kv.scalar_type() == at::kChar ||
                    kv.scalar_type() == at::kFloat8_e4m3fn,
                name, ": expected bf16 rows or byte rows (uint8, int8, float8_e4m3fn), got ", kv.scalar_type());
    if (kv.size(3) == 528) {
        return KvFormat::kFp8;
    }
    TORCH_CHECK(kv.size(3) == 288, name, ": byte rows must be V4.1 FP8 (528) or FP4 (288) bytes, got ", kv.size(3));
    return KvFormat::kFp4;
}

void CheckIndices(const at::Tensor& indices, int64_t tokens, const char* name)
{
    TORCH_CHECK(indices.scalar_type() == at::kInt, name, ": expected int32, got ", indices.scalar_type());
    TORCH_CHECK(indices.dim() == 2 && indices.size(0) == tokens && indices.is_contiguous(), name,
                ": expected a contiguous [T, topk] tensor with T = ", tokens, ", got ", indices.sizes());
}

void CheckLength(const c10::optional<at::Tensor>& length, int64_t tokens, const char* name)
{
    if (length.has_value()) {
        TORCH_CHECK(length->scalar_type() == at::kInt && length->dim() == 1 && length->size(0) == tokens &&
                        length->is_contiguous(),
                    name, ": expected a contiguous int32 [T] tensor with T = ", tokens, ", got ", length->sizes());
    }
}

KeySource Describe(const at::Tensor& kv, const at::Tensor& indices, const c10::optional<at::Tensor>& length,
                   KvFormat format)
{
    const int64_t elem = kv.element_size();
    KeySource s{};
    s.block_stride_bytes = static_cast<uint64_t>(kv.stride(0) * elem);
    s.row_stride_bytes = static_cast<uint64_t>(kv.stride(1) * elem);
    s.num_rows = kv.size(0) * kv.size(1);
    s.page_size = static_cast<uint32_t>(kv.size(1));
    s.topk = static_cast<uint32_t>(indices.size(1));
    s.has_length = length.has_value() ? 1 : 0;
    s.format = static_cast<uint32_t>(format);
    return s;
}

uint32_t CubeCores(int device)
{
    static std::mutex lock;
    static std::unordered_map<int, uint32_t> cores;
    std::lock_guard<std::mutex> guard(lock);
    auto it = cores.find(device);
    if (it == cores.end()) {
        int64_t value = 0;
        const aclError err = aclrtGetDeviceInfo(static_cast<uint32_t>(device), ACL_DEV_ATTR_CUBE_CORE_NUM, &value);
        TORCH_CHECK(err == ACL_SUCCESS && value > 0, "sparse_attention_v41: cannot read the AI core count of NPU ",
                    device, " (aclrtGetDeviceInfo error ", err, ")");
        it = cores.emplace(device, static_cast<uint32_t>(value)).first;
    }
    return it->second;
}

// tiling.py's split: units over min(units, cores) cores, the first (units % used) cores take one more.
SparseAttentionV41Tiling Plan(int64_t tokens, int64_t heads, uint32_t topk, uint32_t extra_topk, uint32_t cores,
                              uint32_t& cores_used)
{
    SparseAttentionV41Tiling t{};
    t.num_tokens = static_cast<uint32_t>(tokens);
    t.num_heads = static_cast<uint32_t>(heads);
    t.head_tiles = static_cast<uint32_t>(heads / kHeadsPerTile);
    t.num_units = t.num_tokens * t.head_tiles;
    cores_used = t.num_units < cores ? t.num_units : cores;
    t.units_per_core = t.num_units / cores_used;
    t.cores_with_extra_unit = t.num_units % cores_used;
    t.topk = topk;
    t.extra_topk = extra_topk;
    t.main_blocks = (topk + kBlockTopk - 1) / kBlockTopk;
    t.extra_blocks = (extra_topk + kBlockTopk - 1) / kBlockTopk;
    t.workspace_bytes_per_core = kMailboxSlots * 2 * kMailboxEntryBytes;
    return t;
}

// The e2m1 code -> value table the vector cores decode FP4 values with (kDecodeTableFloats entries; codes 8-15
// are the negatives of 0-7). FP8 values and scales are converted natively on the 950 (vector_core.h).
at::Tensor DecodeTables(const at::Device& device)
{
    static std::mutex lock;
    static std::unordered_map<int, at::Tensor> tables;
    std::lock_guard<std::mutex> guard(lock);
    auto it = tables.find(device.index());
    if (it == tables.end()) {
        const std::array<float, 8> magnitudes{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
        auto e2m1 = at::zeros({static_cast<int64_t>(kDecodeTableFloats)}, at::kFloat);
        for (int code = 0; code < static_cast<int>(kDecodeTableFloats); ++code) {
            const float m = magnitudes[code & 7];
            e2m1[code] = (code & 8) ? -m : m;
        }
        it = tables.emplace(device.index(), e2m1.to(device)).first;
    }
    return it->second;
}

void* Ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
void* Ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> SparseAttentionV41(
    const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, const c10::optional<at::Tensor>& topk_length,
    const c10::optional<at::Tensor>& extra_kv, const c10::optional<at::Tensor>& extra_indices,
    const c10::optional<at::Tensor>& extra_topk_length, const c10::optional<at::Tensor>& attn_sink, double sm_scale)
{
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == kHeadDim && q.is_contiguous(),
                "q: expected a contiguous bf16 [T, h_q, 512] tensor, got ", q.scalar_type(), " ", q.sizes());
    TORCH_CHECK(q.size(1) > 0 && q.size(1) % kHeadsPerTile == 0, "q: h_q must be a positive multiple of ",
                kHeadsPerTile, ", got ", q.size(1));
    const int64_t tokens = q.size(0);
    const int64_t heads = q.size(1);
    const KvFormat main_format = RowFormat(kv, "kv");
    CheckIndices(indices, tokens, "indices");
    CheckLength(topk_length, tokens, "topk_length");
    TORCH_CHECK(extra_kv.has_value() == extra_indices.has_value(),
                "extra_indices: must be given if and only if extra_kv is given");
    KvFormat extra_format = KvFormat::kNone;
    if (extra_kv.has_value()) {
        extra_format = RowFormat(*extra_kv, "extra_kv");
        CheckIndices(*extra_indices, tokens, "extra_indices");
        CheckLength(extra_topk_length, tokens, "extra_topk_length");
    }
    if (attn_sink.has_value()) {
        TORCH_CHECK(attn_sink->scalar_type() == at::kFloat && attn_sink->dim() == 1 && attn_sink->size(0) == heads &&
                        attn_sink->is_contiguous(),
                    "attn_sink: expected a contiguous fp32 [h_q] tensor, got ", attn_sink->sizes());
    }

    auto out = at::empty({tokens, heads, kHeadDim}, q.options());
    auto max_logits = at::empty({tokens, heads}, q.options().dtype(at::kFloat));
    auto lse = at::empty({tokens, heads}, q.options().dtype(at::kFloat));
    if (tokens == 0) {
        return {out, max_logits, lse};
    }

    const uint32_t extra_topk = extra_indices.has_value() ? static_cast<uint32_t>(extra_indices->size(1)) : 0;
    uint32_t cores_used = 0;
    SparseAttentionV41Params params{};
    params.tiling = Plan(tokens, heads, static_cast<uint32_t>(indices.size(1)), extra_topk, CubeCores(q.device().index()),
                         cores_used);
    params.main = Describe(kv, indices, topk_length, main_format);
    if (extra_kv.has_value()) {
        params.extra = Describe(*extra_kv, *extra_indices, extra_topk_length, extra_format);
    }
    params.sm_scale = static_cast<float>(sm_scale);
    params.has_sink = attn_sink.has_value() ? 1 : 0;

    auto host_params = at::empty({static_cast<int64_t>(sizeof(params))}, at::kByte);
    std::memcpy(host_params.data_ptr(), &params, sizeof(params));
    auto device_params = host_params.to(q.device());
    auto workspace = at::zeros({static_cast<int64_t>(params.tiling.workspace_bytes_per_core) * cores_used},
                               q.options().dtype(at::kByte));
    auto tables = DecodeTables(q.device());

    const uint32_t main_code = static_cast<uint32_t>(main_format);
    const uint32_t extra_code = static_cast<uint32_t>(extra_format);
    // The lambda runs from torch_npu's op queue; it holds every tensor it launches on.
    at_npu::native::OpCommand::RunOpApi("AnymlaSparseAttentionV41", [=]() -> int {
        SparseAttentionV41Buffers b{Ptr(q), Ptr(kv), Ptr(indices), Ptr(topk_length), Ptr(extra_kv),
                                    Ptr(extra_indices), Ptr(extra_topk_length), Ptr(attn_sink), Ptr(tables),
                                    Ptr(out), Ptr(max_logits), Ptr(lse), Ptr(workspace), Ptr(device_params)};
        void* stream = c10_npu::getCurrentNPUStream().stream(false);
        return anymla_sparse_attention_v41_launch(main_code, extra_code, cores_used, stream, &b);
    });
    return {out, max_logits, lse};
}

}  // namespace
}  // namespace anymla_ascendc

TORCH_LIBRARY_IMPL(anymla_ascendc, PrivateUse1, m)
{
    m.impl("sparse_attention_v41", &anymla_ascendc::SparseAttentionV41);
}
