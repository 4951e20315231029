// Internode notify kernels (grid: per rank, 1 + nodes blocks for notify, 1 + rewrite blocks for the
// cached notify).
// internode_notify, block 0 of rank (n, g):
//   1. rail + node barriers (every peer that writes into this rank's buffers finished the previous
//      op), zero the ring metadata of both regions;
//   2. rail hop: put to every rail peer (m, g) the row [tokens to each GPU of node m | tokens to node
//      m | tokens per expert of node m]; rail barrier;
//   3. as rail proxy: prefix over source nodes of the records it will receive over RDMA (published to
//      the host); NVLink hop: give each GPU j of the node, per source node, the tokens it will forward
//      to j, and j's per-expert counts summed over source nodes; node barrier;
//   4. per global source rank s = (n', g'), the rows this rank receives -> recv_gbl_rank_prefix_sum,
//      the receive count and the aligned per-expert counts (host-mapped; the total last).
// Blocks 1..N (destination node m): per channel, this rank's tokens to node m and to each of its
// GPUs, prefix-summed over channels.
// internode_cached_notify: block 0 barriers, zeroes, barriers; the others rewrite send_rdma_head and
// send_nvl_head for combine (device/heads.cuh).
#include "device/heads.cuh"
#include "params/internode.h"
#include "device/internode_sync.cuh"
#include "device/launch.cuh"

namespace ep {

namespace {

__device__ __forceinline__ int read_volatile(const int* ptr) { return *reinterpret_cast<const volatile int*>(ptr); }

template <Backend B>
__device__ void exchange_counts(const InternodeNotifyParams& p, const InternodeNotifyRankArgs& a) {
    constexpr Backend NB = nvl_backend_of<B>();
    const RdmaTransport<B> rdma(a.peers);
    const Transport<NB> nvl(a.peers.nvl);
    const RdmaLayout& rl = p.layout.rdma;
    const NvlLayout& nl = p.layout.nvl;
    const int N = p.num_nodes, G = p.gpus, me = a.peers.node, gpu = a.peers.gpu, rank = a.peers.rank;
    const int local_experts = p.num_experts / (N * G), node_experts = local_experts * G;
    const int row_ints = G + 1 + node_experts;

    rail_barrier(rdma, rl, rank, p.timeout_cycles, p.error);
    node_barrier(nvl, nl, rank, gpu, p.timeout_cycles, p.error);
    zero_internode_metadata(rdma, nvl, p.layout, gpu);

    int* staging = rdma.template local<int>(rl.send_notify);
    for (int i = threadIdx.x; i < N * row_ints; i += blockDim.x) {
        const int m = i / row_ints, k = i % row_ints;
        const int value = k < G ? a.num_tokens_per_rank[m * G + k]
                          : k == G ? a.num_tokens_per_node[m]
                                   : a.num_tokens_per_expert[m * node_experts + k - G - 1];
        st_plain(&staging[m * kRdmaNotifyInts + k], value);
    }
    __syncthreads();
    for (int m = warp_id(); m < N; m += blockDim.x / 32)
        rdma.put_warp(m, rl.notify + static_cast<int64_t>(me) * kRdmaNotifyInts * 4,
                      reinterpret_cast<const int4*>(staging + m * kRdmaNotifyInts), ceil_div(row_ints, 4));
    rail_barrier(rdma, rl, rank, p.timeout_cycles, p.error);

    // As rail proxy: rows[n] came from (n, gpu).
    const int* rows = rdma.template local<int>(rl.notify);
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int n = 0; n < N; ++n) {
            sum += read_volatile(rows + n * kRdmaNotifyInts + G);
            a.recv_rdma_rank_prefix_sum[n] = sum;
        }
        if (a.recv_rdma_counter != nullptr) st_volatile(a.recv_rdma_counter, sum);
    }
    for (int i = threadIdx.x; i < G * N; i += blockDim.x) {
        const int j = i / N, n = i % N;
        st_plain(nvl.template peer_ptr<int>(j, nl.notify + (gpu * kNvlNotifyInts + n) * 4), read_volatile(rows + n * kRdmaNotifyInts + j));
    }
    for (int i = threadIdx.x; i < G * local_experts; i += blockDim.x) {
        const int j = i / local_experts, e = i % local_experts;
        int sum = 0;
        for (int n = 0; n < N; ++n) sum += read_volatile(rows + n * kRdmaNotifyInts + G + 1 + j * local_experts + e);
        st_plain(nvl.template peer_ptr<int>(j, nl.notify + (gpu * kNvlNotifyInts + kMaxRdmaPeers + e) * 4), sum);
    }
    node_barrier(nvl, nl, rank, gpu, p.timeout_cycles, p.error);

    // mine[g'] came from forwarder g': per source node n', then per local expert.
    const int* mine = nvl.template peer_ptr<int>(gpu, nl.notify);
    for (int e = threadIdx.x; e < local_experts && a.recv_expert_counter != nullptr; e += blockDim.x) {
        int sum = 0;
        for (int f = 0; f < G; ++f) sum += read_volatile(mine + f * kNvlNotifyInts + kMaxRdmaPeers + e);
        st_volatile(a.recv_expert_counter + e, ceil_div(sum, p.expert_alignment) * p.expert_alignment);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int s = 0; s < N * G; ++s) {  // global source rank s = (n', g')
            sum += read_volatile(mine + (s % G) * kNvlNotifyInts + s / G);
            a.recv_gbl_rank_prefix_sum[s] = sum;
        }
        if (a.recv_counter != nullptr) {  // nullptr with num_worst_tokens: the host reads no counts
            __threadfence_system();  // expert counts before the total the host polls on
            st_volatile(a.recv_counter, sum);
            __threadfence_system();
        }
    }
}

// Destination node m: per channel (one warp each) the tokens to m and to each GPU of m.
__device__ void channel_prefixes(const InternodeNotifyParams& p, const InternodeNotifyRankArgs& a, int m) {
    const int G = p.gpus, R = p.num_nodes * G, C = p.num_channels;
    EP_SHARED(int, per_channel, [kMaxChannels][kMaxNvlPeers + 1]);
    for (int c = warp_id(); c < C; c += blockDim.x / 32) {
        int begin, end;
        channel_range(a.num_tokens, C, c, &begin, &end);
        int to_gpu[kMaxNvlPeers] = {};
        int to_node = 0;
        for (int t = begin + lane_id(); t < end; t += 32) {
            bool any = false;
#pragma unroll
            for (int j = 0; j < kMaxNvlPeers; ++j) {
                if (j >= G) break;
                const bool in = a.is_token_in_rank[static_cast<int64_t>(t) * R + m * G + j];
                to_gpu[j] += in;
                any |= in;
            }
            to_node += any;
        }
#pragma unroll
        for (int j = 0; j <= kMaxNvlPeers; ++j) {
            int v = j < kMaxNvlPeers ? to_gpu[j] : to_node;
            for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
            if (lane_id() == 0) per_channel[c][j] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x <= static_cast<unsigned>(G)) {
        const int j = static_cast<int>(threadIdx.x);  // j == G: the node itself
        int* out = j < G ? a.gbl_channel_prefix_matrix + (m * G + j) * C : a.rdma_channel_prefix_matrix + m * C;
        const int column = j < G ? j : kMaxNvlPeers;
        int sum = 0;
        for (int c = 0; c < C; ++c) {
            sum += per_channel[c][column];
            out[c] = sum;
        }
    }
}

template <Backend B>
__global__ void __launch_bounds__(kNotifyThreads, 1) internode_notify_kernel(const __grid_constant__ InternodeNotifyParams p) {
    const int blocks_per_rank = 1 + p.num_nodes;
    const InternodeNotifyRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    const int role = static_cast<int>(blockIdx.x % blocks_per_rank);
    if (role == 0)
        exchange_counts<B>(p, a);
    else
        channel_prefixes(p, a, role - 1);
}

template <Backend B>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    internode_cached_notify_kernel(const __grid_constant__ InternodeCachedNotifyParams p) {
    constexpr Backend NB = nvl_backend_of<B>();
    const int blocks_per_rank = static_cast<int>(gridDim.x) / p.num_launch_ranks;
    const InternodeCachedNotifyRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    const int role = static_cast<int>(blockIdx.x % blocks_per_rank);
    const int N = p.num_nodes, G = p.gpus, C = p.num_channels, rank = a.peers.rank, gpu = a.peers.gpu;

    if (role == 0) {
        const RdmaTransport<B> rdma(a.peers);
        const Transport<NB> nvl(a.peers.nvl);
        rail_barrier(rdma, p.layout.rdma, rank, p.timeout_cycles, p.error);
        node_barrier(nvl, p.layout.nvl, rank, gpu, p.timeout_cycles, p.error);
        zero_internode_metadata(rdma, nvl, p.layout, gpu);
        rail_barrier(rdma, p.layout.rdma, rank, p.timeout_cycles, p.error);
        node_barrier(nvl, p.layout.nvl, rank, gpu, p.timeout_cycles, p.error);
        return;
    }
    if (!p.rewrite_heads) return;
    // Jobs: [0, C*N) columns of send_rdma_head per (channel, node); then C*N*G columns of send_nvl_head
    // per (channel, source node, GPU).
    const int warps = kNotifyThreads / 32;
    for (int job = (role - 1) * warps + warp_id(); job < C * N * (1 + G); job += (blocks_per_rank - 1) * warps) {
        if (job < C * N) {
            const int c = job / N, m = job % N;
            int begin, end;
            channel_range(a.num_tokens, C, c, &begin, &end);
            const int* prefix = a.rdma_channel_prefix_matrix + m * C;
            rewrite_heads(a.send_rdma_head, N, m, begin, end, prefix[c] - (c > 0 ? prefix[c - 1] : 0));
            continue;
        }
        const int k = job - C * N, c = k / (N * G), n = k / G % N, j = k % G;
        const int block = n > 0 ? a.recv_rdma_rank_prefix_sum[n - 1] : 0;
        const int* offsets = a.recv_rdma_channel_offset + n * C;
        const int begin = block + offsets[c];
        const int end = c + 1 < C ? block + offsets[c + 1] : a.recv_rdma_rank_prefix_sum[n];
        int present = 0;  // slots of a sub-stream are 0..present-1
        for (int i = begin + lane_id(); i < end; i += 32) present += a.send_nvl_head[static_cast<int64_t>(i) * G + j] >= 0;
        for (int offset = 16; offset > 0; offset /= 2) present += __shfl_xor_sync(0xffffffffu, present, offset);
        rewrite_heads(a.send_nvl_head, G, j, begin, end, present);
    }
}

}  // namespace

cudaError_t launch_internode_notify(const InternodeNotifyParams& p, Backend backend, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * (1 + p.num_nodes);
    return launch_by_backend(backend, internode_notify_kernel<Backend::kEmulated>,
                             internode_notify_kernel<Backend::kNvlink>,
                             EP_NVSHMEM_KERNEL(internode_notify_kernel<Backend::kNvshmem>), blocks, kNotifyThreads,
                             stream, p);
}

cudaError_t launch_internode_cached_notify(const InternodeCachedNotifyParams& p, Backend backend, cudaStream_t stream) {
    const int jobs = p.num_channels * p.num_nodes * (1 + p.gpus);
    const int blocks = p.num_launch_ranks * (1 + ceil_div(jobs, kNotifyThreads / 32));
    return launch_by_backend(backend, internode_cached_notify_kernel<Backend::kEmulated>,
                             internode_cached_notify_kernel<Backend::kNvlink>,
                             EP_NVSHMEM_KERNEL(internode_cached_notify_kernel<Backend::kNvshmem>), blocks, kNotifyThreads,
                             stream, p);
}

}  // namespace ep
