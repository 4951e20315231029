// What every runtime class of kernels_cuda._C shares (the intranode Runtime, host/bindings.cpp; the
// internode runtimes, host/internode_runtime.cpp): RuntimeCore owns the launch stream, the
// host-mapped receive counts and error record the kernels write, makes the checks every launch makes
// (which ranks it covers, channels, buffer sizes) and runs get_dispatch_layout; bind_runtime_core
// binds the methods all runtime classes have. The buffers themselves are RankRegions (rank_regions.h).
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "params/diag.h"
#include "params/intranode.h"
#include "device_api.h"
#include "cuda_check.h"

// Zeroed host memory that the GPU writes through device().
template <typename T>
class HostMapped {
   public:
    explicit HostMapped(int64_t count) {
        T* host = nullptr;
        check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(T) * count, cudaHostAllocMapped), "cudaHostAlloc");
        host_.reset(host);
        std::memset(host, 0, sizeof(T) * count);
        check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host, 0), "cudaHostGetDevicePointer");
    }

    T* host() const { return host_.get(); }
    T* device() const { return device_; }

   private:
    struct FreeHost {
        void operator()(T* host) const { cudaFreeHost(host); }
    };
    std::unique_ptr<T, FreeHost> host_;
    T* device_ = nullptr;
};

// What a trapped kernel recorded: a spin loop timing out (role, rank, channel, peer and the counters it
// waited on), or a num_worst_tokens overflow.
inline std::string describe_timeout(const ep::ErrorRecord& e) {
    if (e.code == 0) return "no device timeout recorded";
    if (e.code < 0) return "a device error was being recorded when the kernel stopped";
    if (e.code == 2)
        return "num_worst_tokens too small: rank " + std::to_string(e.rank) + " receives " + std::to_string(e.tail) +
               " rows (or RDMA records), more than num_worst_tokens=" + std::to_string(e.expected);
    return "device timeout: role=" + std::to_string(e.role) + " rank=" + std::to_string(e.rank) +
           " channel=" + std::to_string(e.channel) + " peer=" + std::to_string(e.peer) +
           " head=" + std::to_string(e.head) + " tail=" + std::to_string(e.tail) +
           " expected=" + std::to_string(e.expected);
}

class RuntimeCore {
   public:
    RuntimeCore(const RuntimeCore&) = delete;
    RuntimeCore& operator=(const RuntimeCore&) = delete;
    virtual ~RuntimeCore() = default;

    // (tokens per rank, per node, per expert, is_token_in_rank) of `topk_idx`, on this runtime's stream.
    std::vector<at::Tensor> dispatch_layout(const at::Tensor& topk_idx, int num_experts, int num_ranks,
                                            int ranks_per_node) {
        TORCH_CHECK(on_launch_device(topk_idx) && topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong &&
                        topk_idx.is_contiguous(),
                    "kernels_cuda: topk_idx must be a contiguous int64 [N, K] tensor on the ", kLaunchDevice);
        TORCH_CHECK(num_experts % num_ranks == 0 && num_ranks % ranks_per_node == 0,
                    "kernels_cuda: experts must split evenly over ranks, ranks over nodes");
        const DeviceGuard guard(topk_idx.device());
        auto ints = topk_idx.options().dtype(at::kInt);
        auto per_rank = at::empty({num_ranks}, ints);
        auto per_node = at::empty({num_ranks / ranks_per_node}, ints);
        auto per_expert = at::empty({num_experts}, ints);
        auto in_rank = at::empty({topk_idx.size(0), num_ranks}, topk_idx.options().dtype(at::kBool));
        ep::LayoutParams p{topk_idx.data_ptr<int64_t>(), static_cast<int>(topk_idx.size(0)),
                           static_cast<int>(topk_idx.size(1)), num_experts, num_ranks, ranks_per_node,
                           per_rank.data_ptr<int>(), per_node.data_ptr<int>(), per_expert.data_ptr<int>(),
                           in_rank.data_ptr<bool>()};
        check_cuda(ep::launch_get_dispatch_layout(p, stream_.get()), "get_dispatch_layout");
        return {per_rank, per_node, per_expert, in_rank};
    }

    std::vector<int> error_record() const {
        const ep::ErrorRecord& e = *error_.host();
        return {e.code, e.role, e.rank, e.channel, e.peer, e.head, e.tail, e.expected};
    }

    LaunchStream& launch_stream() { return stream_; }

   protected:
    // `world_size` is checked by the subclass (a static check in its initialiser list, so that it is
    // checked first). Backend::kEmulated: this process emulates every rank of the world and launches
    // them together; else it launches `rank` only, whose peers run in other processes.
    RuntimeCore(int world_size, int rank, ep::Backend backend)
        : world_size_(world_size), launch_rank_(backend == ep::Backend::kEmulated ? -1 : rank), backend_(backend) {
        TORCH_CHECK(every_rank() || (rank >= 0 && rank < world_size), "kernels_cuda: bad rank ", rank);
        if (!every_rank()) stream_.set_peers_in_other_processes();
    }

    bool every_rank() const { return backend_ == ep::Backend::kEmulated; }

    static void check_buffer_bytes(int64_t bytes) {
        TORCH_CHECK(bytes % ep::kBufferAlign == 0, "kernels_cuda: buffer bytes must be a multiple of ", ep::kBufferAlign);
    }

    // `buffer` needs `need` bytes of the `have` it was created with.
    static void check_fits(const char* buffer, int64_t need, int64_t have) {
        TORCH_CHECK(need <= have, "kernels_cuda: ", buffer, " too small: need ", need, " bytes, have ", have);
    }

    // A rank named by a launch: in the world, and this process's own unless it emulates every rank.
    void check_launch_rank(int rank) const {
        TORCH_CHECK(rank >= 0 && rank < world_size_, "kernels_cuda: bad rank ", rank);
        TORCH_CHECK(every_rank() || rank == launch_rank_, "kernels_cuda: this runtime launches rank ", launch_rank_,
                    " only, not ", rank);
    }

    // Checks and fills what every kernel parameter block has: the number of ranks launched (up to the
    // world when emulating every rank, else one), channels, timeout and the error record.
    template <typename Params>
    void fill_launch(Params& p, size_t launch_ranks, int num_channels, int64_t timeout_cycles) const {
        TORCH_CHECK(launch_ranks >= 1 && static_cast<int>(launch_ranks) <= (every_rank() ? world_size_ : 1),
                    "kernels_cuda: wrong number of ranks in this launch");
        TORCH_CHECK(num_channels >= 1 && num_channels <= ep::kMaxChannels, "kernels_cuda: bad number of channels");
        p.num_launch_ranks = static_cast<int>(launch_ranks);
        p.num_channels = num_channels;
        p.timeout_cycles = timeout_cycles;
        p.error = error_.device();
    }

    // Where launch rank i's notify publishes its receive counts (device addresses of host-mapped
    // ints), each reset to -1 here: rows, records received over RDMA (internode only) and rows per
    // local expert.
    struct CountSlots {
        int* rows;
        int* rdma_records;
        int* expert_rows;
    };
    CountSlots reset_counts(int i, int local_experts) {
        rows_.host()[i] = -1;
        rdma_records_.host()[i] = -1;
        for (int e = 0; e < local_experts; ++e) expert_rows_.host()[i * ep::kMaxLocalExperts + e] = -1;
        return {rows_.device() + i, rdma_records_.device() + i, expert_rows_.device() + i * ep::kMaxLocalExperts};
    }

    // Host wait (with its own timeout) for every count reset_counts reset, the RDMA records only when
    // `rdma_records`: a weakly ordered host (e.g. aarch64) could otherwise read an expert count of the
    // previous op after seeing this op's rows.
    void wait_counts(int num_launch_ranks, int local_experts, bool rdma_records, double timeout_s) const {
        const volatile int* rows = rows_.host();
        const volatile int* records = rdma_records_.host();
        const volatile int* experts = expert_rows_.host();
        const auto ready = [&](int i) {
            if (rows[i] < 0 || (rdma_records && records[i] < 0)) return false;
            for (int e = 0; e < local_experts; ++e)
                if (experts[i * ep::kMaxLocalExperts + e] < 0) return false;
            return true;
        };
        const auto describe = [&] {
            std::string text;
            for (int j = 0; j < num_launch_ranks; ++j)
                text += std::to_string(rows[j]) + (rdma_records ? "/" + std::to_string(records[j]) : "") + " ";
            return std::string("kernels_cuda: timeout waiting for the receive counts ") +
                   (rdma_records ? "(internode dispatch CPU); rows/RDMA records per rank: " : "(dispatch CPU); counters: ") +
                   text + "(-1 = notify never finished); " + describe_timeout(*error_.host());
        };
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        for (int i = 0; i < num_launch_ranks; ++i) {
            while (!ready(i)) {
                TORCH_CHECK(std::chrono::steady_clock::now() <= deadline, describe());
                std::this_thread::yield();
            }
        }
    }

    // The counts wait_counts waited for.
    int rows(int i) const { return rows_.host()[i]; }
    int rdma_records(int i) const { return rdma_records_.host()[i]; }
    std::vector<int> expert_rows(int i, int local_experts) const {
        const int* first = expert_rows_.host() + i * ep::kMaxLocalExperts;
        return std::vector<int>(first, first + local_experts);
    }

    const int world_size_;
    const int launch_rank_;  // -1: every rank
    const ep::Backend backend_;
    LaunchStream stream_;

   private:
    // By launch index: a launch covers at most kMaxEmulatedRanks ranks (kMaxRanks intranode).
    static_assert(ep::kMaxRanks <= ep::kMaxEmulatedRanks, "the count slots serve intranode launches too");
    HostMapped<int> rows_{ep::kMaxEmulatedRanks};
    HostMapped<int> rdma_records_{ep::kMaxEmulatedRanks};
    HostMapped<int> expert_rows_{static_cast<int64_t>(ep::kMaxEmulatedRanks) * ep::kMaxLocalExperts};
    HostMapped<ep::ErrorRecord> error_{1};
};

// The methods every runtime class binds alike: error_record and, in the CPU emulation, set_schedule
// (the fiber scheduler its launches run under, device_api.h).
template <typename Runtime, typename... Options>
void bind_runtime_core(py::class_<Runtime, Options...>& cls) {
    cls.def("error_record", &Runtime::error_record);
#if defined(EP_CPU_EMULATION)
    cls.def("set_schedule", [](Runtime& r, const std::string& policy, uint64_t seed, int depth, int64_t steps,
                               int sm_count, const std::string& memory) {
        r.launch_stream().set_schedule(policy, seed, depth, steps, sm_count, memory);
    });
#endif
}
