// Spin budgets and timeout diagnostics. A timed-out spin records what it waited for in a
// host-mapped ErrorRecord (readable after the context is lost), prints it, and traps.
#pragma once
#include <cstdint>
#include <cstdio>

#include "params/diag.h"
#include "device/ptx.cuh"

namespace ep {

// In the CPU emulation a virtual clock: timeouts are deterministic, and after a deadlock the
// emulator lets every spin budget expire so that each waiting role reports here.
__device__ __forceinline__ long long cycle_counter() {
#if defined(EP_CPU_EMULATION)
    return clock64();
#else
    long long value;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(value));
    return value;
#endif
}

struct SpinBudget {
    long long start;
    long long budget;
    __device__ __forceinline__ explicit SpinBudget(long long cycles) : start(cycle_counter()), budget(cycles) {}
    __device__ __forceinline__ bool expired() const { return cycle_counter() - start > budget; }
};

// A trap ends every thread of the kernel at once, so the record is written by one thread and never cut
// short: the first failing thread claims it (code -1 while it writes), fills it and publishes the code;
// any other failing thread waits for the code before it traps.
__device__ __forceinline__ bool claim_error(ErrorRecord* record) {
    return record != nullptr && atomicCAS_system(&record->code, 0, -1) == 0;
}

__device__ __forceinline__ void publish_error(ErrorRecord* record, int code) {
    __threadfence_system();
    st_release<Scope::kSys>(&record->code, code);
}

__device__ __forceinline__ void await_error(ErrorRecord* record) {
    if (record == nullptr) return;
    for (int i = 0; i < (1 << 20) && ld_acquire<Scope::kSys>(&record->code) < 0; ++i) {
    }
}

__device__ __noinline__ inline void report_timeout(ErrorRecord* record, int role, int rank, int channel, int peer,
                                                    int head, int tail, int expected) {
    if (claim_error(record)) {
        st_plain(&record->role, role);
        st_plain(&record->rank, rank);
        st_plain(&record->channel, channel);
        st_plain(&record->peer, peer);
        st_plain(&record->head, head);
        st_plain(&record->tail, tail);
        st_plain(&record->expected, expected);
        publish_error(record, 1);
    } else {
        await_error(record);
    }
    printf("kernels_cuda timeout: role=%d rank=%d channel=%d peer=%d head=%d tail=%d expected=%d\n", role, rank,
           channel, peer, head, tail, expected);
    __trap();
}

// With num_worst_tokens the outputs are sized before the counts are known: a rank that would receive
// more rows than that records it (code 2) and traps before any block writes past the end.
__device__ __forceinline__ void check_worst_tokens(ErrorRecord* record, int role, int rank, int rows, int limit) {
    if (limit <= 0 || rows <= limit) return;
    if (claim_error(record)) {
        st_plain(&record->role, role);
        st_plain(&record->rank, rank);
        st_plain(&record->channel, -1);
        st_plain(&record->peer, -1);
        st_plain(&record->head, -1);
        st_plain(&record->tail, rows);
        st_plain(&record->expected, limit);
        publish_error(record, 2);
        printf("kernels_cuda: rank %d receives %d rows but num_worst_tokens is %d\n", rank, rows, limit);
    } else {
        await_error(record);
    }
    __trap();
}

}  // namespace ep
