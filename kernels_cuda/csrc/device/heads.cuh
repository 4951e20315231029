// The negative-head rewrite before combine (intranode send_head, internode send_rdma_head and
// send_nvl_head): in one column of a head table, every -1 (token absent from that ring) becomes
// -(next present slot)-1, or -(past_end)-1 after the last present token, so that a consuming warp
// can advance its announced head over absent tokens without waiting (the head coordinators take
// the minimum over warps; a warp stuck on an absent token would stall its producer).
#pragma once
#include <climits>
#include <cstdint>

#include "device/ptx.cuh"

namespace ep {

// One warp rewrites rows [begin, end) of column `column` of a table with `stride` ints per row,
// scanning 32 rows at a time from the end with a suffix minimum of present slots.
__device__ inline void rewrite_heads(int* table, int stride, int column, int begin, int end, int past_end) {
    int next = past_end;
    for (int stop = end; stop > begin; stop -= 32) {
        const int t = stop - 32 + lane_id();
        const bool valid = t >= begin;
        const int stored = valid ? table[static_cast<int64_t>(t) * stride + column] : -1;
        int present = stored >= 0 ? stored : INT_MAX;
        for (int offset = 1; offset < 32; offset *= 2) {
            const int other = __shfl_down_sync(0xffffffffu, present, offset);
            if (lane_id() + offset < 32) present = min(present, other);
        }
        // For an absent row the inclusive suffix minimum is that of the later rows.
        const int target = min(present, next);
        if (valid && stored < 0) table[static_cast<int64_t>(t) * stride + column] = -target - 1;
        next = min(next, __shfl_sync(0xffffffffu, present, 0));
    }
}

}  // namespace ep
