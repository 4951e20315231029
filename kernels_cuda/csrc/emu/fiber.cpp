// Fiber switches for the CPU emulation (see fiber.h).
#include "fiber.h"

#include <cstdint>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace ep_emu {

namespace {

#if defined(__SANITIZE_ADDRESS__)
// The context that switched to the one now running (its fake stack is restored on its return).
thread_local FiberContext* switched_from = nullptr;

void announce(FiberContext* from, FiberContext* to, bool from_exits) {
    switched_from = from;
    __sanitizer_start_switch_fiber(from_exits ? nullptr : &from->fake_stack, to->stack_bottom, to->stack_size);
}

void arrived(FiberContext* self) {
    FiberContext* from = switched_from;
    const void* bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(self->fake_stack, &bottom, &size);
    if (from != nullptr && from->stack_bottom == nullptr) {  // the host thread's stack, learnt on first switch
        from->stack_bottom = const_cast<void*>(bottom);
        from->stack_size = size;
    }
}
#else
void announce(FiberContext*, FiberContext*, bool) {}
void arrived(FiberContext*) {}
#endif

}  // namespace

#if defined(EP_EMU_UCONTEXT)

void make_fiber(FiberContext* fiber, void* stack, size_t size, void (*entry)(void*), void* arg) {
    getcontext(&fiber->context);
    fiber->context.uc_stack.ss_sp = stack;
    fiber->context.uc_stack.ss_size = size;
    fiber->context.uc_link = nullptr;
    fiber->stack_bottom = stack;
    fiber->stack_size = size;
    fiber->fake_stack = nullptr;
    // makecontext passes int arguments: the pointer travels as two halves.
    const uintptr_t bits = reinterpret_cast<uintptr_t>(arg);
    const uintptr_t fn = reinterpret_cast<uintptr_t>(entry);
    makecontext(&fiber->context,
                reinterpret_cast<void (*)()>(+[](unsigned fn_hi, unsigned fn_lo, unsigned hi, unsigned lo) {
                    const uintptr_t f = (static_cast<uintptr_t>(fn_hi) << 32) | fn_lo;
                    const uintptr_t a = (static_cast<uintptr_t>(hi) << 32) | lo;
                    reinterpret_cast<void (*)(void*)>(f)(reinterpret_cast<void*>(a));
                }),
                4, static_cast<unsigned>(static_cast<uint64_t>(fn) >> 32), static_cast<unsigned>(fn),
                static_cast<unsigned>(static_cast<uint64_t>(bits) >> 32), static_cast<unsigned>(bits));
}

void switch_to(FiberContext* from, FiberContext* to, bool from_exits) {
    announce(from, to, from_exits);
    swapcontext(&from->context, &to->context);
    arrived(from);
}

#else

extern "C" void ep_emu_switch(void** save_sp, void* load_sp);
extern "C" void ep_emu_trampoline();

#if defined(__x86_64__)
// Saves rbp, rbx, r12-r15, MXCSR and the x87 control word on the stack, swaps stack pointers,
// restores the same from the other stack and returns into it. A new fiber's stack is laid out as
// if it had been switched out: the return address is ep_emu_trampoline, r12 = arg, r13 = entry.
asm(R"(
    .text
    .globl ep_emu_switch
    .type ep_emu_switch, @function
ep_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ep_emu_switch, .-ep_emu_switch

    .globl ep_emu_trampoline
    .type ep_emu_trampoline, @function
ep_emu_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size ep_emu_trampoline, .-ep_emu_trampoline
    .section .note.GNU-stack,"",@progbits
    .text
)");

void make_fiber(FiberContext* fiber, void* stack, size_t size, void (*entry)(void*), void* arg) {
    auto top = reinterpret_cast<uintptr_t>(stack) + size;
    top &= ~static_cast<uintptr_t>(15);
    auto* words = reinterpret_cast<uint64_t*>(top - 64);
    uint32_t mxcsr = 0;
    uint16_t fpu_control = 0;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpu_control));
    const uint64_t control = mxcsr | static_cast<uint64_t>(fpu_control) << 32;
    std::memcpy(&words[0], &control, 8);
    words[1] = 0;                                        // r15
    words[2] = 0;                                        // r14
    words[3] = reinterpret_cast<uint64_t>(entry);        // r13
    words[4] = reinterpret_cast<uint64_t>(arg);          // r12
    words[5] = 0;                                        // rbx
    words[6] = 0;                                        // rbp
    words[7] = reinterpret_cast<uint64_t>(&ep_emu_trampoline);
    fiber->sp = words;
    fiber->stack_bottom = stack;
    fiber->stack_size = size;
    fiber->fake_stack = nullptr;
}

#elif defined(__aarch64__)
// Saves x19-x30 and d8-d15 (AAPCS64 callee-saved) below the stack pointer, swaps stack pointers and
// restores the same. A new fiber starts in ep_emu_trampoline with x19 = arg, x20 = entry.
asm(R"(
    .text
    .globl ep_emu_switch
    .type ep_emu_switch, %function
ep_emu_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size ep_emu_switch, .-ep_emu_switch

    .globl ep_emu_trampoline
    .type ep_emu_trampoline, %function
ep_emu_trampoline:
    mov x0, x19
    blr x20
    brk #0
    .size ep_emu_trampoline, .-ep_emu_trampoline
    .section .note.GNU-stack,"",%progbits
    .text
)");

void make_fiber(FiberContext* fiber, void* stack, size_t size, void (*entry)(void*), void* arg) {
    auto top = reinterpret_cast<uintptr_t>(stack) + size;
    top &= ~static_cast<uintptr_t>(15);
    auto* words = reinterpret_cast<uint64_t*>(top - 176);
    std::memset(words, 0, 176);
    words[0] = reinterpret_cast<uint64_t>(arg);                // x19
    words[1] = reinterpret_cast<uint64_t>(entry);              // x20
    words[11] = reinterpret_cast<uint64_t>(&ep_emu_trampoline);  // x30 (return address)
    fiber->sp = words;
    fiber->stack_bottom = stack;
    fiber->stack_size = size;
    fiber->fake_stack = nullptr;
}
#endif

void switch_to(FiberContext* from, FiberContext* to, bool from_exits) {
    announce(from, to, from_exits);
    ep_emu_switch(&from->sp, to->sp);
    arrived(from);
}

#endif

void fiber_started(FiberContext* self) { arrived(self); }

}  // namespace ep_emu
