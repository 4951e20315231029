// Parameter blocks and launchers of the internode kernels (the interface between kernels/internode_*.cu
// and host/internode_runtime.cpp). One launch covers `num_launch_ranks` ranks: every rank of the
// emulated nodes x GPUs world (Backend::kEmulated), or this process's rank (Backend::kNvshmem).
// Tensors named as in DeepEP's internode handle (see ../../shared/reference/deepep.md, appendix B).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params/diag.h"
#include "params/internode_layout.h"
#include "params/intranode.h"

namespace ep {

struct InternodePeers {
    int rank;  // node * gpus + gpu
    int node;
    int gpu;
    int gpus;  // per node
    uint8_t* rdma[kMaxRdmaPeers];  // RDMA region of rail peer (m, gpu), by node m
    uint8_t* nvl[kMaxNvlPeers];    // NVLink region of GPU j of this node
};

struct InternodeNotifyRankArgs {
    InternodePeers peers;
    int num_tokens;
    const int* num_tokens_per_rank;    // [R]
    const int* num_tokens_per_node;    // [N]
    const int* num_tokens_per_expert;  // [E]
    const bool* is_token_in_rank;      // [T, R]
    int* rdma_channel_prefix_matrix;   // [N, C] out: this rank's tokens to node m in channels <= c
    int* gbl_channel_prefix_matrix;    // [R, C] out: this rank's tokens to rank r in channels <= c
    int* recv_rdma_rank_prefix_sum;    // [N] out: records received over RDMA from nodes <= n (as rail proxy)
    int* recv_gbl_rank_prefix_sum;     // [R] out: rows received from ranks <= s
    int* recv_counter;                 // host-mapped: rows of recv_x
    int* recv_rdma_counter;            // host-mapped: records received over RDMA (rows of send_nvl_head)
    int* recv_expert_counter;          // host-mapped [E / R]: rows per local expert, aligned
};

struct InternodeNotifyParams {
    InternodeNotifyRankArgs ranks[kMaxEmulatedRanks];
    int num_launch_ranks;
    int num_nodes;
    int gpus;
    int num_channels;
    int num_experts;
    int expert_alignment;
    InternodeLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
};

// Barriers, zeroing of the ring metadata and (before combine) the negative-head rewrite of both
// head tables.
struct InternodeCachedNotifyRankArgs {
    InternodePeers peers;
    int num_tokens;
    int* send_rdma_head;                     // [T, N]
    const int* rdma_channel_prefix_matrix;   // [N, C]
    int* send_nvl_head;                      // [M_rdma, G]
    const int* recv_rdma_rank_prefix_sum;    // [N]
    const int* recv_rdma_channel_offset;     // [N, C]: start of (source node, channel) in its block
};

struct InternodeCachedNotifyParams {
    InternodeCachedNotifyRankArgs ranks[kMaxEmulatedRanks];
    int num_launch_ranks;
    int num_nodes;
    int gpus;
    int num_channels;
    int rewrite_heads;  // 0: barriers and zeroing only (before a cached dispatch)
    InternodeLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
};

struct InternodeDispatchRankArgs {
    InternodePeers peers;
    int num_tokens;
    const void* x;                            // [T, hidden_bytes]
    const float* x_scales;                    // FP8 scales, strided; nullptr without FP8
    int64_t scale_token_stride;
    int64_t scale_hidden_stride;
    const int64_t* topk_idx;                  // [T, K] global ids; nullptr in cached mode without top-k
    const float* topk_weights;                // [T, K]
    const bool* is_token_in_rank;             // [T, R]
    const int* rdma_channel_prefix_matrix;    // [N, C]
    const int* gbl_channel_prefix_matrix;     // [R, C]
    const int* recv_rdma_rank_prefix_sum;     // [N]
    const int* recv_gbl_rank_prefix_sum;      // [R]
    void* recv_x;                             // [M, hidden_bytes]
    float* recv_x_scales;                     // [M, S]
    int* recv_src_idx;                        // [M]
    int64_t* recv_topk_idx;                   // [M, K] local ids, -1 elsewhere
    float* recv_topk_weights;                 // [M, K]
    int* recv_rdma_channel_offset;            // [N, C] out: start of (source node, channel) among its records
    int* recv_gbl_channel_offset;             // [R, C] out: start of (source rank, channel) in its rows
    int* send_rdma_head;                      // [T, N] out: slot of token t in node m's RDMA ring, or -1
    int* send_nvl_head;                       // [M_rdma, G] out: slot of record i in its (node -> GPU j) stream, or -1
};

struct InternodeDispatchParams {
    InternodeDispatchRankArgs ranks[kMaxEmulatedRanks];
    int num_launch_ranks;
    int num_nodes;
    int gpus;
    int num_channels;
    int hidden_int4;
    int num_scales;
    int num_topk;
    int num_experts;
    int nvl_chunk;
    int rdma_chunk;
    int num_worst_tokens;  // > 0: recv_* have this many rows; those past the received ones get top-k ids -1
    RecordLayout record;
    InternodeLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
    int stalled_rank;  // test hook: this rank's blocks exit at once (its peers must time out); -1 off
};

struct InternodeCombineRankArgs {
    InternodePeers peers;
    int num_tokens;                           // original tokens of this rank (rows of combined_x)
    const void* x;                            // [M, H] rows received in dispatch, processed
    const float* topk_weights;                // [M, K] or nullptr
    const int* recv_gbl_rank_prefix_sum;      // [R]
    const int* recv_gbl_channel_offset;       // [R, C]
    const int* recv_rdma_rank_prefix_sum;     // [N]
    const int* recv_rdma_channel_offset;      // [N, C]
    const int* send_nvl_head;                 // [M_rdma, G], rewritten by the cached notify
    const int* send_rdma_head;                // [T, N], rewritten likewise
    void* combined_x;                         // [T, H]
    float* combined_topk_weights;             // [T, K] or nullptr
};

struct InternodeCombineParams {
    InternodeCombineRankArgs ranks[kMaxEmulatedRanks];
    int num_launch_ranks;
    int num_nodes;
    int gpus;
    int num_channels;
    int hidden_int4;
    int num_topk;
    int nvl_chunk;
    int rdma_chunk;
    RecordLayout record;
    InternodeLayout layout;
    long long timeout_cycles;
    ErrorRecord* error;
    int stalled_rank;
};

cudaError_t launch_internode_notify(const InternodeNotifyParams& params, Backend backend, cudaStream_t stream);
cudaError_t launch_internode_cached_notify(const InternodeCachedNotifyParams& params, Backend backend,
                                           cudaStream_t stream);
cudaError_t launch_internode_dispatch(const InternodeDispatchParams& params, Backend backend, cudaStream_t stream);
cudaError_t launch_internode_combine(const InternodeCombineParams& params, Backend backend, Payload payload,
                                     cudaStream_t stream);

}  // namespace ep
