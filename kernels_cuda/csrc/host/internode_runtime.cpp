// Host side of the internode kernels. InternodeRuntime holds what every set-up shares: every rank's
// RDMA and NVLink region as this process addresses them, host-mapped counters and error record,
// validation (validate_internode) and the parameter blocks from per-rank dicts. Set-ups:
//   EmulatedInternodeRuntime  nodes x GPUs ranks on one GPU, the regions slices of two allocations,
//                             one launch for all ranks (Backend::kEmulated);
//   ProcessInternodeRuntime   this process's rank; its NVLink region cudaMalloc'ed and shared with the
//                             node's GPUs through CUDA IPC handles, its RDMA region either
//     IpcInternodeRuntime       cudaMalloc'ed and shared with the rail peers through IPC as well, for
//                               nodes on one machine (Backend::kNvlink), or
//     NvshmemInternodeRuntime   in NVSHMEM's symmetric heap (PE = rank, nvshmem_world.h; EP_WITH_NVSHMEM
//                               builds), for real nodes (Backend::kNvshmem).
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../ep_internode_params.h"
#include "device_api.h"
#include "internode_runtime.h"
#include "ipc.h"
#include "tensor_args.h"
#if defined(EP_WITH_NVSHMEM)
#include "nvshmem_world.h"
#endif

namespace {

ep::InternodeConfig config_of(const py::dict& s) {
    return {s["num_channels"].cast<int>(), s["nvl_chunk"].cast<int>(), s["nvl_capacity"].cast<int>(),
            s["rdma_chunk"].cast<int>(), s["rdma_capacity"].cast<int>()};
}

struct CudaFree {
    void operator()(void* ptr) const { cudaFree(ptr); }
};
struct CudaFreeHost {
    void operator()(void* ptr) const { cudaFreeHost(ptr); }
};
using DeviceMemory = std::unique_ptr<void, CudaFree>;
using HostMemory = std::unique_ptr<void, CudaFreeHost>;

DeviceMemory zeroed_device(int64_t bytes, const char* what) {
    void* ptr = nullptr;
    check_cuda(cudaMalloc(&ptr, bytes), what);
    DeviceMemory memory(ptr);
    check_cuda(cudaMemset(ptr, 0, bytes), what);
    return memory;
}

// Zeroed host memory (owned by `owner`) that the GPU writes through `*device`.
template <typename T>
T* mapped(int64_t count, T** device, std::vector<HostMemory>& owner) {
    T* host = nullptr;
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(T) * count, cudaHostAllocMapped), "cudaHostAlloc");
    owner.emplace_back(host);
    std::memset(host, 0, sizeof(T) * count);
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(device), host, 0), "cudaHostGetDevicePointer");
    return host;
}

class InternodeRuntime {
   public:
    InternodeRuntime(const InternodeRuntime&) = delete;
    InternodeRuntime& operator=(const InternodeRuntime&) = delete;
    virtual ~InternodeRuntime() = default;

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
            // Without a host wait (num_worst_tokens) the kernel publishes nothing: a late write could
            // otherwise land after the next notify reset the counters and pass for its counts.
            if (!publishes_counts(d)) continue;
            recv_counter_[i] = -1;
            recv_rdma_counter_[i] = -1;
            for (int e = 0; e < p.num_experts / (nodes_ * gpus_); ++e) recv_expert_counter_[i * ep::kMaxLocalExperts + e] = -1;
            a.recv_counter = d_recv_counter_ + i;
            a.recv_rdma_counter = d_recv_rdma_counter_ + i;
            a.recv_expert_counter = d_recv_expert_counter_ + i * ep::kMaxLocalExperts;
        }
        check_cuda(ep::launch_internode_notify(p, backend_, stream_.get()), "internode notify");
    }

    // Per launch rank: (rows to receive, records to receive over RDMA, rows per local expert). Every
    // count is reset to -1 by the notify and polled here (see Runtime::wait_recv_counts).
    std::vector<std::tuple<int, int, std::vector<int>>> wait_recv_counts(int num_launch_ranks, int local_experts,
                                                                         double timeout_s) {
        volatile int* rows = recv_counter_;
        volatile int* records = recv_rdma_counter_;
        volatile int* experts = recv_expert_counter_;
        const auto ready = [&](int i) {
            if (rows[i] < 0 || records[i] < 0) return false;
            for (int e = 0; e < local_experts; ++e)
                if (experts[i * ep::kMaxLocalExperts + e] < 0) return false;
            return true;
        };
        wait_for_counts(num_launch_ranks, timeout_s, ready, [&] {
            std::string text;
            for (int j = 0; j < num_launch_ranks; ++j) text += std::to_string(rows[j]) + "/" + std::to_string(records[j]) + " ";
            return "kernels_cuda: timeout waiting for the receive counts (internode dispatch CPU); rows/RDMA records "
                   "per rank: " + text + "(-1 = notify never finished); " + describe_error();
        });
        std::vector<std::tuple<int, int, std::vector<int>>> out;
        for (int i = 0; i < num_launch_ranks; ++i) {
            std::vector<int> per_expert(local_experts);
            for (int e = 0; e < local_experts; ++e) per_expert[e] = experts[i * ep::kMaxLocalExperts + e];
            out.emplace_back(rows[i], records[i], per_expert);
        }
        return out;
    }

    std::vector<at::Tensor> get_dispatch_layout(const at::Tensor& topk_idx, int num_experts) {
        return dispatch_layout(topk_idx, num_experts, nodes_ * gpus_, gpus_, stream_.get());
    }

    LaunchStream& launch_stream() { return stream_; }

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
        check_cuda(ep::launch_internode_cached_notify(p, backend_, stream_.get()),
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
        p.num_worst_tokens = s["num_worst_tokens"].cast<int>();
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
        check_cuda(ep::launch_internode_dispatch(p, backend_, stream_.get()),
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
        check_cuda(ep::launch_internode_combine(p, backend_, payload, stream_.get()),
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

   protected:
    // `launch_rank`: the one rank this process launches, or -1 for every rank of the world (emulated).
    InternodeRuntime(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes, ep::Backend backend,
                     int launch_rank)
        : nodes_(num_nodes), gpus_(gpus), rdma_bytes_(rdma_bytes), nvl_bytes_(nvl_bytes), launch_rank_(launch_rank),
          backend_(backend) {
        TORCH_CHECK(num_nodes >= 2 && num_nodes <= ep::kMaxRdmaPeers && gpus >= 1 && gpus <= ep::kMaxNvlPeers,
                    "kernels_cuda: internode needs 2..", ep::kMaxRdmaPeers, " nodes of 1..", ep::kMaxNvlPeers, " GPUs");
        TORCH_CHECK(launch_rank >= -1 && launch_rank < num_nodes * gpus, "kernels_cuda: bad rank ", launch_rank);
        TORCH_CHECK(rdma_bytes % ep::kBufferAlign == 0 && nvl_bytes % ep::kBufferAlign == 0,
                    "kernels_cuda: buffer bytes must be multiples of ", ep::kBufferAlign);
        rdma_.assign(num_nodes * gpus, nullptr);
        nvl_.assign(num_nodes * gpus, nullptr);
        recv_counter_ = mapped(ep::kMaxEmulatedRanks, &d_recv_counter_, host_memory_);
        recv_rdma_counter_ = mapped(ep::kMaxEmulatedRanks, &d_recv_rdma_counter_, host_memory_);
        recv_expert_counter_ = mapped(static_cast<int64_t>(ep::kMaxEmulatedRanks) * ep::kMaxLocalExperts,
                                      &d_recv_expert_counter_, host_memory_);
        error_ = mapped(1, &d_error_, host_memory_);
    }

    const int nodes_, gpus_;
    const int64_t rdma_bytes_, nvl_bytes_;
    const int launch_rank_;
    // By rank: the base of its RDMA / NVLink region as this process addresses it (nullptr: none).
    std::vector<uint8_t*> rdma_, nvl_;

   private:
    ep::InternodePeers peers_of(int rank) const {
        TORCH_CHECK(rank >= 0 && rank < nodes_ * gpus_, "kernels_cuda: bad rank ", rank);
        TORCH_CHECK(launch_rank_ < 0 || rank == launch_rank_, "kernels_cuda: this runtime launches rank ", launch_rank_,
                    " only, not ", rank);
        ep::InternodePeers p{};
        p.rank = rank;
        p.node = rank / gpus_;
        p.gpu = rank % gpus_;
        p.gpus = gpus_;
        for (int m = 0; m < nodes_; ++m) p.rdma[m] = region(rdma_, m * gpus_ + p.gpu, "RDMA");
        for (int j = 0; j < gpus_; ++j) p.nvl[j] = region(nvl_, p.node * gpus_ + j, "NVLink");
        return p;
    }

    static uint8_t* region(const std::vector<uint8_t*>& regions, int rank, const char* kind) {
        TORCH_CHECK(regions[rank] != nullptr, "kernels_cuda: the ", kind, " region of rank ", rank,
                    " is not mapped here (open_ipc_handles not called, or the buffer was destroyed)");
        return regions[rank];
    }

    void common(size_t launch_ranks, const py::dict& s, int record_bytes, int* num_launch_ranks, int* num_nodes, int* gpus,
                int* channels, ep::InternodeLayout* layout, long long* timeout, ep::ErrorRecord** error) const {
        TORCH_CHECK(launch_ranks >= 1 && static_cast<int>(launch_ranks) <= (launch_rank_ < 0 ? nodes_ * gpus_ : 1),
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

    const ep::Backend backend_;
    LaunchStream stream_;
    std::vector<HostMemory> host_memory_;
    int* recv_counter_ = nullptr;
    int* recv_rdma_counter_ = nullptr;
    int* recv_expert_counter_ = nullptr;
    ep::ErrorRecord* error_ = nullptr;
    int* d_recv_counter_ = nullptr;
    int* d_recv_rdma_counter_ = nullptr;
    int* d_recv_expert_counter_ = nullptr;
    ep::ErrorRecord* d_error_ = nullptr;
};

class EmulatedInternodeRuntime final : public InternodeRuntime {
   public:
    EmulatedInternodeRuntime(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes)
        : InternodeRuntime(num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kEmulated, -1) {
        const int ranks = num_nodes * gpus;
        TORCH_CHECK(ranks <= ep::kMaxEmulatedRanks, "kernels_cuda: emulated internode handles at most ",
                    ep::kMaxEmulatedRanks, " ranks");
        rdma_memory_ = zeroed_device(rdma_bytes * ranks, "cudaMalloc(RDMA regions)");
        nvl_memory_ = zeroed_device(nvl_bytes * ranks, "cudaMalloc(NVLink regions)");
        for (int r = 0; r < ranks; ++r) {
            rdma_[r] = static_cast<uint8_t*>(rdma_memory_.get()) + r * rdma_bytes;
            nvl_[r] = static_cast<uint8_t*>(nvl_memory_.get()) + r * nvl_bytes;
        }
    }

   private:
    DeviceMemory rdma_memory_, nvl_memory_;
};

// This process's rank: the NVLink region cudaMalloc'ed and shared with the node's GPUs through CUDA
// IPC handles; the RDMA region is the subclass's.
class ProcessInternodeRuntime : public InternodeRuntime {
   public:
    // (NVLink handle, RDMA handle or empty bytes when the RDMA hop needs none).
    std::pair<py::bytes, py::bytes> ipc_handles() const {
        require_alive();
        return {ipc_handle_of(nvl_memory_.get()), rdma_ipc_handle()};
    }

    // One pair per rank of the EP group (from all-gathering `ipc_handles`): this node's NVLink
    // regions are opened, and the rail peers' RDMA regions where the RDMA hop goes through IPC.
    void open_ipc_handles(const std::vector<std::pair<py::bytes, py::bytes>>& handles) {
        require_alive();
        TORCH_CHECK(static_cast<int>(handles.size()) == nodes_ * gpus_, "kernels_cuda: need one IPC handle per rank");
        for (const int r : node_peers())
            if (nvl_[r] == nullptr) nvl_[r] = open_ipc_handle(handles[r].first);
        open_rdma_handles(handles);
    }

    // Collective over the group (the caller synchronises the ranks first); the destructor calls it
    // when the caller did not.
    void destroy() {
        if (nvl_memory_ == nullptr) return;
        cudaDeviceSynchronize();
        for (const int r : node_peers())
            if (nvl_[r] != nullptr) cudaIpcCloseMemHandle(nvl_[r]);
        release_rdma();
        std::fill(rdma_.begin(), rdma_.end(), nullptr);
        std::fill(nvl_.begin(), nvl_.end(), nullptr);
        nvl_memory_.reset();
    }

   protected:
    ProcessInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes,
                            ep::Backend backend)
        : InternodeRuntime(num_nodes, gpus, rdma_bytes, nvl_bytes, backend, rank) {
        TORCH_CHECK(rank >= 0, "kernels_cuda: bad rank ", rank);
        nvl_memory_ = zeroed_device(nvl_bytes, "cudaMalloc(NVLink region)");
        nvl_[rank] = static_cast<uint8_t*>(nvl_memory_.get());
        launch_stream().set_peers_in_other_processes();
    }

    virtual py::bytes rdma_ipc_handle() const { return py::bytes(); }
    virtual void open_rdma_handles(const std::vector<std::pair<py::bytes, py::bytes>>&) {}
    virtual void release_rdma() = 0;

    void require_alive() const {
        TORCH_CHECK(nvl_memory_ != nullptr, "kernels_cuda: the internode buffer was destroyed");
    }

    // The other ranks of this rank's node, and this rank's rail peers (same GPU on the other nodes).
    std::vector<int> node_peers() const {
        std::vector<int> peers;
        const int first = launch_rank_ / gpus_ * gpus_;
        for (int r = first; r < first + gpus_; ++r)
            if (r != launch_rank_) peers.push_back(r);
        return peers;
    }
    std::vector<int> rail_peers() const {
        std::vector<int> peers;
        for (int m = 0; m < nodes_; ++m)
            if (m * gpus_ + launch_rank_ % gpus_ != launch_rank_) peers.push_back(m * gpus_ + launch_rank_ % gpus_);
        return peers;
    }

    DeviceMemory nvl_memory_;
};

// The RDMA hop through CUDA IPC as well (Backend::kNvlink): "nodes" that share one machine, such as
// simulated nodes (gpus_per_node smaller than the machine's GPUs) or processes sharing one GPU.
class IpcInternodeRuntime final : public ProcessInternodeRuntime {
   public:
    IpcInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes)
        : ProcessInternodeRuntime(rank, num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kNvlink) {
        rdma_memory_ = zeroed_device(rdma_bytes, "cudaMalloc(RDMA region)");
        rdma_[rank] = static_cast<uint8_t*>(rdma_memory_.get());
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // zeroed before any peer maps it
    }

    ~IpcInternodeRuntime() override { destroy(); }

   private:
    py::bytes rdma_ipc_handle() const override { return ipc_handle_of(rdma_memory_.get()); }

    void open_rdma_handles(const std::vector<std::pair<py::bytes, py::bytes>>& handles) override {
        for (const int r : rail_peers())
            if (rdma_[r] == nullptr) rdma_[r] = open_ipc_handle(handles[r].second);
    }

    void release_rdma() override {
        for (const int r : rail_peers())
            if (rdma_[r] != nullptr) cudaIpcCloseMemHandle(rdma_[r]);
        rdma_memory_.reset();
    }

    DeviceMemory rdma_memory_;
};

#if defined(EP_WITH_NVSHMEM)
namespace world = ep::nvshmem_world;

struct SymmetricFree {
    void operator()(void* ptr) const { world::deallocate(ptr); }
};

// The RDMA region in NVSHMEM's symmetric heap (Backend::kNvshmem, PE = rank): real multi-node runs.
class NvshmemInternodeRuntime final : public ProcessInternodeRuntime {
   public:
    // Collective over the EP group (every rank constructs one with the unique id made by rank 0).
    NvshmemInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes,
                            const std::string& unique_id)
        : ProcessInternodeRuntime(rank, num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kNvshmem) {
        world::size_heap(rdma_bytes);
        world::join(unique_id, rank, num_nodes * gpus);
        symmetric_.reset(world::allocate(rdma_bytes));
        check_cuda(cudaMemset(symmetric_.get(), 0, rdma_bytes), "cudaMemset(RDMA region)");
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        world::barrier();  // every region is zero before any peer signals into it
        // The symmetric heap has the same address on every PE: node m's rail peer is reached at ours.
        for (int m = 0; m < num_nodes; ++m) rdma_[m * gpus + rank % gpus] = static_cast<uint8_t*>(symmetric_.get());
    }

    ~NvshmemInternodeRuntime() override { destroy(); }

    // Made on rank 0 and broadcast before the runtimes are constructed; empty once this process's
    // NVSHMEM world exists (it is initialised once). Sizes the heap first: NVSHMEM may read it here.
    static py::bytes unique_id(int64_t rdma_bytes) {
        world::size_heap(rdma_bytes);
        return py::bytes(world::initialised() ? std::string() : world::unique_id());
    }

   private:
    // The NVSHMEM world stays (it is finalised at process exit).
    void release_rdma() override {
        world::barrier();  // no peer reads or writes this rank's regions any more
        symmetric_.reset();
    }

    std::unique_ptr<void, SymmetricFree> symmetric_;
};
#endif

}  // namespace

void register_internode(py::module_& m) {
    py::class_<InternodeRuntime> runtime(m, "InternodeRuntime");
    runtime.def("notify", &InternodeRuntime::notify)
        .def("get_dispatch_layout", &InternodeRuntime::get_dispatch_layout)
        .def("wait_recv_counts", &InternodeRuntime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &InternodeRuntime::cached_notify)
        .def("dispatch", &InternodeRuntime::dispatch)
        .def("combine", &InternodeRuntime::combine)
        .def("error_record", &InternodeRuntime::error_record)
        .def_static("region_bytes", &InternodeRuntime::region_bytes);
#if defined(EP_CPU_EMULATION)
    runtime.def("set_schedule", [](InternodeRuntime& r, const std::string& policy, uint64_t seed, int depth, int64_t steps,
                                   int sm_count, const std::string& memory) { r.launch_stream().set_schedule(policy, seed, depth, steps, sm_count, memory); });
#endif
    py::class_<EmulatedInternodeRuntime, InternodeRuntime>(m, "EmulatedInternodeRuntime")
        .def(py::init<int, int, int64_t, int64_t>());
    py::class_<ProcessInternodeRuntime, InternodeRuntime>(m, "ProcessInternodeRuntime")
        .def("ipc_handles", &ProcessInternodeRuntime::ipc_handles)
        .def("open_ipc_handles", &ProcessInternodeRuntime::open_ipc_handles)
        .def("destroy", &ProcessInternodeRuntime::destroy);
    py::class_<IpcInternodeRuntime, ProcessInternodeRuntime>(m, "IpcInternodeRuntime")
        .def(py::init<int, int, int, int64_t, int64_t>());
#if defined(EP_WITH_NVSHMEM)
    py::class_<NvshmemInternodeRuntime, ProcessInternodeRuntime>(m, "NvshmemInternodeRuntime")
        .def(py::init<int, int, int, int64_t, int64_t, const std::string&>())
        .def_static("unique_id", &NvshmemInternodeRuntime::unique_id);
    m.attr("with_nvshmem") = true;
#else
    m.attr("with_nvshmem") = false;
#endif
}
