// Low-latency (decoding) dispatch/combine: the region layout, parameter block and launchers shared by
// the kernels (kernels/low_latency_*.cu) and the host runtime (host/low_latency_runtime.cpp).
//
// Every rank owns one region, reached by its peers as in the intranode kernels (Transport<B>): two
// halves used in turn by consecutive ops, then a workspace only its own kernels touch. A half holds
//   signals:        dispatch counts [E_local][R] (-count-1 once source s sent everything for expert e),
//                   then combine flags [E] (non-zero once expert e's outputs for this rank arrived);
//   dispatch_recv:  messages [E_local][R][T_max], each a 16-byte header (the token's index at its
//                   source) and the payload (e4m3 row and H/128 float scales, or the bfloat16 row);
//   combine_recv:   bfloat16 rows [E][T_max]: expert e's output for this rank's token t;
//   combine_send:   bfloat16 [E_local][R * T_max][H], the zero-copy combine input.
// The workspace: per-expert slot and finished counters, the word that says which op cleaned the next
// half, and the staging rows [T_max] of this rank's messages.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params/config.h"
#include "params/diag.h"
#include "params/intranode.h"

namespace ep {

constexpr int kLowLatencyWarps = 12;  // warps 0..K-1 send a token's K copies (K <= kLowLatencyMaxTopk)
constexpr int kLowLatencyMaxTopk = 11;
constexpr int kLowLatencyHeaderBytes = 16;
constexpr int kLowLatencySendPhase = 1;
constexpr int kLowLatencyRecvPhase = 2;

struct LowLatencyLayout {
    int64_t message_bytes;   // header + the larger payload (bfloat16 row), 16-byte aligned
    int64_t half_bytes;
    int64_t dispatch_count;  // offsets inside a half
    int64_t combine_flag;
    int64_t dispatch_recv;
    int64_t combine_recv;
    int64_t combine_send;
    int64_t slot_counter;    // offsets in the region (the workspace follows the two halves)
    int64_t finish_counter;
    int64_t clean_word;
    int64_t send_stage;
    int64_t total;
};

EP_HD LowLatencyLayout make_low_latency_layout(int num_experts, int max_tokens, int hidden) {
    LowLatencyLayout l{};
    const int64_t row_bytes = 2LL * hidden;
    l.message_bytes = (kLowLatencyHeaderBytes + row_bytes + 15) / 16 * 16;
    int64_t at = 0;
    l.dispatch_count = at;
    l.combine_flag = at += 4LL * num_experts;  // E_local * R == E counts
    at = align_up(at + 4LL * num_experts, kBufferAlign);
    l.dispatch_recv = at;
    at = align_up(at + static_cast<int64_t>(num_experts) * max_tokens * l.message_bytes, kBufferAlign);
    l.combine_recv = at;
    at = align_up(at + static_cast<int64_t>(num_experts) * max_tokens * row_bytes, kBufferAlign);
    l.combine_send = at;
    at = align_up(at + static_cast<int64_t>(num_experts) * max_tokens * row_bytes, kBufferAlign);
    l.half_bytes = at;
    at *= 2;
    l.slot_counter = at;
    l.finish_counter = at += 4LL * num_experts;
    l.clean_word = at += 4LL * num_experts;
    at = align_up(at + 4, kBufferAlign);
    l.send_stage = at;
    l.total = align_up(at + static_cast<int64_t>(max_tokens) * l.message_bytes, kBufferAlign);
    return l;
}

struct LowLatencyRankArgs {
    int rank;
    int num_tokens;
    uint8_t* peers[kMaxRanks];    // every rank's low-latency region, as seen from this rank
    const void* x;                // dispatch: [T, H] bfloat16; combine: [E_local, R * T_max, H] bfloat16
    const int64_t* topk_idx;      // [T, K], -1 = none
    const float* topk_weights;    // combine: [T, K]
    void* packed_x;               // dispatch out: [E_local, R * T_max, H] e4m3 or bfloat16
    void* packed_scales;          // dispatch out (FP8): float [E_local, S, R * T_max] or UE8M0 int [.., S / 4, ..]
    int* src_info;                // [E_local, R * T_max] (dispatch out, combine in)
    int64_t* layout_range;        // [E_local, R] (dispatch out, combine in): (begin << 32) | count
    int* packed_count;            // dispatch out: [E_local], zeroed by the caller
    int* stats;                   // dispatch: cumulative_local_expert_recv_stats [E_local] or nullptr
    void* combined_x;             // combine out: [T, H] bfloat16
};

struct LowLatencyParams {
    LowLatencyRankArgs ranks[kMaxRanks];
    LowLatencyLayout layout;
    int num_launch_ranks;
    int num_channels;  // blocks per rank
    int num_ranks;
    int num_experts;
    int num_topk;
    int hidden;
    int max_tokens;    // num_max_dispatch_tokens_per_rank (T_max)
    int half;          // the half this op uses; it zeroes the other one's signals
    int seq;           // this op's number (> 0), written to the clean word once the next half is zeroed
    int phases;        // kLowLatencySendPhase | kLowLatencyRecvPhase
    int use_fp8;
    int round_scale;
    int use_ue8m0;
    long long timeout_cycles;
    ErrorRecord* error;
};

cudaError_t launch_low_latency_dispatch(const LowLatencyParams& p, Backend backend, cudaStream_t stream);
cudaError_t launch_low_latency_combine(const LowLatencyParams& p, Backend backend, cudaStream_t stream);

}  // namespace ep
