// Low-latency combine (shared/reference/deepep.md §5): the expert outputs go back to their source
// ranks by peer stores into fixed slots, and each source sums its tokens' K rows with their weights.
// Grid: per rank `num_channels` blocks of kLowLatencyWarps warps.
//   send phase: warp w takes (local expert, destination) pairs: rows [begin, begin + count) of the
//     dispatch's layout_range go to the destination's combine_recv[global expert][source token]; then,
//     once the next half is clean, a flag of the global expert on the destination (+1, release). Every
//     expert flags every rank, with or without rows.
//   receive phase: each block waits for all E flags, then its warps take tokens: out[t] =
//     sum over k of w[t][k] * row(expert k, t), in fp32, in k order, rounded once to bfloat16.
#include "device/launch.cuh"
#include "device/low_latency.cuh"
#include "device/vec.cuh"

namespace ep {

namespace {

template <Backend B>
__device__ void combine_send(const LowLatencyParams& p, const LowLatencyRankArgs& a, const LowLatencyTransport<B>& net, int block) {
    const LowLatencyLayout& l = p.layout;
    const int me = a.rank, R = p.num_ranks, local_experts = p.num_experts / R;
    const int row_int4 = p.hidden * 2 / 16;
    const int64_t slots = static_cast<int64_t>(R) * p.max_tokens;
    uint8_t* own = net.template peer_ptr<uint8_t>(me, 0);
    clean_next_half(p, own, block);
    for (int pair = block * kLowLatencyWarps + warp_id(); pair < local_experts * R;
         pair += p.num_channels * kLowLatencyWarps) {
        const int local = pair / R, dst = pair % R, expert = me * local_experts + local;
        const int64_t range = a.layout_range[pair];
        const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffffLL);
        for (int j = 0; j < count; ++j) {
            const int64_t row = local * slots + begin + j;
            const int token = a.src_info[row];
            const int64_t offset = half_offset(p, p.half) + l.combine_recv +
                                   (static_cast<int64_t>(expert) * p.max_tokens + token) * p.hidden * 2;
            net.put_warp(dst, offset, static_cast<const int4*>(a.x) + row * row_int4, row_int4);
        }
        __syncwarp();
        if (lane_id() == 0) {
            net.quiet();
            wait_for_clean(p, own, WaitContext{p.error, p.timeout_cycles, kRoleLowLatencyCombineSender, me, local, dst});
            net.signal_add(dst, half_offset(p, p.half) + l.combine_flag + static_cast<int64_t>(expert) * 4, 1);
        }
        __syncwarp();
    }
}

template <Backend B>
__device__ void combine_recv(const LowLatencyParams& p, const LowLatencyRankArgs& a, const LowLatencyTransport<B>& net, int block) {
    constexpr Scope S = LowLatencyTransport<B>::kScope;
    const LowLatencyLayout& l = p.layout;
    const int me = a.rank, local_experts = p.num_experts / p.num_ranks, num_topk = p.num_topk;
    const uint8_t* half = net.template peer_ptr<uint8_t>(me, half_offset(p, p.half));
    const int* flags = reinterpret_cast<const int*>(half + l.combine_flag);
    for (int expert = threadIdx.x; expert < p.num_experts; expert += blockDim.x) {
        const WaitContext ctx{p.error, p.timeout_cycles, kRoleLowLatencyCombineReceiver, me,
                              expert % local_experts, expert / local_experts};
        SpinBudget spin(ctx.timeout_cycles);
        while (ld_acquire<S>(flags + expert) == 0) {
            if (spin.expired()) report_timeout(ctx.error, ctx.role, me, ctx.channel, ctx.peer, 0, 0, 1);
        }
    }
    __syncthreads();

    using V = Vec<__nv_bfloat16>;
    const int row_int4 = p.hidden * 2 / 16;
    const int4* rows = reinterpret_cast<const int4*>(half + l.combine_recv);
    for (int t = block * kLowLatencyWarps + warp_id(); t < a.num_tokens; t += p.num_channels * kLowLatencyWarps) {
        const int64_t* idx = a.topk_idx + static_cast<int64_t>(t) * num_topk;
        const float* weights = a.topk_weights + static_cast<int64_t>(t) * num_topk;
        int4* out = static_cast<int4*>(a.combined_x) + static_cast<int64_t>(t) * row_int4;
        for (int i = lane_id(); i < row_int4; i += 32) {
            float acc[V::kElems] = {};
            for (int k = 0; k < num_topk; ++k) {
                const int64_t expert = idx[k];
                if (expert < 0) continue;
                const int4 v = ld_int4(rows + (expert * p.max_tokens + t) * row_int4 + i);
                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(h[e]);
                    acc[2 * e] = add_rn(acc[2 * e], mul_rn(weights[k], f.x));
                    acc[2 * e + 1] = add_rn(acc[2 * e + 1], mul_rn(weights[k], f.y));
                }
            }
            out[i] = V::pack(acc);
        }
    }
}

template <Backend B>
__global__ void __launch_bounds__(kLowLatencyThreads, 1) low_latency_combine_kernel(const __grid_constant__ LowLatencyParams p) {
    const LowLatencyRankArgs& a = p.ranks[blockIdx.x / p.num_channels];
    const int block = static_cast<int>(blockIdx.x % p.num_channels);
    const LowLatencyTransport<B> net(a.peers);
    if (p.phases & kLowLatencySendPhase) combine_send(p, a, net, block);
    if (p.phases & kLowLatencyRecvPhase) combine_recv(p, a, net, block);
}

}  // namespace

cudaError_t launch_low_latency_combine(const LowLatencyParams& p, Backend backend, cudaStream_t stream) {
    return launch_by_backend(backend, low_latency_combine_kernel<Backend::kEmulated>, low_latency_combine_kernel<Backend::kNvlink>,
                             EP_NVSHMEM_KERNEL(low_latency_combine_kernel<Backend::kNvshmem>), p.num_launch_ranks * p.num_channels,
                             kLowLatencyThreads, stream, p);
}

}  // namespace ep
