// Intranode notify kernels.
// notify_dispatch: block 0 of each rank exchanges counts (barrier, put own row of per-rank counts
//   and per-local-expert counts into every peer, zero own ring metadata, barrier), then derives
//   rank_prefix_matrix and publishes the receive counts to host-mapped memory. Blocks 1..R compute
//   channel_prefix_matrix, one destination rank each.
// cached_notify: block 0 barriers, zeroes the ring metadata and barriers again (used before a
//   cached dispatch and before combine); the other blocks rewrite send_head for combine: every -1
//   becomes -(next present slot)-1, the channel's count past the last present token, so that a
//   combine reducer can advance its head over tokens absent from a ring without waiting.
#include "device/heads.cuh"
#include "device/launch.cuh"
#include "params/intranode.h"
#include "device/sync.cuh"

namespace ep {

namespace {

__device__ __forceinline__ int read_volatile(const int* ptr) { return *reinterpret_cast<const volatile int*>(ptr); }

template <Backend B>
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_dispatch_kernel(const __grid_constant__ NotifyParams p) {
    const int blocks_per_rank = 1 + p.num_ranks;
    const NotifyRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    const int role = static_cast<int>(blockIdx.x % blocks_per_rank);
    const int num_ranks = p.num_ranks, me = a.rank;
    const Transport<B> net(a.peers);
    const BufferLayout& layout = p.layout;

    if (role == 0) {
        const int local_experts = p.num_experts / num_ranks;
        rank_barrier(net, layout, me, num_ranks, p.timeout_cycles, p.error);  // the previous op is over everywhere
        for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
            const int dst = i / num_ranks, col = i % num_ranks;
            st_plain(net.template peer_ptr<int>(dst, layout.notify_rank + (me * kMaxRanks + col) * 4), a.num_tokens_per_rank[col]);
        }
        for (int i = threadIdx.x; i < num_ranks * local_experts; i += blockDim.x) {
            const int dst = i / local_experts, e = i % local_experts;
            st_plain(net.template peer_ptr<int>(dst, layout.notify_expert + (static_cast<int64_t>(me) * kMaxLocalExperts + e) * 4),
                     a.num_tokens_per_expert[i]);
        }
        zero_ring_metadata(net, layout, me);
        rank_barrier(net, layout, me, num_ranks, p.timeout_cycles, p.error);

        const int* rows = net.template peer_ptr<int>(me, layout.notify_rank);
        if (threadIdx.x < num_ranks) {
            const int col = static_cast<int>(threadIdx.x);
            int sum = 0;
            for (int src = 0; src < num_ranks; ++src) {
                sum += read_volatile(rows + src * kMaxRanks + col);
                a.rank_prefix_matrix[src * num_ranks + col] = sum;
            }
        }
        if (a.recv_counter == nullptr) return;  // num_worst_tokens: the host reads no counts
        const int* experts = net.template peer_ptr<int>(me, layout.notify_expert);
        for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
            int sum = 0;
            for (int src = 0; src < num_ranks; ++src) sum += read_volatile(experts + src * kMaxLocalExperts + e);
            const int aligned = (sum + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
            st_volatile(a.recv_expert_counter + e, aligned);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int src = 0; src < num_ranks; ++src) total += read_volatile(rows + src * kMaxRanks + me);
            __threadfence_system();  // expert counts before the total the host polls on
            st_volatile(a.recv_counter, total);
            __threadfence_system();
        }
        return;
    }

    // Channel prefix for destination rank `dst`: one warp per channel, then a serial scan.
    const int dst = role - 1;
    EP_SHARED(int, per_channel, [kMaxChannels]);
    for (int c = warp_id(); c < p.num_channels; c += blockDim.x / 32) {
        int begin, end;
        channel_range(a.num_tokens, p.num_channels, c, &begin, &end);
        int count = 0;
        for (int t = begin + lane_id(); t < end; t += 32) count += a.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + dst];
        for (int offset = 16; offset > 0; offset /= 2) count += __shfl_xor_sync(0xffffffffu, count, offset);
        if (lane_id() == 0) per_channel[c] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int c = 0; c < p.num_channels; ++c) {
            sum += per_channel[c];
            a.channel_prefix_matrix[dst * p.num_channels + c] = sum;
        }
    }
}

template <Backend B>
__global__ void __launch_bounds__(kNotifyThreads, 1) cached_notify_kernel(const __grid_constant__ CachedNotifyParams p) {
    const int blocks_per_rank = static_cast<int>(gridDim.x) / p.num_launch_ranks;
    const CachedNotifyRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    const int role = static_cast<int>(blockIdx.x % blocks_per_rank);
    const Transport<B> net(a.peers);

    if (role == 0) {
        rank_barrier(net, p.layout, a.rank, p.num_ranks, p.timeout_cycles, p.error);
        zero_ring_metadata(net, p.layout, a.rank);
        rank_barrier(net, p.layout, a.rank, p.num_ranks, p.timeout_cycles, p.error);
        return;
    }
    if (a.send_head == nullptr) return;
    const int warps = kNotifyThreads / 32;
    for (int job = (role - 1) * warps + warp_id(); job < p.num_channels * p.num_ranks; job += (blocks_per_rank - 1) * warps) {
        const int channel = job / p.num_ranks, rank = job % p.num_ranks;
        int begin, end;
        channel_range(a.num_tokens, p.num_channels, channel, &begin, &end);
        const int* prefix = a.channel_prefix_matrix + rank * p.num_channels;
        const int count = prefix[channel] - (channel > 0 ? prefix[channel - 1] : 0);
        rewrite_heads(a.send_head, p.num_ranks, rank, begin, end, count);
    }
}

}  // namespace

cudaError_t launch_notify_dispatch(const NotifyParams& p, Backend backend, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * (1 + p.num_ranks);
    if (backend == Backend::kEmulated)
        return launch_cooperative(notify_dispatch_kernel<Backend::kEmulated>, blocks, kNotifyThreads, stream, p);
    return launch_cooperative(notify_dispatch_kernel<Backend::kNvlink>, blocks, kNotifyThreads, stream, p);
}

cudaError_t launch_cached_notify(const CachedNotifyParams& p, Backend backend, cudaStream_t stream) {
    const int rewrite_blocks = ceil_div(p.num_channels * p.num_ranks, kNotifyThreads / 32);
    const int blocks = p.num_launch_ranks * (1 + rewrite_blocks);
    if (backend == Backend::kEmulated)
        return launch_cooperative(cached_notify_kernel<Backend::kEmulated>, blocks, kNotifyThreads, stream, p);
    return launch_cooperative(cached_notify_kernel<Backend::kNvlink>, blocks, kNotifyThreads, stream, p);
}

}  // namespace ep
