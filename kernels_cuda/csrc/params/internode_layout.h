// Internode (two-hop) record format and buffer layout; plain C++ for host and device code.
// A rank is (node n, GPU g), rank = n * G + g. Each rank owns two regions with identical offsets on
// every rank: the RDMA region (reached by the rail peers (m, g); NVSHMEM's symmetric heap on real
// nodes) and the NVLink region (reached by the GPUs (n, j) of the node). As intranode, data and tail
// live in the consumer, the head in the producer, and everybody polls only its own memory:
//   RDMA   tail[c][producer node], data[c][producer node], head[c][consumer node];
//   NVLink tail[c][producer GPU][sub], data[c][producer GPU], head[c][consumer GPU][sub], where
//   dispatch uses sub-ring 0 of full capacity and combine splits the ring into one sub-ring per
//   origin node (capacity / nodes each).
#pragma once
#include <cstdint>

#include "params/config.h"

namespace ep {

static_assert(kMaxRdmaPeers <= kWarpSize && kMaxNvlPeers <= kWarpSize, "one lane per node and per GPU");
static_assert(kRdmaMetaInts >= 2 + 2 * kMaxNvlPeers && kRdmaMetaInts % 4 == 0, "RDMA channel meta is whole int4s");
static_assert(kInternodeDispatchWarps >= kRdmaSenderWarps + 1 + kMaxNvlPeers, "dispatch sender SM roles");
static_assert(kInternodeCombineWarps >= kMaxNvlPeers + kRdmaReceiverWarps + 1 &&
                  kInternodeCombineWarps >= kMaxRdmaPeers + 1,
              "combine roles");

// Dispatch record: payload | scales | meta {source token, source node, GPU bitmask of the destination
// node} | top-k ids (int32, global) | top-k weights. The same record travels both hops.
EP_HD RecordLayout internode_dispatch_record(int hidden_bytes, int num_scales, int num_topk) {
    return dispatch_record_with_meta(hidden_bytes, num_scales, 12, num_topk);
}

// RDMA channel meta (ints of one (channel, node) entry, all -v-1 encoded): this channel's range in the
// per-node record count, then per GPU j of the destination node its range in the per-rank count.
constexpr int kMetaNodeStart = 0;
constexpr int kMetaNodeEnd = 1;
EP_HD int meta_gpu_start(int j) { return 2 + 2 * j; }
EP_HD int meta_gpu_end(int j) { return 3 + 2 * j; }

// Rail count exchange, row n (from rail peer (n, g)): [per-GPU tokens | node tokens | per-expert tokens
// of the node's experts]; NVLink exchange, row g (from forwarder g): [per source node tokens | per
// local expert tokens].
constexpr int kRdmaNotifyInts = (kMaxNvlPeers * (1 + kMaxLocalExperts) + 1 + 3) / 4 * 4;  // whole int4s (puts)
constexpr int kNvlNotifyInts = kMaxRdmaPeers + kMaxLocalExperts;

struct RdmaLayout {
    int64_t barrier;    // int[kMaxRdmaPeers]
    int64_t notify;     // int[kMaxRdmaPeers][kRdmaNotifyInts]
    int64_t send_notify;  // staging of the notify puts, same shape
    int64_t meta_begin;
    int64_t meta;       // int[C][N][kRdmaMetaInts], written by the producer node
    int64_t head;       // int[C][N]
    int64_t tail;       // int[C][N]
    int64_t send_meta;  // staging of the meta puts, int[C][N][kRdmaMetaInts]
    int64_t send_data;  // staging of the records, record[C][N][capacity] (same slots as the remote recv_data)
    int64_t recv_data;  // record[C][N][capacity]
    int64_t total;
    int num_nodes;
    int num_channels;
    int capacity;
    int record_bytes;

    EP_HD int64_t slot(int64_t region, int channel, int node, int index) const {
        return region + ((static_cast<int64_t>(channel) * num_nodes + node) * capacity + index % capacity) * record_bytes;
    }
    EP_HD int64_t word(int64_t region, int channel, int node) const {
        return region + (static_cast<int64_t>(channel) * num_nodes + node) * 4;
    }
    EP_HD int64_t meta_entry(int64_t region, int channel, int node) const {
        return region + (static_cast<int64_t>(channel) * num_nodes + node) * kRdmaMetaInts * 4;
    }
};

struct NvlLayout {
    int64_t barrier;  // int[kMaxNvlPeers]
    int64_t notify;   // int[kMaxNvlPeers][kNvlNotifyInts]
    int64_t meta_begin;
    int64_t meta;     // int[C][G][N][2]: per source node, (start, end) of the channel in the per-rank count
    int64_t head;     // int[C][G][N]
    int64_t tail;     // int[C][G][N]
    int64_t data;     // record[C][G][capacity]
    int64_t total;
    int num_nodes;
    int gpus;
    int num_channels;
    int capacity;
    int record_bytes;

    // Slot `index` of sub-ring `sub` of the ring (channel, peer) when the ring is split into `subs`.
    EP_HD int64_t slot(int channel, int peer, int sub, int subs, int index) const {
        const int sub_capacity = capacity / subs;
        return data + ((static_cast<int64_t>(channel) * gpus + peer) * capacity + sub * sub_capacity + index % sub_capacity) *
                          record_bytes;
    }
    EP_HD int64_t word(int64_t region, int channel, int peer, int sub) const {
        return region + ((static_cast<int64_t>(channel) * gpus + peer) * num_nodes + sub) * 4;
    }
    EP_HD int64_t meta_word(int channel, int peer, int node, int which) const {
        return meta + (((static_cast<int64_t>(channel) * gpus + peer) * num_nodes + node) * 2 + which) * 4;
    }
};

EP_HD RdmaLayout make_rdma_layout(int num_nodes, int num_channels, int capacity, int record_bytes) {
    RdmaLayout l;
    const int64_t words = static_cast<int64_t>(num_channels) * num_nodes * 4;
    const int64_t metas = words * kRdmaMetaInts;
    const int64_t records = static_cast<int64_t>(num_channels) * num_nodes * capacity * record_bytes;
    l.barrier = 0;
    l.notify = align_up(kMaxRdmaPeers * 4, kBufferAlign);
    l.send_notify = align_up(l.notify + static_cast<int64_t>(kMaxRdmaPeers) * kRdmaNotifyInts * 4, kBufferAlign);
    l.meta_begin = align_up(l.send_notify + static_cast<int64_t>(kMaxRdmaPeers) * kRdmaNotifyInts * 4, kBufferAlign);
    l.meta = l.meta_begin;
    l.head = align_up(l.meta + metas, kBufferAlign);
    l.tail = align_up(l.head + words, kBufferAlign);
    l.send_meta = align_up(l.tail + words, kBufferAlign);
    l.send_data = align_up(l.send_meta + metas, kBufferAlign);
    l.recv_data = align_up(l.send_data + records, kBufferAlign);
    l.total = align_up(l.recv_data + records, kBufferAlign);
    l.num_nodes = num_nodes;
    l.num_channels = num_channels;
    l.capacity = capacity;
    l.record_bytes = record_bytes;
    return l;
}

EP_HD NvlLayout make_nvl_layout(int num_nodes, int gpus, int num_channels, int capacity, int record_bytes) {
    NvlLayout l;
    const int64_t words = static_cast<int64_t>(num_channels) * gpus * num_nodes * 4;
    l.barrier = 0;
    l.notify = align_up(kMaxNvlPeers * 4, kBufferAlign);
    l.meta_begin = align_up(l.notify + static_cast<int64_t>(kMaxNvlPeers) * kNvlNotifyInts * 4, kBufferAlign);
    l.meta = l.meta_begin;
    l.head = align_up(l.meta + 2 * words, kBufferAlign);
    l.tail = align_up(l.head + words, kBufferAlign);
    l.data = align_up(l.tail + words, kBufferAlign);
    l.total = align_up(l.data + static_cast<int64_t>(num_channels) * gpus * capacity * record_bytes, kBufferAlign);
    l.num_nodes = num_nodes;
    l.gpus = gpus;
    l.num_channels = num_channels;
    l.capacity = capacity;
    l.record_bytes = record_bytes;
    return l;
}

// The two regions of a rank. They are separate buffers of fixed sizes (DeepEP's num_rdma_bytes and
// num_nvl_bytes): the barrier words must stay in place while the record size changes between ops.
struct InternodeLayout {
    RdmaLayout rdma;
    NvlLayout nvl;
};

EP_HD InternodeLayout make_internode_layout(const InternodeConfig& cfg, int num_nodes, int gpus, int record_bytes) {
    InternodeLayout l;
    l.rdma = make_rdma_layout(num_nodes, cfg.num_channels, cfg.rdma_capacity, record_bytes);
    l.nvl = make_nvl_layout(num_nodes, gpus, cfg.num_channels, cfg.nvl_capacity, record_bytes);
    return l;
}

}  // namespace ep
