// Host side of kernels_cuda._C (torch extension; kernels_cuda._C_cpu in the CPU emulation build): the
// module, and its intranode Runtime. Runtime owns every rank's communication buffer as this process
// addresses it (one rank per process, the peers' buffers mapped through CUDA IPC; or every rank
// emulated in one process), validates intranode configurations (params/config.h) and fills the kernels'
// parameter blocks from the typed arguments bound here (op_args.h): every op takes a list with one
// `...Rank` per rank of the launch (all ranks emulated, or this rank over NVLink), the kernel's per-rank
// struct itself (rank_args.h), and an `...Op`.
// Its lifecycle is RegionRuntime's (region_runtime.h, shared with the low-latency runtime); what it
// shares with the internode runtimes (host/internode_runtime.cpp) is RuntimeCore (runtime_common.h).
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "params/intranode.h"
#include "internode_runtime.h"
#include "low_latency_runtime.h"
#include "region_runtime.h"
#include "runtime_common.h"
#include "op_args.h"
#include "rank_args.h"
#include "cuda_check.h"

namespace {

// The kernels' per-rank structs, bound (rank_args.h), and the ops' settings (op_args.h).
using NotifyRank = RankArgs<ep::NotifyRankArgs, CountPublishing>;
using CachedNotifyRank = RankArgs<ep::CachedNotifyRankArgs>;
using DispatchRank = RankArgs<ep::DispatchRankArgs>;
using CombineRank = RankArgs<ep::CombineRankArgs>;
using NotifyOp = OpArgs<LaunchSettings, ExpertCounts>;
using CachedNotifyOp = OpArgs<LaunchSettings, HeadRewrite>;
using DispatchOp = OpArgs<LaunchSettings, IntranodeRings, DispatchSettings>;
using CombineOp = OpArgs<LaunchSettings, IntranodeRings, CombineSettings>;

// What the notify computes and the dispatch reads: where each (rank, channel)'s tokens start.
template <typename T>
void bind_routing(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("rank_prefix_matrix", &K::rank_prefix_matrix).tensor("channel_prefix_matrix", &K::channel_prefix_matrix);
}

// What the dispatch writes and the combine reads: where the received rows came from.
template <typename T>
void bind_receipt(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("recv_channel_offset", &K::recv_channel_offset).tensor("send_head", &K::send_head);
}

void register_intranode_args(py::module_& m) {
    ArgClass<NotifyRank> notify(m, "NotifyRank");
    using N = ep::NotifyRankArgs;
    bind_rank_tokens(notify);
    notify.tensor("num_tokens_per_rank", &N::num_tokens_per_rank)
        .tensor("num_tokens_per_expert", &N::num_tokens_per_expert)
        .tensor("is_token_in_rank", &N::is_token_in_rank)
        .value("publish_counts", &CountPublishing::publish_counts);
    bind_routing(notify);  // out
    NotifyOp::bind(m, "NotifyOp");

    ArgClass<CachedNotifyRank> cached(m, "CachedNotifyRank");
    bind_rank_tokens(cached);
    // send_head is rewritten before a combine (rewrite_heads), and needed then only.
    cached.optional_tensor("send_head", &ep::CachedNotifyRankArgs::send_head)
        .tensor("channel_prefix_matrix", &ep::CachedNotifyRankArgs::channel_prefix_matrix);
    CachedNotifyOp::bind(m, "CachedNotifyOp");

    ArgClass<DispatchRank> dispatch(m, "DispatchRank");
    bind_rank_tokens(dispatch);
    bind_dispatch_payload(dispatch);
    bind_routing(dispatch);
    bind_receipt(dispatch);  // out
    DispatchOp::bind(m, "DispatchOp");

    ArgClass<CombineRank> combine(m, "CombineRank");
    bind_rank_tokens(combine);
    bind_combine_payload(combine);
    combine.tensor("rank_prefix_matrix", &ep::CombineRankArgs::rank_prefix_matrix);
    bind_receipt(combine);
    CombineOp::bind(m, "CombineOp");
}

class Runtime final : public RegionRuntime {
   public:
    Runtime(int rank, int num_ranks, int64_t num_bytes, bool emulated)
        : RegionRuntime("buffer", rank, num_ranks, num_bytes, emulated ? ep::Backend::kEmulated : ep::Backend::kNvlink) {
        allocate_own();
    }

    // Counts exchange; resets this launch's mapped counters to -1 first.
    void notify(const std::vector<NotifyRank>& ranks, const NotifyOp& op) {
        ep::NotifyParams p{};
        fill_common(p, ranks.size(), op.num_channels, 1, op.timeout_cycles, 16);
        TORCH_CHECK(op.num_experts % world_size_ == 0 && op.num_experts / world_size_ <= ep::kMaxLocalExperts,
                    "kernels_cuda: bad number of experts");
        p.num_experts = op.num_experts;
        p.expert_alignment = op.expert_alignment;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const NotifyRank& d = ranks[i];
            ep::NotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            // Without a host wait (num_worst_tokens) the kernel publishes nothing: a late write could
            // otherwise land after the next notify reset the counters and pass for its counts.
            if (!d.publish_counts) continue;
            const CountSlots slots = reset_counts(static_cast<int>(i), op.num_experts / world_size_);
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

    void cached_notify(const std::vector<CachedNotifyRank>& ranks, const CachedNotifyOp& op) {
        ep::CachedNotifyParams p{};
        fill_common(p, ranks.size(), op.num_channels, 1, op.timeout_cycles, 16);
        for (size_t i = 0; i < ranks.size(); ++i) {
            const CachedNotifyRank& d = ranks[i];
            ep::CachedNotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            if (op.rewrite_heads)
                d.require("send_head");
            else
                a.send_head = nullptr;  // the kernel's sign that there is nothing to rewrite
        }
        check_cuda(ep::launch_cached_notify(p, backend_, stream_.get()), "cached_notify");
    }

    void dispatch(const std::vector<DispatchRank>& ranks, const DispatchOp& op) {
        ep::DispatchParams p{};
        p.record = ep::dispatch_record(op.hidden_bytes, op.num_scales, op.num_topk);
        fill_common(p, ranks.size(), op.num_channels, op.capacity, op.timeout_cycles, p.record.bytes);
        validate(op, op.num_experts / world_size_);
        fill_dispatch_settings(p, op);
        p.chunk = op.chunk;
        for (size_t i = 0; i < ranks.size(); ++i) fill_rank(p.ranks[i], ranks[i]);
        check_cuda(ep::launch_dispatch(p, backend_, stream_.get()), "dispatch");
    }

    void combine(const std::vector<CombineRank>& ranks, const CombineOp& op) {
        ep::CombineParams p{};
        p.record = ep::combine_record(op.hidden_bytes, op.num_topk);
        fill_common(p, ranks.size(), op.num_channels, op.capacity, op.timeout_cycles, p.record.bytes);
        validate(op, 1);
        fill_combine_settings(p, op);
        p.chunk = op.chunk;
        const auto payload = op.float32 ? ep::Payload::kFloat32 : ep::Payload::kBF16;
        for (size_t i = 0; i < ranks.size(); ++i) fill_rank(p.ranks[i], ranks[i]);
        check_cuda(ep::launch_combine(p, backend_, payload, stream_.get()), "combine");
    }

    bool emulated() const { return every_rank(); }

   private:
    // The launch fields (RuntimeCore::fill_launch), then the buffer layout for records of `record_bytes`.
    template <typename Params>
    void fill_common(Params& p, size_t launch_ranks, int num_channels, int capacity, int64_t timeout_cycles,
                     int record_bytes) const {
        fill_launch(p, launch_ranks, num_channels, timeout_cycles);
        p.num_ranks = world_size_;
        p.layout = ep::make_buffer_layout(world_size_, num_channels, capacity, record_bytes);
        check_fits("buffer", p.layout.total, num_bytes_);
    }

    // A rank's arguments as bound, and every rank's buffer as this process sees it.
    template <typename Rank>
    void fill_rank(typename Rank::KernelArgs& a, const Rank& d) const {
        a = d.kernel;
        check_launch_rank(a.rank);
        for (int r = 0; r < world_size_; ++r) a.peers[r] = regions_.at(r);
    }

    // The op's channels and rings for its rows (params/config.h's validate_intranode).
    template <typename Op>
    void validate(const Op& op, int local_experts) const {
        const ep::IntranodeConfig cfg{op.num_channels, op.chunk, op.capacity};
        const char* error = ep::validate_intranode(cfg, world_size_, op.hidden_bytes, op.num_topk, local_experts, 0);
        TORCH_CHECK(error == nullptr, "kernels_cuda: invalid config: ", error);
    }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kernels_cuda: EP dispatch/combine kernels (see kernels_cuda/buffer.py, kernels_cuda/internode.py)";
    register_intranode_args(m);
    py::class_<Runtime> runtime(m, "Runtime");
    runtime.def(py::init<int, int, int64_t, bool>())
        .def("get_dispatch_layout", &Runtime::dispatch_layout)
        .def("notify", &Runtime::notify)
        .def("wait_recv_counts", &Runtime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &Runtime::cached_notify)
        .def("dispatch", &Runtime::dispatch)
        .def("combine", &Runtime::combine)
        .def_property_readonly("emulated", &Runtime::emulated);
    bind_region_runtime(runtime);
#if defined(EP_CPU_EMULATION)
    m.attr("device") = "cpu";
#else
    m.attr("device") = "cuda";
#endif
    register_internode(m);
    register_low_latency(m);
}
