// Host side of kernels_cuda._C (torch extension; kernels_cuda._C_cpu in the CPU emulation build):
// owns the communication buffer(s), the host-mapped counters and error record, exchanges CUDA IPC
// handles, validates configurations (ep_config.h) and fills the kernels' parameter blocks from
// per-rank dicts of tensors. Every op takes a list with one dict per rank of the launch: all ranks
// (EMULATED) or this rank (NVLINK).
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "../ep_diag.h"
#include "../ep_params.h"
#include "device_api.h"
#include "internode_runtime.h"
#include "ipc.h"
#include "tensor_args.h"

namespace py = pybind11;

std::vector<at::Tensor> dispatch_layout(const at::Tensor& topk_idx, int num_experts, int num_ranks, int ranks_per_node,
                                        cudaStream_t stream) {
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
    ep::LayoutParams p{topk_idx.data_ptr<int64_t>(), static_cast<int>(topk_idx.size(0)), static_cast<int>(topk_idx.size(1)),
                       num_experts, num_ranks, ranks_per_node, per_rank.data_ptr<int>(), per_node.data_ptr<int>(),
                       per_expert.data_ptr<int>(), in_rank.data_ptr<bool>()};
    check_cuda(ep::launch_get_dispatch_layout(p, stream), "get_dispatch_layout");
    return {per_rank, per_node, per_expert, in_rank};
}

namespace {

class Runtime {
   public:
    Runtime(int rank, int num_ranks, int64_t num_bytes, bool emulated)
        : rank_(rank), num_ranks_(num_ranks), num_bytes_(num_bytes), emulated_(emulated) {
        TORCH_CHECK(num_ranks >= 1 && num_ranks <= ep::kMaxRanks, "kernels_cuda: num_ranks must be in [1, ",
                    ep::kMaxRanks, "]");
        TORCH_CHECK(num_bytes % ep::kBufferAlign == 0, "kernels_cuda: buffer bytes must be a multiple of ",
                    ep::kBufferAlign);
        const int64_t total = emulated ? num_bytes * num_ranks : num_bytes;
        check_cuda(cudaMalloc(&base_, total), "cudaMalloc(buffer)");
        check_cuda(cudaMemset(base_, 0, total), "cudaMemset(buffer)");
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // zeroed before any peer maps it
        for (int r = 0; r < ep::kMaxRanks; ++r) peers_[r] = nullptr;
        if (emulated) {
            for (int r = 0; r < num_ranks; ++r) peers_[r] = static_cast<uint8_t*>(base_) + r * num_bytes;
        } else {
            peers_[rank] = static_cast<uint8_t*>(base_);
            stream_.set_peers_in_other_processes();
        }
        check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&recv_counter_), sizeof(int) * ep::kMaxRanks, cudaHostAllocMapped),
                   "cudaHostAlloc(counters)");
        check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&recv_expert_counter_),
                                 sizeof(int) * ep::kMaxRanks * ep::kMaxLocalExperts, cudaHostAllocMapped),
                   "cudaHostAlloc(expert counters)");
        check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&error_), sizeof(ep::ErrorRecord), cudaHostAllocMapped),
                   "cudaHostAlloc(error record)");
        std::memset(error_, 0, sizeof(ep::ErrorRecord));
        check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_recv_counter_), recv_counter_, 0), "mapped counter");
        check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_recv_expert_counter_), recv_expert_counter_, 0),
                   "mapped expert counter");
        check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_error_), error_, 0), "mapped error record");
    }

    ~Runtime() {
        destroy();
        cudaFreeHost(recv_counter_);
        cudaFreeHost(recv_expert_counter_);
        cudaFreeHost(error_);
    }

    // Unmaps the peers' buffers and frees this rank's (collective: the caller synchronises the ranks
    // first); the destructor calls it when the caller did not. Later ops fail naming the unmapped peer.
    void destroy() {
        if (base_ == nullptr) return;
        cudaDeviceSynchronize();
        for (int r = 0; r < num_ranks_; ++r) {
            if (!emulated_ && r != rank_ && peers_[r] != nullptr) cudaIpcCloseMemHandle(peers_[r]);
            peers_[r] = nullptr;
        }
        cudaFree(base_);
        base_ = nullptr;
    }

    py::bytes ipc_handle() const {
        TORCH_CHECK(base_ != nullptr, "kernels_cuda: the buffer was destroyed");
        return ipc_handle_of(base_);
    }

    void open_ipc_handles(const std::vector<py::bytes>& handles) {
        TORCH_CHECK(!emulated_, "kernels_cuda: the emulated back end has no IPC peers");
        TORCH_CHECK(static_cast<int>(handles.size()) == num_ranks_, "kernels_cuda: need one IPC handle per rank");
        for (int r = 0; r < num_ranks_; ++r)
            if (r != rank_) peers_[r] = open_ipc_handle(handles[r]);
    }

    std::vector<at::Tensor> get_dispatch_layout(const at::Tensor& topk_idx, int num_experts, int num_ranks,
                                                int ranks_per_node) {
        return dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node, stream_.get());
    }

    // Counts exchange; resets this launch's mapped counters to -1 first.
    void notify_dispatch(const std::vector<py::dict>& ranks, int num_experts, int num_channels, int expert_alignment,
                         int64_t timeout_cycles) {
        ep::NotifyParams p{};
        fill_common(ranks.size(), num_channels, 1, timeout_cycles, &p.num_launch_ranks, &p.num_ranks, &p.num_channels,
                    &p.layout, &p.timeout_cycles, &p.error);
        TORCH_CHECK(num_experts % num_ranks_ == 0 && num_experts / num_ranks_ <= ep::kMaxLocalExperts,
                    "kernels_cuda: bad number of experts");
        p.num_experts = num_experts;
        p.expert_alignment = expert_alignment;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::NotifyRankArgs& a = p.ranks[i];
            a.rank = d["rank"].cast<int>();
            a.num_tokens = d["num_tokens"].cast<int>();
            std::memcpy(a.peers, peers_for(a.rank), sizeof(a.peers));
            a.num_tokens_per_rank = ptr<int>(d, "num_tokens_per_rank");
            a.num_tokens_per_expert = ptr<int>(d, "num_tokens_per_expert");
            a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
            a.rank_prefix_matrix = ptr<int>(d, "rank_prefix_matrix");
            a.channel_prefix_matrix = ptr<int>(d, "channel_prefix_matrix");
            // Without a host wait (num_worst_tokens) the kernel publishes nothing: a late write could
            // otherwise land after the next notify reset the counters and pass for its counts.
            if (!publishes_counts(d)) continue;
            recv_counter_[i] = -1;
            for (int e = 0; e < p.num_experts / num_ranks_; ++e) recv_expert_counter_[i * ep::kMaxLocalExperts + e] = -1;
            a.recv_counter = d_recv_counter_ + i;
            a.recv_expert_counter = d_recv_expert_counter_ + i * ep::kMaxLocalExperts;
        }
        check_cuda(ep::launch_notify_dispatch(p, backend(), stream_.get()), "notify_dispatch");
    }

    // Host wait (with its own timeout) for the counts published by notify_dispatch: the total and every
    // per-expert count, each reset to -1 by the notify (a weakly ordered host, e.g. aarch64, could
    // otherwise read an expert count of the previous op after seeing this op's total).
    std::vector<std::pair<int, std::vector<int>>> wait_recv_counts(int num_launch_ranks, int local_experts, double timeout_s) {
        volatile int* counters = recv_counter_;
        volatile int* experts = recv_expert_counter_;
        const auto ready = [&](int i) {
            if (counters[i] < 0) return false;
            for (int e = 0; e < local_experts; ++e)
                if (experts[i * ep::kMaxLocalExperts + e] < 0) return false;
            return true;
        };
        wait_for_counts(num_launch_ranks, timeout_s, ready, [&] {
            std::string text;
            for (int j = 0; j < num_launch_ranks; ++j) text += std::to_string(counters[j]) + " ";
            return "kernels_cuda: timeout waiting for the receive counts (dispatch CPU); counters: " + text +
                   "(-1 = notify never finished); " + describe_error();
        });
        std::vector<std::pair<int, std::vector<int>>> out;
        for (int i = 0; i < num_launch_ranks; ++i) {
            std::vector<int> per_expert(local_experts);
            for (int e = 0; e < local_experts; ++e) per_expert[e] = experts[i * ep::kMaxLocalExperts + e];
            out.emplace_back(counters[i], per_expert);
        }
        return out;
    }

    void cached_notify(const std::vector<py::dict>& ranks, int num_channels, int64_t timeout_cycles) {
        ep::CachedNotifyParams p{};
        fill_common(ranks.size(), num_channels, 1, timeout_cycles, &p.num_launch_ranks, &p.num_ranks, &p.num_channels,
                    &p.layout, &p.timeout_cycles, &p.error);
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::CachedNotifyRankArgs& a = p.ranks[i];
            a.rank = d["rank"].cast<int>();
            a.num_tokens = d["num_tokens"].cast<int>();
            std::memcpy(a.peers, peers_for(a.rank), sizeof(a.peers));
            a.send_head = ptr_or_null<int>(d, "send_head");
            a.channel_prefix_matrix = ptr<int>(d, "channel_prefix_matrix");
        }
        check_cuda(ep::launch_cached_notify(p, backend(), stream_.get()), "cached_notify");
    }

    void dispatch(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::DispatchParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>();
        const int num_scales = s["num_scales"].cast<int>();
        const int num_topk = s["num_topk"].cast<int>();
        p.record = ep::dispatch_record(hidden_bytes, num_scales, num_topk);
        fill_common(ranks.size(), s["num_channels"].cast<int>(), s["capacity"].cast<int>(), s["timeout_cycles"].cast<int64_t>(),
                    &p.num_launch_ranks, &p.num_ranks, &p.num_channels, &p.layout, &p.timeout_cycles, &p.error,
                    p.record.bytes);
        validate(s, hidden_bytes, num_topk);
        p.hidden_int4 = hidden_bytes / 16;
        p.num_scales = num_scales;
        p.num_topk = num_topk;
        p.num_experts = s["num_experts"].cast<int>();
        p.num_worst_tokens = s["num_worst_tokens"].cast<int>();
        p.chunk = s["chunk"].cast<int>();
        p.stalled_rank = s["stalled_rank"].cast<int>();
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::DispatchRankArgs& a = p.ranks[i];
            a.rank = d["rank"].cast<int>();
            a.num_tokens = d["num_tokens"].cast<int>();
            std::memcpy(a.peers, peers_for(a.rank), sizeof(a.peers));
            a.x = ptr<void>(d, "x");
            a.x_scales = ptr_or_null<float>(d, "x_scales");
            a.scale_token_stride = d["scale_token_stride"].cast<int64_t>();
            a.scale_hidden_stride = d["scale_hidden_stride"].cast<int64_t>();
            a.topk_idx = ptr_or_null<int64_t>(d, "topk_idx");
            a.topk_weights = ptr_or_null<float>(d, "topk_weights");
            a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
            a.channel_prefix_matrix = ptr<int>(d, "channel_prefix_matrix");
            a.rank_prefix_matrix = ptr<int>(d, "rank_prefix_matrix");
            a.recv_x = ptr<void>(d, "recv_x");
            a.recv_x_scales = ptr_or_null<float>(d, "recv_x_scales");
            a.recv_src_idx = ptr<int>(d, "recv_src_idx");
            a.recv_topk_idx = ptr_or_null<int64_t>(d, "recv_topk_idx");
            a.recv_topk_weights = ptr_or_null<float>(d, "recv_topk_weights");
            a.recv_channel_offset = ptr<int>(d, "recv_channel_offset");
            a.send_head = ptr<int>(d, "send_head");
        }
        check_cuda(ep::launch_dispatch(p, backend(), stream_.get()), "dispatch");
    }

    void combine(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::CombineParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>();
        const int num_topk = s["num_topk"].cast<int>();
        p.record = ep::combine_record(hidden_bytes, num_topk);
        fill_common(ranks.size(), s["num_channels"].cast<int>(), s["capacity"].cast<int>(), s["timeout_cycles"].cast<int64_t>(),
                    &p.num_launch_ranks, &p.num_ranks, &p.num_channels, &p.layout, &p.timeout_cycles, &p.error,
                    p.record.bytes);
        validate(s, hidden_bytes, num_topk);
        p.hidden_int4 = hidden_bytes / 16;
        p.num_topk = num_topk;
        p.chunk = s["chunk"].cast<int>();
        p.stalled_rank = s["stalled_rank"].cast<int>();
        const auto payload = s["float32"].cast<bool>() ? ep::Payload::kFloat32 : ep::Payload::kBF16;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::CombineRankArgs& a = p.ranks[i];
            a.rank = d["rank"].cast<int>();
            a.num_tokens = d["num_tokens"].cast<int>();
            std::memcpy(a.peers, peers_for(a.rank), sizeof(a.peers));
            a.x = ptr<void>(d, "x");
            a.topk_weights = ptr_or_null<float>(d, "topk_weights");
            a.rank_prefix_matrix = ptr<int>(d, "rank_prefix_matrix");
            a.recv_channel_offset = ptr<int>(d, "recv_channel_offset");
            a.send_head = ptr<int>(d, "send_head");
            a.combined_x = ptr<void>(d, "combined_x");
            a.combined_topk_weights = ptr_or_null<float>(d, "combined_topk_weights");
        }
        check_cuda(ep::launch_combine(p, backend(), payload, stream_.get()), "combine");
    }

    std::vector<int> error_record() const {
        const ep::ErrorRecord& e = *error_;
        return {e.code, e.role, e.rank, e.channel, e.peer, e.head, e.tail, e.expected};
    }

    int64_t num_bytes() const { return num_bytes_; }
    bool emulated() const { return emulated_; }
    LaunchStream& launch_stream() { return stream_; }

   private:
    ep::Backend backend() const { return emulated_ ? ep::Backend::kEmulated : ep::Backend::kNvlink; }

    uint8_t* const* peers_for(int rank) const {
        TORCH_CHECK(emulated_ || rank == rank_, "kernels_cuda: an NVLINK buffer only launches its own rank");
        for (int r = 0; r < num_ranks_; ++r)
            TORCH_CHECK(peers_[r] != nullptr, "kernels_cuda: the buffer of rank ", r,
                        " is not mapped here (open_ipc_handles not called, or the buffer was destroyed)");
        return peers_;
    }

    void fill_common(size_t launch_ranks, int num_channels, int capacity, int64_t timeout_cycles, int* num_launch_ranks,
                     int* num_ranks, int* channels, ep::BufferLayout* layout, long long* timeout, ep::ErrorRecord** error,
                     int record_bytes = 16) const {
        TORCH_CHECK(launch_ranks >= 1 && static_cast<int>(launch_ranks) <= (emulated_ ? num_ranks_ : 1),
                    "kernels_cuda: wrong number of ranks in this launch");
        TORCH_CHECK(num_channels >= 1 && num_channels <= ep::kMaxChannels, "kernels_cuda: bad number of channels");
        *num_launch_ranks = static_cast<int>(launch_ranks);
        *num_ranks = num_ranks_;
        *channels = num_channels;
        *layout = ep::make_buffer_layout(num_ranks_, num_channels, capacity, record_bytes);
        TORCH_CHECK(layout->total <= num_bytes_, "kernels_cuda: buffer too small: need ", layout->total, " bytes, have ",
                    num_bytes_);
        *timeout = timeout_cycles;
        *error = d_error_;
    }

    void validate(const py::dict& s, int hidden_bytes, int num_topk) const {
        const ep::IntranodeConfig cfg{s["num_channels"].cast<int>(), s["chunk"].cast<int>(), s["capacity"].cast<int>()};
        const int local_experts = s.contains("num_experts") ? s["num_experts"].cast<int>() / num_ranks_ : 1;
        const char* error = ep::validate_intranode(cfg, num_ranks_, hidden_bytes, num_topk, local_experts, 0);
        TORCH_CHECK(error == nullptr, "kernels_cuda: invalid config: ", error);
    }

    std::string describe_error() const { return describe_timeout(*error_); }

    LaunchStream stream_;
    int rank_, num_ranks_;
    int64_t num_bytes_;
    bool emulated_;
    void* base_ = nullptr;
    uint8_t* peers_[ep::kMaxRanks];
    int* recv_counter_ = nullptr;
    int* recv_expert_counter_ = nullptr;
    ep::ErrorRecord* error_ = nullptr;
    int* d_recv_counter_ = nullptr;
    int* d_recv_expert_counter_ = nullptr;
    ep::ErrorRecord* d_error_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kernels_cuda: EP dispatch/combine kernels (see kernels_cuda/buffer.py, kernels_cuda/internode.py)";
    py::class_<Runtime> runtime(m, "Runtime");
    runtime.def(py::init<int, int, int64_t, bool>())
        .def("get_dispatch_layout", &Runtime::get_dispatch_layout)
        .def("ipc_handle", &Runtime::ipc_handle)
        .def("open_ipc_handles", &Runtime::open_ipc_handles)
        .def("destroy", &Runtime::destroy)
        .def("notify_dispatch", &Runtime::notify_dispatch)
        .def("wait_recv_counts", &Runtime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &Runtime::cached_notify)
        .def("dispatch", &Runtime::dispatch)
        .def("combine", &Runtime::combine)
        .def("error_record", &Runtime::error_record)
        .def_property_readonly("num_bytes", &Runtime::num_bytes)
        .def_property_readonly("emulated", &Runtime::emulated);
#if defined(EP_CPU_EMULATION)
    runtime.def("set_schedule", [](Runtime& r, const std::string& policy, uint64_t seed, int depth, int64_t steps,
                                   int sm_count, const std::string& memory) { r.launch_stream().set_schedule(policy, seed, depth, steps, sm_count, memory); });
    m.attr("device") = "cpu";
#else
    m.attr("device") = "cuda";
#endif
    register_internode(m);
}
