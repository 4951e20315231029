// Low-latency dispatch (DeepEP's decoding kernel, shared/reference/deepep.md §5): no rings, no
// forwarding; every (token, expert) copy is one message into a fixed slot of its destination.
// Grid: per rank `num_channels` blocks of kLowLatencyWarps warps.
//   send phase: block b takes tokens b, b + blocks, ...; all warps stage the token's message (with FP8,
//     cast per 128 channels, one warp per block of channels: amax over the warp, scale = amax / 448
//     (floor 1e-4, optionally rounded up to a power of two), e4m3 = round(x / scale)); then warp k
//     copies it for the token's k-th expert e into the destination's [e % E_local][me][slot], the slot
//     from an atomic counter of e, and counts the copy finished. Expert e's owner (block e % blocks)
//     counts this rank's copies to e, waits until they are all finished and the next half is clean,
//     then releases -count-1 into the destination's count word (e % E_local, me).
//   receive phase: warp w takes (local expert, source) pairs: waits for the count, takes `begin` with
//     an atomic on packed_recv_count, writes layout_range and unpacks rows, scales (column-major;
//     UE8M0 packs the exponent bytes) and source indices. Rows of a source land in slot order, the
//     sources in arrival order.
#include "device/launch.cuh"
#include "device/low_latency.cuh"

namespace ep {

namespace {

// Stages token t's message: header, then the e4m3 row and its scales, or the bfloat16 row.
__device__ void stage_token(const LowLatencyParams& p, const LowLatencyRankArgs& a, uint8_t* message, int t) {
    const int hidden = p.hidden, lane = lane_id();
    if (threadIdx.x == 0) st_plain(reinterpret_cast<int*>(message), t);
    if (!p.use_fp8) {
        const int4* row = static_cast<const int4*>(a.x) + static_cast<int64_t>(t) * hidden * 2 / 16;
        int4* payload = reinterpret_cast<int4*>(message + kLowLatencyHeaderBytes);
        for (int i = threadIdx.x; i < hidden * 2 / 16; i += blockDim.x) st_int4(payload + i, ld_int4(row + i));
        return;
    }
    const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(a.x) + static_cast<int64_t>(t) * hidden;
    float* scales = reinterpret_cast<float*>(message + kLowLatencyHeaderBytes + hidden);
    for (int block = warp_id(); block < hidden / 128; block += kLowLatencyWarps) {
        float v[4];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = __bfloat162float(row[block * 128 + lane * 4 + i]);
            amax = fmaxf(amax, fabsf(v[i]));
        }
#pragma unroll
        for (int mask = 16; mask > 0; mask >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
        float scale = div_rn(fmaxf(amax, kAmaxFloor), kE4m3Max);
        if (p.round_scale) scale = power_of_two_ceil(scale);
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            packed |= float_to_e4m3(fminf(fmaxf(div_rn(v[i], scale), -kE4m3Max), kE4m3Max)) << (8 * i);
        st_plain(reinterpret_cast<uint32_t*>(message + kLowLatencyHeaderBytes + block * 128 + lane * 4), packed);
        if (lane == 0) st_plain(scales + block, scale);
    }
}

template <Backend B>
__device__ void dispatch_send(const LowLatencyParams& p, const LowLatencyRankArgs& a, const LowLatencyTransport<B>& net, int block) {
    const LowLatencyLayout& l = p.layout;
    const int me = a.rank, num_topk = p.num_topk, local_experts = p.num_experts / p.num_ranks;
    uint8_t* own = net.template peer_ptr<uint8_t>(me, 0);
    int* slot_counter = reinterpret_cast<int*>(own + l.slot_counter);
    int* finish_counter = reinterpret_cast<int*>(own + l.finish_counter);
    const int payload = p.use_fp8 ? p.hidden + 4 * (p.hidden / 128) : 2 * p.hidden;
    const int message_int4 = (kLowLatencyHeaderBytes + payload + 15) / 16;
    clean_next_half(p, own, block);

    for (int t = block; t < a.num_tokens; t += p.num_channels) {
        uint8_t* message = own + l.send_stage + static_cast<int64_t>(t) * l.message_bytes;
        stage_token(p, a, message, t);
        __syncthreads();
        if (warp_id() >= num_topk) continue;
        const int64_t expert = a.topk_idx[static_cast<int64_t>(t) * num_topk + warp_id()];
        if (expert < 0) continue;
        int slot = lane_id() == 0 ? atomicAdd(slot_counter + expert, 1) : 0;
        slot = __shfl_sync(0xffffffffu, slot, 0);
        const int dst = static_cast<int>(expert) / local_experts, local = static_cast<int>(expert) % local_experts;
        const int64_t offset = half_offset(p, p.half) + l.dispatch_recv +
                               ((static_cast<int64_t>(local) * p.num_ranks + me) * p.max_tokens + slot) * l.message_bytes;
        net.put_warp(dst, offset, reinterpret_cast<const int4*>(message), message_int4);
        __syncwarp();
        if (lane_id() == 0) {
            net.quiet();
            atomicAdd(finish_counter + expert, 1);
        }
    }

    // Owners: expert e belongs to block e % blocks, warp (e / blocks) % warps.
    const int lane = lane_id(), total = a.num_tokens * num_topk;
    for (int expert = block + p.num_channels * warp_id(); expert < p.num_experts;
         expert += p.num_channels * kLowLatencyWarps) {
        int count = 0;
        for (int i = lane; i < total; i += 32) count += a.topk_idx[i] == expert ? 1 : 0;
#pragma unroll
        for (int mask = 16; mask > 0; mask >>= 1) count += __shfl_xor_sync(0xffffffffu, count, mask);
        if (lane == 0) {
            const int dst = expert / local_experts, local = expert % local_experts;
            const WaitContext ctx{p.error, p.timeout_cycles, kRoleLowLatencyDispatchSender, me, local, dst};
            SpinBudget spin(ctx.timeout_cycles);
            int finished;
            while ((finished = ld_acquire<Scope::kGpu>(finish_counter + expert)) != count) {
                if (spin.expired()) report_timeout(ctx.error, ctx.role, me, local, dst, finished, 0, count);
            }
            wait_for_clean(p, own, ctx);
            st_plain(finish_counter + expert, 0);  // read again only by the next op's launch
            st_plain(slot_counter + expert, 0);
            net.signal_store(dst, half_offset(p, p.half) + l.dispatch_count +
                                      (static_cast<int64_t>(local) * p.num_ranks + me) * 4,
                             encode_count(count));
        }
        __syncwarp();
    }
}

template <Backend B>
__device__ void dispatch_recv(const LowLatencyParams& p, const LowLatencyRankArgs& a, const LowLatencyTransport<B>& net, int block) {
    constexpr Scope S = LowLatencyTransport<B>::kScope;
    const LowLatencyLayout& l = p.layout;
    const int me = a.rank, lane = lane_id(), R = p.num_ranks, local_experts = p.num_experts / R;
    const int64_t slots = static_cast<int64_t>(R) * p.max_tokens;
    const int num_scales = p.hidden / 128;
    const uint8_t* half = net.template peer_ptr<uint8_t>(me, half_offset(p, p.half));
    for (int pair = block * kLowLatencyWarps + warp_id(); pair < local_experts * R;
         pair += p.num_channels * kLowLatencyWarps) {
        const int local = pair / R, src = pair % R;
        int count = 0, begin = 0;
        if (lane == 0) {
            const WaitContext ctx{p.error, p.timeout_cycles, kRoleLowLatencyDispatchReceiver, me, local, src};
            count = wait_for_count<S>(reinterpret_cast<const int*>(half + l.dispatch_count) + pair, ctx);
            begin = atomicAdd(a.packed_count + local, count);
            a.layout_range[pair] = (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(count);
            if (a.stats != nullptr) atomicAdd(a.stats + local, count);
        }
        count = __shfl_sync(0xffffffffu, count, 0);
        begin = __shfl_sync(0xffffffffu, begin, 0);
        __syncwarp();  // the lanes read the messages after lane 0's acquire of the count
        for (int j = 0; j < count; ++j) {
            const uint8_t* message = half + l.dispatch_recv + (static_cast<int64_t>(pair) * p.max_tokens + j) * l.message_bytes;
            const int64_t row = local * slots + begin + j;
            if (lane == 0) a.src_info[row] = *reinterpret_cast<const int*>(message);
            const int row_bytes = p.use_fp8 ? p.hidden : 2 * p.hidden;
            const int4* data = reinterpret_cast<const int4*>(message + kLowLatencyHeaderBytes);
            int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.packed_x) + row * row_bytes);
            for (int i = lane; i < row_bytes / 16; i += 32) out[i] = ld_int4(data + i);
            if (!p.use_fp8) continue;
            const float* scales = reinterpret_cast<const float*>(message + kLowLatencyHeaderBytes + p.hidden);
            if (p.use_ue8m0) {  // 4 exponent bytes per int32, column-major [E_local, S / 4, R * T_max]
                for (int s = lane; s < num_scales / 4; s += 32) {
                    int packed = 0;
#pragma unroll
                    for (int i = 0; i < 4; ++i) packed |= ((__float_as_int(scales[4 * s + i]) >> 23) & 0xff) << (8 * i);
                    static_cast<int*>(a.packed_scales)[(local * (num_scales / 4) + s) * slots + begin + j] = packed;
                }
            } else {  // column-major [E_local, S, R * T_max]
                for (int s = lane; s < num_scales; s += 32)
                    static_cast<float*>(a.packed_scales)[(local * num_scales + s) * slots + begin + j] = scales[s];
            }
        }
    }
}

template <Backend B>
__global__ void __launch_bounds__(kLowLatencyThreads, 1) low_latency_dispatch_kernel(const __grid_constant__ LowLatencyParams p) {
    const LowLatencyRankArgs& a = p.ranks[blockIdx.x / p.num_channels];
    const int block = static_cast<int>(blockIdx.x % p.num_channels);
    const LowLatencyTransport<B> net(a.peers);
    if (p.phases & kLowLatencySendPhase) dispatch_send(p, a, net, block);
    if (p.phases & kLowLatencyRecvPhase) dispatch_recv(p, a, net, block);
}

}  // namespace

cudaError_t launch_low_latency_dispatch(const LowLatencyParams& p, Backend backend, cudaStream_t stream) {
    return launch_by_backend(backend, low_latency_dispatch_kernel<Backend::kEmulated>, low_latency_dispatch_kernel<Backend::kNvlink>,
                             EP_NVSHMEM_KERNEL(low_latency_dispatch_kernel<Backend::kNvshmem>), p.num_launch_ranks * p.num_channels,
                             kLowLatencyThreads, stream, p);
}

}  // namespace ep
