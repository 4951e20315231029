// What a kernel source sees of the device in the CPU emulation: force-included into every kernel file
// (as nvcc includes cuda_runtime.h), it maps CUDA's qualifiers, builtins, warp collectives, barriers
// and atomics onto the emulator (emulator.h). Memory-model primitives with explicit orders live in
// device/ptx.cuh / device/diag.cuh, which call the emulator the same way.
#pragma once
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>  // the device math functions CUDA provides (fmaxf, fabsf, ...)
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cuda_bf16.h"
#include "cuda_runtime.h"
#include "emulator.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict

// threadIdx / blockIdx are the running fiber's (the emulator sets them at every switch).
extern thread_local ep_emu::Dim3 threadIdx __attribute__((tls_model("initial-exec")));
extern thread_local ep_emu::Dim3 blockIdx __attribute__((tls_model("initial-exec")));
extern thread_local ep_emu::Dim3 blockDim __attribute__((tls_model("initial-exec")));
extern thread_local ep_emu::Dim3 gridDim __attribute__((tls_model("initial-exec")));

// Device printf goes to the emulator, which prints it and keeps it for the launch's report.
#define printf(...) ::ep_emu::device_printf(__VA_ARGS__)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline float max(float a, float b) { return a > b ? a : b; }

inline int __ffs(int value) { return __builtin_ffs(value); }
inline int __popc(unsigned value) { return __builtin_popcount(value); }
inline float __int_as_float(int value) { return std::bit_cast<float>(value); }
inline int __float_as_int(float value) { return std::bit_cast<int>(value); }

namespace ep_emu {
template <typename T>
inline uint64_t to_bits(T value) {
    static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    return bits;
}
template <typename T>
inline T from_bits(uint64_t bits) {
    T value;
    std::memcpy(&value, &bits, sizeof(T));
    return value;
}
inline void require_full_width(int width) {
    if (width != 32) device_printf("kernels_cuda emulation: shuffles of width %d are not emulated\n", width), trap();
}
}  // namespace ep_emu

template <typename T>
inline T __shfl_sync(unsigned mask, T value, int src, int width = 32) {
    ep_emu::require_full_width(width);
    return ep_emu::from_bits<T>(ep_emu::warp_collective(ep_emu::Collective::kShflIdx, mask, ep_emu::to_bits(value), src));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    ep_emu::require_full_width(width);
    return ep_emu::from_bits<T>(
        ep_emu::warp_collective(ep_emu::Collective::kShflXor, mask, ep_emu::to_bits(value), lane_mask));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    ep_emu::require_full_width(width);
    return ep_emu::from_bits<T>(
        ep_emu::warp_collective(ep_emu::Collective::kShflDown, mask, ep_emu::to_bits(value), static_cast<int>(delta)));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    ep_emu::require_full_width(width);
    return ep_emu::from_bits<T>(
        ep_emu::warp_collective(ep_emu::Collective::kShflUp, mask, ep_emu::to_bits(value), static_cast<int>(delta)));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return static_cast<unsigned>(ep_emu::warp_collective(ep_emu::Collective::kBallot, mask, predicate != 0, 0));
}
inline int __any_sync(unsigned mask, int predicate) {
    return static_cast<int>(ep_emu::warp_collective(ep_emu::Collective::kAny, mask, predicate != 0, 0));
}
inline int __all_sync(unsigned mask, int predicate) {
    return static_cast<int>(ep_emu::warp_collective(ep_emu::Collective::kAll, mask, predicate != 0, 0));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ep_emu::warp_collective(ep_emu::Collective::kSyncWarp, mask, 0, 0); }
inline void __syncthreads() { ep_emu::block_barrier(0, -1, false); }

inline void __threadfence_block() {
    ep_emu::yield(ep_emu::Event::kFence);
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence() { __threadfence_block(); }
inline void __threadfence_system() { __threadfence_block(); }

// The relaxed memory mode (emulator.h): a tracked plain store, and the hook before a strong write. The
// tracked path is out of line, so that the sequential mode's store stays a plain store in a register.
namespace ep_emu {
template <typename T>
[[gnu::noinline, gnu::cold]] void store_tracked(T* ptr, T value) {
    tracked_store(ptr, &value, sizeof(T));
}
template <typename T>
inline void store(T* ptr, T value) {
    static_assert(sizeof(T) % 4 == 0 && sizeof(T) <= 16, "tracked stores are 4 to 16 bytes of whole words");
    if (__builtin_expect(relaxed_memory, false))
        store_tracked(ptr, value);
    else
        *ptr = value;
}
inline void strong_write(const void* ptr, size_t size, bool release) {
    if (relaxed_memory) before_write(ptr, size, release);
}
}  // namespace ep_emu

// CUDA's atomics are relaxed.
inline int atomicAdd(int* address, int value) {
    ep_emu::yield(ep_emu::Event::kAtomic);
    ep_emu::strong_write(address, sizeof(int), false);
    return std::atomic_ref<int>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline int atomicCAS(int* address, int compare, int value) {
    ep_emu::yield(ep_emu::Event::kAtomic);
    ep_emu::strong_write(address, sizeof(int), false);
    std::atomic_ref<int>(*address).compare_exchange_strong(compare, value, std::memory_order_relaxed);
    return compare;
}
inline int atomicCAS_system(int* address, int compare, int value) { return atomicCAS(address, compare, value); }

inline long long clock64() { return ep_emu::clock64(); }
inline void __nanosleep(unsigned ns) { ep_emu::nanosleep(ns); }
[[noreturn]] inline void __trap() { ep_emu::trap(); }

// __shared__ variables: one per block (see EP_SHARED in device/ptx.cuh).
namespace ep_emu {
template <typename T>
inline T& shared_variable(const char* site) {
    return *static_cast<T*>(block_shared(site, sizeof(T), alignof(T)));
}
}  // namespace ep_emu
