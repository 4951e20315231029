// Spin budgets and timeout diagnostics. A timed-out spin records what it waited for in a
// host-mapped ErrorRecord (readable after the context is lost), prints it, and traps.
#pragma once
#include <cstdint>
#include <cstdio>

#include "ep_diag.h"

namespace ep {

__device__ __forceinline__ long long cycle_counter() {
    long long value;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(value));
    return value;
}

struct SpinBudget {
    long long start;
    long long budget;
    __device__ __forceinline__ explicit SpinBudget(long long cycles) : start(cycle_counter()), budget(cycles) {}
    __device__ __forceinline__ bool expired() const { return cycle_counter() - start > budget; }
};

__device__ __noinline__ inline void report_timeout(ErrorRecord* record, int role, int rank, int channel, int peer,
                                                    int head, int tail, int expected) {
    if (record != nullptr && atomicCAS_system(&record->code, 0, 1) == 0) {
        record->role = role;
        record->rank = rank;
        record->channel = channel;
        record->peer = peer;
        record->head = head;
        record->tail = tail;
        record->expected = expected;
        __threadfence_system();
    }
    printf("kernels_cuda timeout: role=%d rank=%d channel=%d peer=%d head=%d tail=%d expected=%d\n", role, rank,
           channel, peer, head, tail, expected);
    __trap();
}

// With num_worst_tokens the outputs are sized before the counts are known: a rank that would receive
// more rows than that records it (code 2) and traps before any block writes past the end.
__device__ __forceinline__ void check_worst_tokens(ErrorRecord* record, int role, int rank, int rows, int limit) {
    if (limit <= 0 || rows <= limit) return;
    if (threadIdx.x == 0 && record != nullptr && atomicCAS_system(&record->code, 0, 2) == 0) {
        record->role = role;
        record->rank = rank;
        record->channel = record->peer = record->head = -1;
        record->tail = rows;
        record->expected = limit;
        __threadfence_system();
        printf("kernels_cuda: rank %d receives %d rows but num_worst_tokens is %d\n", rank, rows, limit);
    }
    __trap();
}

}  // namespace ep
