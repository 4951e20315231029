// Host side of kernels_cuda._C (torch extension; kernels_cuda._C_cpu in the CPU emulation build): the
// module, and its intranode Runtime. Runtime owns every rank's communication buffer as this process
// addresses it (one rank per process, the peers' buffers mapped through CUDA IPC; or every rank
// emulated in one process), validates intranode configurations (params/config.h) and fills the kernels'
// parameter blocks from the typed arguments bound here (op_args.h): every op takes a list with one
// `...Rank` struct per rank of the launch (all ranks emulated, or this rank over NVLink) and an `...Op`.
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
#include "cuda_check.h"

namespace {

struct NotifyRank : RankTokens {
    at::Tensor num_tokens_per_rank;
    at::Tensor num_tokens_per_expert;
    at::Tensor is_token_in_rank;
    at::Tensor rank_prefix_matrix;     // out
    at::Tensor channel_prefix_matrix;  // out
    bool publish_counts = true;        // false for a num_worst_tokens dispatch, which allocates without them
};
struct NotifyOp : LaunchSettings, ExpertCounts {};

struct CachedNotifyRank : RankTokens {
    at::Tensor send_head;  // rewritten before a combine (rewrite_heads), and needed then only
    at::Tensor channel_prefix_matrix;
};
struct CachedNotifyOp : LaunchSettings, HeadRewrite {};

struct DispatchRank : RankTokens, DispatchPayload {
    at::Tensor channel_prefix_matrix;
    at::Tensor rank_prefix_matrix;
    at::Tensor recv_channel_offset;  // out
    at::Tensor send_head;            // out
};
struct DispatchOp : LaunchSettings, IntranodeRings, DispatchSettings {};

struct CombineRank : RankTokens, CombinePayload {
    at::Tensor rank_prefix_matrix;
    at::Tensor recv_channel_offset;
    at::Tensor send_head;
};
struct CombineOp : LaunchSettings, IntranodeRings, CombineSettings {};

void register_intranode_args(py::module_& m) {
    ArgClass<NotifyRank> notify(m, "NotifyRank");
    bind_rank_tokens(notify);
    notify.tensor("num_tokens_per_rank", &NotifyRank::num_tokens_per_rank)
        .tensor("num_tokens_per_expert", &NotifyRank::num_tokens_per_expert)
        .tensor("is_token_in_rank", &NotifyRank::is_token_in_rank)
        .tensor("rank_prefix_matrix", &NotifyRank::rank_prefix_matrix)
        .tensor("channel_prefix_matrix", &NotifyRank::channel_prefix_matrix)
        .value("publish_counts", &NotifyRank::publish_counts);
    ArgClass<NotifyOp> notify_op(m, "NotifyOp");
    bind_launch_settings(notify_op);
    bind_expert_counts(notify_op);

    ArgClass<CachedNotifyRank> cached(m, "CachedNotifyRank");
    bind_rank_tokens(cached);
    cached.optional_tensor("send_head", &CachedNotifyRank::send_head)
        .tensor("channel_prefix_matrix", &CachedNotifyRank::channel_prefix_matrix);
    ArgClass<CachedNotifyOp> cached_op(m, "CachedNotifyOp");
    bind_launch_settings(cached_op);
    bind_head_rewrite(cached_op);

    ArgClass<DispatchRank> dispatch(m, "DispatchRank");
    bind_rank_tokens(dispatch);
    bind_dispatch_payload(dispatch);
    dispatch.tensor("channel_prefix_matrix", &DispatchRank::channel_prefix_matrix)
        .tensor("rank_prefix_matrix", &DispatchRank::rank_prefix_matrix)
        .tensor("recv_channel_offset", &DispatchRank::recv_channel_offset)
        .tensor("send_head", &DispatchRank::send_head);
    ArgClass<DispatchOp> dispatch_op(m, "DispatchOp");
    bind_launch_settings(dispatch_op);
    bind_intranode_rings(dispatch_op);
    bind_dispatch_settings(dispatch_op);

    ArgClass<CombineRank> combine(m, "CombineRank");
    bind_rank_tokens(combine);
    bind_combine_payload(combine);
    combine.tensor("rank_prefix_matrix", &CombineRank::rank_prefix_matrix)
        .tensor("recv_channel_offset", &CombineRank::recv_channel_offset)
        .tensor("send_head", &CombineRank::send_head);
    ArgClass<CombineOp> combine_op(m, "CombineOp");
    bind_launch_settings(combine_op);
    bind_intranode_rings(combine_op);
    bind_combine_settings(combine_op);
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
            a.num_tokens_per_rank = data_of<int>(d.num_tokens_per_rank);
            a.num_tokens_per_expert = data_of<int>(d.num_tokens_per_expert);
            a.is_token_in_rank = data_of<bool>(d.is_token_in_rank);
            a.rank_prefix_matrix = data_of<int>(d.rank_prefix_matrix);
            a.channel_prefix_matrix = data_of<int>(d.channel_prefix_matrix);
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
            a.send_head = op.rewrite_heads ? required_data<int>(d.send_head, "send_head") : nullptr;
            a.channel_prefix_matrix = data_of<int>(d.channel_prefix_matrix);
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
        for (size_t i = 0; i < ranks.size(); ++i) {
            const DispatchRank& d = ranks[i];
            ep::DispatchRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            fill_dispatch_payload(a, d);
            a.channel_prefix_matrix = data_of<int>(d.channel_prefix_matrix);
            a.rank_prefix_matrix = data_of<int>(d.rank_prefix_matrix);
            a.recv_channel_offset = data_of<int>(d.recv_channel_offset);
            a.send_head = data_of<int>(d.send_head);
        }
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
        for (size_t i = 0; i < ranks.size(); ++i) {
            const CombineRank& d = ranks[i];
            ep::CombineRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            fill_combine_payload(a, d);
            a.rank_prefix_matrix = data_of<int>(d.rank_prefix_matrix);
            a.recv_channel_offset = data_of<int>(d.recv_channel_offset);
            a.send_head = data_of<int>(d.send_head);
        }
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

    // What every rank's arguments have: its rank, tokens and every rank's buffer as this process sees it.
    template <typename RankArgs>
    void fill_rank(RankArgs& a, const RankTokens& d) const {
        a.rank = d.rank;
        a.num_tokens = d.num_tokens;
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
