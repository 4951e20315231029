// Intranode combine: the rows a rank received in dispatch go back to their source ranks and are
// summed there (unweighted, fp32 accumulation, rank order 0..R-1). Grid: per rank 2C blocks.
//   sender block (2c): warp group g pushes the channel-c rows that came from rank g, in row
//     order, into the ring (channel c, from me) in g's buffer; ring slot = the token's dispatch slot;
//   receiver block (2c+1): warp 0 keeps the heads (per peer, the minimum over the reducer warps of
//     the next slot each still needs, released into the producer's buffer); warps 1.. reduce the
//     channel's tokens (strided): lane r reads send_head[t][r] (slot, or -(next present slot)-1
//     after the cached notify), announces it, waits for the data if present, then the warp sums.
#include <climits>

#include "device/launch.cuh"
#include "params/intranode.h"
#include "device/ring.cuh"
#include "device/transport.cuh"
#include "device/vec.cuh"

namespace ep {

namespace {

constexpr int kThreads = kCombineWarps * 32;

template <Backend B>
__device__ void combine_sender(const CombineParams& p, const CombineRankArgs& a, const Transport<B>& net, int channel) {
    constexpr Scope S = Transport<B>::kScope;
    const int num_ranks = p.num_ranks, me = a.rank, group_warps = kCombineWarps / num_ranks;
    const int dst = warp_id() / group_warps, in_group = warp_id() % group_warps;
    const BufferLayout& layout = p.layout;
    const bool leader = in_group == 0 && lane_id() == 0;
    const int block_begin = dst > 0 ? a.rank_prefix_matrix[(dst - 1) * num_ranks + me] : 0;
    const int block_rows = a.rank_prefix_matrix[dst * num_ranks + me] - block_begin;
    const int* offsets = a.recv_channel_offset + dst * p.num_channels;
    const int start = offsets[channel];
    const int count = (channel + 1 < p.num_channels ? offsets[channel + 1] : block_rows) - start;
    const int first_row = block_begin + start;
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleCombineSender, me, channel, dst};
    const int* head_word = net.template peer_ptr<int>(me, layout.word(layout.head, channel, dst));

    int head = 0;
    for (int tail = 0; tail < count;) {
        if (lane_id() == 0) head = wait_for_room<S>(head_word, tail, layout.capacity, p.chunk, head, ctx);
        head = __shfl_sync(0xffffffffu, head, 0);
        __syncwarp();
        const int n = min(p.chunk, count - tail);
        for (int j = in_group; j < n; j += group_warps) {
            const int row = first_row + tail + j;
            const int64_t offset = layout.slot(channel, me, tail + j);
            net.put_warp(dst, offset, static_cast<const int4*>(a.x) + static_cast<int64_t>(row) * p.hidden_int4, p.hidden_int4);
            if (lane_id() < p.num_topk)
                st_plain(net.template peer_ptr<float>(dst, offset + p.record.weights_offset) + lane_id(),
                         a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(row) * p.num_topk + lane_id()] : 0.0f);
        }
        tail += n;
        net.quiet();
        named_barrier(1 + dst, group_warps * 32);
        if (leader) net.signal_store(dst, layout.word(layout.tail, channel, me), tail);
    }
}

template <Backend B, typename T>
__device__ void combine_receiver(const CombineParams& p, const CombineRankArgs& a, const Transport<B>& net, int channel) {
    constexpr Scope S = Transport<B>::kScope;
    const int num_ranks = p.num_ranks, me = a.rank;
    const BufferLayout& layout = p.layout;
    // next_slot[w][r]: the smallest slot of ring r that reducer w may still read.
    EP_SHARED(volatile int, next_slot, [kCombineWarps][kMaxRanks]);
    EP_SHARED(volatile int, retired, [kCombineWarps]);
    for (int i = threadIdx.x; i < kCombineWarps * kMaxRanks; i += blockDim.x) next_slot[i / kMaxRanks][i % kMaxRanks] = 0;
    if (threadIdx.x < kCombineWarps) retired[threadIdx.x] = 0;
    __syncthreads();

    int begin, end;
    channel_range(a.num_tokens, p.num_channels, channel, &begin, &end);
    const int lane = lane_id();

    if (warp_id() < kCombineKeeperWarps) {
        const WaitContext ctx{p.error, p.timeout_cycles, kRoleCombineKeeper, me, channel, lane};
        SpinBudget spin(ctx.timeout_cycles);
        int published = 0;
        while (true) {
            int lowest = INT_MAX;
            bool all_retired = true;
            for (int w = kCombineKeeperWarps; w < kCombineWarps; ++w) {
                if (retired[w]) continue;
                all_retired = false;
                if (lane < num_ranks) lowest = min(lowest, next_slot[w][lane]);
            }
            if (all_retired) break;  // every record was read; producers are done
            __threadfence_block();
            if (lane < num_ranks && lowest != INT_MAX && lowest > published) {
                net.signal_store(lane, layout.word(layout.head, channel, me), lowest);
                published = lowest;
            }
            if (spin.expired()) report_timeout(ctx.error, ctx.role, me, channel, lane, published, lowest, -1);
        }
        return;
    }

    using V = Vec<T>;
    const int reducer = warp_id() - kCombineKeeperWarps, num_reducers = kCombineWarps - kCombineKeeperWarps;
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleCombineReceiver, me, channel, lane};
    for (int token = begin + reducer; token < end; token += num_reducers) {
        const int slot = lane < num_ranks ? a.send_head[static_cast<int64_t>(token) * num_ranks + lane] : -1;
        // Every lane's reads of the previous token's slots are done before lane r releases ring r's slot
        // (the lanes need not run in step: the fence alone orders only the releasing lane's own reads).
        __syncwarp();
        __threadfence_block();
        if (lane < num_ranks) {
            next_slot[warp_id()][lane] = slot >= 0 ? slot : -slot - 1;
            if (slot >= 0)
                wait_for_data<S>(net.template peer_ptr<int>(me, layout.word(layout.tail, channel, lane)), slot, slot, ctx);
        }
        __syncwarp();
        int slots[kMaxRanks];
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) slots[r] = __shfl_sync(0xffffffffu, slot, r);

        int4* out = static_cast<int4*>(a.combined_x) + static_cast<int64_t>(token) * p.hidden_int4;
        for (int i = lane; i < p.hidden_int4; i += 32) {
            float acc[V::kElems] = {};
#pragma unroll
            for (int r = 0; r < kMaxRanks; ++r) {
                if (r >= num_ranks || slots[r] < 0) continue;
                V::add(acc, ld_int4(net.template peer_ptr<int4>(me, layout.slot(channel, r, slots[r])) + i));
            }
            out[i] = V::pack(acc);
        }
        if (a.combined_topk_weights != nullptr && lane < p.num_topk) {
            float sum = 0.0f;
#pragma unroll
            for (int r = 0; r < kMaxRanks; ++r) {
                if (r >= num_ranks || slots[r] < 0) continue;
                sum += net.template peer_ptr<float>(me, layout.slot(channel, r, slots[r]) + p.record.weights_offset)[lane];
            }
            a.combined_topk_weights[static_cast<int64_t>(token) * p.num_topk + lane] = sum;
        }
    }
    __syncwarp();
    __threadfence_block();
    if (lane == 0) retired[warp_id()] = 1;
}

template <Backend B, typename T>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    const int blocks_per_rank = 2 * p.num_channels;
    const CombineRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    if (a.rank == p.stalled_rank) return;
    const int channel = static_cast<int>(blockIdx.x % blocks_per_rank) / 2;
    const Transport<B> net(a.peers);
    if (blockIdx.x % 2 == 0) {
        if (warp_id() < (kCombineWarps / p.num_ranks) * p.num_ranks) combine_sender(p, a, net, channel);
    } else {
        combine_receiver<B, T>(p, a, net, channel);
    }
}

template <Backend B>
cudaError_t launch_for_backend(const CombineParams& p, Payload payload, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * 2 * p.num_channels;
    if (payload == Payload::kBF16) return launch_cooperative(combine_kernel<B, __nv_bfloat16>, blocks, kThreads, stream, p);
    return launch_cooperative(combine_kernel<B, float>, blocks, kThreads, stream, p);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, Backend backend, Payload payload, cudaStream_t stream) {
    if (backend == Backend::kEmulated) return launch_for_backend<Backend::kEmulated>(p, payload, stream);
    return launch_for_backend<Backend::kNvlink>(p, payload, stream);
}

}  // namespace ep
