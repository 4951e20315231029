// Intranode dispatch. Grid: per rank 2C blocks; block 2c sends channel c, block 2c+1 receives it.
// Each block splits its warps into num_ranks equal groups, group g serving peer g:
//   sender group for peer d: publishes the channel's [start, end) for d into d's buffer, then walks
//     the channel's tokens in chunks of `chunk` records, records each token's slot in send_head
//     (-1 if the token does not go to d), copies record `slot` with warp `slot % group_warps`, and
//     publishes the tail after a group barrier;
//   receiver group for source s: waits for s's [start, end), then repeatedly takes the tail, copies
//     the records to rows block(s) + start + index (so rows are ordered by source rank, then token),
//     rewrites top-k ids to local expert ids (-1 elsewhere, weight 0) and publishes the head.
#include "device/launch.cuh"
#include "params/intranode.h"
#include "device/ring.cuh"
#include "device/transport.cuh"

namespace ep {

namespace {

constexpr int kThreads = kDispatchWarps * 32;

template <Backend B>
__device__ void send_record(const DispatchParams& p, const DispatchRankArgs& a, const Transport<B>& net, int dst,
                            int64_t offset, int token) {
    const RecordLayout& rec = p.record;
    net.put_warp(dst, offset, static_cast<const int4*>(a.x) + static_cast<int64_t>(token) * p.hidden_int4, p.hidden_int4);
    float* scales = net.template peer_ptr<float>(dst, offset + rec.scales_offset);
    for (int i = lane_id(); i < p.num_scales; i += 32)
        st_plain(scales + i, a.x_scales[token * a.scale_token_stride + i * a.scale_hidden_stride]);
    if (lane_id() == 0) st_plain(net.template peer_ptr<int>(dst, offset + rec.src_offset), token);
    if (a.topk_idx != nullptr && lane_id() < p.num_topk) {
        const int64_t k = static_cast<int64_t>(token) * p.num_topk + lane_id();
        st_plain(net.template peer_ptr<int>(dst, offset + rec.idx_offset) + lane_id(), static_cast<int>(a.topk_idx[k]));
        st_plain(net.template peer_ptr<float>(dst, offset + rec.weights_offset) + lane_id(), a.topk_weights[k]);
    }
}

template <Backend B>
__device__ void receive_record(const DispatchParams& p, const DispatchRankArgs& a, const uint8_t* slot, int row) {
    const RecordLayout& rec = p.record;
    const int4* src = reinterpret_cast<const int4*>(slot);
    int4* dst = static_cast<int4*>(a.recv_x) + static_cast<int64_t>(row) * p.hidden_int4;
    for (int i = lane_id(); i < p.hidden_int4; i += 32) dst[i] = ld_int4(src + i);
    const float* scales = reinterpret_cast<const float*>(slot + rec.scales_offset);
    for (int i = lane_id(); i < p.num_scales; i += 32) a.recv_x_scales[static_cast<int64_t>(row) * p.num_scales + i] = scales[i];
    if (lane_id() == 0) a.recv_src_idx[row] = *reinterpret_cast<const int*>(slot + rec.src_offset);
    if (a.recv_topk_idx != nullptr && lane_id() < p.num_topk) {
        const int local_experts = p.num_experts / p.num_ranks;
        const int expert = reinterpret_cast<const int*>(slot + rec.idx_offset)[lane_id()] - a.rank * local_experts;
        const bool local = expert >= 0 && expert < local_experts;
        const int64_t k = static_cast<int64_t>(row) * p.num_topk + lane_id();
        a.recv_topk_idx[k] = local ? expert : -1;
        a.recv_topk_weights[k] = local ? reinterpret_cast<const float*>(slot + rec.weights_offset)[lane_id()] : 0.0f;
    }
}

template <Backend B>
__device__ void dispatch_sender(const DispatchParams& p, const DispatchRankArgs& a, const Transport<B>& net, int channel) {
    constexpr Scope S = Transport<B>::kScope;
    const int num_ranks = p.num_ranks, me = a.rank, group_warps = kDispatchWarps / num_ranks;
    const int dst = warp_id() / group_warps, in_group = warp_id() % group_warps;
    const BufferLayout& layout = p.layout;
    const bool leader = in_group == 0 && lane_id() == 0;
    if (leader) {
        const int* prefix = a.channel_prefix_matrix + dst * p.num_channels;
        net.signal_store(dst, layout.word(layout.channel_start, channel, me), encode_count(channel > 0 ? prefix[channel - 1] : 0));
        net.signal_store(dst, layout.word(layout.channel_end, channel, me), encode_count(prefix[channel]));
    }
    int begin, end;
    channel_range(a.num_tokens, p.num_channels, channel, &begin, &end);
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleDispatchSender, me, channel, dst};
    const int* head_word = net.template peer_ptr<int>(me, layout.word(layout.head, channel, dst));
    int tail = 0, head = 0;
    // Every warp of the group walks the same tokens, so all agree on each token's slot.
    for (int token = begin; token < end;) {
        if (lane_id() == 0) head = wait_for_room<S>(head_word, tail, layout.capacity, p.chunk, head, ctx);
        head = __shfl_sync(0xffffffffu, head, 0);
        __syncwarp();
        for (int sent = 0; token < end && sent < p.chunk; ++token) {
            const bool to_dst = a.is_token_in_rank[static_cast<int64_t>(token) * num_ranks + dst];
            if (leader) a.send_head[static_cast<int64_t>(token) * num_ranks + dst] = to_dst ? tail : -1;
            if (!to_dst) continue;
            if (tail % group_warps == in_group) send_record(p, a, net, dst, layout.slot(channel, me, tail), token);
            ++tail, ++sent;
        }
        net.quiet();
        named_barrier(1 + dst, group_warps * 32);
        if (leader) net.signal_store(dst, layout.word(layout.tail, channel, me), tail);
    }
}

template <Backend B>
__device__ void dispatch_receiver(const DispatchParams& p, const DispatchRankArgs& a, const Transport<B>& net, int channel) {
    constexpr Scope S = Transport<B>::kScope;
    const int num_ranks = p.num_ranks, me = a.rank, group_warps = kDispatchWarps / num_ranks;
    const int src = warp_id() / group_warps, in_group = warp_id() % group_warps;
    const BufferLayout& layout = p.layout;
    const bool leader = in_group == 0 && lane_id() == 0;
    const WaitContext ctx{p.error, p.timeout_cycles, kRoleDispatchReceiver, me, channel, src};
    EP_SHARED(int, shared_tail, [kMaxRanks]);

    int start = 0, end = 0;
    if (lane_id() == 0) {
        start = wait_for_count<S>(net.template peer_ptr<int>(me, layout.word(layout.channel_start, channel, src)), ctx);
        end = wait_for_count<S>(net.template peer_ptr<int>(me, layout.word(layout.channel_end, channel, src)), ctx);
    }
    start = __shfl_sync(0xffffffffu, start, 0);
    end = __shfl_sync(0xffffffffu, end, 0);
    if (leader) a.recv_channel_offset[src * p.num_channels + channel] = start;
    const int first_row = (src > 0 ? a.rank_prefix_matrix[(src - 1) * num_ranks + me] : 0) + start;
    const int count = end - start;
    const int* tail_word = net.template peer_ptr<int>(me, layout.word(layout.tail, channel, src));

    for (int head = 0; head < count;) {
        if (leader) shared_tail[src] = wait_for_data<S>(tail_word, head, head, ctx);
        __syncwarp();  // bar.sync is aligned: the leader's warp reconverges after its spin first
        named_barrier(1 + src, group_warps * 32);
        const int tail = *reinterpret_cast<volatile int*>(&shared_tail[src]);
        for (int i = head + in_group; i < tail; i += group_warps)
            receive_record<B>(p, a, net.template peer_ptr<uint8_t>(me, layout.slot(channel, src, i)), first_row + i);
        named_barrier(1 + src, group_warps * 32);  // every record read before the head frees its slot
        if (leader) net.signal_store(src, layout.word(layout.head, channel, me), tail);
        head = tail;
    }
}

// With num_worst_tokens the outputs have more rows than received: their top-k ids become -1.
__device__ void clear_unused_rows(const DispatchParams& p, const DispatchRankArgs& a, int channel) {
    if (p.num_worst_tokens <= 0 || a.recv_topk_idx == nullptr) return;
    const int received = a.rank_prefix_matrix[(p.num_ranks - 1) * p.num_ranks + a.rank];
    const int64_t first = static_cast<int64_t>(received) * p.num_topk;
    const int64_t last = static_cast<int64_t>(p.num_worst_tokens) * p.num_topk;
    for (int64_t i = first + channel * kThreads + threadIdx.x; i < last; i += static_cast<int64_t>(p.num_channels) * kThreads) {
        a.recv_topk_idx[i] = -1;
        a.recv_topk_weights[i] = 0.0f;
    }
}

template <Backend B>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    const int blocks_per_rank = 2 * p.num_channels;
    const DispatchRankArgs& a = p.ranks[blockIdx.x / blocks_per_rank];
    if (a.rank == p.stalled_rank) return;
    if (p.num_worst_tokens > 0)
        check_worst_tokens(p.error, kRoleDispatchReceiver, a.rank,
                           a.rank_prefix_matrix[(p.num_ranks - 1) * p.num_ranks + a.rank], p.num_worst_tokens);
    const int channel = static_cast<int>(blockIdx.x % blocks_per_rank) / 2;
    const Transport<B> net(a.peers);
    if (warp_id() >= (kDispatchWarps / p.num_ranks) * p.num_ranks) return;
    if (blockIdx.x % 2 == 0) {
        dispatch_sender(p, a, net, channel);
    } else {
        clear_unused_rows(p, a, channel);
        dispatch_receiver(p, a, net, channel);
    }
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, Backend backend, cudaStream_t stream) {
    const int blocks = p.num_launch_ranks * 2 * p.num_channels;
    if (backend == Backend::kEmulated)
        return launch_cooperative(dispatch_kernel<Backend::kEmulated>, blocks, kThreads, stream, p);
    return launch_cooperative(dispatch_kernel<Backend::kNvlink>, blocks, kThreads, stream, p);
}

}  // namespace ep
