// The CPU emulation of the CUDA device that runs kernels_cuda/csrc's kernels unchanged (see
// shared/design.md, "Kernels on a CPU"). One launch runs every block at once, each CUDA thread a
// fiber (fiber.h) on the calling OS thread. The kernels reach the emulator only through the device
// header (device.h: builtins, warp collectives, barriers, __shared__) and the memory primitives in
// device/ptx.cuh / device/diag.cuh, which call yield() before every atomic, acquire load, release store,
// fence, clock read and __nanosleep. At each such point the scheduler (round robin, uniform random,
// or PCT: random priorities with d - 1 change points) picks the fiber that runs next; its choices
// come from a seed, so a seed replays a launch exactly.
//
// What a launch checks beyond the kernel's own results:
//  * barriers and warp collectives are rendezvous of the fibers that take part: a thread that exits
//    while its warp or block waits for it, or that arrives at another barrier or collective, fails
//    the launch with kernel, block, warp, lane and barrier named; so does a lane that spins while
//    other lanes of its warp wait at an aligned barrier (bar.sync needs a converged warp);
//  * deadlock: when every live fiber is blocked, or every runnable one spins (it came back to a spin
//    point it passed since the last change, so it went once around its wait loop) and a second such
//    round changes nothing either (no release store, atomic, barrier completion or exit), the virtual
//    clock of every fiber jumps past its spin budget, so each waiting role reports its wait context
//    through the kernels' own timeout path; the launch then fails with those reports and the blocked
//    fibers;
//  * __trap ends the launch (as a GPU context would); the host gets an error, not a crash;
//  * a cooperative grid larger than Schedule::sm_count blocks is refused, as on a GPU.
//
// Memory is sequentially consistent by default: a store is seen by every fiber at once. Under
// Memory::kRelaxed, plain stores that other threads read (device/ptx.cuh's st_plain / st_int4) stay
// pending, seen by the storing thread only, until the PTX memory model makes them visible (the
// rules are at "the relaxed memory mode" in emulator.cpp and in docs/kernels_emulation.md), so that
// a missing fence or a release downgraded to a plain store shows as stale data. Stores become visible
// eventually: when every runnable fiber spins, pending ones are published before a deadlock is found.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace ep_emu {

enum class Policy : int { kRoundRobin = 0, kRandom = 1, kPct = 2 };
enum class Memory : int { kSequential = 0, kRelaxed = 1 };

struct Schedule {
    Policy policy = Policy::kRoundRobin;
    uint64_t seed = 0;
    int pct_depth = 3;            // PCT's d: d - 1 priority change points per launch
    int64_t pct_steps = 1 << 20;  // PCT's horizon: change points fall in the first this many steps
    int sm_count = 132;           // blocks one cooperative launch may keep resident (an H200's SMs)
    Memory memory = Memory::kSequential;
};

// The emulated stream (cudaStream_t of the emulation): the schedule its launches run under, and a
// launch counter so that each launch draws its own interleaving from (seed, launch index).
//
// `peers_in_other_processes`: the launch is one rank of a group whose other ranks run their own
// launches in other processes, on shared memory (per-process buffers). A fiber may then wait for a
// process that has not been scheduled, so spinning is not a deadlock: when every runnable fiber
// spins, the OS thread yields the core (sched_yield, then short sleeps) instead, and clock64 reads
// wall-clock time (2 cycles per ns), so the kernels' spin budgets are real timeouts. A wait inside
// the process (every live fiber at a barrier or collective) still fails the launch at once.
struct Stream {
    Schedule schedule;
    uint64_t launches = 0;
    bool peers_in_other_processes = false;
};

// What a fiber does at a switch point; the scheduler and the checks above read it.
enum class Event : uint8_t {
    kAcquire,  // acquire load (spin)
    kClock,    // clock64 read (spin)
    kSleep,    // __nanosleep (spin)
    kRelease,  // release store (changes memory)
    kAtomic,   // read-modify-write (changes memory)
    kFence,
};

void yield(Event event);

// The relaxed memory mode's hooks (device.h calls them only while `relaxed_memory` is set, i.e. inside a
// launch under Memory::kRelaxed). tracked_store: a plain store of `size` bytes (at most 16, 4-byte
// aligned) that stays pending. before_write: the calling thread is about to write [ptr, ptr + size)
// with an atomic, release or volatile (strong) store; `release`: the write is a release.
extern thread_local bool relaxed_memory __attribute__((tls_model("initial-exec")));
void tracked_store(void* ptr, const void* value, size_t size);
void before_write(const void* ptr, size_t size, bool release);

long long clock64();
void nanosleep(unsigned ns);
[[noreturn]] void trap();
void device_printf(const char* format, ...) __attribute__((format(printf, 1, 2)));

// Warp collectives over the lanes of `mask`; every lane of the mask must reach the same kind.
enum class Collective : uint8_t { kShflIdx, kShflXor, kShflDown, kShflUp, kBallot, kAny, kAll, kSyncWarp };
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg);

// Barrier `id` over `threads` threads (threads < 0: the whole block). `aligned`: bar.sync, which needs
// each warp converged (a lane that spins or reaches another barrier or collective while lanes of its
// warp wait here fails the launch); __syncthreads is not aligned (the compiler reconverges for it).
void block_barrier(int id, int threads, bool aligned);

// The calling block's __shared__ storage for the declaration at `site` ("file:line"): allocated,
// poisoned, by the first thread of the block to reach it.
void* block_shared(const char* site, size_t bytes, size_t alignment);

struct Dim3 {
    unsigned x, y, z;
};

// Runs body(args) as `blocks` x `threads` fibers; 0, or a cudaError_t code with report() saying why.
int launch(const char* launcher, int blocks, int threads, Stream* stream, bool cooperative,
           void (*body)(const void*), const void* args);

// The report of this OS thread's last failed launch (kernel, seed, what went wrong) or memory call.
const std::string& last_report();
void set_last_report(const std::string& text);

}  // namespace ep_emu
