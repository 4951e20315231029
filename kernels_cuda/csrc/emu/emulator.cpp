// The CPU emulation of the CUDA device (see emulator.h for what it does and checks).
#include "emulator.h"

#include <sched.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "fiber.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

thread_local ep_emu::Dim3 threadIdx __attribute__((tls_model("initial-exec")));
thread_local ep_emu::Dim3 blockIdx __attribute__((tls_model("initial-exec")));
thread_local ep_emu::Dim3 blockDim __attribute__((tls_model("initial-exec")));
thread_local ep_emu::Dim3 gridDim __attribute__((tls_model("initial-exec")));

namespace ep_emu {

namespace {

constexpr int kWarp = 32;
constexpr int kMaxBarriers = 16;
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = 256 << 10;  // instrumented frames are larger
#else
constexpr size_t kStackBytes = 64 << 10;
#endif
constexpr uint64_t kStackCanary = 0x5eed5eed5eed5eedULL;
constexpr size_t kSharedBytes = 48 << 10;  // static __shared__ memory of a block, as on a GPU
constexpr unsigned char kPoison = 0xa5;
constexpr long long kCyclesPerClockRead = 1000;  // virtual cycles one spin iteration takes
constexpr long long kExpiredJump = 1LL << 45;    // after a deadlock: every clock read passes any budget
constexpr int kSpinSites = 4;                    // spin points a fiber remembers (its wait loop's)
constexpr uint64_t kMaxSteps = 1ULL << 34;       // livelock guard
constexpr uint64_t kMaxStepsAfterDeadlock = 1ULL << 26;
constexpr size_t kMaxPrintedLines = 4096;
constexpr long long kCyclesPerNs = 2;                // the wall clock of a launch with peers in other processes
constexpr int kYieldsBeforeSleeping = 64;            // ... rounds of all-spinning fibers before it sleeps
constexpr long kIdleSleepNs = 20000;

enum class State : uint8_t { kRunnable, kBlocked, kExited, kTrapped };
enum class Wait : uint8_t { kNone, kCollective, kBarrier, kParked };

struct Block;
struct Warp;

struct Fiber {
    FiberContext context;
    Dim3 thread_idx;
    Block* block = nullptr;
    Warp* warp = nullptr;
    int lane = 0;
    int id = 0;
    State state = State::kRunnable;
    Wait wait = Wait::kNone;
    int wait_barrier = -1;
    uint64_t collective_result = 0;
    long long clock = 0;
    uint64_t spin_epoch = 0;     // deadlock detection: the change epoch of `sites`
    const void* sites[kSpinSites] = {};  // spin points passed in that epoch (code addresses)
    int num_sites = 0;
    uint64_t counted_epoch = 0;  // the epoch in which this fiber counts as stuck
    int64_t priority = 0;        // PCT
    bool expired = false;        // after a deadlock: this fiber's clock reads pass every spin budget
    bool caught_up = false;      // ... it was let through one clock read unexpired to rejoin its warp
    uint64_t* canary = nullptr;
};

struct Warp {
    int index = 0;
    std::vector<Fiber*> lanes;
    int arrived = 0;  // lanes waiting at the collective in progress
    unsigned mask = 0;
    Collective kind = Collective::kSyncWarp;
    uint64_t values[kWarp] = {};
    int args[kWarp] = {};
    int at_barrier = 0;  // lanes waiting at a block barrier
    int barrier_id = -1;
};

struct Barrier {
    int expected = 0;
    std::vector<Fiber*> waiting;
};

struct Block {
    int index = 0;
    Dim3 block_idx{};
    int num_threads = 0;
    int exited = 0;
    std::vector<Warp> warps;
    Barrier barriers[kMaxBarriers];
    std::vector<std::pair<const char*, void*>> shared;
    std::vector<unsigned char> arena;
    size_t arena_used = 0;
};

const char* collective_name(Collective kind) {
    switch (kind) {
        case Collective::kShflIdx: return "__shfl_sync";
        case Collective::kShflXor: return "__shfl_xor_sync";
        case Collective::kShflDown: return "__shfl_down_sync";
        case Collective::kShflUp: return "__shfl_up_sync";
        case Collective::kBallot: return "__ballot_sync";
        case Collective::kAny: return "__any_sync";
        case Collective::kAll: return "__all_sync";
        case Collective::kSyncWarp: return "__syncwarp";
    }
    return "?";
}

std::string barrier_name(int id) { return id == 0 ? std::string("__syncthreads") : "bar.sync " + std::to_string(id); }

const char* policy_name(Policy policy) {
    switch (policy) {
        case Policy::kRoundRobin: return "round_robin";
        case Policy::kRandom: return "random";
        case Policy::kPct: return "pct";
    }
    return "?";
}

// "ep::InternodeDispatchParams" in cudaLaunchKernelEx's signature -> "internode_dispatch kernel".
std::string kernel_name(const char* launcher) {
    const std::string text(launcher);
    const size_t at = text.find("Params = ");
    if (at == std::string::npos) return "kernel";
    size_t begin = at + 9, end = text.find_first_of(";]", begin);
    std::string type = text.substr(begin, end - begin);
    if (type.rfind("ep::", 0) == 0) type = type.substr(4);
    std::string base = type.size() > 6 && type.compare(type.size() - 6, 6, "Params") == 0 ? type.substr(0, type.size() - 6) : type;
    std::string snake;
    for (size_t i = 0; i < base.size(); ++i) {
        const char c = base[i];
        if (c >= 'A' && c <= 'Z') {
            if (i > 0) snake += '_';
            snake += static_cast<char>(c - 'A' + 'a');
        } else {
            snake += c;
        }
    }
    return snake + " kernel (" + type + ")";
}

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// Fiber stacks of this OS thread, kept between launches (one mapping, grown on demand).
struct StackPool {
    unsigned char* base = nullptr;
    size_t count = 0;

    unsigned char* acquire(size_t stacks) {
        if (stacks > count) {
            if (base != nullptr) {
#if defined(__SANITIZE_ADDRESS__)
                // Abandoned fibers leave poisoned frames; the next mapping here must not inherit them.
                ASAN_UNPOISON_MEMORY_REGION(base, count * kStackBytes);
#endif
                munmap(base, count * kStackBytes);
            }
            void* memory = mmap(nullptr, stacks * kStackBytes, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (memory == MAP_FAILED) {
                base = nullptr;
                count = 0;
                return nullptr;
            }
            base = static_cast<unsigned char*>(memory);
            count = stacks;
        }
        return base;
    }
};

thread_local StackPool stack_pool;

struct Launch;
thread_local Launch* current_launch __attribute__((tls_model("initial-exec"))) = nullptr;
thread_local std::string last_failure;

void fiber_entry(void* arg);

struct Launch {
    std::string kernel;
    Schedule schedule;
    uint64_t index = 0;
    bool cross_process = false;  // Stream::peers_in_other_processes
    std::chrono::steady_clock::time_point started;
    int idle_rounds = 0;         // consecutive rounds in which every runnable fiber spun (cross_process)
    Dim3 block_dim{}, grid_dim{};
    void (*body)(const void*) = nullptr;
    const void* args = nullptr;

    std::vector<Fiber> fibers;
    std::vector<Block> blocks;
    FiberContext host;
    Fiber* current = nullptr;

    // Runnable fibers: a vector (random), a bitmap (round robin) or a priority order (PCT).
    std::vector<int> runnable;
    std::vector<int> position;  // index in `runnable`, -1 when not runnable
    std::vector<uint64_t> bitmap;
    std::set<std::pair<int64_t, int>> by_priority;  // (-priority, id): the first runs
    int64_t lowest_priority = 0;
    std::mt19937_64 rng;
    uint64_t steps = 0;
    std::vector<uint64_t> change_points;
    size_t next_change = 0;

    // Deadlock detection (emulator.h).
    uint64_t epoch = 1;
    uint64_t stuck_epoch = 0;
    uint64_t probe_epoch = 0;
    int stuck_count = 0;
    // After a deadlock is found, every fiber is parked at its next clock read; once all runnable ones
    // are, they expire: their clock reads pass every spin budget from then on, so each waiting role
    // times out. Parking keeps the lanes of a warp in step (converged lanes read the same clock): a
    // parked lane whose warp-mates wait at a collective it has not reached is first let through one
    // more read unexpired, to rejoin them (a lane spinning alone comes back to park, and expires).
    bool pending_expire = false;
    uint64_t pending_step = 0;
    std::vector<Fiber*> parked;

    int status = cudaSuccess;
    std::string failure;
    int traps = 0;
    std::vector<std::string> printed;

    // --- runnable set ---------------------------------------------------------------------------
    void add_runnable(Fiber* f) {
        f->state = State::kRunnable;
        f->wait = Wait::kNone;
        if (counted(f)) ++stuck_count;  // woken by a warp collective: still in the same stuck wait loop
        position[f->id] = static_cast<int>(runnable.size());
        runnable.push_back(f->id);
        if (schedule.policy == Policy::kRoundRobin) bitmap[f->id / 64] |= 1ULL << (f->id % 64);
        if (schedule.policy == Policy::kPct) by_priority.insert({-f->priority, f->id});
    }

    void remove_runnable(Fiber* f) {
        const int at = position[f->id];
        if (at < 0) return;
        const int last = runnable.back();
        runnable[at] = last;
        position[last] = at;
        runnable.pop_back();
        position[f->id] = -1;
        if (schedule.policy == Policy::kRoundRobin) bitmap[f->id / 64] &= ~(1ULL << (f->id % 64));
        if (schedule.policy == Policy::kPct) by_priority.erase({-f->priority, f->id});
        if (counted(f)) --stuck_count;  // it stays counted for the epoch: see add_runnable
    }

    void demote(Fiber* f) {
        if (position[f->id] < 0) return;
        by_priority.erase({-f->priority, f->id});
        f->priority = --lowest_priority;
        by_priority.insert({-f->priority, f->id});
    }

    // The fiber to run next (runnable is not empty); `after` orders round robin.
    Fiber* pick(int after) {
        switch (schedule.policy) {
            case Policy::kRandom: return &fibers[runnable[rng() % runnable.size()]];
            case Policy::kPct: return &fibers[by_priority.begin()->second];
            case Policy::kRoundRobin: break;
        }
        const int n = static_cast<int>(fibers.size());
        int id = (after + 1) % n;
        for (int scanned = 0; scanned <= n; scanned += 64) {
            const int word = id / 64;
            const uint64_t bits = bitmap[word] & (~0ULL << (id % 64));
            if (bits != 0) return &fibers[word * 64 + __builtin_ctzll(bits)];
            id = (word + 1) * 64;
            if (id >= n) id = 0;
        }
        return &fibers[runnable[0]];
    }

    // --- switching --------------------------------------------------------------------------------
    void switch_from(Fiber* f, Fiber* next) {
        current = next;
        switch_to(&f->context, &next->context);
        resumed(f);
    }

    // The fiber `f` runs again: the builtins are its own.
    void resumed(Fiber* f) {
        current = f;
        threadIdx = f->thread_idx;
        blockIdx = f->block->block_idx;
    }

    // `f` stops being runnable: run another fiber, or return to the host when none is left.
    void leave(Fiber* f, bool exits) {
        if (!runnable.empty()) {
            Fiber* next = pick(f->id);
            current = next;
            switch_to(&f->context, &next->context, exits);
            resumed(f);
            return;
        }
        current = nullptr;
        switch_to(&f->context, &host, exits);
        resumed(f);
    }

    [[noreturn]] void end_from(Fiber* f) {
        current = nullptr;
        switch_to(&f->context, &host, true);
        __builtin_unreachable();
    }

    [[noreturn]] void fail(int code, const std::string& what) {
        if (status == cudaSuccess) {
            status = code;
            failure = what;
        }
        end_from(current);
    }

    std::string where(const Fiber* f) const {
        return "block " + std::to_string(f->block->index) + ", warp " + std::to_string(f->warp->index) + ", lane " +
               std::to_string(f->lane) + " (thread " + std::to_string(f->thread_idx.x) + ")";
    }

    // --- deadlock detection --------------------------------------------------------------------------
    bool counted(const Fiber* f) const { return f->counted_epoch == epoch && stuck_epoch == epoch; }

    void note_change() {
        ++epoch;
        idle_rounds = 0;
    }

    // `f` is at the spin point `site`. It counts as stuck once it comes back to a point it passed in
    // this epoch: it went around its wait loop, so its loads since the last change saw no progress.
    void note_spin(Fiber* f, const void* site) {
        if (pending_expire) {
            if (steps - pending_step > kMaxStepsAfterDeadlock)
                fail(cudaErrorLaunchTimeout, "deadlock: fibers keep spinning without reaching a timeout");
            return;
        }
        if (f->spin_epoch != epoch) {
            f->spin_epoch = epoch;
            f->num_sites = 0;
        }
        bool looped = false;
        for (int i = 0; i < f->num_sites; ++i) looped |= f->sites[i] == site;
        if (!looped) {
            if (f->num_sites == kSpinSites) {
                std::copy(f->sites + 1, f->sites + kSpinSites, f->sites);
                --f->num_sites;
            }
            f->sites[f->num_sites++] = site;
            return;
        }
        if (stuck_epoch != epoch) {
            stuck_epoch = epoch;
            stuck_count = 0;
        }
        if (f->counted_epoch != epoch) {
            f->counted_epoch = epoch;
            ++stuck_count;
        }
        if (stuck_count < static_cast<int>(runnable.size())) return;
        if (cross_process) {  // they wait for another process: give it the core
            wait_for_peers();
            return;
        }
        if (probe_epoch != epoch) {  // every runnable fiber spins: one more full round to be sure
            probe_epoch = ++epoch;
            return;
        }
        pending_expire = true;
        pending_step = steps;
    }

    // Every runnable fiber went around its wait loop without news: yield the OS thread, and after many
    // such rounds sleep briefly (peers may be descheduled for a while on few cores). The next round
    // counts afresh.
    void wait_for_peers() {
        ++epoch;
        if (++idle_rounds < kYieldsBeforeSleeping) {
            sched_yield();
            return;
        }
        const timespec pause{0, kIdleSleepNs};
        ::nanosleep(&pause, nullptr);
    }

    long long wall_cycles() const {
        const auto elapsed = std::chrono::steady_clock::now() - started;
        return std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count() * kCyclesPerNs;
    }

    // At a clock read while a deadlock's expiry is pending: wait there until every runnable fiber does.
    void park(Fiber* f) {
        parked.push_back(f);
        f->state = State::kBlocked;
        f->wait = Wait::kParked;
        remove_runnable(f);
        if (!runnable.empty()) {
            leave(f, false);
            return;
        }
        for (Fiber* p : parked) {
            if (!p->caught_up && p->warp->arrived > 0)
                p->caught_up = true;
            else
                p->expired = true;
            add_runnable(p);
        }
        parked.clear();
    }

    // --- checks of warp convergence ---------------------------------------------------------------------
    void require_converged(Fiber* f, const char* doing) {
        Warp& w = *f->warp;
        if (w.at_barrier == 0) return;
        fail(cudaErrorIllegalInstruction,
             where(f) + " " + doing + " while " + std::to_string(w.at_barrier) + " lane(s) of its warp wait at " +
                 barrier_name(w.barrier_id) + ": bar.sync needs the whole warp converged (add __syncwarp() first)");
    }
};

Launch& launch_state() { return *current_launch; }

void fiber_entry(void* arg) {
    Fiber* f = static_cast<Fiber*>(arg);
    fiber_started(&f->context);
    Launch& L = launch_state();
    L.resumed(f);
    L.body(L.args);
    if (*f->canary != kStackCanary) L.fail(cudaErrorLaunchFailure, L.where(f) + ": fiber stack overflow");
    // The thread exits: nobody may still wait for it.
    f->state = State::kExited;
    Block& b = *f->block;
    ++b.exited;
    Warp& w = *f->warp;
    if (w.arrived > 0 && ((w.mask >> f->lane) & 1u))
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " exited while its warp waits for it at " +
                                                std::string(collective_name(w.kind)));
    if (!b.barriers[0].waiting.empty())
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " exited while its block waits at __syncthreads");
    L.remove_runnable(f);
    L.note_change();
    L.leave(f, true);
    __builtin_unreachable();
}

// Lane-range text: "lanes 1-31", "lane 0", "lanes 0-3, 8".
std::string lane_list(const std::vector<int>& lanes) {
    std::string text = lanes.size() == 1 ? "lane " : "lanes ";
    for (size_t i = 0; i < lanes.size();) {
        size_t j = i;
        while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) ++j;
        if (i > 0) text += ", ";
        text += std::to_string(lanes[i]);
        if (j > i) text += "-" + std::to_string(lanes[j]);
        i = j + 1;
    }
    return text;
}

std::string blocked_summary(const Launch& L) {
    std::string text;
    int warps = 0;
    for (const Block& b : L.blocks) {
        for (const Warp& w : b.warps) {
            std::map<std::string, std::vector<int>> by_wait;
            for (const Fiber* f : w.lanes) {
                if (f->state != State::kBlocked) continue;
                const std::string at = f->wait == Wait::kCollective ? std::string(collective_name(w.kind))
                                       : f->wait == Wait::kParked ? std::string("a clock read (parked after a deadlock)")
                                                                  : barrier_name(f->wait_barrier);
                by_wait[at].push_back(f->lane);
            }
            if (by_wait.empty()) continue;
            if (++warps > 32) continue;
            std::vector<int> trapped, exited;
            for (const Fiber* f : w.lanes) {
                if (f->state == State::kTrapped) trapped.push_back(f->lane);
                if (f->state == State::kExited) exited.push_back(f->lane);
            }
            for (const auto& [at, lanes] : by_wait) {
                text += "\n    block " + std::to_string(b.index) + " warp " + std::to_string(w.index) + ": " + lane_list(lanes) + " wait at " + at;
                if (!trapped.empty()) text += " (" + lane_list(trapped) + " trapped)";
                if (!exited.empty()) text += " (" + lane_list(exited) + " exited)";
            }
        }
    }
    if (warps > 32) text += "\n    ... and " + std::to_string(warps - 32) + " more warps";
    return text;
}

std::string report(const Launch& L, const std::string& what) {
    std::string text = "kernels_cuda emulation: " + L.kernel + ", grid " + std::to_string(L.grid_dim.x) + " x " +
                       std::to_string(L.block_dim.x) + " threads: " + what;
    text += "\n  schedule: " + std::string(policy_name(L.schedule.policy)) + " seed=" + std::to_string(L.schedule.seed) +
            (L.schedule.policy == Policy::kPct ? " depth=" + std::to_string(L.schedule.pct_depth) : std::string()) +
            ", launch " + std::to_string(L.index) + " of its stream (the same seed replays it)";
    if (!L.printed.empty()) {
        text += "\n  device printf (each distinct line once):";
        std::set<std::string> seen;
        for (const std::string& line : L.printed)
            if (seen.insert(line).second) text += "\n    " + line;
    }
    const std::string blocked = blocked_summary(L);
    if (!blocked.empty()) text += "\n  blocked:" + blocked;
    return text;
}

}  // namespace

// --- the device API (emulator.h) -------------------------------------------------------------------

namespace {

// A switch point; `site` (the kernel's code address) tells the wait loops apart.
void yield_at(Event event, const void* site) {
    Launch& L = launch_state();
    Fiber* f = L.current;
    if (++L.steps > kMaxSteps && !L.cross_process) L.fail(cudaErrorLaunchTimeout, "no end after " + std::to_string(kMaxSteps) + " steps (livelock?)");
    const bool spin = event == Event::kAcquire || event == Event::kClock || event == Event::kSleep;
    if (spin) {
        L.require_converged(f, "spins");
        L.note_spin(f, site);
    } else if (event == Event::kRelease || event == Event::kAtomic) {
        L.note_change();
    }
    if (L.schedule.policy == Policy::kPct) {
        if (spin) L.demote(f);
        while (L.next_change < L.change_points.size() && L.steps >= L.change_points[L.next_change]) {
            L.demote(f);
            ++L.next_change;
        }
    }
    Fiber* next = L.pick(f->id);
    if (next != f) L.switch_from(f, next);
}

}  // namespace

void yield(Event event) { yield_at(event, __builtin_return_address(0)); }

long long clock64() {
    yield_at(Event::kClock, __builtin_return_address(0));
    Launch& L = launch_state();
    Fiber* f = L.current;
    if (L.cross_process) return f->clock = L.wall_cycles();
    if (L.pending_expire && !f->expired) L.park(f);
    f->clock += f->expired ? kExpiredJump : kCyclesPerClockRead;
    return f->clock;
}

void nanosleep(unsigned ns) {
    yield_at(Event::kSleep, __builtin_return_address(0));
    Launch& L = launch_state();
    Fiber* f = L.current;
    if (L.cross_process) return;  // the wall clock moves on by itself
    if (L.pending_expire && !f->expired) L.park(f);
    f->clock += f->expired ? kExpiredJump : kCyclesPerNs * ns;
}

void trap() {
    Launch& L = launch_state();
    Fiber* f = L.current;
    ++L.traps;
    if (!L.pending_expire) L.fail(cudaErrorLaunchFailure, "__trap in " + L.where(f));
    // After a deadlock every waiting role times out and traps in turn; the rest keep reporting.
    f->state = State::kTrapped;
    L.remove_runnable(f);
    L.leave(f, true);
    __builtin_unreachable();
}

void device_printf(const char* format, ...) {
    char line[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(line, sizeof(line), format, args);
    va_end(args);
    std::fputs(line, stdout);
    std::fflush(stdout);
    Launch* L = current_launch;
    if (L == nullptr || L->printed.size() >= kMaxPrintedLines) return;
    std::string text(line);
    while (!text.empty() && text.back() == '\n') text.pop_back();
    L->printed.push_back(text);
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg) {
    Launch& L = launch_state();
    Fiber* f = L.current;
    Warp& w = *f->warp;
    const int lane = f->lane;
    const std::string name = collective_name(kind);
    if (((mask >> lane) & 1u) == 0) L.fail(cudaErrorIllegalInstruction, L.where(f) + " calls " + name + " with a mask that excludes itself");
    L.require_converged(f, ("reaches " + name).c_str());
    for (int j = 0; j < kWarp; ++j) {
        if (((mask >> j) & 1u) == 0) continue;
        if (j >= static_cast<int>(w.lanes.size()) || w.lanes[j]->state == State::kExited)
            L.fail(cudaErrorIllegalInstruction, L.where(f) + " waits at " + name + " for lane " + std::to_string(j) + ", which has exited");
        if (w.lanes[j]->state == State::kTrapped) {  // after a deadlock: this lane waits for good (reported as blocked)
            f->state = State::kBlocked;
            f->wait = Wait::kCollective;
            w.kind = kind;
            L.remove_runnable(f);
            L.leave(f, true);
        }
    }
    if (w.arrived == 0) {
        w.kind = kind;
        w.mask = mask;
    } else if (w.kind != kind || w.mask != mask) {
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + name + " while other lanes of its warp wait at " +
                                                collective_name(w.kind) + " (mask " + std::to_string(w.mask) + ")");
    }
    w.values[lane] = value;
    w.args[lane] = arg;
    if (++w.arrived < __builtin_popcount(mask)) {
        f->state = State::kBlocked;
        f->wait = Wait::kCollective;
        L.remove_runnable(f);
        L.leave(f, false);
        return f->collective_result;
    }
    // The last lane: every participant's result, then wake them.
    const uint64_t poison = 0xa5a5a5a5a5a5a5a5ULL;
    uint64_t ballot = 0;
    for (int j = 0; j < kWarp; ++j)
        if ((mask >> j) & 1u) ballot |= static_cast<uint64_t>(w.values[j] != 0) << j;
    for (int j = 0; j < kWarp; ++j) {
        if (((mask >> j) & 1u) == 0) continue;
        uint64_t result = 0;
        int src = j;
        switch (kind) {
            case Collective::kShflIdx: src = w.args[j] & (kWarp - 1); break;
            case Collective::kShflXor: src = (j ^ w.args[j]) & (kWarp - 1); break;
            case Collective::kShflDown: src = j + w.args[j] < kWarp ? j + w.args[j] : j; break;
            case Collective::kShflUp: src = j - w.args[j] >= 0 ? j - w.args[j] : j; break;
            default: break;
        }
        switch (kind) {
            case Collective::kBallot: result = ballot; break;
            case Collective::kAny: result = ballot != 0; break;
            case Collective::kAll: result = ballot == mask; break;
            case Collective::kSyncWarp: result = 0; break;
            default: result = ((mask >> src) & 1u) ? w.values[src] : poison; break;
        }
        Fiber* other = w.lanes[j];
        other->collective_result = result;
        if (other != f) L.add_runnable(other);
    }
    w.arrived = 0;
    return f->collective_result;
}

void block_barrier(int id, int threads, bool aligned) {
    Launch& L = launch_state();
    Fiber* f = L.current;
    Block& b = *f->block;
    Warp& w = *f->warp;
    const std::string name = barrier_name(id);
    if (id < 0 || id >= kMaxBarriers) L.fail(cudaErrorIllegalInstruction, L.where(f) + ": barrier id " + std::to_string(id) + " out of range");
    const int expected = threads < 0 ? b.num_threads : threads;
    if (expected <= 0 || expected % kWarp != 0 || expected > b.num_threads)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + ": " + name + " over " + std::to_string(expected) +
                                                " threads (must be a multiple of 32, at most the block's)");
    if (threads < 0 && b.exited > 0)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches __syncthreads after " + std::to_string(b.exited) +
                                                " thread(s) of its block exited");
    if (aligned && w.arrived > 0)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + name + " while lanes of its warp wait at " + collective_name(w.kind));
    if (aligned && w.at_barrier > 0 && w.barrier_id != id)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + name + " while lanes of its warp wait at " + barrier_name(w.barrier_id));
    Barrier& bar = b.barriers[id];
    if (bar.waiting.empty()) {
        bar.expected = expected;
    } else if (bar.expected != expected) {
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + name + " counting " + std::to_string(expected) +
                                                " threads while others count " + std::to_string(bar.expected));
    }
    if (static_cast<int>(bar.waiting.size()) + 1 < bar.expected) {
        bar.waiting.push_back(f);
        if (aligned) {
            ++w.at_barrier;
            w.barrier_id = id;
        }
        f->state = State::kBlocked;
        f->wait = Wait::kBarrier;
        f->wait_barrier = id;
        L.remove_runnable(f);
        L.leave(f, false);
        return;
    }
    for (Fiber* other : bar.waiting) {
        Warp& ow = *other->warp;
        if (ow.at_barrier > 0 && --ow.at_barrier == 0) ow.barrier_id = -1;
        other->wait_barrier = -1;
        L.add_runnable(other);
    }
    bar.waiting.clear();
    L.note_change();
}

void* block_shared(const char* site, size_t bytes, size_t alignment) {
    Launch& L = launch_state();
    Block& b = *L.current->block;
    for (const auto& [known, ptr] : b.shared)
        if (known == site || std::strcmp(known, site) == 0) return ptr;
    if (b.arena.empty()) b.arena.assign(kSharedBytes, kPoison);
    const size_t offset = (b.arena_used + alignment - 1) / alignment * alignment;
    if (offset + bytes > kSharedBytes)
        L.fail(cudaErrorIllegalInstruction, "block " + std::to_string(b.index) + " needs more than 48 KiB of __shared__ memory");
    b.arena_used = offset + bytes;
    void* ptr = b.arena.data() + offset;
    b.shared.emplace_back(site, ptr);
    return ptr;
}

const std::string& last_report() { return last_failure; }
void set_last_report(const std::string& text) { last_failure = text; }

int launch(const char* launcher, int blocks, int threads, Stream* stream, bool cooperative, void (*body)(const void*),
           const void* args) {
    Launch L;
    L.kernel = kernel_name(launcher);
    L.schedule = stream != nullptr ? stream->schedule : Schedule{};
    L.index = stream != nullptr ? stream->launches++ : 0;
    L.cross_process = stream != nullptr && stream->peers_in_other_processes;
    L.started = std::chrono::steady_clock::now();
    L.block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
    L.grid_dim = Dim3{static_cast<unsigned>(blocks), 1, 1};
    L.body = body;
    L.args = args;
    if (blocks < 1 || threads < 1 || threads > 1024 || threads % kWarp != 0) {
        last_failure = report(L, "bad launch shape");
        return cudaErrorInvalidValue;
    }
    if (cooperative && blocks > L.schedule.sm_count) {
        last_failure = report(L, "a cooperative grid of " + std::to_string(blocks) + " blocks cannot be resident on " +
                                     std::to_string(L.schedule.sm_count) + " SMs");
        return cudaErrorCooperativeLaunchTooLarge;
    }
    if (current_launch != nullptr) {
        last_failure = report(L, "a launch from inside a kernel");
        return cudaErrorNotSupported;
    }
    const size_t total = static_cast<size_t>(blocks) * threads;
    unsigned char* stacks = stack_pool.acquire(total);
    if (stacks == nullptr) {
        last_failure = report(L, "cannot map " + std::to_string(total) + " fiber stacks");
        return cudaErrorMemoryAllocation;
    }

    L.rng.seed(splitmix64(L.schedule.seed ^ splitmix64(L.index + 1)));
    L.fibers.resize(total);
    L.blocks.resize(blocks);
    L.position.assign(total, -1);
    L.bitmap.assign((total + 63) / 64, 0);
    std::vector<int64_t> priorities(total);
    for (size_t i = 0; i < total; ++i) priorities[i] = static_cast<int64_t>(i) + 1;
    if (L.schedule.policy == Policy::kPct) {
        std::shuffle(priorities.begin(), priorities.end(), L.rng);
        for (int i = 0; i + 1 < L.schedule.pct_depth; ++i)
            L.change_points.push_back(L.rng() % static_cast<uint64_t>(std::max<int64_t>(1, L.schedule.pct_steps)));
        std::sort(L.change_points.begin(), L.change_points.end());
    }
    const int warps = threads / kWarp;
    for (int bi = 0; bi < blocks; ++bi) {
        Block& b = L.blocks[bi];
        b.index = bi;
        b.block_idx = Dim3{static_cast<unsigned>(bi), 0, 0};
        b.num_threads = threads;
        b.warps.resize(warps);
        for (int wi = 0; wi < warps; ++wi) b.warps[wi].index = wi;
        for (int t = 0; t < threads; ++t) {
            const size_t id = static_cast<size_t>(bi) * threads + t;
            Fiber& f = L.fibers[id];
            f.id = static_cast<int>(id);
            f.block = &b;
            f.warp = &b.warps[t / kWarp];
            f.lane = t % kWarp;
            f.thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
            f.priority = priorities[id];
            b.warps[t / kWarp].lanes.push_back(&f);
            unsigned char* stack = stacks + id * kStackBytes;
#if defined(__SANITIZE_ADDRESS__)
            ASAN_UNPOISON_MEMORY_REGION(stack, kStackBytes);
#endif
            f.canary = reinterpret_cast<uint64_t*>(stack);
            *f.canary = kStackCanary;
            make_fiber(&f.context, stack, kStackBytes, &fiber_entry, &f);
            L.add_runnable(&f);
        }
    }

    current_launch = &L;
    blockDim = L.block_dim;
    gridDim = L.grid_dim;
    Fiber* first = L.pick(-1);
    L.current = first;
    switch_to(&L.host, &first->context);
    current_launch = nullptr;

    int status = L.status;
    std::string what = L.failure;
    bool all_done = true;
    for (const Fiber& f : L.fibers) all_done &= f.state == State::kExited;
    if (status == cudaSuccess && !all_done) {
        if (L.pending_expire && L.traps > 0) {
            status = cudaErrorLaunchFailure;
            what = "deadlock: no fiber could make progress, so every waiting role was timed out (" +
                   std::to_string(L.traps) + " trapped)";
        } else {
            status = cudaErrorLaunchTimeout;
            what = "deadlock: every live thread waits at a barrier or warp collective";
        }
    }
    if (status == cudaSuccess) return cudaSuccess;
    last_failure = report(L, what);
    return status;
}

}  // namespace ep_emu
