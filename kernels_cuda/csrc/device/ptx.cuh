// Memory-model primitives (PTX) used by the transport and the rings. Scope is a template
// parameter: the EMULATED back end keeps every rank on one GPU (gpu scope suffices), the NVLINK
// back end talks to peer GPUs (system scope). In the CPU emulation (EP_CPU_EMULATION, csrc/emu/)
// each is a std::atomic_ref operation with the same memory order, preceded by a switch point of the
// emulator's scheduler; __shared__ variables are declared with EP_SHARED, one per emulated block.
#pragma once
#include <cstdint>

#if defined(EP_CPU_EMULATION)
#include <atomic>

#define EP_SHARED(type, name, dims)              \
    using name##_shared_type = type dims;        \
    name##_shared_type& name = ::ep_emu::shared_variable<name##_shared_type>(__FILE__ ":" EP_LINE_STRING(__LINE__))
#define EP_LINE_STRING(line) EP_LINE_STRING_(line)
#define EP_LINE_STRING_(line) #line
#else
#define EP_SHARED(type, name, dims) __shared__ type name dims
#endif

namespace ep {

enum class Scope { kGpu, kSys };

template <Scope S>
__device__ __forceinline__ int ld_acquire(const int* ptr) {
#if defined(EP_CPU_EMULATION)
    ep_emu::yield(ep_emu::Event::kAcquire);
    return std::atomic_ref<int>(*const_cast<int*>(ptr)).load(std::memory_order_acquire);
#else
    int value;
    if constexpr (S == Scope::kSys)
        asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    else
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
#endif
}

template <Scope S>
__device__ __forceinline__ void st_release(int* ptr, int value) {
#if defined(EP_CPU_EMULATION)
    ep_emu::yield(ep_emu::Event::kRelease);
    ep_emu::strong_write(ptr, sizeof(int), true);
    std::atomic_ref<int>(*ptr).store(value, std::memory_order_release);
#else
    if constexpr (S == Scope::kSys)
        asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
#endif
}

template <Scope S>
__device__ __forceinline__ int atomic_add_release(int* ptr, int value) {
#if defined(EP_CPU_EMULATION)
    ep_emu::yield(ep_emu::Event::kAtomic);
    ep_emu::strong_write(ptr, sizeof(int), true);
    return std::atomic_ref<int>(*ptr).fetch_add(value, std::memory_order_release);
#else
    int old;
    if constexpr (S == Scope::kSys)
        asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    else
        asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
#endif
}

template <Scope S>
__device__ __forceinline__ void fence_acq_rel() {
#if defined(EP_CPU_EMULATION)
    ep_emu::yield(ep_emu::Event::kFence);
    std::atomic_thread_fence(std::memory_order_acq_rel);
#else
    if constexpr (S == Scope::kSys)
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    else
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
}

// A plain store to memory that other threads or ranks read: ring records and metadata, counts put into
// peers' buffers, staging areas (not __shared__ memory, not the kernel's outputs). In the CUDA build it
// is exactly `*ptr = value`; in the emulation's relaxed memory mode it stays pending, seen by this
// thread only, until the memory model makes it visible (a barrier to the threads taking part, a
// release to every thread: emulator.cpp, "the relaxed memory mode").
template <typename T>
__device__ __forceinline__ void st_plain(T* ptr, T value) {
#if defined(EP_CPU_EMULATION)
    ep_emu::store(ptr, value);
#else
    *ptr = value;
#endif
}

// A volatile store (a flag in shared memory, a counter the host polls): strong, so in the relaxed memory
// mode it publishes what its thread saw at its last fence (a fence, then a strong store, is PTX's
// release pattern). In the CUDA build exactly the volatile store.
template <typename T>
__device__ __forceinline__ void st_volatile(volatile T* ptr, T value) {
#if defined(EP_CPU_EMULATION)
    ep_emu::strong_write(const_cast<T*>(ptr), sizeof(T), false);
#endif
    *ptr = value;
}

// Plain 16-byte loads/stores for payload copies. Ring data is only read after an acquire of the
// tail that covers it, so ordinary (coherent) loads are enough; no `.nc` trick on peer data. The
// stores are st_plain's; the kernels' own outputs, which no other thread reads during the launch, are
// written with plain assignments.
__device__ __forceinline__ int4 ld_int4(const int4* ptr) { return *ptr; }
__device__ __forceinline__ void st_int4(int4* ptr, int4 value) { st_plain(ptr, value); }

// Named barrier over `threads` threads of the block (ids 1..15; 0 is __syncthreads). bar.sync is
// aligned: every warp must arrive converged (after divergent code, __syncwarp() first).
__device__ __forceinline__ void named_barrier(int id, int threads) {
#if defined(EP_CPU_EMULATION)
    ep_emu::block_barrier(id, threads, true);
#else
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % 32); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x / 32); }

}  // namespace ep
