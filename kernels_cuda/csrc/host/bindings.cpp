// Host side of kernels_cuda._C (torch extension; kernels_cuda._C_cpu in the CPU emulation build): the
// module, and its intranode Runtime. Runtime owns every rank's communication buffer as this process
// addresses it (one rank per process, the peers' buffers mapped through CUDA IPC; or every rank
// emulated in one process), validates intranode configurations (ep_config.h) and fills the kernels'
// parameter blocks from per-rank dicts of tensors. Every op takes a list with one dict per rank of the
// launch: all ranks (emulated) or this rank (NVLink). What it shares with the internode runtimes
// (host/internode_runtime.cpp) is RuntimeCore (runtime_common.h) and RankRegions (rank_regions.h).
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "../ep_params.h"
#include "internode_runtime.h"
#include "low_latency_runtime.h"
#include "rank_regions.h"
#include "runtime_common.h"
#include "tensor_args.h"

namespace {

class Runtime final : public RuntimeCore {
   public:
    Runtime(int rank, int num_ranks, int64_t num_bytes, bool emulated)
        : RuntimeCore(checked_world(num_ranks, num_bytes), rank,
                      emulated ? ep::Backend::kEmulated : ep::Backend::kNvlink),
          num_bytes_(num_bytes),
          buffers_("buffer", num_ranks) {
        if (emulated)
            buffers_.allocate_all(num_bytes);
        else
            buffers_.allocate(rank, num_bytes);
    }

    ~Runtime() override { destroy(); }

    // Unmaps the peers' buffers and frees this rank's (collective: the caller synchronises the ranks
    // first); the destructor calls it when the caller did not. Later ops fail naming the unmapped peer.
    void destroy() { buffers_.release_when_idle(); }

    py::bytes ipc_handle() const {
        require_alive();
        return buffers_.ipc_handle();
    }

    void open_ipc_handles(const std::vector<py::bytes>& handles) {
        TORCH_CHECK(!every_rank(), "kernels_cuda: the emulated back end has no IPC peers");
        buffers_.open_peers(handles, launch_rank_);
    }

    // Counts exchange; resets this launch's mapped counters to -1 first.
    void notify_dispatch(const std::vector<py::dict>& ranks, int num_experts, int num_channels, int expert_alignment,
                         int64_t timeout_cycles) {
        ep::NotifyParams p{};
        fill_common(p, ranks.size(), num_channels, 1, timeout_cycles, 16);
        TORCH_CHECK(num_experts % world_size_ == 0 && num_experts / world_size_ <= ep::kMaxLocalExperts,
                    "kernels_cuda: bad number of experts");
        p.num_experts = num_experts;
        p.expert_alignment = expert_alignment;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::NotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            a.num_tokens_per_rank = ptr<int>(d, "num_tokens_per_rank");
            a.num_tokens_per_expert = ptr<int>(d, "num_tokens_per_expert");
            a.is_token_in_rank = ptr<bool>(d, "is_token_in_rank");
            a.rank_prefix_matrix = ptr<int>(d, "rank_prefix_matrix");
            a.channel_prefix_matrix = ptr<int>(d, "channel_prefix_matrix");
            // Without a host wait (num_worst_tokens) the kernel publishes nothing: a late write could
            // otherwise land after the next notify reset the counters and pass for its counts.
            if (!publishes_counts(d)) continue;
            const CountSlots slots = reset_counts(static_cast<int>(i), num_experts / world_size_);
            a.recv_counter = slots.rows;
            a.recv_expert_counter = slots.expert_rows;
        }
        check_cuda(ep::launch_notify_dispatch(p, backend_, stream_.get()), "notify_dispatch");
    }

    // Per launch rank: (rows to receive, rows per local expert).
    std::vector<std::pair<int, std::vector<int>>> wait_recv_counts(int num_launch_ranks, int local_experts, double timeout_s) {
        wait_counts(num_launch_ranks, local_experts, false, timeout_s);
        std::vector<std::pair<int, std::vector<int>>> out;
        for (int i = 0; i < num_launch_ranks; ++i) out.emplace_back(rows(i), expert_rows(i, local_experts));
        return out;
    }

    void cached_notify(const std::vector<py::dict>& ranks, int num_channels, int64_t timeout_cycles) {
        ep::CachedNotifyParams p{};
        fill_common(p, ranks.size(), num_channels, 1, timeout_cycles, 16);
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::CachedNotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            a.send_head = ptr_or_null<int>(d, "send_head");
            a.channel_prefix_matrix = ptr<int>(d, "channel_prefix_matrix");
        }
        check_cuda(ep::launch_cached_notify(p, backend_, stream_.get()), "cached_notify");
    }

    void dispatch(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::DispatchParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>();
        const int num_scales = s["num_scales"].cast<int>();
        const int num_topk = s["num_topk"].cast<int>();
        p.record = ep::dispatch_record(hidden_bytes, num_scales, num_topk);
        fill_common(p, ranks.size(), s["num_channels"].cast<int>(), s["capacity"].cast<int>(),
                    s["timeout_cycles"].cast<int64_t>(), p.record.bytes);
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
            fill_rank(a, d);
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
        check_cuda(ep::launch_dispatch(p, backend_, stream_.get()), "dispatch");
    }

    void combine(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::CombineParams p{};
        const int hidden_bytes = s["hidden_bytes"].cast<int>();
        const int num_topk = s["num_topk"].cast<int>();
        p.record = ep::combine_record(hidden_bytes, num_topk);
        fill_common(p, ranks.size(), s["num_channels"].cast<int>(), s["capacity"].cast<int>(),
                    s["timeout_cycles"].cast<int64_t>(), p.record.bytes);
        validate(s, hidden_bytes, num_topk);
        p.hidden_int4 = hidden_bytes / 16;
        p.num_topk = num_topk;
        p.chunk = s["chunk"].cast<int>();
        p.stalled_rank = s["stalled_rank"].cast<int>();
        const auto payload = s["float32"].cast<bool>() ? ep::Payload::kFloat32 : ep::Payload::kBF16;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::CombineRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            a.x = ptr<void>(d, "x");
            a.topk_weights = ptr_or_null<float>(d, "topk_weights");
            a.rank_prefix_matrix = ptr<int>(d, "rank_prefix_matrix");
            a.recv_channel_offset = ptr<int>(d, "recv_channel_offset");
            a.send_head = ptr<int>(d, "send_head");
            a.combined_x = ptr<void>(d, "combined_x");
            a.combined_topk_weights = ptr_or_null<float>(d, "combined_topk_weights");
        }
        check_cuda(ep::launch_combine(p, backend_, payload, stream_.get()), "combine");
    }

    int64_t num_bytes() const { return num_bytes_; }
    bool emulated() const { return every_rank(); }

    // `rank`'s whole buffer as bytes (get_local_buffer_tensor): a view, valid until destroy().
    at::Tensor region(int rank) const {
        require_alive();
        check_launch_rank(rank);
        return buffers_.bytes_view(rank, num_bytes_);
    }

   private:
    static int checked_world(int num_ranks, int64_t num_bytes) {
        TORCH_CHECK(num_ranks >= 1 && num_ranks <= ep::kMaxRanks, "kernels_cuda: num_ranks must be in [1, ",
                    ep::kMaxRanks, "]");
        check_buffer_bytes(num_bytes);
        return num_ranks;
    }

    void require_alive() const { TORCH_CHECK(buffers_.allocated(), "kernels_cuda: the buffer was destroyed"); }

    // The launch fields (RuntimeCore::fill_launch), then the buffer layout for records of `record_bytes`.
    template <typename Params>
    void fill_common(Params& p, size_t launch_ranks, int num_channels, int capacity, int64_t timeout_cycles,
                     int record_bytes) const {
        fill_launch(p, launch_ranks, num_channels, timeout_cycles);
        p.num_ranks = world_size_;
        p.layout = ep::make_buffer_layout(world_size_, num_channels, capacity, record_bytes);
        check_fits("buffer", p.layout.total, num_bytes_);
    }

    // What every rank's arguments have: its rank, tokens and every rank's buffer as this process sees it.
    template <typename RankArgs>
    void fill_rank(RankArgs& a, const py::dict& d) const {
        a.rank = d["rank"].cast<int>();
        a.num_tokens = d["num_tokens"].cast<int>();
        check_launch_rank(a.rank);
        for (int r = 0; r < world_size_; ++r) a.peers[r] = buffers_.at(r);
    }

    void validate(const py::dict& s, int hidden_bytes, int num_topk) const {
        const ep::IntranodeConfig cfg{s["num_channels"].cast<int>(), s["chunk"].cast<int>(), s["capacity"].cast<int>()};
        const int local_experts = s.contains("num_experts") ? s["num_experts"].cast<int>() / world_size_ : 1;
        const char* error = ep::validate_intranode(cfg, world_size_, hidden_bytes, num_topk, local_experts, 0);
        TORCH_CHECK(error == nullptr, "kernels_cuda: invalid config: ", error);
    }

    const int64_t num_bytes_;
    RankRegions buffers_;  // by rank
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kernels_cuda: EP dispatch/combine kernels (see kernels_cuda/buffer.py, kernels_cuda/internode.py)";
    py::class_<Runtime> runtime(m, "Runtime");
    runtime.def(py::init<int, int, int64_t, bool>())
        .def("get_dispatch_layout", &Runtime::dispatch_layout)
        .def("ipc_handle", &Runtime::ipc_handle)
        .def("open_ipc_handles", &Runtime::open_ipc_handles)
        .def("destroy", &Runtime::destroy)
        .def("notify_dispatch", &Runtime::notify_dispatch)
        .def("wait_recv_counts", &Runtime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &Runtime::cached_notify)
        .def("dispatch", &Runtime::dispatch)
        .def("combine", &Runtime::combine)
        .def("region", &Runtime::region)
        .def_property_readonly("num_bytes", &Runtime::num_bytes)
        .def_property_readonly("emulated", &Runtime::emulated);
    bind_runtime_core(runtime);
#if defined(EP_CPU_EMULATION)
    m.attr("device") = "cpu";
#else
    m.attr("device") = "cuda";
#endif
    register_internode(m);
    register_low_latency(m);
}
