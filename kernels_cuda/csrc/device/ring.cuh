// Ring-buffer waits shared by the intranode kernels (rules mirrored by kernels_cuda/protocol_model.py):
//   producer: before each chunk, wait until capacity - (tail - head) >= chunk, write the records,
//             fence, group barrier, then one thread release-stores the new tail in the consumer;
//   consumer: acquire-load the tail (local), read the records, then release-store the head in
//             the producer. Counts (channel start/end) arrive first, -v-1 encoded.
#pragma once
#include "device/diag.cuh"
#include "device/ptx.cuh"

namespace ep {

struct WaitContext {
    ErrorRecord* error;
    long long timeout_cycles;
    int role;
    int rank;
    int channel;
    int peer;
};

// Returns the head once the ring has room for `chunk` more records past `tail`.
template <Scope S>
__device__ __forceinline__ int wait_for_room(const int* head_word, int tail, int capacity, int chunk, int cached_head,
                                             const WaitContext& ctx) {
    if (capacity - (tail - cached_head) >= chunk) return cached_head;
    SpinBudget spin(ctx.timeout_cycles);
    int head;
    while (capacity - (tail - (head = ld_acquire<S>(head_word))) < chunk) {
        if (spin.expired()) report_timeout(ctx.error, ctx.role, ctx.rank, ctx.channel, ctx.peer, head, tail, tail + chunk - capacity);
    }
    return head;
}

// Returns the tail once it is greater than `index`.
template <Scope S>
__device__ __forceinline__ int wait_for_data(const int* tail_word, int head, int index, const WaitContext& ctx) {
    SpinBudget spin(ctx.timeout_cycles);
    int tail;
    while ((tail = ld_acquire<S>(tail_word)) <= index) {
        if (spin.expired()) report_timeout(ctx.error, ctx.role, ctx.rank, ctx.channel, ctx.peer, head, tail, index + 1);
    }
    return tail;
}

// Returns the decoded value once the -v-1 encoded word has arrived (is non-zero).
template <Scope S>
__device__ __forceinline__ int wait_for_count(const int* word, const WaitContext& ctx) {
    SpinBudget spin(ctx.timeout_cycles);
    int stored;
    while ((stored = ld_acquire<S>(word)) == 0) {
        if (spin.expired()) report_timeout(ctx.error, ctx.role, ctx.rank, ctx.channel, ctx.peer, 0, 0, -1);
    }
    return decode_count(stored);
}

}  // namespace ep
