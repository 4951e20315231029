// Intranode and internode configurations, their validation (the deadlock-freedom conditions), the
// ring record formats and the layout of the intranode per-rank buffer (the internode regions are in
// params/internode_layout.h). Plain C++ usable from host code, device code and the host-only probe
// (host/config_probe.cpp) that the CPU tests compare with the Python mirror, kernels_cuda/config.py.
#pragma once
#include <cstdint>

#include "params/constants.h"

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif

namespace ep {

static_assert(kMaxRanks <= kWarpSize, "one lane per rank in the combine reducers");
static_assert(kMaxTopk <= kWarpSize, "one lane per top-k slot");
static_assert(kCombineWarps > kCombineKeeperWarps, "combine needs at least one reducer warp");

EP_HD int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }
EP_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Counts published before data (channel starts/ends) are stored as -v-1, so that the zeroed
// buffer reads as "not arrived yet" and every real value, 0 included, is negative.
EP_HD int encode_count(int value) { return -value - 1; }
EP_HD int decode_count(int stored) { return -stored - 1; }

// Tokens [begin, end) of `channel` when `num_tokens` are split into `num_channels` contiguous ranges.
EP_HD void channel_range(int num_tokens, int num_channels, int channel, int* begin, int* end) {
    const int per_channel = ceil_div(num_tokens, num_channels);
    const int b = per_channel * channel;
    *begin = b < num_tokens ? b : num_tokens;
    *end = b + per_channel < num_tokens ? b + per_channel : num_tokens;
}

// One ring record. Dispatch: payload | FP8 scales | source meta | top-k ids (int32, global) | top-k
// weights, where the meta is the source token index (intranode; internode adds more:
// params/internode_layout.h). Combine: payload | top-k weights. Each part is 4-byte aligned, the record 16.
struct RecordLayout {
    int scales_offset;
    int src_offset;
    int idx_offset;
    int weights_offset;
    int bytes;
};

EP_HD RecordLayout dispatch_record_with_meta(int hidden_bytes, int num_scales, int meta_bytes, int num_topk) {
    RecordLayout r;
    r.scales_offset = hidden_bytes;
    r.src_offset = r.scales_offset + num_scales * 4;
    r.idx_offset = r.src_offset + meta_bytes;
    r.weights_offset = r.idx_offset + num_topk * 4;
    r.bytes = static_cast<int>(align_up(r.weights_offset + num_topk * 4, kRecordAlign));
    return r;
}

EP_HD RecordLayout dispatch_record(int hidden_bytes, int num_scales, int num_topk) {
    return dispatch_record_with_meta(hidden_bytes, num_scales, 4, num_topk);
}

EP_HD RecordLayout combine_record(int hidden_bytes, int num_topk) {
    RecordLayout r;
    r.scales_offset = hidden_bytes;
    r.src_offset = hidden_bytes;
    r.idx_offset = hidden_bytes;
    r.weights_offset = hidden_bytes;
    r.bytes = static_cast<int>(align_up(hidden_bytes + num_topk * 4, kRecordAlign));
    return r;
}

// Byte offsets inside one rank's buffer; identical on every rank, so a peer's region is its base
// pointer plus the same offset. Rings are indexed [channel][peer]:
//   tail[c][producer] and data[c][producer] live in the consumer's buffer,
//   head[c][consumer] lives in the producer's buffer, so everybody polls only local memory.
// [meta_begin, data) is zeroed before every dispatch and combine.
struct BufferLayout {
    int64_t barrier;        // int[kMaxRanks]: barrier signal words, one per peer
    int64_t notify_rank;    // int[kMaxRanks][kMaxRanks]: row s = tokens rank s sends to each rank
    int64_t notify_expert;  // int[kMaxRanks][kMaxLocalExperts]: row s = tokens from s per local expert
    int64_t meta_begin;
    int64_t channel_start;  // int[C][R], -v-1 encoded
    int64_t channel_end;    // int[C][R], -v-1 encoded
    int64_t head;           // int[C][R]
    int64_t tail;           // int[C][R]
    int64_t data;           // record[C][R][capacity]
    int64_t total;
    int num_ranks;
    int num_channels;
    int capacity;
    int record_bytes;

    EP_HD int64_t slot(int channel, int peer, int index) const {
        return data + ((static_cast<int64_t>(channel) * num_ranks + peer) * capacity + index % capacity) * record_bytes;
    }
    EP_HD int64_t word(int64_t region, int channel, int peer) const {
        return region + (static_cast<int64_t>(channel) * num_ranks + peer) * 4;
    }
};

EP_HD BufferLayout make_buffer_layout(int num_ranks, int num_channels, int capacity, int record_bytes) {
    BufferLayout l;
    const int64_t ring_words = static_cast<int64_t>(num_channels) * num_ranks * 4;
    l.barrier = 0;
    l.notify_rank = align_up(kMaxRanks * 4, kBufferAlign);
    l.notify_expert = align_up(l.notify_rank + kMaxRanks * kMaxRanks * 4, kBufferAlign);
    l.meta_begin = align_up(l.notify_expert + static_cast<int64_t>(kMaxRanks) * kMaxLocalExperts * 4, kBufferAlign);
    l.channel_start = l.meta_begin;
    l.channel_end = align_up(l.channel_start + ring_words, kBufferAlign);
    l.head = align_up(l.channel_end + ring_words, kBufferAlign);
    l.tail = align_up(l.head + ring_words, kBufferAlign);
    l.data = align_up(l.tail + ring_words, kBufferAlign);
    l.total = align_up(l.data + static_cast<int64_t>(num_channels) * num_ranks * capacity * record_bytes, kBufferAlign);
    l.num_ranks = num_ranks;
    l.num_channels = num_channels;
    l.capacity = capacity;
    l.record_bytes = record_bytes;
    return l;
}

// The checks both validations end with: the row format and the experts of one rank.
inline const char* validate_rows(int hidden_bytes, int num_topk, int num_local_experts) {
    if (hidden_bytes <= 0 || hidden_bytes % 16 != 0) return "hidden bytes must be a positive multiple of 16";
    if (num_topk < 1 || num_topk > kMaxTopk) return "num_topk must be in [1, kMaxTopk]";
    if (num_local_experts < 1 || num_local_experts > kMaxLocalExperts)
        return "experts per rank must be in [1, kMaxLocalExperts]";
    return nullptr;
}

struct IntranodeConfig {
    int num_channels;         // SM pairs; tokens are split into this many contiguous ranges
    int num_max_send_tokens;  // chunk: records a producer publishes per tail update
    int num_max_recv_tokens;  // ring capacity per (channel, producer, consumer)
};

// nullptr when the configuration is safe, else why not. These are the conditions under which the
// ring protocol cannot deadlock (see kernels_cuda/protocol_model.py):
//  * a producer waits until a whole chunk fits, so 1 <= chunk <= capacity;
//  * every peer is served by its own group of warps in each role (a peer without warps would never
//    consume and its producers would stall); groups are equal, so the warps divide evenly;
//  * counts travel as -v-1 in int32 and one lane serves one rank or one top-k slot.
inline const char* validate_intranode(const IntranodeConfig& cfg, int num_ranks, int hidden_bytes, int num_topk,
                                      int num_local_experts, int64_t buffer_bytes) {
    if (num_ranks < 1 || num_ranks > kMaxRanks) return "num_ranks must be in [1, kMaxRanks]";
    if (kDispatchWarps % num_ranks != 0 || kCombineWarps % num_ranks != 0)
        return "the warps of a block must divide evenly among the ranks (one warp group per peer)";
    if (cfg.num_channels < 1 || cfg.num_channels > kMaxChannels) return "num_channels must be in [1, kMaxChannels]";
    if (cfg.num_max_send_tokens < 1) return "num_max_send_tokens (chunk) must be >= 1";
    if (cfg.num_max_send_tokens > cfg.num_max_recv_tokens)
        return "num_max_send_tokens (chunk) must not exceed num_max_recv_tokens (ring capacity): "
               "a producer waits for room for a whole chunk";
    if (const char* error = validate_rows(hidden_bytes, num_topk, num_local_experts)) return error;
    if (buffer_bytes > 0) {
        const int scales = hidden_bytes / kFp8BlockSize;  // FP8 payload: one byte per channel
        const int record = dispatch_record(hidden_bytes, scales, num_topk).bytes;
        if (make_buffer_layout(num_ranks, cfg.num_channels, cfg.num_max_recv_tokens, record).total > buffer_bytes)
            return "the buffer is too small for this configuration (see buffer_size_hint)";
    }
    return nullptr;
}

// Internode (two hops). The conditions are the two-hop protocol's deadlock-freedom conditions
// (kernels_cuda/protocol_model_internode.py):
//  * a producer waits until a whole chunk fits: nvl_chunk <= nvl_capacity, and in combine the
//    NVLink ring is split into one sub-ring per origin node: nvl_chunk <= nvl_capacity / nodes;
//  * sender warps release records a round at a time (one token per warp), the coordinator puts whole
//    chunks and RDMA heads are released lazily (a chunk at a time), so a blocked sender may face
//    W - 1 unreleased, chunk - 1 unsent and chunk - 1 consumed-but-unreleased records:
//    rdma_capacity >= kRdmaSenderWarps + 2 * rdma_chunk - 2;
//  * RDMA puts never wrap: rdma_capacity % rdma_chunk == 0;
//  * one lane per node / per GPU of a node.
struct InternodeConfig {
    int num_channels;
    int nvl_chunk;
    int nvl_capacity;
    int rdma_chunk;
    int rdma_capacity;
};

inline const char* validate_internode(const InternodeConfig& cfg, int num_nodes, int gpus_per_node, int hidden_bytes,
                                      int num_topk, int num_local_experts) {
    if (num_nodes < 2 || num_nodes > kMaxRdmaPeers) return "num_nodes must be in [2, kMaxRdmaPeers]";
    if (gpus_per_node < 1 || gpus_per_node > kMaxNvlPeers) return "gpus_per_node must be in [1, kMaxNvlPeers]";
    if (cfg.num_channels < 1 || cfg.num_channels > kMaxChannels) return "num_channels must be in [1, kMaxChannels]";
    if (cfg.nvl_chunk < 1 || cfg.rdma_chunk < 1) return "chunks must be >= 1";
    if (cfg.nvl_chunk > cfg.nvl_capacity)
        return "nvl_chunk must not exceed nvl_capacity: a forwarder waits for room for a whole chunk";
    if (cfg.nvl_capacity % num_nodes != 0)
        return "nvl_capacity must be a multiple of num_nodes (combine splits the ring per origin node)";
    if (cfg.nvl_chunk > cfg.nvl_capacity / num_nodes)
        return "nvl_chunk must not exceed nvl_capacity / num_nodes: a combine NVLink sender waits for room for "
               "a whole chunk in its origin node's sub-ring";
    if (cfg.rdma_capacity % cfg.rdma_chunk != 0) return "rdma_capacity must be a multiple of rdma_chunk (RDMA puts never wrap)";
    if (cfg.rdma_capacity < kRdmaSenderWarps + 2 * cfg.rdma_chunk - 2)
        return "rdma_capacity must be >= kRdmaSenderWarps + 2 * rdma_chunk - 2: a blocked sender may face a round "
               "of unreleased records, a chunk of unsent ones and a chunk of consumed but unreleased slots";
    return validate_rows(hidden_bytes, num_topk, num_local_experts);
}

}  // namespace ep
