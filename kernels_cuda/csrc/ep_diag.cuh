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

}  // namespace ep
