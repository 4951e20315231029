// Host side of the internode kernels on EMULATED ranks: nodes x GPUs ranks on one GPU, each rank an
// RDMA region and an NVLink region (slices of two allocations), host-mapped counters and error
// record, validation (validate_internode) and the parameter blocks from per-rank dicts.
// The NVSHMEM back end (one rank per process, the RDMA region in NVSHMEM's symmetric heap, set up
// with a unique id broadcast through torch.distributed) needs its own host initialisation, not
// written yet: the kernels have the Backend::kNvshmem slot (EP_WITH_NVSHMEM builds).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../ep_internode_params.h"
#include "internode_runtime.h"
#include "tensor_args.h"

namespace {

ep::InternodeConfig config_of(const py::dict& s) {
    return {s["num_channels"].cast<int>(), s["nvl_chunk"].cast<int>(), s["nvl_capacity"].cast<int>(),
            s["rdma_chunk"].cast<int>(), s["rdma_capacity"].cast<int>()};
}

template <typename T>
T* mapped(int64_t count, T** device) {
    T* host = nullptr;
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(T) * count, cudaHostAllocMapped), "cudaHostAlloc");
    std::memset(host, 0, sizeof(T) * count);
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(device), host, 0), "cudaHostGetDevicePointer");
    return host;
}

class EmulatedInternodeRuntime {
   public:
    EmulatedInternodeRuntime(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes)
        : nodes_(num_nodes), gpus_(gpus), rdma_bytes_(rdma_bytes), nvl_bytes_(nvl_bytes) {
        TORCH_CHECK(num_nodes >= 2 && num_nodes <= ep::kMaxRdmaPeers && gpus >= 1 && gpus <= ep::kMaxNvlPeers &&
                        num_nodes * gpus <= ep::kMaxEmulatedRanks,
                    "kernels_cuda: emulated internode needs 2..", ep::kMaxRdmaPeers, " nodes of 1..", ep::kMaxNvlPeers,
                    " GPUs, at most ", ep::kMaxEmulatedRanks, " ranks");
        TORCH_CHECK(rdma_bytes % ep::kBufferAlign == 0 && nvl_bytes % ep::kBufferAlign == 0,
                    "kernels_cuda: buffer bytes must be multiples of ", ep::kBufferAlign);
        const int64_t ranks = static_cast<int64_t>(num_nodes) * gpus;
        check_cuda(cudaMalloc(&rdma_, rdma_bytes * ranks), "cudaMalloc(RDMA regions)");
        check_cuda(cudaMalloc(&nvl_, nvl_bytes * ranks), "cudaMalloc(NVLink regions)");
        check_cuda(cudaMemset(rdma_, 0, rdma_bytes * ranks), "cudaMemset");
        check_cuda(cudaMemset(nvl_, 0, nvl_bytes * ranks), "cudaMemset");
        recv_counter_ = mapped(ep::kMaxEmulatedRanks, &d_recv_counter_);
        recv_rdma_counter_ = mapped(ep::kMaxEmulatedRanks, &d_recv_rdma_counter_);
        recv_expert_counter_ = mapped(static_cast<int64_t>(ep::kMaxEmulatedRanks) * ep::kMaxLocalExperts, &d_recv_expert_counter_);
        error_ = mapped(1, &d_error_);
    }

    ~EmulatedInternodeRuntime() {
        cudaFree(rdma_);
        cudaFree(nvl_);
        cudaFreeHost(recv_counter_);
        cudaFreeHost(recv_rdma_counter_);
        cudaFreeHost(recv_expert_counter_);
        cudaFreeHost(error_);
    }

    // Count exchange; resets this launch's mapped counters to -1 first.
    void notify(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::InternodeNotifyParams p{};
        common(ranks.size(), s, 16, &p.num_launch_ranks, &p.num_nodes, &p.gpus, &p.num_channels, &p.layout,
               &p.timeout_cycles, &p.error);
        p.num_experts = s["num_experts"].cast<int>();
        TORCH_CHECK(p.num_experts % (nodes_ * gpus_) == 0 && p.num_experts / (nodes_ * gpus_) <= ep::kMaxLocalExperts,
                    "kernels_cuda: bad number of experts");
        p.expert_alignment = s["expert_alignment"].cast<int>();
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::InternodeNotifyRankArgs& a = p.ranks[i];
            a.peers = peers_of(d["rank"].cast<int>());
            a.num_tokens = d["num_tokens"].cast<int>();
            a.num_tokens_per_rank = ptr<int>(d, "num_tokens_per_rank");
            a.num_tokens_per_node = ptr<int>(d, "num_tokens_per_node");
            a.num_tokens_per_expert = ptr<int>(d, "num_tokens_per_expert");
            a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
            a.rdma_channel_prefix_matrix = ptr<int>(d, "rdma_channel_prefix_matrix");
            a.gbl_channel_prefix_matrix = ptr<int>(d, "gbl_channel_prefix_matrix");
            a.recv_rdma_rank_prefix_sum = ptr<int>(d, "recv_rdma_rank_prefix_sum");
            a.recv_gbl_rank_prefix_sum = ptr<int>(d, "recv_gbl_rank_prefix_sum");
            recv_counter_[i] = -1;
            recv_rdma_counter_[i] = -1;
            a.recv_counter = d_recv_counter_ + i;
            a.recv_rdma_counter = d_recv_rdma_counter_ + i;
            a.recv_expert_counter = d_recv_expert_counter_ + i * ep::kMaxLocalExperts;
        }
        check_cuda(ep::launch_internode_notify(p, ep::Backend::kEmulated, c10::cuda::getCurrentCUDAStream()), "internode notify");
    }

    // Per launch rank: (rows to receive, records to receive over RDMA, rows per local expert).
    std::vector<std::tuple<int, int, std::vector<int>>> wait_recv_counts(int num_launch_ranks, int local_experts,
                                                                         double timeout_s) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        std::vector<std::tuple<int, int, std::vector<int>>> out;
        for (int i = 0; i < num_launch_ranks; ++i) {
            volatile int* counter = recv_counter_ + i;
            volatile int* rdma_counter = recv_rdma_counter_ + i;
            while (*counter < 0 || *rdma_counter < 0) {
                if (std::chrono::steady_clock::now() > deadline) {
                    std::string counters;
                    for (int j = 0; j < num_launch_ranks; ++j)
                        counters += std::to_string(recv_counter_[j]) + "/" + std::to_string(recv_rdma_counter_[j]) + " ";
                    TORCH_CHECK(false, "kernels_cuda: timeout waiting for the receive counts (internode dispatch CPU); "
                                       "rows/RDMA records per rank: ", counters, "(-1 = notify never finished); ",
                                describe_error());
                }
                std::this_thread::yield();
            }
            std::vector<int> experts(local_experts);
            for (int e = 0; e < local_experts; ++e) experts[e] = recv_expert_counter_[i * ep::kMaxLocalExperts + e];
            out.emplace_back(*counter, *rdma_counter, experts);
        }
        return out;
    }

    void cached_notify(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::InternodeCachedNotifyParams p{};
        common(ranks.size(), s, 16, &p.num_launch_ranks, &p.num_nodes, &p.gpus, &p.num_channels, &p.layout,
               &p.timeout_cycles, &p.error);
        p.rewrite_heads = s["rewrite_heads"].cast<bool>();
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::InternodeCachedNotifyRankArgs& a = p.ranks[i];
            a.peers = peers_of(d["rank"].cast<int>());
            a.num_tokens = d["num_tokens"].cast<int>();
            if (!p.rewrite_heads) continue;
            a.send_rdma_head = ptr<int>(d, "send_rdma_head");
            a.rdma_channel_prefix_matrix = ptr<int>(d, "rdma_channel_prefix_matrix");
            a.send_nvl_head = ptr<int>(d, "send_nvl_head");
            a.recv_rdma_rank_prefix_sum = ptr<int>(d, "recv_rdma_rank_prefix_sum");
            a.recv_rdma_channel_offset = ptr<int>(d, "recv_rdma_channel_offset");
        }
        check_cuda(ep::launch_internode_cached_notify(p, ep::Backend::kEmulated, c10::cuda::getCurrentCUDAStream()),
                   "internode cached notify");
    }

    void dispatch(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::InternodeDispatchParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>(), num_topk = s["num_topk"].cast<int>();
        p.num_scales = s["num_scales"].cast<int>();
        p.record = ep::internode_dispatch_record(hidden_bytes, p.num_scales, num_topk);
        common(ranks.size(), s, p.record.bytes, &p.num_launch_ranks, &p.num_nodes, &p.gpus, &p.num_channels, &p.layout,
               &p.timeout_cycles, &p.error);
        validate(s, hidden_bytes, num_topk);
        p.hidden_int4 = hidden_bytes / 16;
        p.num_topk = num_topk;
        p.num_experts = s["num_experts"].cast<int>();
        p.nvl_chunk = s["nvl_chunk"].cast<int>();
        p.rdma_chunk = s["rdma_chunk"].cast<int>();
        p.stalled_rank = s["stalled_rank"].cast<int>();
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::InternodeDispatchRankArgs& a = p.ranks[i];
            a.peers = peers_of(d["rank"].cast<int>());
            a.num_tokens = d["num_tokens"].cast<int>();
            a.x = ptr<void>(d, "x");
            a.x_scales = ptr_or_null<float>(d, "x_scales");
            a.scale_token_stride = d["scale_token_stride"].cast<int64_t>();
            a.scale_hidden_stride = d["scale_hidden_stride"].cast<int64_t>();
            a.topk_idx = ptr_or_null<int64_t>(d, "topk_idx");
            a.topk_weights = ptr_or_null<float>(d, "topk_weights");
            a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
            a.rdma_channel_prefix_matrix = ptr<int>(d, "rdma_channel_prefix_matrix");
            a.gbl_channel_prefix_matrix = ptr<int>(d, "gbl_channel_prefix_matrix");
            a.recv_rdma_rank_prefix_sum = ptr<int>(d, "recv_rdma_rank_prefix_sum");
            a.recv_gbl_rank_prefix_sum = ptr<int>(d, "recv_gbl_rank_prefix_sum");
            a.recv_x = ptr<void>(d, "recv_x");
            a.recv_x_scales = ptr_or_null<float>(d, "recv_x_scales");
            a.recv_src_idx = ptr<int>(d, "recv_src_idx");
            a.recv_topk_idx = ptr_or_null<int64_t>(d, "recv_topk_idx");
            a.recv_topk_weights = ptr_or_null<float>(d, "recv_topk_weights");
            a.recv_rdma_channel_offset = ptr<int>(d, "recv_rdma_channel_offset");
            a.recv_gbl_channel_offset = ptr<int>(d, "recv_gbl_channel_offset");
            a.send_rdma_head = ptr<int>(d, "send_rdma_head");
            a.send_nvl_head = ptr<int>(d, "send_nvl_head");
        }
        check_cuda(ep::launch_internode_dispatch(p, ep::Backend::kEmulated, c10::cuda::getCurrentCUDAStream()),
                   "internode dispatch");
    }

    void combine(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::InternodeCombineParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>(), num_topk = s["num_topk"].cast<int>();
        p.record = ep::combine_record(hidden_bytes, num_topk);
        common(ranks.size(), s, p.record.bytes, &p.num_launch_ranks, &p.num_nodes, &p.gpus, &p.num_channels, &p.layout,
               &p.timeout_cycles, &p.error);
        validate(s, hidden_bytes, num_topk);
        p.hidden_int4 = hidden_bytes / 16;
        p.num_topk = num_topk;
        p.nvl_chunk = s["nvl_chunk"].cast<int>();
        p.rdma_chunk = s["rdma_chunk"].cast<int>();
        p.stalled_rank = s["stalled_rank"].cast<int>();
        const auto payload = s["float32"].cast<bool>() ? ep::Payload::kFloat32 : ep::Payload::kBF16;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::InternodeCombineRankArgs& a = p.ranks[i];
            a.peers = peers_of(d["rank"].cast<int>());
            a.num_tokens = d["num_tokens"].cast<int>();
            a.x = ptr<void>(d, "x");
            a.topk_weights = ptr_or_null<float>(d, "topk_weights");
            a.recv_gbl_rank_prefix_sum = ptr<int>(d, "recv_gbl_rank_prefix_sum");
            a.recv_gbl_channel_offset = ptr<int>(d, "recv_gbl_channel_offset");
            a.recv_rdma_rank_prefix_sum = ptr<int>(d, "recv_rdma_rank_prefix_sum");
            a.recv_rdma_channel_offset = ptr<int>(d, "recv_rdma_channel_offset");
            a.send_nvl_head = ptr<int>(d, "send_nvl_head");
            a.send_rdma_head = ptr<int>(d, "send_rdma_head");
            a.combined_x = ptr<void>(d, "combined_x");
            a.combined_topk_weights = ptr_or_null<float>(d, "combined_topk_weights");
        }
        check_cuda(ep::launch_internode_combine(p, ep::Backend::kEmulated, payload, c10::cuda::getCurrentCUDAStream()),
                   "internode combine");
    }

    std::vector<int> error_record() const {
        const ep::ErrorRecord& e = *error_;
        return {e.code, e.role, e.rank, e.channel, e.peer, e.head, e.tail, e.expected};
    }

    // Bytes each region needs for `record_bytes` (dispatch or combine record) under this config.
    static std::pair<int64_t, int64_t> region_bytes(const py::dict& s, int num_nodes, int gpus, int record_bytes) {
        const ep::InternodeLayout l = ep::make_internode_layout(config_of(s), num_nodes, gpus, record_bytes);
        return {l.rdma.total, l.nvl.total};
    }

   private:
    ep::InternodePeers peers_of(int rank) const {
        TORCH_CHECK(rank >= 0 && rank < nodes_ * gpus_, "kernels_cuda: bad rank ", rank);
        ep::InternodePeers p{};
        p.rank = rank;
        p.node = rank / gpus_;
        p.gpu = rank % gpus_;
        p.gpus = gpus_;
        for (int m = 0; m < nodes_; ++m) p.rdma[m] = static_cast<uint8_t*>(rdma_) + (m * gpus_ + p.gpu) * rdma_bytes_;
        for (int j = 0; j < gpus_; ++j) p.nvl[j] = static_cast<uint8_t*>(nvl_) + (p.node * gpus_ + j) * nvl_bytes_;
        return p;
    }

    void common(size_t launch_ranks, const py::dict& s, int record_bytes, int* num_launch_ranks, int* num_nodes, int* gpus,
                int* channels, ep::InternodeLayout* layout, long long* timeout, ep::ErrorRecord** error) const {
        TORCH_CHECK(launch_ranks >= 1 && static_cast<int>(launch_ranks) <= nodes_ * gpus_,
                    "kernels_cuda: wrong number of ranks in this launch");
        const ep::InternodeConfig cfg = config_of(s);
        TORCH_CHECK(cfg.num_channels >= 1 && cfg.num_channels <= ep::kMaxChannels, "kernels_cuda: bad number of channels");
        *num_launch_ranks = static_cast<int>(launch_ranks);
        *num_nodes = nodes_;
        *gpus = gpus_;
        *channels = cfg.num_channels;
        *layout = ep::make_internode_layout(cfg, nodes_, gpus_, record_bytes);
        TORCH_CHECK(layout->rdma.total <= rdma_bytes_, "kernels_cuda: RDMA buffer too small: need ", layout->rdma.total,
                    " bytes, have ", rdma_bytes_);
        TORCH_CHECK(layout->nvl.total <= nvl_bytes_, "kernels_cuda: NVLink buffer too small: need ", layout->nvl.total,
                    " bytes, have ", nvl_bytes_);
        *timeout = s["timeout_cycles"].cast<int64_t>();
        *error = d_error_;
    }

    void validate(const py::dict& s, int hidden_bytes, int num_topk) const {
        const int local_experts = s.contains("num_experts") ? s["num_experts"].cast<int>() / (nodes_ * gpus_) : 1;
        const char* error = ep::validate_internode(config_of(s), nodes_, gpus_, hidden_bytes, num_topk, local_experts);
        TORCH_CHECK(error == nullptr, "kernels_cuda: invalid internode config: ", error);
    }

    std::string describe_error() const { return describe_timeout(*error_); }

    int nodes_, gpus_;
    int64_t rdma_bytes_, nvl_bytes_;
    void* rdma_ = nullptr;
    void* nvl_ = nullptr;
    int* recv_counter_ = nullptr;
    int* recv_rdma_counter_ = nullptr;
    int* recv_expert_counter_ = nullptr;
    ep::ErrorRecord* error_ = nullptr;
    int* d_recv_counter_ = nullptr;
    int* d_recv_rdma_counter_ = nullptr;
    int* d_recv_expert_counter_ = nullptr;
    ep::ErrorRecord* d_error_ = nullptr;
};

}  // namespace

void register_internode(py::module_& m) {
    py::class_<EmulatedInternodeRuntime>(m, "EmulatedInternodeRuntime")
        .def(py::init<int, int, int64_t, int64_t>())
        .def("notify", &EmulatedInternodeRuntime::notify)
        .def("wait_recv_counts", &EmulatedInternodeRuntime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &EmulatedInternodeRuntime::cached_notify)
        .def("dispatch", &EmulatedInternodeRuntime::dispatch)
        .def("combine", &EmulatedInternodeRuntime::combine)
        .def("error_record", &EmulatedInternodeRuntime::error_record)
        .def_static("region_bytes", &EmulatedInternodeRuntime::region_bytes);
}
