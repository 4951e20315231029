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
#include <unordered_map>
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
constexpr int kMaxWarps = 32;  // of a block (1024 threads): warp masks are 32 bits
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
constexpr size_t kMaxTrackedBytes = 16;              // relaxed memory: the widest tracked store (an int4)
constexpr uint64_t kPublishOdds = 8;                 // ... a switch point publishes a pending store with odds 1/8

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

const char* memory_name(Memory memory) { return memory == Memory::kRelaxed ? "relaxed" : "sequential"; }

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

// --- the relaxed memory mode (Memory::kRelaxed) ---------------------------------------------------------
// A tracked store (st_plain, st_int4) is pending until it is published, i.e. visible to every fiber. Who
// sees a pending store follows PTX's rules for weak stores:
//  * the storing thread, at once;
//  * a warp collective grants the pending stores of its lanes to their warp, a barrier grants those that
//    any participant sees to every participant's warp (both order memory among the threads taking part);
//  * a release (st_release, atomic_add_release) publishes every pending store the releasing thread sees
//    (a release is cumulative); a strong relaxed write (atomicAdd/atomicCAS, st_volatile) publishes those it
//    saw at its thread's last fence (PTX's release pattern is a fence, then a strong write); a fence alone
//    publishes nothing;
//  * stores become visible eventually, in any order: a thread's exit or trap publishes its own; a switch
//    point of a fiber publishes one pending store it sees, picked at random, with odds 1 / kPublishOdds;
//    when every runnable fiber spins, a random half of all pending stores is published (and deadlock
//    detection starts over); the end of the launch publishes the rest.
// Loads need no instrumentation: memory always shows what the running fiber sees. A tracked store writes
// memory at once and keeps the bytes it replaced; when the scheduler switches fibers, the pending stores
// the old fiber sees and the new one does not are undone (their replaced bytes written back) and those
// the new one sees are redone (replacing the bytes there now). A 4-byte word has at most one pending store
// (a store to a word that has one publishes that first, unless it is the same thread's store of the same
// width since its last fence, which it replaces), so undoing and redoing never depend on each other.
struct PendingStore {
    unsigned char* address = nullptr;
    uint32_t size = 0;
    uint32_t slot = 0;        // index in its list: the owner's `own`, or once granted its block's `granted`
    Fiber* owner = nullptr;
    uint32_t warps = 0;       // warps of the owner's block that see it since `granted_at` (0: the owner only)
    uint32_t late_warps = 0;  // warps granted later, seeing it since `late_at`, the first of those grants (earlier
                              // than the others: only more is published)
    uint64_t created = 0, granted_at = 0, late_at = 0;
    bool applied = false;     // its bytes are in memory: the running fiber sees it
    unsigned char bytes[kMaxTrackedBytes];
    unsigned char replaced[kMaxTrackedBytes];
};

// Its state lives here, not in the fibers and blocks, and the hooks the scheduler calls are not inlined:
// the sequential mode's data and hot paths stay as they were.
struct RelaxedMemory {
    struct FiberState {
        std::vector<uint32_t> own;  // its pending stores that only it sees
        uint64_t fence_tick = 0;    // the tick of its last fence
    };
    struct BlockState {
        std::vector<uint32_t> granted;  // pending stores of its threads that some of its warps see
        int seen_by[kMaxWarps] = {};    // how many of them each warp sees
    };
    std::vector<FiberState> fibers;  // by Fiber::id
    std::vector<BlockState> blocks;  // by Block::index
    std::vector<PendingStore> stores;  // pending ones are in some fiber's `own` or some block's `granted`
    std::vector<uint32_t> unused;
    std::unordered_map<uintptr_t, uint32_t> by_word;  // word address / 4 -> its pending store
    size_t pending = 0;
    uint64_t tick = 0;  // orders stores, grants and fences
    std::mt19937_64 rng;

    void start(size_t num_fibers, size_t num_blocks) {
        fibers.resize(num_fibers);
        blocks.resize(num_blocks);
    }
    std::vector<uint32_t>& own(const Fiber* f) { return fibers[f->id].own; }
    uint64_t& fence_tick(const Fiber* f) { return fibers[f->id].fence_tick; }
    BlockState& block_of(const Fiber* f) { return blocks[f->block->index]; }

    static uintptr_t word(const void* address) { return reinterpret_cast<uintptr_t>(address) >> 2; }

    // A granted store: a warp of its block sees it (the owner's warp always does).
    static bool warp_sees(const PendingStore& s, int warp) { return ((s.warps | s.late_warps) >> warp) & 1u; }
    static uint64_t seen_since(const PendingStore& s, const Fiber* f) {
        if (s.owner == f) return s.created;
        return ((s.warps >> f->warp->index) & 1u) ? s.granted_at : s.late_at;
    }

    // Inlined for the common widths (an int4, a word): every switch between fibers runs these.
    static void copy(unsigned char* to, const unsigned char* from, uint32_t size) {
        if (size == 16)
            std::memcpy(to, from, 16);
        else if (size == 4)
            std::memcpy(to, from, 4);
        else
            std::memcpy(to, from, size);
    }
    static void redo(PendingStore& s) {
        copy(s.replaced, s.address, s.size);
        copy(s.address, s.bytes, s.size);
        s.applied = true;
    }
    static void undo(PendingStore& s) {
        copy(s.address, s.replaced, s.size);
        s.applied = false;
    }

    std::vector<uint32_t>& list_of(const PendingStore& s) { return s.warps != 0 ? block_of(s.owner).granted : own(s.owner); }
    void link(uint32_t id, std::vector<uint32_t>& list) {
        stores[id].slot = static_cast<uint32_t>(list.size());
        list.push_back(id);
    }

    static void count_seen(BlockState& b, uint32_t warps, int delta) {
        for (; warps != 0; warps &= warps - 1) b.seen_by[__builtin_ctz(warps)] += delta;
    }

    void publish(uint32_t id) {
        PendingStore& s = stores[id];
        if (!s.applied) std::memcpy(s.address, s.bytes, s.size);  // undone: memory holds what every fiber sees
        count_seen(block_of(s.owner), s.warps | s.late_warps, -1);
        std::vector<uint32_t>& list = list_of(s);
        const uint32_t moved = list.back();
        list[s.slot] = moved;
        stores[moved].slot = s.slot;
        list.pop_back();
        for (uint32_t at = 0; at < s.size; at += 4) by_word.erase(word(s.address + at));
        unused.push_back(id);
        --pending;
    }

    template <typename Which>
    void publish_if(std::vector<uint32_t>& list, Which which) {
        for (size_t i = list.size(); i-- > 0;)  // publish() moves the last entry into i: already visited
            if (which(stores[list[i]])) publish(list[i]);
    }

    void publish_words(const unsigned char* address, size_t size) {
        for (size_t at = 0; at < size; at += 4) {
            const auto found = by_word.find(word(address + at));
            if (found != by_word.end()) publish(found->second);
        }
    }

    [[gnu::noinline]] void store(Fiber* f, void* ptr, const void* value, size_t size) {
        unsigned char* address = static_cast<unsigned char*>(ptr);
        const auto found = by_word.find(word(address));
        if (found != by_word.end()) {
            PendingStore& s = stores[found->second];
            if (s.owner == f && s.address == address && s.size == size && s.warps == 0 && s.created > fence_tick(f)) {
                std::memcpy(s.bytes, value, size);
                std::memcpy(address, value, size);
                return;
            }
        }
        publish_words(address, size);
        uint32_t id;
        if (unused.empty()) {
            id = static_cast<uint32_t>(stores.size());
            stores.emplace_back();
        } else {
            id = unused.back();
            unused.pop_back();
        }
        PendingStore& s = stores[id];
        s = PendingStore{};
        s.address = address;
        s.size = static_cast<uint32_t>(size);
        s.owner = f;
        s.created = ++tick;
        std::memcpy(s.bytes, value, size);
        redo(s);
        link(id, own(f));
        for (uint32_t at = 0; at < s.size; at += 4) by_word[word(address + at)] = id;
        ++pending;
    }

    // `f` writes [ptr, ptr + size) with an atomic, release or strong store next: it publishes what that
    // write releases, and any pending store to those words goes first (coherence).
    [[gnu::noinline]] void before_write(Fiber* f, const void* ptr, size_t size, bool release) {
        if (pending == 0) return;
        const uint64_t until = release ? UINT64_MAX : fence_tick(f);
        publish_if(own(f), [&](const PendingStore& s) { return s.created <= until; });
        const int warp = f->warp->index;
        publish_if(block_of(f).granted, [&](const PendingStore& s) { return warp_sees(s, warp) && seen_since(s, f) <= until; });
        publish_words(static_cast<const unsigned char*>(ptr), size);
    }

    void fence(const Fiber* f) { fence_tick(f) = ++tick; }

    // `p`'s own pending stores become visible to `warps` (of its block); `running` sees what it sees.
    void grant_own(const Fiber* p, uint32_t warps, uint64_t now, const Fiber* running) {
        BlockState& b = block_of(p);
        for (const uint32_t id : own(p)) {
            PendingStore& s = stores[id];
            s.warps = warps;
            s.granted_at = now;
            count_seen(b, warps, 1);
            link(id, b.granted);
            if (!s.applied && warp_sees(s, running->warp->index)) redo(s);
        }
        own(p).clear();
    }

    [[gnu::noinline]] void grant_collective(Warp& w, unsigned mask, const Fiber* running) {
        if (pending == 0) return;
        const uint64_t now = ++tick;
        for (int j = 0; j < kWarp; ++j)
            if ((mask >> j) & 1u) grant_own(w.lanes[j], 1u << w.index, now, running);
    }

    [[gnu::noinline]] void grant_barrier(const std::vector<Fiber*>& waiting, const Fiber* last) {
        if (pending == 0) return;
        uint32_t warps = 1u << last->warp->index;
        for (const Fiber* p : waiting) warps |= 1u << p->warp->index;
        const uint64_t now = ++tick;
        BlockState& b = block_of(last);
        for (const uint32_t id : b.granted) {
            PendingStore& s = stores[id];
            const uint32_t seen = s.warps | s.late_warps;
            if ((seen & warps) == 0 || (warps & ~seen) == 0) continue;
            if (s.late_warps == 0) s.late_at = now;
            s.late_warps |= warps & ~seen;
            count_seen(b, warps & ~seen, 1);
            if (!s.applied && warp_sees(s, last->warp->index)) redo(s);
        }
        for (const Fiber* p : waiting) grant_own(p, warps, now, last);
        grant_own(last, warps, now, last);
    }

    // The running fiber changes from `from` to `to`: memory shows what `to` sees.
    [[gnu::noinline]] void switch_view(const Fiber* from, const Fiber* to) {
        if (pending == 0) return;
        for (const uint32_t id : own(from)) undo(stores[id]);
        const int warp = to->warp->index;
        BlockState &from_block = block_of(from), &to_block = block_of(to);
        const bool from_sees = from_block.seen_by[from->warp->index] > 0, to_sees = to_block.seen_by[warp] > 0;
        if (from->block != to->block) {
            if (from_sees)
                for (const uint32_t id : from_block.granted)
                    if (stores[id].applied) undo(stores[id]);
            if (to_sees)
                for (const uint32_t id : to_block.granted)
                    if (warp_sees(stores[id], warp)) redo(stores[id]);
        } else if (from->warp != to->warp && (from_sees || to_sees)) {
            for (const uint32_t id : from_block.granted) {
                PendingStore& s = stores[id];
                const bool seen = warp_sees(s, warp);
                if (seen && !s.applied) redo(s);
                if (!seen && s.applied) undo(s);
            }
        }
        for (const uint32_t id : own(to)) redo(stores[id]);
    }

    // `f` stops running, for good if it `exits` (its stores become visible then), and `next` runs. (Back to
    // the host instead, the launch is over and publish_all follows.)
    [[gnu::noinline]] void leave(const Fiber* f, const Fiber* next, bool exits) {
        if (pending == 0) return;
        if (exits) {
            publish_if(own(f), [](const PendingStore&) { return true; });
            publish_if(block_of(f).granted, [&](const PendingStore& s) { return s.owner == f; });
        }
        switch_view(f, next);
    }

    [[gnu::noinline]] void publish_at_random(const Fiber* f) {
        if (pending == 0 || rng() % kPublishOdds != 0) return;
        const std::vector<uint32_t>& mine = own(f);
        const std::vector<uint32_t>& granted = block_of(f).granted;
        const size_t all = mine.size() + granted.size();
        if (all == 0) return;
        const size_t pick = rng() % all;
        if (pick < mine.size())
            publish(mine[pick]);
        else if (warp_sees(stores[granted[pick - mine.size()]], f->warp->index))
            publish(granted[pick - mine.size()]);
    }

    // A random half of the pending stores (at least one); false when none is pending.
    [[gnu::noinline]] bool publish_some() {
        if (pending == 0) return false;
        const size_t before = pending;
        const auto coin = [&](const PendingStore&) { return (rng() & 1u) != 0; };
        for (FiberState& f : fibers) publish_if(f.own, coin);
        for (BlockState& b : blocks) publish_if(b.granted, coin);
        if (pending < before) return true;
        for (FiberState& f : fibers)
            if (!f.own.empty()) {
                publish(f.own[0]);
                return true;
            }
        for (BlockState& b : blocks)
            if (!b.granted.empty()) {
                publish(b.granted[0]);
                return true;
            }
        return true;
    }

    [[gnu::noinline]] void publish_all() {
        if (pending == 0) return;
        const auto all = [](const PendingStore&) { return true; };
        for (FiberState& f : fibers) publish_if(f.own, all);
        for (BlockState& b : blocks) publish_if(b.granted, all);
    }
};

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

}  // namespace

thread_local bool relaxed_memory __attribute__((tls_model("initial-exec"))) = false;

namespace {

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

    // Last, so that the scheduler's fields above keep their small offsets (and its code its size).
    bool relaxed = false;  // Schedule::memory is kRelaxed
    RelaxedMemory memory;

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
        if (relaxed) memory.switch_view(f, next);
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
            if (relaxed) memory.leave(f, next, exits);
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
        if (relaxed && memory.publish_some()) {  // they may wait for stores still pending
            note_change();
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
    void require_converged(Fiber* f, const char* doing, const char* what = "") {
        Warp& w = *f->warp;
        if (w.at_barrier == 0) return;
        fail(cudaErrorIllegalInstruction,
             where(f) + " " + doing + what + " while " + std::to_string(w.at_barrier) + " lane(s) of its warp wait at " +
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
            " memory=" + memory_name(L.schedule.memory) + ", launch " + std::to_string(L.index) + " of its stream (the same seed replays it)";
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
    if (L.relaxed) L.memory.publish_at_random(f);
    if (L.schedule.policy == Policy::kPct) {
        if (spin) L.demote(f);
        while (L.next_change < L.change_points.size() && L.steps >= L.change_points[L.next_change]) {
            L.demote(f);
            ++L.next_change;
        }
    }
    Fiber* next = L.pick(f->id);
    if (next != f) L.switch_from(f, next);
    if (event == Event::kFence && L.relaxed) L.memory.fence(f);
}

}  // namespace

void yield(Event event) { yield_at(event, __builtin_return_address(0)); }

void tracked_store(void* ptr, const void* value, size_t size) {
    Launch& L = launch_state();
    if (size > kMaxTrackedBytes || size % 4 != 0 || reinterpret_cast<uintptr_t>(ptr) % 4 != 0)
        L.fail(cudaErrorIllegalInstruction, L.where(L.current) + ": a tracked store must be 4-byte aligned words, at most " +
                                                std::to_string(kMaxTrackedBytes) + " bytes");
    L.memory.store(L.current, ptr, value, size);
}

void before_write(const void* ptr, size_t size, bool release) {
    Launch& L = launch_state();
    L.memory.before_write(L.current, ptr, size, release);
}

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
    const char* name = collective_name(kind);  // the failure messages are built only when a launch fails
    if (((mask >> lane) & 1u) == 0) L.fail(cudaErrorIllegalInstruction, L.where(f) + " calls " + name + " with a mask that excludes itself");
    L.require_converged(f, "reaches ", name);
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
    if (L.relaxed) L.memory.grant_collective(w, mask, f);
    w.arrived = 0;
    return f->collective_result;
}

void block_barrier(int id, int threads, bool aligned) {
    Launch& L = launch_state();
    Fiber* f = L.current;
    Block& b = *f->block;
    Warp& w = *f->warp;
    if (id < 0 || id >= kMaxBarriers) L.fail(cudaErrorIllegalInstruction, L.where(f) + ": barrier id " + std::to_string(id) + " out of range");
    const int expected = threads < 0 ? b.num_threads : threads;
    if (expected <= 0 || expected % kWarp != 0 || expected > b.num_threads)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + ": " + barrier_name(id) + " over " + std::to_string(expected) +
                                                " threads (must be a multiple of 32, at most the block's)");
    if (threads < 0 && b.exited > 0)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches __syncthreads after " + std::to_string(b.exited) +
                                                " thread(s) of its block exited");
    if (aligned && w.arrived > 0)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + barrier_name(id) + " while lanes of its warp wait at " + collective_name(w.kind));
    if (aligned && w.at_barrier > 0 && w.barrier_id != id)
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + barrier_name(id) + " while lanes of its warp wait at " + barrier_name(w.barrier_id));
    Barrier& bar = b.barriers[id];
    if (bar.waiting.empty()) {
        bar.expected = expected;
    } else if (bar.expected != expected) {
        L.fail(cudaErrorIllegalInstruction, L.where(f) + " reaches " + barrier_name(id) + " counting " + std::to_string(expected) +
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
    if (L.relaxed) L.memory.grant_barrier(bar.waiting, f);
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
    L.relaxed = L.schedule.memory == Memory::kRelaxed;
    if (L.relaxed && L.cross_process) {  // undoing a pending store would show its peers the value going back
        last_failure = report(L, "the relaxed memory mode needs every rank of the group in this process's launch");
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
    if (L.relaxed) {  // it draws from a random stream of its own: the scheduler's choices stay those of the seed
        L.memory.rng.seed(splitmix64(splitmix64(L.schedule.seed ^ splitmix64(L.index + 1)) ^ 0x6d656d6f7279ULL));
        L.memory.start(total, blocks);
    }
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
    relaxed_memory = L.relaxed;
    blockDim = L.block_dim;
    gridDim = L.grid_dim;
    Fiber* first = L.pick(-1);
    L.current = first;
    switch_to(&L.host, &first->context);
    current_launch = nullptr;
    relaxed_memory = false;
    if (L.relaxed) L.memory.publish_all();

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
