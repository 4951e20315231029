// Kernel parameter blocks and launcher declarations: the only interface between the device code
// (kernels/*.cu, CUDA toolkit only) and the host bindings (host/bindings.cpp, torch).
// One launch covers `num_launch_ranks` ranks: all ranks of the group in the EMULATED back end,
// only this process's rank in the NVLINK back end. Block b serves ranks[b / blocks_per_rank].
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params/config.h"
#include "params/diag.h"

namespace ep {

// kNvlink: one rank per process, peers through CUDA IPC (internode: the RDMA hop too, for nodes that
// share one machine). kNvshmem: internode only, RDMA hop through NVSHMEM (built with EP_WITH_NVSHMEM).
enum class Backend : int { kEmulated = 0, kNvlink = 1, kNvshmem = 2 };
enum class Payload : int { kBF16 = 0, kFloat32 = 1 };

struct LayoutParams {
    const int64_t* topk_idx;  // [N, K], -1 = no expert
    int num_tokens;
    int num_topk;
    int num_experts;
    int num_ranks;
    int ranks_per_node;
    int* num_tokens_per_rank;    // [R]
    int* num_tokens_per_node;    // [R / ranks_per_node]
    int* num_tokens_per_expert;  // [E]
    bool* is_token_in_rank;      // [N, R]
};

struct NotifyRankArgs {
    int rank;
    int num_tokens;
    uint8_t* peers[kMaxRanks];         // every rank's buffer, as seen from this rank
    const int* num_tokens_per_rank;    // [R]
    const int* num_tokens_per_expert;  // [E]
    const bool* is_token_in_rank;      // [N, R]
    int* rank_prefix_matrix;           // [R, R] out: [i][j] = tokens from ranks <= i to rank j
    int* channel_prefix_matrix;        // [R, C] out: [j][c] = tokens to rank j in channels <= c
    int* recv_counter;                 // host-mapped int out: rows this rank receives
    int* recv_expert_counter;          // host-mapped [E / R] out: rows per local expert (aligned)
};

struct NotifyParams {
    NotifyRankArgs ranks[kMaxRanks];
    int num_launch_ranks;
    int num_ranks;
    int num_channels;
    int num_experts;
    int expert_alignment;
    BufferLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
};

// Barrier, zeroing of the ring metadata and (before combine) the negative-head rewrite of send_head.
struct CachedNotifyRankArgs {
    int rank;
    int num_tokens;
    uint8_t* peers[kMaxRanks];
    int* send_head;                    // [N, R]; nullptr: no rewrite (cached dispatch)
    const int* channel_prefix_matrix;  // [R, C]
};

struct CachedNotifyParams {
    CachedNotifyRankArgs ranks[kMaxRanks];
    int num_launch_ranks;
    int num_ranks;
    int num_channels;
    BufferLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
};

struct DispatchRankArgs {
    int rank;
    int num_tokens;
    uint8_t* peers[kMaxRanks];
    const void* x;                     // [N, hidden_bytes]
    const float* x_scales;             // FP8 scales, strided; nullptr without FP8
    int64_t scale_token_stride;
    int64_t scale_hidden_stride;
    const int64_t* topk_idx;           // [N, K] global ids; nullptr in cached mode without top-k
    const float* topk_weights;         // [N, K]
    const bool* is_token_in_rank;      // [N, R]
    const int* channel_prefix_matrix;  // [R, C]
    const int* rank_prefix_matrix;     // [R, R]
    void* recv_x;                      // [M, hidden_bytes]
    float* recv_x_scales;              // [M, S]
    int* recv_src_idx;                 // [M]
    int64_t* recv_topk_idx;            // [M, K] local ids, -1 elsewhere
    float* recv_topk_weights;          // [M, K]
    int* recv_channel_offset;          // [R, C] out: start of (source, channel) inside the source's block
    int* send_head;                    // [N, R] out: slot of token t in the ring to rank r, or -1
};

struct DispatchParams {
    DispatchRankArgs ranks[kMaxRanks];
    int num_launch_ranks;
    int num_ranks;
    int num_channels;
    int hidden_int4;  // payload bytes / 16
    int num_scales;
    int num_topk;
    int num_experts;
    int num_worst_tokens;  // > 0: rows past the received ones get top-k ids -1
    int chunk;
    RecordLayout record;
    BufferLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
    int stalled_rank;  // test hook: this rank's blocks exit at once (its peers must time out); -1 off
};

struct CombineRankArgs {
    int rank;
    int num_tokens;  // original tokens of this rank (rows of combined_x)
    uint8_t* peers[kMaxRanks];
    const void* x;                    // [M, H] rows received in dispatch, processed
    const float* topk_weights;        // [M, K] or nullptr
    const int* rank_prefix_matrix;    // [R, R]
    const int* recv_channel_offset;   // [R, C]
    const int* send_head;             // [N, R], rewritten by the cached notify
    void* combined_x;                 // [N, H]
    float* combined_topk_weights;     // [N, K] or nullptr
};

struct CombineParams {
    CombineRankArgs ranks[kMaxRanks];
    int num_launch_ranks;
    int num_ranks;
    int num_channels;
    int hidden_int4;
    int num_topk;
    int chunk;
    RecordLayout record;
    BufferLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
    int stalled_rank;
};

cudaError_t launch_get_dispatch_layout(const LayoutParams& params, cudaStream_t stream);
cudaError_t launch_notify_dispatch(const NotifyParams& params, Backend backend, cudaStream_t stream);
cudaError_t launch_cached_notify(const CachedNotifyParams& params, Backend backend, cudaStream_t stream);
cudaError_t launch_dispatch(const DispatchParams& params, Backend backend, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& params, Backend backend, Payload payload, cudaStream_t stream);

}  // namespace ep
