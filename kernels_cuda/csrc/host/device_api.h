// The device the host runtime launches on: CUDA (c10's current stream, device guard, GPU tensors), or
// the CPU emulation (EP_CPU_EMULATION, csrc/emu/): each runtime's own emulated stream, which carries
// the scheduler settings its launches run under, and CPU tensors.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>

#if defined(EP_CPU_EMULATION)

struct DeviceGuard {
    explicit DeviceGuard(const at::Device&) {}
};

inline bool on_launch_device(const at::Tensor& t) { return t.device().is_cpu(); }
constexpr const char* kLaunchDevice = "CPU (the emulation build runs on CPU tensors)";

// A tensor of `dtype` over memory of the launch device (a view of a region, torch::from_blob).
inline at::TensorOptions launch_device_options(at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(at::kCPU);
}

class LaunchStream {
   public:
    cudaStream_t get() { return &stream_; }

    // policy: "round_robin", "random" or "pct"; memory: "sequential" or "relaxed" (emulator.h).
    void set_schedule(const std::string& policy, uint64_t seed, int pct_depth, int64_t pct_steps, int sm_count,
                      const std::string& memory) {
        ep_emu::Schedule& s = stream_.schedule;
        if (policy == "round_robin") {
            s.policy = ep_emu::Policy::kRoundRobin;
        } else if (policy == "random") {
            s.policy = ep_emu::Policy::kRandom;
        } else if (policy == "pct") {
            s.policy = ep_emu::Policy::kPct;
        } else {
            TORCH_CHECK(false, "kernels_cuda emulation: unknown schedule policy '", policy,
                        "' (round_robin, random or pct)");
        }
        TORCH_CHECK(memory == "sequential" || memory == "relaxed", "kernels_cuda emulation: unknown memory mode '", memory,
                    "' (sequential or relaxed)");
        TORCH_CHECK(pct_depth >= 1 && pct_steps >= 1 && sm_count >= 1, "kernels_cuda emulation: bad schedule");
        s.memory = memory == "relaxed" ? ep_emu::Memory::kRelaxed : ep_emu::Memory::kSequential;
        s.seed = seed;
        s.pct_depth = pct_depth;
        s.pct_steps = pct_steps;
        s.sm_count = sm_count;
        stream_.launches = 0;
    }

    // This stream launches one rank of a group whose other ranks run in other processes (emulator.h).
    void set_peers_in_other_processes() { stream_.peers_in_other_processes = true; }

   private:
    ep_emu::Stream stream_;
};

#else

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

using DeviceGuard = c10::cuda::CUDAGuard;

inline bool on_launch_device(const at::Tensor& t) { return t.is_cuda(); }
constexpr const char* kLaunchDevice = "GPU";

inline at::TensorOptions launch_device_options(at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(at::kCUDA, c10::cuda::current_device());
}

class LaunchStream {
   public:
    cudaStream_t get() const { return c10::cuda::getCurrentCUDAStream(); }
    // GPUs run every process's kernels at once: nothing to set (the emulation's counterpart matters).
    void set_peers_in_other_processes() {}
};

#endif
