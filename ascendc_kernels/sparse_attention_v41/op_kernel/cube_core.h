// The cube core of sparse_attention_v41: Q K^T and S V, O_partial in L0C, FixPipe of logits and drains.
#pragma once

#include "layout.h"

namespace anymla_ascendc::device {

template <KvFormat MAIN, KvFormat EXTRA>
class CubeCore {
    using U = UbLayout<MAIN, EXTRA>;

public:
    __aicore__ inline void Init(const SparseAttentionV41Params& p, GM_ADDR q, GM_ADDR workspace)
    {
        params_ = p;
        work_.Init(p.tiling);
        q_.SetGlobalBuffer(reinterpret_cast<__gm__ bfloat16_t*>(q));
        mailbox_.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(
            workspace + static_cast<uint64_t>(GroupIndex()) * p.tiling.workspace_bytes_per_core));
    }

    __aicore__ inline void Run()
    {
        // Prime the intra-core rings: each waits on the release of its previous use.
        SetFlag<HardEvent::M_MTE1>(kEv0);
        SetFlag<HardEvent::M_MTE1>(kEv1);
        SetFlag<HardEvent::FIX_M>(kEv0);
        SetFlag<HardEvent::FIX_M>(kEv1);
        SetFlag<HardEvent::MTE1_MTE2>(kEv0);
        SetFlag<HardEvent::MTE1_MTE2>(kEv1);
        for (uint32_t g = 0; g < work_.total_blocks; ++g) {
            if (work_.Local(g) == 0) {
                LoadQ(g);
            }
            Await(kKvReady);
            QueryKey(g);
            if (g > 0) {
                ProbsValue(g - 1);  // PV of the previous block runs while the vectors do softmax(g)
            }
        }
        if (work_.total_blocks > 0) {
            ProbsValue(work_.total_blocks - 1);
        }
        // Balance counting flags whose last releases nobody waited for.
        for (uint32_t i = 0; i < 2 && i < work_.total_blocks; ++i) {
            Await(kLogitsFree);
        }
        for (uint32_t i = 0; i < 2 && i < drains_; ++i) {
            Await(kDrainFree);
        }
        WaitFlag<HardEvent::M_MTE1>(kEv0);
        WaitFlag<HardEvent::M_MTE1>(kEv1);
        WaitFlag<HardEvent::FIX_M>(kEv0);
        WaitFlag<HardEvent::FIX_M>(kEv1);
        WaitFlag<HardEvent::MTE1_MTE2>(kEv0);
        WaitFlag<HardEvent::MTE1_MTE2>(kEv1);
    }

private:
    // Q tile [64, 512] of a unit, GM (ND) -> L1 (NZ) with the on-the-fly conversion of contiguous rows;
    // d in [0, 256) goes to bank 0 and [256, 512) to bank 1.
    __aicore__ inline void LoadQ(uint32_t g)
    {
        const uint32_t unit = work_.Unit(g);
        const uint32_t slot = (unit - work_.first_unit) & 1;
        const uint32_t token = unit / params_.tiling.head_tiles;
        const uint32_t tile = unit % params_.tiling.head_tiles;
        const uint64_t row = static_cast<uint64_t>(token) * params_.tiling.num_heads + tile * kHeadsPerTile;
        WaitFlag<HardEvent::MTE1_MTE2>(Ev(slot));  // the unit two back has finished reading this slot
        for (uint32_t half = 0; half < 2; ++half) {
            Nd2NzParams nz;
            nz.ndNum = kQNdNum;
            nz.nValue = kQNValue;
            nz.dValue = kQDValue;
            nz.srcNdMatrixStride = 0;
            nz.srcDValue = kQSrcDValue;
            nz.dstNzC0Stride = kQDstNzC0Stride;
            nz.dstNzNStride = kQDstNzNStride;
            nz.dstNzMatrixStride = 0;
            DataCopy(L1<bfloat16_t>(L1Layout::Q(slot, half)), q_[row * kHeadDim + half * (kHeadDim / 2)], nz);
        }
        SetFlag<HardEvent::MTE2_MTE1>(kEv0);
        WaitFlag<HardEvent::MTE2_MTE1>(kEv0);
    }

    // P = Q K^T over d in two halves of 256 (one per L1 bank), then FixPipe P to the vector cores.
    __aicore__ inline void QueryKey(uint32_t g)
    {
        const uint32_t slot = g & 1;
        const uint32_t qslot = (work_.Unit(g) - work_.first_unit) & 1;
        const uint32_t kv = g % kKvStages;
        WaitFlag<HardEvent::FIX_M>(Ev(slot));  // logits of block g - 2 have left L0C
        for (uint32_t half = 0; half < 2; ++half) {
            const uint32_t pp = NextOperand();
            WaitFlag<HardEvent::M_MTE1>(Ev(pp));
            LoadFractals(L0a<bfloat16_t>(pp * L0Layout::kOperand), L1<bfloat16_t>(L1Layout::Q(qslot, half)), 0,
                         kQLoadRepeat, 1, false);
            // K^T as the B operand (Zn [d, keys]): the Nz key tile of K [keys, d] is that layout already.
            LoadKeyOperand(pp, kv, half, kKtLoads, kKtStartStep, kKtRepeat, kKtSrcStride, kKtDstStep, kKtTranspose);
            SetFlag<HardEvent::MTE1_M>(Ev(pp));
            WaitFlag<HardEvent::MTE1_M>(Ev(pp));
            MatMul(L0c<float>(L0Layout::Logits(slot)), L0a<bfloat16_t>(pp * L0Layout::kOperand),
                   L0b<bfloat16_t>(pp * L0Layout::kOperand), kHeadsPerTile, kBlockTopk, kHeadDim / 2, half == 0);
            SetFlag<HardEvent::M_MTE1>(Ev(pp));
        }
        if (work_.Last(g)) {
            SetFlag<HardEvent::MTE1_MTE2>(Ev(qslot));  // this unit's Q is no longer read
        }
        SetFlag<HardEvent::M_FIX>(Ev(slot));
        WaitFlag<HardEvent::M_FIX>(Ev(slot));
        if (g >= 2) {
            Await(kLogitsFree);  // the vector cores are done with UB logits stage `slot` (block g - 2)
        }
        FixpipeRowSplit(Ub<float>(U::kLogits + slot * kHeadsPerVectorCore * kBlockTopk * 4),
                        L0c<float>(L0Layout::Logits(slot)), kHeadsPerTile, kLogitsFixN, kLogitsFixDstStride);
        SetFlag<HardEvent::FIX_M>(Ev(slot));
        Signal<PIPE_FIX>(kLogitsReady);
    }

    // O_partial += bf16(P) V for block g, after draining O_partial when either vector core rescaled.
    __aicore__ inline void ProbsValue(uint32_t g)
    {
        const uint32_t local = work_.Local(g);
        const uint32_t slot = g & 1;
        const uint32_t kv = g % kKvStages;
        Await(kProbsReady);
        const bool rescaled = (ReadMailbox(mailbox_, g, 0) | ReadMailbox(mailbox_, g, 1)) != 0;
        Signal<PIPE_MTE1>(kDecided);  // issued after the scalar reads above have returned
        const bool drain = local > 0 && rescaled;  // a unit's first block finds O_partial empty
        if (drain) {
            Drain();
        }
        for (uint32_t half = 0; half < 2; ++half) {  // output columns [256 half, 256 half + 256)
            const uint32_t pp = NextOperand();
            WaitFlag<HardEvent::M_MTE1>(Ev(pp));
            // A = P [64 heads, 64 keys] (Nz): keys [0, 32) from bank 0, then [32, 64) from bank 1.
            for (uint32_t keys = 0; keys < 2; ++keys) {
                LoadFractals(L0a<bfloat16_t>(pp * L0Layout::kOperand + keys * kProbsLoadRepeat * kFractalBytes),
                             L1<bfloat16_t>(L1Layout::Probs(slot, keys)), 0, kProbsLoadRepeat, 1, false);
            }
            // B = V [64 keys, 256 d] of the key tile's half `half`, as Zn: key block by key block, each fractal
            // transposed (a single load in source order would leave the blocks d-major: the PV operand wrong).
            LoadKeyOperand(pp, kv, half, kVLoads, kVStartStep, kVRepeat, kVSrcStride, kVDstStep, kVTranspose);
            SetFlag<HardEvent::MTE1_M>(Ev(pp));
            WaitFlag<HardEvent::MTE1_M>(Ev(pp));
            MatMul(L0c<float>(L0Layout::kPartial + half * kHeadsPerTile * (kHeadDim / 2) * 4),
                   L0a<bfloat16_t>(pp * L0Layout::kOperand), L0b<bfloat16_t>(pp * L0Layout::kOperand),
                   kHeadsPerTile, kHeadDim / 2, kBlockTopk, local == 0 || drain);
            SetFlag<HardEvent::M_MTE1>(Ev(pp));
        }
        Signal<PIPE_M>(kPvDone);
        if (work_.Last(g)) {
            Drain();  // the unit's final O_partial goes to the vector cores for the epilogue
        }
    }

    // O_partial (L0C) -> the vector cores' UB in column chunks through two UB stages.
    __aicore__ inline void Drain()
    {
        SetFlag<HardEvent::M_FIX>(kEvPartial);
        WaitFlag<HardEvent::M_FIX>(kEvPartial);
        for (uint32_t chunk = 0; chunk < kHeadDim / kDrainChunk; ++chunk, ++drains_) {
            const uint32_t stage = drains_ & 1;
            if (drains_ >= 2) {
                Await(kDrainFree);
            }
            // In L0C NZ a column chunk is contiguous: kDrainChunk / 16 column blocks of 64 rows.
            FixpipeRowSplit(Ub<float>(U::kDrain + stage * kHeadsPerVectorCore * kDrainChunk * 4),
                            L0c<float>(L0Layout::kPartial + chunk * kHeadsPerTile * kDrainChunk * 4), kHeadsPerTile,
                            kDrainFixN, kDrainFixDstStride);
            Signal<PIPE_FIX>(kDrainReady);
        }
        SetFlag<HardEvent::FIX_M>(kEvPartial);
        WaitFlag<HardEvent::FIX_M>(kEvPartial);
    }

    // A key tile half (L1 Nz of K [64 keys, 256 d]) into L0B half `pp` as `loads` LoadData calls; call i takes
    // `repeat` fractals from fractal i * start_step, src_stride apart, and writes them at i * dst_step fractals
    // (the Q K^T and P V parameter sets of data_paths.h).
    __aicore__ inline void LoadKeyOperand(uint32_t pp, uint32_t kv, uint32_t half, uint32_t loads, uint32_t start_step,
                                          uint32_t repeat, uint32_t src_stride, uint32_t dst_step, uint32_t transpose)
    {
        for (uint32_t i = 0; i < loads; ++i) {
            LoadFractals(L0b<bfloat16_t>(pp * L0Layout::kOperand + i * dst_step * kFractalBytes),
                         L1<bfloat16_t>(L1Layout::Kv(kv, half)), i * start_step, repeat, src_stride, transpose != 0);
        }
    }

    __aicore__ inline uint32_t NextOperand() { return (operand_++) & 1; }

    SparseAttentionV41Params params_;
    Work work_;
    GlobalTensor<bfloat16_t> q_;
    GlobalTensor<uint32_t> mailbox_;
    uint32_t operand_ = 0;
    uint32_t drains_ = 0;
};

}  // namespace anymla_ascendc::device
