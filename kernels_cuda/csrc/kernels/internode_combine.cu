// Internode combine: dispatch's two hops backwards (roles of protocol_model_internode.py's combine).
// Grid: per rank 2C blocks; channel c uses an SM pair:
//   even block: warp g < G the NVLink sender towards forwarder GPU g, warps [kMaxNvlPeers, +W_r) the
//               RDMA receivers, the last warp the RDMA head coordinator;
//   odd block:  warp n < N the forwarder for origin node n, the last warp the NVLink head coordinator.
// NVLink sender (on the GPU that ran the experts) for forwarder g: lane n owns the rows that came
// from source rank (n, g) in this channel, in arrival order, which is their slot order in the
// (n -> this GPU) sub-stream of dispatch; they go to sub-ring n of the ring (c, this GPU) in g's
// buffer (capacity / N each). The warp serves any lane whose sub-ring has room for a whole nvl_chunk.
// Forwarder n (on rank (m, g)) walks node n's dispatch records in order, a chunk of rdma_chunk at a
// time after waiting for room in the RDMA ring back to (n, g); per record, lane j announces the next
// slot of sub-ring (j, n) it needs (send_nvl_head, absent entries rewritten to the next present
// slot), waits for it, and the warp sums the rows of every GPU that had the token (fp32, GPU order,
// rounded once to the payload type) into the RDMA slot; the chunk is put, then its tail added.
// The NVLink coordinator releases each sub-ring's head (minimum announced slot of its forwarder)
// into the producer GPU. RDMA receivers stride over the channel's tokens: lane m announces and
// waits for the token's slot in node m's ring (send_rdma_head, rewritten likewise), the warp sums
// over nodes (fp32, node order) into combined_x; weights are summed alike. The RDMA coordinator
// releases each node's head lazily (by rdma_chunk) as the minimum over unretired receivers.
#include <climits>

#include "params/internode.h"
#include "device/launch.cuh"
#include "device/rdma.cuh"
#include "device/ring.cuh"
#include "device/transport.cuh"
#include "device/vec.cuh"

namespace ep {

namespace {

constexpr int kThreads = kInternodeCombineWarps * 32;
constexpr int kFirstReceiver = kMaxNvlPeers;
constexpr int kCoordinator = kInternodeCombineWarps - 1;
// (origin node, producer GPU) pairs of the NVLink coordinator's lanes: every pair has a lane.
constexpr int kPairsPerLane = (kMaxRdmaPeers * kMaxNvlPeers + kWarpSize - 1) / kWarpSize;
// The five roles are __noinline__: inlined into one kernel, values hoisted for one role stayed live
// through the others, and with kInternodeCombineWarps = kMaxRdmaPeers + 1 = 21 warps (at most 80
// registers a thread) the kernel spilled; compiled apart, each role fits (python -m kernels_cuda.compile_check).

struct Ctx {
    const InternodeCombineParams& p;
    const InternodeCombineRankArgs& a;
    int channel;
};

// Rows [first, first + count) of `block` in a table of per-channel starts (`offsets`, one row per
// peer), for the peer whose rows are [prefix[peer - 1], prefix[peer]).
__device__ __forceinline__ void channel_rows(const int* prefix, const int* offsets, int peer, int C, int c, int* first,
                                             int* count) {
    const int block = peer > 0 ? prefix[peer - 1] : 0;
    const int start = offsets[peer * C + c];
    const int stop = c + 1 < C ? offsets[peer * C + c + 1] : prefix[peer] - block;
    *first = block + start;
    *count = stop - start;
}

template <Backend B>
__device__ __noinline__ void nvl_sender(const Ctx& x, const Transport<B>& nvl, int g) {
    constexpr Scope S = Transport<B>::kScope;
    const InternodeCombineParams& p = x.p;
    const InternodeCombineRankArgs& a = x.a;
    const NvlLayout& nl = p.layout.nvl;
    const int N = p.num_nodes, G = p.gpus, C = p.num_channels, c = x.channel, gpu = a.peers.gpu, lane = lane_id();
    const int sub_capacity = nl.capacity / N;
    int first = 0, count = 0;  // lane n: rows from source rank (n, g) in this channel
    if (lane < N) channel_rows(a.recv_gbl_rank_prefix_sum, a.recv_gbl_channel_offset, lane * G + g, C, c, &first, &count);
    const int* head_word = lane < N ? nvl.template peer_ptr<int>(gpu, nl.word(nl.head, c, g, lane)) : nullptr;
    int tail = 0, head = 0;
    SpinBudget spin(p.timeout_cycles);
    while (__any_sync(0xffffffffu, tail < count)) {
        if (tail < count && sub_capacity - (tail - head) < p.nvl_chunk) head = ld_acquire<S>(head_word);
        const unsigned ready = __ballot_sync(0xffffffffu, tail < count && sub_capacity - (tail - head) >= p.nvl_chunk);
        if (ready == 0) {
            if (spin.expired()) {
                const int n = __ffs(__ballot_sync(0xffffffffu, tail < count)) - 1;
                const int h = __shfl_sync(0xffffffffu, head, n), t = __shfl_sync(0xffffffffu, tail, n);
                report_timeout(p.error, kRoleCombineNvlSender, a.peers.rank, c, g, h, t, t + p.nvl_chunk - sub_capacity);
            }
            continue;
        }
        spin = SpinBudget(p.timeout_cycles);
        __syncwarp();  // each lane's acquire of its head orders the whole warp's writes into that sub-ring
        for (unsigned bits = ready; bits != 0; bits &= bits - 1) {
            const int n = __ffs(bits) - 1;
            const int start = __shfl_sync(0xffffffffu, tail, n), rows = __shfl_sync(0xffffffffu, count, n);
            const int row0 = __shfl_sync(0xffffffffu, first, n) + start;
            const int batch = min(p.nvl_chunk, rows - start);
            for (int k = 0; k < batch; ++k) {
                const int64_t row = row0 + k;
                const int64_t offset = nl.slot(c, gpu, n, N, start + k);
                nvl.put_warp(g, offset, static_cast<const int4*>(a.x) + row * p.hidden_int4, p.hidden_int4);
                if (lane < p.num_topk)
                    st_plain(nvl.template peer_ptr<float>(g, offset + p.record.weights_offset) + lane,
                             a.topk_weights != nullptr ? a.topk_weights[row * p.num_topk + lane] : 0.0f);
            }
            nvl.quiet();
            __syncwarp();
            if (lane == 0) nvl.signal_store(g, nl.word(nl.tail, c, gpu, n), start + batch);
            if (lane == n) tail += batch;
        }
    }
}

struct ForwarderShared {
    int next[kMaxRdmaPeers][kMaxNvlPeers];  // [n][j]: the smallest slot of sub-ring (j, n) forwarder n may still read
    int retired[kMaxRdmaPeers];
};

template <Backend B, typename T>
__device__ __noinline__ void forwarder(const Ctx& x, const RdmaTransport<B>& rdma, const Transport<nvl_backend_of<B>()>& nvl,
                          volatile ForwarderShared& shared, int n) {
    constexpr Scope S = Transport<nvl_backend_of<B>()>::kScope;
    using V = Vec<T>;
    const InternodeCombineParams& p = x.p;
    const InternodeCombineRankArgs& a = x.a;
    const RdmaLayout& rl = p.layout.rdma;
    const NvlLayout& nl = p.layout.nvl;
    const int N = p.num_nodes, G = p.gpus, C = p.num_channels, c = x.channel, gpu = a.peers.gpu, me = a.peers.node;
    const int lane = lane_id(), rank = a.peers.rank;
    int first, count;  // node n's dispatch records in this channel: rows [first, first + count) of send_nvl_head
    channel_rows(a.recv_rdma_rank_prefix_sum, a.recv_rdma_channel_offset, n, C, c, &first, &count);
    const int* head_word = rdma.template local<int>(rl.word(rl.head, c, n));
    const int* tail_word = lane < G ? nvl.template peer_ptr<int>(gpu, nl.word(nl.tail, c, lane, n)) : nullptr;
    const WaitContext room_ctx{p.error, p.timeout_cycles, kRoleCombineForwarderRdmaRoom, rank, c, n};
    const WaitContext data_ctx{p.error, p.timeout_cycles, kRoleCombineForwarderNvlData, rank, c, lane};
    const int64_t out_region = n == me ? rl.recv_data : rl.send_data;  // own node: straight into the receive ring
    int head = 0;
    for (int chunk = 0; chunk < count; chunk += p.rdma_chunk) {
        const int batch = min(p.rdma_chunk, count - chunk);
        if (lane == 0) head = wait_for_room<RdmaTransport<B>::kScope>(head_word, chunk, rl.capacity, batch, head, room_ctx);
        __syncwarp();
        for (int i = chunk; i < chunk + batch; ++i) {
            const int slot = lane < G ? a.send_nvl_head[static_cast<int64_t>(first + i) * G + lane] : -1;
            __syncwarp();  // every lane's reads of the previous record are done before its slots are released
            fence_acq_rel<S>();
            if (lane < G) {
                shared.next[n][lane] = slot >= 0 ? slot : -slot - 1;
                if (slot >= 0) wait_for_data<S>(tail_word, slot, slot, data_ctx);
            }
            __syncwarp();
            int slots[kMaxNvlPeers];
#pragma unroll
            for (int j = 0; j < kMaxNvlPeers; ++j) slots[j] = __shfl_sync(0xffffffffu, slot, j);
            uint8_t* out = rdma.template local<uint8_t>(rl.slot(out_region, c, n, i));
            for (int v = lane; v < p.hidden_int4; v += 32) {
                float acc[V::kElems] = {};
#pragma unroll
                for (int j = 0; j < kMaxNvlPeers; ++j) {
                    if (j >= G || slots[j] < 0) continue;
                    V::add(acc, ld_int4(nvl.template peer_ptr<int4>(gpu, nl.slot(c, j, n, N, slots[j])) + v));
                }
                st_int4(reinterpret_cast<int4*>(out) + v, V::pack(acc));
            }
            if (lane < p.num_topk) {
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < kMaxNvlPeers; ++j) {
                    if (j >= G || slots[j] < 0) continue;
                    sum += nvl.template peer_ptr<float>(gpu, nl.slot(c, j, n, N, slots[j]) + p.record.weights_offset)[lane];
                }
                st_plain(reinterpret_cast<float*>(out + p.record.weights_offset) + lane, sum);
            }
        }
        __syncwarp();  // the put reads what other lanes wrote
        if (n != me)
            rdma.put_warp(n, rl.slot(rl.recv_data, c, me, chunk), rdma.template local<int4>(rl.slot(rl.send_data, c, n, chunk)),
                          batch * rl.record_bytes / 16);
        rdma.signal_add_warp(n, rl.word(rl.tail, c, me), batch);
    }
    __syncwarp();
    if (lane == 0) shared.retired[n] = 1;
}

template <Backend B>
__device__ __noinline__ void nvl_coordinator(const Ctx& x, const Transport<B>& nvl, const volatile ForwarderShared& shared) {
    const InternodeCombineParams& p = x.p;
    const NvlLayout& nl = p.layout.nvl;
    const int N = p.num_nodes, G = p.gpus, gpu = x.a.peers.gpu, lane = lane_id();
    int published[kPairsPerLane] = {};  // pair lane + 32 q = (origin node, producer GPU)
    SpinBudget spin(p.timeout_cycles);
    while (true) {
        bool all_retired = true;
        for (int n = 0; n < N; ++n) all_retired &= shared.retired[n] != 0;
        if (all_retired) break;
#pragma unroll
        for (int q = 0; q < kPairsPerLane; ++q) {
            const int pair = lane + 32 * q, n = pair / G, j = pair % G;
            if (n >= N || shared.retired[n]) continue;
            const int next = shared.next[n][j];
            if (next > published[q]) {
                nvl.signal_store(j, nl.word(nl.head, x.channel, gpu, n), next);
                published[q] = next;
                spin = SpinBudget(p.timeout_cycles);
            }
        }
        if (spin.expired()) report_timeout(p.error, kRoleCombineNvlCoordinator, x.a.peers.rank, x.channel, lane, published[0], 0, -1);
        __nanosleep(64);
    }
}

struct ReceiverShared {
    int next[kRdmaReceiverWarps][kMaxRdmaPeers];  // [w][m]: the smallest slot of node m's ring receiver w may still read
    int retired[kRdmaReceiverWarps];
    int slot[kRdmaReceiverWarps][kMaxRdmaPeers];  // [w][m]: receiver w's current token's slot in node m's ring, or < 0
};

template <Backend B, typename T>
__device__ __noinline__ void rdma_receiver(const Ctx& x, const RdmaTransport<B>& rdma, volatile ReceiverShared& shared, int w) {
    using V = Vec<T>;
    const InternodeCombineParams& p = x.p;
    const InternodeCombineRankArgs& a = x.a;
    const RdmaLayout& rl = p.layout.rdma;
    const int N = p.num_nodes, lane = lane_id();
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleCombineRdmaReceiver, a.peers.rank, x.channel, lane};
    const int* tail_word = lane < N ? rdma.template local<int>(rl.word(rl.tail, x.channel, lane)) : nullptr;
    int begin, end;
    channel_range(a.num_tokens, p.num_channels, x.channel, &begin, &end);
    for (int t = begin + w; t < end; t += kRdmaReceiverWarps) {
        const int slot = lane < N ? a.send_rdma_head[static_cast<int64_t>(t) * N + lane] : -1;
        __syncwarp();  // every lane's reads of the previous token are done before its slots are released
        fence_acq_rel<RdmaTransport<B>::kScope>();
        if (lane < N) {
            shared.next[w][lane] = slot >= 0 ? slot : -slot - 1;
            if (slot >= 0) wait_for_data<RdmaTransport<B>::kScope>(tail_word, slot, slot, ctx);
        }
        // Slots through shared memory rather than registers (a register per node would spill).
        int* slots = const_cast<int*>(shared.slot[w]);
        __syncwarp();  // the previous token's reduction is done with them
        if (lane < N) slots[lane] = slot;
        __syncwarp();
        int4* out = static_cast<int4*>(a.combined_x) + static_cast<int64_t>(t) * p.hidden_int4;
        for (int v = lane; v < p.hidden_int4; v += 32) {
            float acc[V::kElems] = {};
            for (int m = 0; m < N; ++m) {
                if (slots[m] < 0) continue;
                V::add(acc, ld_int4(rdma.template local<int4>(rl.slot(rl.recv_data, x.channel, m, slots[m])) + v));
            }
            out[v] = V::pack(acc);
        }
        if (a.combined_topk_weights != nullptr && lane < p.num_topk) {
            float sum = 0.0f;
            for (int m = 0; m < N; ++m) {
                if (slots[m] < 0) continue;
                sum += rdma.template local<float>(rl.slot(rl.recv_data, x.channel, m, slots[m]) + p.record.weights_offset)[lane];
            }
            a.combined_topk_weights[static_cast<int64_t>(t) * p.num_topk + lane] = sum;
        }
    }
    __syncwarp();
    __threadfence_block();
    if (lane == 0) shared.retired[w] = 1;
}

template <Backend B>
__device__ __noinline__ void rdma_coordinator(const Ctx& x, const RdmaTransport<B>& rdma, const volatile ReceiverShared& shared) {
    const InternodeCombineParams& p = x.p;
    const RdmaLayout& rl = p.layout.rdma;
    const int N = p.num_nodes, me = x.a.peers.node, lane = lane_id();
    int published = 0;  // lane m: head released into node m's forwarder
    SpinBudget spin(p.timeout_cycles);
    while (true) {
        int lowest = INT_MAX;
        bool all_retired = true;
        for (int w = 0; w < kRdmaReceiverWarps; ++w) {
            if (shared.retired[w]) continue;
            all_retired = false;
            if (lane < N) lowest = min(lowest, shared.next[w][lane]);
        }
        if (all_retired) break;
        if (lane < N && lowest != INT_MAX && lowest - published >= p.rdma_chunk) {
            rdma.signal_add(lane, rl.word(rl.head, x.channel, me), lowest - published);
            published = lowest;
            spin = SpinBudget(p.timeout_cycles);
        }
        if (spin.expired()) report_timeout(p.error, kRoleCombineRdmaCoordinator, x.a.peers.rank, x.channel, lane, published, lowest, -1);
        __nanosleep(64);
    }
}

template <Backend B, typename T>
__global__ void __launch_bounds__(kThreads, 1) internode_combine_kernel(const __grid_constant__ InternodeCombineParams p) {
    constexpr Backend NB = nvl_backend_of<B>();
    const int blocks_per_rank = 2 * p.num_channels;
    const InternodeCombineRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    if (a.peers.rank == p.stalled_rank) return;
    const Ctx x{p, a, static_cast<int>(blockIdx.x % blocks_per_rank) / 2};
    const RdmaTransport<B> rdma(a.peers);
    const Transport<NB> nvl(a.peers.nvl);
    const int warp = warp_id();

    if (blockIdx.x % 2 == 0) {
        EP_SHARED(ReceiverShared, receivers, );
        for (int i = threadIdx.x; i < kRdmaReceiverWarps * kMaxRdmaPeers; i += blockDim.x)
            receivers.next[i / kMaxRdmaPeers][i % kMaxRdmaPeers] = 0;
        if (threadIdx.x < kRdmaReceiverWarps) receivers.retired[threadIdx.x] = 0;
        __syncthreads();
        volatile ReceiverShared& s = receivers;
        if (warp < kFirstReceiver) {
            if (warp < p.gpus) nvl_sender(x, nvl, warp);
        } else if (warp < kFirstReceiver + kRdmaReceiverWarps) {
            rdma_receiver<B, T>(x, rdma, s, warp - kFirstReceiver);
        } else if (warp == kCoordinator) {
            rdma_coordinator(x, rdma, s);
        }
        return;
    }
    EP_SHARED(ForwarderShared, forwarders, );
    for (int i = threadIdx.x; i < kMaxRdmaPeers * kMaxNvlPeers; i += blockDim.x) forwarders.next[i / kMaxNvlPeers][i % kMaxNvlPeers] = 0;
    if (threadIdx.x < kMaxRdmaPeers) forwarders.retired[threadIdx.x] = 0;
    __syncthreads();
    volatile ForwarderShared& s = forwarders;
    if (warp < p.num_nodes)
        forwarder<B, T>(x, rdma, nvl, s, warp);
    else if (warp == kCoordinator)
        nvl_coordinator(x, nvl, s);
}

}  // namespace

cudaError_t launch_internode_combine(const InternodeCombineParams& p, Backend backend, Payload payload, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * 2 * p.num_channels;
    if (payload == Payload::kBF16)
        return launch_by_backend(backend, internode_combine_kernel<Backend::kEmulated, __nv_bfloat16>,
                                 internode_combine_kernel<Backend::kNvlink, __nv_bfloat16>,
                                 EP_NVSHMEM_KERNEL(internode_combine_kernel<Backend::kNvshmem, __nv_bfloat16>), blocks,
                                 kThreads, stream, p);
    return launch_by_backend(backend, internode_combine_kernel<Backend::kEmulated, float>,
                             internode_combine_kernel<Backend::kNvlink, float>,
                             EP_NVSHMEM_KERNEL(internode_combine_kernel<Backend::kNvshmem, float>), blocks, kThreads,
                             stream, p);
}

}  // namespace ep
