// Litmus tests of the CPU emulation's memory modes (csrc/emu/emulator.h), built and run by
// tests/kernels/test_emulation.py: a tiny hand-written kernel launched straight on the emulator under
// many seeds. Block 0 writes data = 1 and raises a flag; block 1's thread 0 waits for the flag, then
// reads the data. Each line printed is "<writer> <memory> stale=<launches whose reader saw data 0>
// failed=<launches that failed> launches=<n>", then "replay identical=<0|1>" (the same seeds again).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device.h"
#include "device/ptx.cuh"

namespace {

constexpr ep::Scope kGpu = ep::Scope::kGpu;

// How block 0 publishes its data: by thread 0 alone (the first three); through __syncwarp (lane 5 writes the
// data, lane 0 raises the flag); through __syncthreads (thread 32, of the other warp, writes the data and
// fences, thread 0 raises the flag).
enum class Writer { kRelease, kPlainFlag, kFenceVolatile, kWarpRelease, kBarrierVolatile, kBarrierFenceVolatile, kBarrierRelease };
constexpr const char* kNames[] = {"release",          "plain_flag",             "fence_volatile", "warp_release",
                                  "barrier_volatile", "barrier_fence_volatile", "barrier_release"};

struct Args {
    Writer writer;
    int* data;
    int* flag;
    int* ack;
    int* seen;
    int* own_misses;  // times the data's writer did not read back its own pending store
};

void kernel(const Args& a) {
    const int t = static_cast<int>(threadIdx.x);
    if (blockIdx.x == 1) {
        if (t != 0) return;
        while (ep::ld_acquire<kGpu>(a.flag) == 0) {
        }
        *a.seen = *a.data;
        ep::st_release<kGpu>(a.ack, 1);
        return;
    }
    const bool barrier = a.writer >= Writer::kBarrierVolatile;
    const int writer = barrier ? 32 : a.writer == Writer::kWarpRelease ? 5 : 0;
    if (t == writer) {
        ep::st_plain(a.data, 1);
        if (*a.data != 1) ++*a.own_misses;
        if (barrier || a.writer == Writer::kFenceVolatile) ep::fence_acq_rel<kGpu>();
    }
    if (barrier) __syncthreads();
    if (a.writer == Writer::kWarpRelease && t < 32) __syncwarp();
    if (t == 0) {
        switch (a.writer) {
            case Writer::kRelease:
            case Writer::kWarpRelease:
            case Writer::kBarrierRelease: ep::st_release<kGpu>(a.flag, 1); break;
            case Writer::kPlainFlag: ep::st_plain(a.flag, 1); break;
            case Writer::kFenceVolatile:
            case Writer::kBarrierVolatile: ep::st_volatile(a.flag, 1); break;
            case Writer::kBarrierFenceVolatile:
                __threadfence();
                ep::st_volatile(a.flag, 1);
                break;
        }
    }
    // The writers wait for the reader, so that nothing but the memory model publishes their stores before it looks.
    if (t == 0 || t == writer)
        while (ep::ld_acquire<kGpu>(a.ack) == 0) {
        }
}

// Per seed: 1 if the reader saw stale data, 0 if not, -1 if the launch failed.
std::vector<int> run(Writer writer, ep_emu::Memory memory, int seeds, int* own_misses) {
    std::vector<int> outcomes;
    for (int seed = 0; seed < seeds; ++seed) {
        static int data, flag, ack, seen;
        data = flag = ack = 0;
        seen = -1;
        ep_emu::Stream stream;
        stream.schedule.policy = seed % 2 == 0 ? ep_emu::Policy::kRandom : ep_emu::Policy::kPct;
        stream.schedule.seed = static_cast<uint64_t>(seed);
        stream.schedule.memory = memory;
        const Args args{writer, &data, &flag, &ack, &seen, own_misses};
        const int status = ep_emu::launch("void litmus(Params) [with Params = ep::LitmusParams]", 2, 64, &stream, false,
                                          [](const void* p) { kernel(*static_cast<const Args*>(p)); }, &args);
        if (status != 0) std::fprintf(stderr, "%s\n", ep_emu::last_report().c_str());
        outcomes.push_back(status != 0 ? -1 : seen == 0 ? 1 : 0);
    }
    return outcomes;
}

}  // namespace

int main(int argc, char** argv) {
    const int seeds = argc > 1 ? std::atoi(argv[1]) : 200;
    int own_misses = 0;
    for (int w = 0; w <= static_cast<int>(Writer::kBarrierRelease); ++w) {
        for (const ep_emu::Memory memory : {ep_emu::Memory::kSequential, ep_emu::Memory::kRelaxed}) {
            const std::vector<int> outcomes = run(static_cast<Writer>(w), memory, seeds, &own_misses);
            int stale = 0, failed = 0;
            for (const int o : outcomes) stale += o == 1, failed += o == -1;
            std::fprintf(stdout, "%s %s stale=%d failed=%d launches=%d\n", kNames[w],
                        memory == ep_emu::Memory::kRelaxed ? "relaxed" : "sequential", stale, failed, seeds);
        }
    }
    std::fprintf(stdout, "own_misses=%d\n", own_misses);
    const bool identical = run(Writer::kPlainFlag, ep_emu::Memory::kRelaxed, seeds, &own_misses) ==
                           run(Writer::kPlainFlag, ep_emu::Memory::kRelaxed, seeds, &own_misses);
    std::fprintf(stdout, "replay identical=%d\n", identical ? 1 : 0);
    return 0;
}
