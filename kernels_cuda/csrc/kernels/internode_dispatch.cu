// Internode dispatch (two hops), the roles and rules of kernels_cuda/protocol_model_internode.py.
// Grid: per rank 2C blocks; channel c uses an SM pair:
//   odd block (sender SM):  warps [0, W) RDMA senders, warp W the sender coordinator, warps W+1+g the
//                           NVLink receivers of forwarder GPU g;
//   even block (forwarder SM): warp j < G forwards to GPU j of the node, warp G the forwarder
//                           coordinator.
// RDMA senders walk the channel's tokens in rounds of W (token k handled by warp k % W); every warp
// counts every token, so all agree on each record's slot in every node's ring. The handling warp
// waits (lane m) for room in node m's ring, writes send_rdma_head, and copies the token once from
// HBM into the slot of every destination node (one record per node, the node's GPU bitmask in its
// meta): staged in send_data for remote nodes, straight into its own recv_data for its own node.
// After each round the warps meet at a named barrier and warp 0 releases the slot counts.
// The coordinator puts released records in chunks of rdma_chunk (or all that remain) to the same
// slots of the remote ring, then adds the count to the remote tail on the same ordered stream;
// nodes are visited in the rotated order (i + channel + node) % N to spread incast.
// Forwarder j (rank (m, g)) announces per source node n the (start, end) of the channel's rows for
// GPU j, then loops: room for a whole nvl_chunk in GPU j's ring, a source node with RDMA data
// (round robin), copy the records whose bit j is set (send_nvl_head = slot in the (n -> j)
// sub-stream, else -1), publish the NVLink tail and its consumed RDMA head in shared memory.
// The forwarder coordinator releases each RDMA head as the minimum over the unretired forwarders,
// lazily (once it moved by rdma_chunk), as an atomic add into the producer.
// NVLink receiver for forwarder g places each record at the row of its global source rank
// (n, g): recv_gbl_rank_prefix_sum + channel start + arrival index, with local expert ids.
#include <climits>

#include "params/internode.h"
#include "device/launch.cuh"
#include "device/rdma.cuh"
#include "device/ring.cuh"
#include "device/transport.cuh"

namespace ep {

namespace {

constexpr int kThreads = kInternodeDispatchWarps * 32;
constexpr int kSenderCoordinator = kRdmaSenderWarps;
constexpr int kFirstReceiver = kRdmaSenderWarps + 1;
constexpr int kSenderBarrier = 1;  // named barrier of the sender warps' rounds

struct Ctx {
    const InternodeDispatchParams& p;
    const InternodeDispatchRankArgs& a;
    int channel;
    int begin;  // the channel's tokens
    int end;
};

__device__ __forceinline__ int meta_value(const InternodeDispatchRankArgs& a, int C, int c, int m, int G, int k) {
    const int* row = k < 2 ? a.rdma_channel_prefix_matrix + m * C : a.gbl_channel_prefix_matrix + (m * G + (k - 2) / 2) * C;
    const bool start = k % 2 == 0;
    return encode_count(start ? (c > 0 ? row[c - 1] : 0) : row[c]);
}

// Channel meta of every destination node (warp w serves nodes w, w + W, ...).
template <Backend B>
__device__ void send_channel_meta(const Ctx& x, const RdmaTransport<B>& rdma) {
    const RdmaLayout& rl = x.p.layout.rdma;
    const int N = x.p.num_nodes, G = x.p.gpus, me = x.a.peers.node, k = lane_id();
    for (int m = warp_id(); m < N; m += kRdmaSenderWarps) {
        const int value = k < 2 + 2 * G ? meta_value(x.a, x.p.num_channels, x.channel, m, G, k) : 0;
        if (m == me) {
            if (k < kRdmaMetaInts) st_plain(rdma.template local<int>(rl.meta_entry(rl.meta, x.channel, me)) + k, value);
            continue;
        }
        int* staged = rdma.template local<int>(rl.meta_entry(rl.send_meta, x.channel, m));
        if (k < kRdmaMetaInts) st_plain(staged + k, value);
        __syncwarp();
        rdma.put_warp(m, rl.meta_entry(rl.meta, x.channel, me), reinterpret_cast<const int4*>(staged), kRdmaMetaInts / 4);
    }
    rdma.quiet();  // a node that gets no records never sees a tail that would flush the meta
}

// The handling warp copies token t into the slot of every node in `nodes` (bit m; lane m holds the
// slot's address and the node's GPU bitmask). The payload is read once and stored N times.
template <Backend B>
__device__ void write_records(const Ctx& x, int t, unsigned nodes, uint8_t* my_slot, int my_mask) {
    const InternodeDispatchParams& p = x.p;
    const InternodeDispatchRankArgs& a = x.a;
    const RecordLayout& rec = p.record;
    const int4* src = static_cast<const int4*>(a.x) + static_cast<int64_t>(t) * p.hidden_int4;
    for (int base = 0; base < p.hidden_int4; base += 32) {
        const int i = base + lane_id();
        const int4 v = i < p.hidden_int4 ? ld_int4(src + i) : make_int4(0, 0, 0, 0);
        for (unsigned bits = nodes; bits != 0; bits &= bits - 1) {
            uint8_t* slot = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_slot), __ffs(bits) - 1));
            if (i < p.hidden_int4) st_int4(reinterpret_cast<int4*>(slot) + i, v);
        }
    }
    for (unsigned bits = nodes; bits != 0; bits &= bits - 1) {
        const int m = __ffs(bits) - 1;
        uint8_t* slot = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_slot), m));
        const int mask = __shfl_sync(0xffffffffu, my_mask, m);
        float* scales = reinterpret_cast<float*>(slot + rec.scales_offset);
        for (int i = lane_id(); i < p.num_scales; i += 32)
            st_plain(scales + i, a.x_scales[t * a.scale_token_stride + i * a.scale_hidden_stride]);
        int* meta = reinterpret_cast<int*>(slot + rec.src_offset);
        if (lane_id() == 0) {
            st_plain(meta, t);
            st_plain(meta + 1, x.a.peers.node);
            st_plain(meta + 2, mask);
        }
        if (a.topk_idx != nullptr && lane_id() < p.num_topk) {
            const int64_t k = static_cast<int64_t>(t) * p.num_topk + lane_id();
            st_plain(reinterpret_cast<int*>(slot + rec.idx_offset) + lane_id(), static_cast<int>(a.topk_idx[k]));
            st_plain(reinterpret_cast<float*>(slot + rec.weights_offset) + lane_id(), a.topk_weights[k]);
        }
    }
}

template <Backend B>
__device__ void rdma_sender(const Ctx& x, const RdmaTransport<B>& rdma, volatile int* released) {
    const InternodeDispatchParams& p = x.p;
    const InternodeDispatchRankArgs& a = x.a;
    const RdmaLayout& rl = p.layout.rdma;
    const int N = p.num_nodes, G = p.gpus, R = N * G, me = a.peers.node, lane = lane_id(), warp = warp_id();
    send_channel_meta(x, rdma);

    const int* head_word = lane < N ? rdma.template local<int>(rl.word(rl.head, x.channel, lane)) : nullptr;
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleRdmaSender, a.peers.rank, x.channel, lane};
    int slot = 0, head = 0;  // lane m: records so far to node m, its ring's last seen head
    for (int t = x.begin; t < x.end; ++t) {
        const int k = t - x.begin;
        int mask = 0;  // lane m: GPUs of node m that need token t
        if (lane < N)
            for (int j = 0; j < G; ++j) mask |= a.is_token_in_rank[static_cast<int64_t>(t) * R + lane * G + j] << j;
        const unsigned nodes = __ballot_sync(0xffffffffu, mask != 0);
        if (k % kRdmaSenderWarps == warp) {
            if (lane < N) a.send_rdma_head[static_cast<int64_t>(t) * N + lane] = mask != 0 ? slot : -1;
            if (mask != 0) head = wait_for_room<RdmaTransport<B>::kScope>(
                               head_word, slot, rl.capacity, 1, head, ctx);
            uint8_t* my_slot = nullptr;
            if (mask != 0)
                my_slot = lane == me ? rdma.local(rl.slot(rl.recv_data, x.channel, me, slot))
                                     : rdma.local(rl.slot(rl.send_data, x.channel, lane, slot));
            __syncwarp();
            write_records<B>(x, t, nodes, my_slot, mask);
        }
        slot += mask != 0;
        if (k % kRdmaSenderWarps == kRdmaSenderWarps - 1 || t == x.end - 1) {  // end of a round
            rdma.quiet();
            named_barrier(kSenderBarrier, kRdmaSenderWarps * 32);
            if (warp == 0 && lane < N) {
                __threadfence_block();
                st_volatile(released + lane, slot);
            }
        }
    }
}

template <Backend B>
__device__ void rdma_sender_coordinator(const Ctx& x, const RdmaTransport<B>& rdma, const volatile int* released) {
    const InternodeDispatchParams& p = x.p;
    const RdmaLayout& rl = p.layout.rdma;
    const int N = p.num_nodes, C = p.num_channels, c = x.channel, me = x.a.peers.node, lane = lane_id();
    const int* prefix = x.a.rdma_channel_prefix_matrix;
    const int total = lane < N ? prefix[lane * C + c] - (c > 0 ? prefix[lane * C + c - 1] : 0) : 0;
    const int record_int4 = rl.record_bytes / 16;
    int issued = 0;
    SpinBudget spin(p.timeout_cycles);
    while (__any_sync(0xffffffffu, issued < total)) {
        bool progress = false;
        for (int i = 0; i < N; ++i) {
            const int m = (i + c + me) % N;
            // One read, broadcast: the lanes must agree on whether and what to put.
            const int ready = __shfl_sync(0xffffffffu, released[m], 0);
            const int done = __shfl_sync(0xffffffffu, issued, m), all = __shfl_sync(0xffffffffu, total, m);
            if (!(ready - done >= p.rdma_chunk || (ready == all && ready > done))) continue;
            __threadfence_block();  // the released records' writes before their put
            const int count = min(ready - done, p.rdma_chunk);  // never wraps: capacity % chunk == 0
            if (m != me)
                rdma.put_warp(m, rl.slot(rl.recv_data, c, me, done),
                              rdma.template local<int4>(rl.slot(rl.send_data, c, m, done)), count * record_int4);
            rdma.signal_add_warp(m, rl.word(rl.tail, c, me), count);
            if (lane == m) issued += count;
            progress = true;
        }
        if (progress) {
            spin = SpinBudget(p.timeout_cycles);
        } else if (spin.expired()) {
            const int m = __ffs(__ballot_sync(0xffffffffu, issued < total)) - 1;
            report_timeout(p.error, kRoleRdmaSenderCoordinator, x.a.peers.rank, c, m, __shfl_sync(0xffffffffu, issued, m),
                           released[m], __shfl_sync(0xffffffffu, total, m));
        }
    }
}

template <Backend B>
__device__ void nvl_receiver(const Ctx& x, const Transport<B>& nvl, int f) {
    constexpr Scope S = Transport<B>::kScope;
    const InternodeDispatchParams& p = x.p;
    const InternodeDispatchRankArgs& a = x.a;
    const NvlLayout& nl = p.layout.nvl;
    const RecordLayout& rec = p.record;
    const int N = p.num_nodes, G = p.gpus, C = p.num_channels, c = x.channel, gpu = a.peers.gpu, lane = lane_id();
    const int local_experts = p.num_experts / (N * G);
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleNvlReceiver, a.peers.rank, c, f};

    int next_row = 0, count = 0;  // lane n: next row for source rank (n, f), rows from it in this channel
    if (lane < N) {
        const int start = wait_for_count<S>(nvl.template peer_ptr<int>(gpu, nl.meta_word(c, f, lane, 0)), ctx);
        const int end = wait_for_count<S>(nvl.template peer_ptr<int>(gpu, nl.meta_word(c, f, lane, 1)), ctx);
        const int s = lane * G + f;
        a.recv_gbl_channel_offset[s * C + c] = start;
        next_row = (s > 0 ? a.recv_gbl_rank_prefix_sum[s - 1] : 0) + start;
        count = end - start;
    }
    int total = count;
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);

    const int* tail_word = nvl.template peer_ptr<int>(gpu, nl.word(nl.tail, c, f, 0));
    for (int head = 0; head < total;) {
        int tail = 0;
        if (lane == 0) tail = wait_for_data<S>(tail_word, head, head, ctx);
        __syncwarp();  // lane 0's acquire orders the whole warp's reads of the records
        tail = __shfl_sync(0xffffffffu, tail, 0);
        for (int i = head; i < tail; ++i) {
            const uint8_t* slot = nvl.template peer_ptr<uint8_t>(gpu, nl.slot(c, f, 0, 1, i));
            const int* meta = reinterpret_cast<const int*>(slot + rec.src_offset);
            const int node = meta[1];
            const int row = __shfl_sync(0xffffffffu, next_row, node);
            if (lane == node) ++next_row;
            const int4* src = reinterpret_cast<const int4*>(slot);
            int4* dst = static_cast<int4*>(a.recv_x) + static_cast<int64_t>(row) * p.hidden_int4;
            for (int v = lane; v < p.hidden_int4; v += 32) dst[v] = ld_int4(src + v);
            const float* scales = reinterpret_cast<const float*>(slot + rec.scales_offset);
            for (int v = lane; v < p.num_scales; v += 32) a.recv_x_scales[static_cast<int64_t>(row) * p.num_scales + v] = scales[v];
            if (lane == 0) a.recv_src_idx[row] = meta[0];
            if (a.recv_topk_idx != nullptr && lane < p.num_topk) {
                const int expert = reinterpret_cast<const int*>(slot + rec.idx_offset)[lane] - a.peers.rank * local_experts;
                const bool local = expert >= 0 && expert < local_experts;
                const int64_t k = static_cast<int64_t>(row) * p.num_topk + lane;
                a.recv_topk_idx[k] = local ? expert : -1;
                a.recv_topk_weights[k] = local ? reinterpret_cast<const float*>(slot + rec.weights_offset)[lane] : 0.0f;
            }
        }
        __syncwarp();  // every record read before the head frees its slot
        if (lane == 0) nvl.signal_store(f, nl.word(nl.head, c, gpu, 0), tail);
        head = tail;
    }
}

struct ForwarderShared {
    int head[kMaxNvlPeers][kMaxRdmaPeers];  // [j][n]: records of node n's ring forwarder j is done with
    int retired[kMaxNvlPeers];
};

template <Backend B>
__device__ void forwarder(const Ctx& x, const RdmaTransport<B>& rdma, const Transport<nvl_backend_of<B>()>& nvl,
                          volatile ForwarderShared& shared, int j) {
    constexpr Scope S = Transport<nvl_backend_of<B>()>::kScope;
    const InternodeDispatchParams& p = x.p;
    const InternodeDispatchRankArgs& a = x.a;
    const RdmaLayout& rl = p.layout.rdma;
    const NvlLayout& nl = p.layout.nvl;
    const int N = p.num_nodes, G = p.gpus, C = p.num_channels, c = x.channel, gpu = a.peers.gpu, lane = lane_id();
    const int rank = a.peers.rank;

    int count = 0, base = 0;  // lane n: records from node n in this channel, index of the first in send_nvl_head
    if (lane < N) {
        const WaitContext meta_ctx{p.error, p.timeout_cycles, kRoleForwarderMeta, rank, c, lane};
        const int* meta = rdma.template local<int>(rl.meta_entry(rl.meta, c, lane));
        const int node_start = wait_for_count<S>(meta + kMetaNodeStart, meta_ctx);
        const int node_end = wait_for_count<S>(meta + kMetaNodeEnd, meta_ctx);
        const int gpu_start = wait_for_count<S>(meta + meta_gpu_start(j), meta_ctx);
        const int gpu_end = wait_for_count<S>(meta + meta_gpu_end(j), meta_ctx);
        nvl.signal_store(j, nl.meta_word(c, gpu, lane, 0), encode_count(gpu_start));
        nvl.signal_store(j, nl.meta_word(c, gpu, lane, 1), encode_count(gpu_end));
        if (j == 0) a.recv_rdma_channel_offset[lane * C + c] = node_start;
        count = node_end - node_start;
        base = (lane > 0 ? a.recv_rdma_rank_prefix_sum[lane - 1] : 0) + node_start;
    }

    const int record_int4 = rl.record_bytes / 16;
    const int* head_word = nvl.template peer_ptr<int>(gpu, nl.word(nl.head, c, j, 0));
    const int* rdma_tail_word = lane < N ? rdma.template local<int>(rl.word(rl.tail, c, lane)) : nullptr;
    const WaitContext room_ctx{p.error, p.timeout_cycles, kRoleForwarderNvlRoom, rank, c, j};
    int consumed = 0, sub = 0;  // lane n: records read from node n's ring, records of it sent to GPU j
    int tail = 0, head = 0, turn = 0;
    while (__any_sync(0xffffffffu, consumed < count)) {
        if (lane == 0) head = wait_for_room<S>(head_word, tail, nl.capacity, p.nvl_chunk, head, room_ctx);
        __syncwarp();  // the room is seen before any lane writes into it
        head = __shfl_sync(0xffffffffu, head, 0);

        unsigned ready;
        int rdma_tail = 0;
        SpinBudget spin(p.timeout_cycles);
        while (true) {
            if (lane < N) rdma_tail = ld_acquire<S>(rdma_tail_word);
            ready = __ballot_sync(0xffffffffu, consumed < count && rdma_tail > consumed);
            if (ready != 0) break;
            if (spin.expired()) {
                const int n = __ffs(__ballot_sync(0xffffffffu, consumed < count)) - 1;
                report_timeout(p.error, kRoleForwarderRdmaData, rank, c, n, __shfl_sync(0xffffffffu, consumed, n),
                               __shfl_sync(0xffffffffu, rdma_tail, n), __shfl_sync(0xffffffffu, count, n));
            }
        }
        __syncwarp();  // lane n's acquire of the tail orders the whole warp's reads of node n's records
        const unsigned rotated = turn == 0 ? ready : (ready >> turn) | (ready << (32 - turn));
        const int n = (__ffs(rotated) - 1 + turn) % 32;
        turn = (n + 1) % N;

        const int available = __shfl_sync(0xffffffffu, rdma_tail, n), first = __shfl_sync(0xffffffffu, base, n);
        int index = __shfl_sync(0xffffffffu, consumed, n), slot = __shfl_sync(0xffffffffu, sub, n);
        for (int sent = 0; index < available && sent < p.nvl_chunk; ++index) {
            const uint8_t* record = rdma.template local<uint8_t>(rl.slot(rl.recv_data, c, n, index));
            const int mask = reinterpret_cast<const int*>(record + p.record.src_offset)[2];
            const bool forward = (mask >> j) & 1;
            if (lane == 0) a.send_nvl_head[static_cast<int64_t>(first + index) * G + j] = forward ? slot : -1;
            if (!forward) continue;
            nvl.put_warp(j, nl.slot(c, gpu, 0, 1, tail), reinterpret_cast<const int4*>(record), record_int4);
            ++slot, ++tail, ++sent;
        }
        if (lane == n) consumed = index, sub = slot;
        nvl.quiet();
        __syncwarp();
        if (lane == 0) {
            nvl.signal_store(j, nl.word(nl.tail, c, gpu, 0), tail);
            shared.head[j][n] = index;  // read before this point: the coordinator may free the slots
        }
    }
    __syncwarp();
    if (lane == 0) shared.retired[j] = 1;
}

template <Backend B>
__device__ void forwarder_coordinator(const Ctx& x, const RdmaTransport<B>& rdma, const volatile ForwarderShared& shared) {
    const InternodeDispatchParams& p = x.p;
    const RdmaLayout& rl = p.layout.rdma;
    const int N = p.num_nodes, G = p.gpus, me = x.a.peers.node, lane = lane_id();
    int published = 0;  // lane n: head released into node n's producer
    SpinBudget spin(p.timeout_cycles);
    while (true) {
        int lowest = INT_MAX;
        bool all_retired = true;
        for (int j = 0; j < G; ++j) {
            if (shared.retired[j]) continue;
            all_retired = false;
            if (lane < N) lowest = min(lowest, shared.head[j][lane]);
        }
        if (all_retired) break;
        if (lane < N && lowest != INT_MAX && lowest - published >= p.rdma_chunk) {
            rdma.signal_add(lane, rl.word(rl.head, x.channel, me), lowest - published);
            published = lowest;
            spin = SpinBudget(p.timeout_cycles);
        }
        if (spin.expired())
            report_timeout(p.error, kRoleForwarderCoordinator, x.a.peers.rank, x.channel, lane, published, lowest, -1);
        __nanosleep(64);
    }
}

// With num_worst_tokens the outputs have more rows than received (no host wait for the counts):
// the rows past the received ones get top-k ids -1 and weights 0, and the send_nvl_head rows past
// the received RDMA records -1 (no copy), spread over the channels.
__device__ void clear_unused_rows(const InternodeDispatchParams& p, const InternodeDispatchRankArgs& a, int channel) {
    if (p.num_worst_tokens <= 0) return;
    const int64_t stride = static_cast<int64_t>(p.num_channels) * kThreads;
    const int64_t records = a.recv_rdma_rank_prefix_sum[p.num_nodes - 1];
    const int64_t worst = p.num_worst_tokens;
    for (int64_t i = records * p.gpus + channel * kThreads + threadIdx.x; i < worst * p.gpus; i += stride)
        a.send_nvl_head[i] = -1;
    if (a.recv_topk_idx == nullptr) return;
    const int64_t rows = a.recv_gbl_rank_prefix_sum[p.num_nodes * p.gpus - 1];
    for (int64_t i = rows * p.num_topk + channel * kThreads + threadIdx.x; i < worst * p.num_topk; i += stride) {
        a.recv_topk_idx[i] = -1;
        a.recv_topk_weights[i] = 0.0f;
    }
}

template <Backend B>
__global__ void __launch_bounds__(kThreads, 1) internode_dispatch_kernel(const __grid_constant__ InternodeDispatchParams p) {
    constexpr Backend NB = nvl_backend_of<B>();
    const int blocks_per_rank = 2 * p.num_channels;
    const InternodeDispatchRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    if (a.peers.rank == p.stalled_rank) return;
    if (p.num_worst_tokens > 0) {
        check_worst_tokens(p.error, kRoleNvlReceiver, a.peers.rank, a.recv_gbl_rank_prefix_sum[p.num_nodes * p.gpus - 1],
                           p.num_worst_tokens);
        check_worst_tokens(p.error, kRoleForwarderRdmaData, a.peers.rank, a.recv_rdma_rank_prefix_sum[p.num_nodes - 1],
                           p.num_worst_tokens);
    }
    Ctx x{p, a, static_cast<int>(blockIdx.x % blocks_per_rank) / 2, 0, 0};
    channel_range(a.num_tokens, p.num_channels, x.channel, &x.begin, &x.end);
    const RdmaTransport<B> rdma(a.peers);
    const Transport<NB> nvl(a.peers.nvl);
    const int warp = warp_id();

    if (blockIdx.x % 2 == 1) {
        clear_unused_rows(p, a, x.channel);
        EP_SHARED(volatile int, released, [kMaxRdmaPeers]);
        if (threadIdx.x < kMaxRdmaPeers) released[threadIdx.x] = 0;
        __syncthreads();
        if (warp < kRdmaSenderWarps)
            rdma_sender(x, rdma, released);
        else if (warp == kSenderCoordinator)
            rdma_sender_coordinator(x, rdma, released);
        else if (warp - kFirstReceiver < p.gpus)
            nvl_receiver(x, nvl, warp - kFirstReceiver);
        return;
    }
    EP_SHARED(ForwarderShared, shared, );
    for (int i = threadIdx.x; i < kMaxNvlPeers * kMaxRdmaPeers; i += blockDim.x) shared.head[i / kMaxRdmaPeers][i % kMaxRdmaPeers] = 0;
    if (threadIdx.x < kMaxNvlPeers) shared.retired[threadIdx.x] = 0;
    __syncthreads();
    volatile ForwarderShared& s = shared;
    if (warp < p.gpus)
        forwarder(x, rdma, nvl, s, warp);
    else if (warp == p.gpus)
        forwarder_coordinator(x, rdma, s);
}

}  // namespace

cudaError_t launch_internode_dispatch(const InternodeDispatchParams& p, Backend backend, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * 2 * p.num_channels;
    return launch_by_backend(backend, internode_dispatch_kernel<Backend::kEmulated>,
                             internode_dispatch_kernel<Backend::kNvlink>,
                             EP_NVSHMEM_KERNEL(internode_dispatch_kernel<Backend::kNvshmem>), blocks, kThreads, stream, p);
}

}  // namespace ep
