// User-level fibers for the CPU emulation: one per emulated CUDA thread. A switch saves the callee-saved
// registers on the current stack and loads the other fiber's stack pointer (no system call; x86-64 and
// AArch64 in assembly, ucontext elsewhere). Under AddressSanitizer every switch is announced to it.
#pragma once
#include <cstddef>

#if !defined(__x86_64__) && !defined(__aarch64__)
#define EP_EMU_UCONTEXT 1
#endif
#if defined(EP_EMU_UCONTEXT)
#include <ucontext.h>
#endif

namespace ep_emu {

struct FiberContext {
#if defined(EP_EMU_UCONTEXT)
    ucontext_t context;
#else
    void* sp = nullptr;  // the saved stack pointer (registers are on that stack)
#endif
    void* stack_bottom = nullptr;  // for AddressSanitizer: the stack this context runs on
    size_t stack_size = 0;
    void* fake_stack = nullptr;    // AddressSanitizer's fake stack of this context while switched out
};

// Prepares `fiber` to run entry(arg) on [stack, stack + size) at its first switch_to. entry never returns.
void make_fiber(FiberContext* fiber, void* stack, size_t size, void (*entry)(void*), void* arg);

// Saves the running context into `from` and resumes `to`. `from_exits`: `from` never runs again.
void switch_to(FiberContext* from, FiberContext* to, bool from_exits = false);

// Called first thing by a fiber's entry: completes the switch that started it.
void fiber_started(FiberContext* from);

}  // namespace ep_emu
