// Host side of the internode kernels (part of kernels_cuda._C, registered by register_internode).
// InternodeRuntime holds what every internode set-up shares on top of RuntimeCore (runtime_common.h):
// every rank's RDMA and NVLink region as this process addresses it (two RankRegions), validation
// (validate_internode) and the parameter blocks from the typed arguments bound here (op_args.h,
// rank_args.h). Set-ups:
//   EmulatedInternodeRuntime  nodes x GPUs ranks in one process, the regions slices of two allocations,
//                             one launch for all ranks (Backend::kEmulated);
//   ProcessInternodeRuntime   this process's rank; its NVLink region shared with the node's GPUs
//                             through CUDA IPC handles, its RDMA region either
//     IpcInternodeRuntime       cudaMalloc'ed and shared with the rail peers through IPC as well, for
//                               nodes on one machine (Backend::kNvlink), or
//     NvshmemInternodeRuntime   in NVSHMEM's symmetric heap (PE = rank, nvshmem_world.h; EP_WITH_NVSHMEM
//                               builds), for real nodes (Backend::kNvshmem).
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "params/internode.h"
#include "internode_runtime.h"
#include "rank_regions.h"
#include "runtime_common.h"
#include "op_args.h"
#include "rank_args.h"
#include "symmetric_region.h"
#include "cuda_check.h"

namespace {

// The kernels' per-rank structs, bound (rank_args.h), and the ops' settings (op_args.h). A rank's
// place in the world (ep::InternodePeers) is the runtime's, from its number.
struct InternodeRank {
    int rank = -1;
};
using InternodeNotifyRank = RankArgs<ep::InternodeNotifyRankArgs, InternodeRank, CountPublishing>;
using InternodeCachedNotifyRank = RankArgs<ep::InternodeCachedNotifyRankArgs, InternodeRank>;
using InternodeDispatchRank = RankArgs<ep::InternodeDispatchRankArgs, InternodeRank>;
using InternodeCombineRank = RankArgs<ep::InternodeCombineRankArgs, InternodeRank>;
using InternodeNotifyOp = OpArgs<LaunchSettings, InternodeRings, ExpertCounts>;
using InternodeCachedNotifyOp = OpArgs<LaunchSettings, InternodeRings, HeadRewrite>;
using InternodeDispatchOp = OpArgs<LaunchSettings, InternodeRings, DispatchSettings>;
using InternodeCombineOp = OpArgs<LaunchSettings, InternodeRings, CombineSettings>;

template <typename T>
void bind_internode_rank(ArgClass<T>& c) {
    c.value("rank", &InternodeRank::rank).value("num_tokens", &T::KernelArgs::num_tokens);
}

// What the notify computes and the dispatch reads: where each (node or rank, channel)'s tokens start.
template <typename T>
void bind_internode_routing(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("rdma_channel_prefix_matrix", &K::rdma_channel_prefix_matrix)
        .tensor("gbl_channel_prefix_matrix", &K::gbl_channel_prefix_matrix);
    c.tensor("recv_rdma_rank_prefix_sum", &K::recv_rdma_rank_prefix_sum)
        .tensor("recv_gbl_rank_prefix_sum", &K::recv_gbl_rank_prefix_sum);
}

// What the dispatch writes and the combine reads: where the received records and rows came from.
template <typename T>
void bind_internode_receipt(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("recv_rdma_channel_offset", &K::recv_rdma_channel_offset)
        .tensor("recv_gbl_channel_offset", &K::recv_gbl_channel_offset);
    c.tensor("send_rdma_head", &K::send_rdma_head).tensor("send_nvl_head", &K::send_nvl_head);
}

void register_internode_args(py::module_& m) {
    ArgClass<InternodeNotifyRank> notify(m, "InternodeNotifyRank");
    using N = ep::InternodeNotifyRankArgs;
    bind_internode_rank(notify);
    notify.tensor("num_tokens_per_rank", &N::num_tokens_per_rank)
        .tensor("num_tokens_per_node", &N::num_tokens_per_node)
        .tensor("num_tokens_per_expert", &N::num_tokens_per_expert)
        .tensor("is_token_in_rank", &N::is_token_in_rank)
        .value("publish_counts", &CountPublishing::publish_counts);
    bind_internode_routing(notify);  // out
    InternodeNotifyOp::bind(m, "InternodeNotifyOp");

    // The head tables are rewritten before a combine only (rewrite_heads), and needed then only.
    ArgClass<InternodeCachedNotifyRank> cached(m, "InternodeCachedNotifyRank");
    using C = ep::InternodeCachedNotifyRankArgs;
    bind_internode_rank(cached);
    cached.optional_tensor("send_rdma_head", &C::send_rdma_head)
        .optional_tensor("rdma_channel_prefix_matrix", &C::rdma_channel_prefix_matrix)
        .optional_tensor("send_nvl_head", &C::send_nvl_head)
        .optional_tensor("recv_rdma_rank_prefix_sum", &C::recv_rdma_rank_prefix_sum)
        .optional_tensor("recv_rdma_channel_offset", &C::recv_rdma_channel_offset);
    InternodeCachedNotifyOp::bind(m, "InternodeCachedNotifyOp");

    ArgClass<InternodeDispatchRank> dispatch(m, "InternodeDispatchRank");
    bind_internode_rank(dispatch);
    bind_dispatch_payload(dispatch);
    bind_internode_routing(dispatch);
    bind_internode_receipt(dispatch);  // out
    InternodeDispatchOp::bind(m, "InternodeDispatchOp");

    ArgClass<InternodeCombineRank> combine(m, "InternodeCombineRank");
    using K = ep::InternodeCombineRankArgs;
    bind_internode_rank(combine);
    bind_combine_payload(combine);
    combine.tensor("recv_rdma_rank_prefix_sum", &K::recv_rdma_rank_prefix_sum)
        .tensor("recv_gbl_rank_prefix_sum", &K::recv_gbl_rank_prefix_sum);
    bind_internode_receipt(combine);
    InternodeCombineOp::bind(m, "InternodeCombineOp");
}

// The channels and rings of an op (params/internode_layout.h).
template <typename Op>
ep::InternodeConfig config_of(const Op& op) {
    return {op.num_channels, op.nvl_chunk, op.nvl_capacity, op.rdma_chunk, op.rdma_capacity};
}

class InternodeRuntime : public RuntimeCore {
   public:
    // Count exchange; resets this launch's mapped counters to -1 first.
    void notify(const std::vector<InternodeNotifyRank>& ranks, const InternodeNotifyOp& op) {
        ep::InternodeNotifyParams p{};
        fill_common(p, ranks.size(), op, 16);
        p.num_experts = op.num_experts;
        TORCH_CHECK(p.num_experts % world_size_ == 0 && p.num_experts / world_size_ <= ep::kMaxLocalExperts,
                    "kernels_cuda: bad number of experts");
        p.expert_alignment = op.expert_alignment;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const InternodeNotifyRank& d = ranks[i];
            ep::InternodeNotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            // Without a host wait (num_worst_tokens) the kernel publishes nothing: a late write could
            // otherwise land after the next notify reset the counters and pass for its counts.
            if (!d.publish_counts) continue;
            const CountSlots slots = reset_counts(static_cast<int>(i), p.num_experts / world_size_);
            a.recv_counter = slots.rows;
            a.recv_rdma_counter = slots.rdma_records;
            a.recv_expert_counter = slots.expert_rows;
        }
        check_cuda(ep::launch_internode_notify(p, backend_, stream_.get()), "internode notify");
    }

    // Per launch rank: (rows to receive, records to receive over RDMA, rows per local expert).
    std::vector<std::tuple<int, int, std::vector<int>>> wait_recv_counts(int num_launch_ranks, int local_experts,
                                                                         double timeout_s) {
        wait_counts(num_launch_ranks, local_experts, true, timeout_s);
        std::vector<std::tuple<int, int, std::vector<int>>> out;
        for (int i = 0; i < num_launch_ranks; ++i) out.emplace_back(rows(i), rdma_records(i), expert_rows(i, local_experts));
        return out;
    }

    std::vector<at::Tensor> get_dispatch_layout(const at::Tensor& topk_idx, int num_experts) {
        return dispatch_layout(topk_idx, num_experts, world_size_, gpus_);
    }

    void cached_notify(const std::vector<InternodeCachedNotifyRank>& ranks, const InternodeCachedNotifyOp& op) {
        ep::InternodeCachedNotifyParams p{};
        fill_common(p, ranks.size(), op, 16);
        p.rewrite_heads = op.rewrite_heads;
        for (size_t i = 0; i < ranks.size(); ++i) {
            const InternodeCachedNotifyRank& d = ranks[i];
            ep::InternodeCachedNotifyRankArgs& a = p.ranks[i];
            fill_rank(a, d);
            if (!p.rewrite_heads) continue;  // the kernel then reads none of them
            for (const char* name : {"send_rdma_head", "rdma_channel_prefix_matrix", "send_nvl_head",
                                     "recv_rdma_rank_prefix_sum", "recv_rdma_channel_offset"})
                d.require(name);
        }
        check_cuda(ep::launch_internode_cached_notify(p, backend_, stream_.get()), "internode cached notify");
    }

    void dispatch(const std::vector<InternodeDispatchRank>& ranks, const InternodeDispatchOp& op) {
        ep::InternodeDispatchParams p{};
        p.record = ep::internode_dispatch_record(op.hidden_bytes, op.num_scales, op.num_topk);
        fill_common(p, ranks.size(), op, p.record.bytes);
        validate(op, op.num_experts / world_size_);
        fill_dispatch_settings(p, op);
        p.nvl_chunk = op.nvl_chunk;
        p.rdma_chunk = op.rdma_chunk;
        for (size_t i = 0; i < ranks.size(); ++i) fill_rank(p.ranks[i], ranks[i]);
        check_cuda(ep::launch_internode_dispatch(p, backend_, stream_.get()), "internode dispatch");
    }

    void combine(const std::vector<InternodeCombineRank>& ranks, const InternodeCombineOp& op) {
        ep::InternodeCombineParams p{};
        p.record = ep::combine_record(op.hidden_bytes, op.num_topk);
        fill_common(p, ranks.size(), op, p.record.bytes);
        validate(op, 1);
        fill_combine_settings(p, op);
        p.nvl_chunk = op.nvl_chunk;
        p.rdma_chunk = op.rdma_chunk;
        const auto payload = op.float32 ? ep::Payload::kFloat32 : ep::Payload::kBF16;
        for (size_t i = 0; i < ranks.size(); ++i) fill_rank(p.ranks[i], ranks[i]);
        check_cuda(ep::launch_internode_combine(p, backend_, payload, stream_.get()), "internode combine");
    }

    // `rank`'s whole RDMA or NVLink region as bytes (get_local_buffer_tensor): a view, valid until destroy().
    at::Tensor rdma_region(int rank) const {
        check_launch_rank(rank);
        return rdma_.bytes_view(rank, rdma_bytes_);
    }
    at::Tensor nvl_region(int rank) const {
        check_launch_rank(rank);
        return nvl_.bytes_view(rank, nvl_bytes_);
    }

   protected:
    InternodeRuntime(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes, ep::Backend backend, int rank)
        : RuntimeCore(checked_world(num_nodes, gpus, rdma_bytes, nvl_bytes), rank, backend),
          nodes_(num_nodes),
          gpus_(gpus),
          rdma_bytes_(rdma_bytes),
          nvl_bytes_(nvl_bytes),
          rdma_("RDMA region", num_nodes * gpus),
          nvl_("NVLink region", num_nodes * gpus) {}

    const int nodes_, gpus_;
    const int64_t rdma_bytes_, nvl_bytes_;
    RankRegions rdma_, nvl_;  // by rank

   private:
    static int checked_world(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes) {
        TORCH_CHECK(num_nodes >= 2 && num_nodes <= ep::kMaxRdmaPeers && gpus >= 1 && gpus <= ep::kMaxNvlPeers,
                    "kernels_cuda: internode needs 2..", ep::kMaxRdmaPeers, " nodes of 1..", ep::kMaxNvlPeers, " GPUs");
        check_buffer_bytes(rdma_bytes);
        check_buffer_bytes(nvl_bytes);
        return num_nodes * gpus;
    }

    // The launch fields (RuntimeCore::fill_launch), then both regions' layouts for records of `record_bytes`.
    template <typename Params, typename Op>
    void fill_common(Params& p, size_t launch_ranks, const Op& op, int record_bytes) const {
        const ep::InternodeConfig cfg = config_of(op);
        fill_launch(p, launch_ranks, cfg.num_channels, op.timeout_cycles);
        p.num_nodes = nodes_;
        p.gpus = gpus_;
        p.layout = ep::make_internode_layout(cfg, nodes_, gpus_, record_bytes);
        check_fits("RDMA buffer", p.layout.rdma.total, rdma_bytes_);
        check_fits("NVLink buffer", p.layout.nvl.total, nvl_bytes_);
    }

    // A rank's arguments as bound, then its place in the world and the regions it reaches.
    template <typename Rank>
    void fill_rank(typename Rank::KernelArgs& a, const Rank& d) const {
        a = d.kernel;
        const int rank = d.rank;
        check_launch_rank(rank);
        a.peers = ep::InternodePeers{};
        a.peers.rank = rank;
        a.peers.node = rank / gpus_;
        a.peers.gpu = rank % gpus_;
        a.peers.gpus = gpus_;
        for (int m = 0; m < nodes_; ++m) a.peers.rdma[m] = rdma_.at(m * gpus_ + a.peers.gpu);
        for (int j = 0; j < gpus_; ++j) a.peers.nvl[j] = nvl_.at(a.peers.node * gpus_ + j);
    }

    // The op's channels and rings for its rows (params/internode_layout.h's validate_internode).
    template <typename Op>
    void validate(const Op& op, int local_experts) const {
        const char* error =
            ep::validate_internode(config_of(op), nodes_, gpus_, op.hidden_bytes, op.num_topk, local_experts);
        TORCH_CHECK(error == nullptr, "kernels_cuda: invalid internode config: ", error);
    }
};

class EmulatedInternodeRuntime final : public InternodeRuntime {
   public:
    EmulatedInternodeRuntime(int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes)
        : InternodeRuntime(num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kEmulated, 0) {
        TORCH_CHECK(world_size_ <= ep::kMaxEmulatedRanks, "kernels_cuda: emulated internode handles at most ",
                    ep::kMaxEmulatedRanks, " ranks");
        rdma_.allocate_all(rdma_bytes);
        nvl_.allocate_all(nvl_bytes);
    }
};

// This process's rank: the NVLink region cudaMalloc'ed and shared with the node's GPUs through CUDA
// IPC handles; the RDMA region is the subclass's.
class ProcessInternodeRuntime : public InternodeRuntime {
   public:
    ~ProcessInternodeRuntime() override { destroy(); }

    // (NVLink handle, RDMA handle or empty bytes when the RDMA hop needs none).
    std::pair<py::bytes, py::bytes> ipc_handles() const {
        require_alive();
        return {nvl_.ipc_handle(), rdma_over_ipc() ? rdma_.ipc_handle() : py::bytes()};
    }

    // One pair per rank of the EP group (from all-gathering `ipc_handles`): this node's NVLink
    // regions are opened, and the rail peers' RDMA regions where the RDMA hop goes through IPC.
    void open_ipc_handles(const std::vector<std::pair<py::bytes, py::bytes>>& handles) {
        require_alive();
        TORCH_CHECK(static_cast<int>(handles.size()) == world_size_, "kernels_cuda: need one IPC handle per rank");
        for (const int r : node_peers()) nvl_.open(r, handles[r].first);
        if (rdma_over_ipc())
            for (const int r : rail_peers()) rdma_.open(r, handles[r].second);
    }

    // Collective over the group (the caller synchronises the ranks first); the destructor calls it
    // when the caller did not.
    void destroy() {
        if (!nvl_.allocated()) return;
        cudaDeviceSynchronize();
        rdma_.release();
        nvl_.release();
    }

   protected:
    ProcessInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes,
                            ep::Backend backend)
        : InternodeRuntime(num_nodes, gpus, rdma_bytes, nvl_bytes, backend, rank) {
        nvl_.allocate(rank, nvl_bytes);
    }

   private:
    bool rdma_over_ipc() const { return backend_ == ep::Backend::kNvlink; }

    void require_alive() const {
        TORCH_CHECK(nvl_.allocated(), "kernels_cuda: the internode buffer was destroyed");
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
};

// The RDMA hop through CUDA IPC as well (Backend::kNvlink): "nodes" that share one machine, such as
// simulated nodes (gpus_per_node smaller than the machine's GPUs) or processes sharing one GPU.
class IpcInternodeRuntime final : public ProcessInternodeRuntime {
   public:
    IpcInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes)
        : ProcessInternodeRuntime(rank, num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kNvlink) {
        rdma_.allocate(rank, rdma_bytes);
    }
};

#if defined(EP_WITH_NVSHMEM)
// The RDMA region in NVSHMEM's symmetric heap (Backend::kNvshmem, PE = rank): real multi-node runs.
class NvshmemInternodeRuntime final : public ProcessInternodeRuntime {
   public:
    // Collective over the EP group (every rank constructs one with the unique id made by rank 0).
    NvshmemInternodeRuntime(int rank, int num_nodes, int gpus, int64_t rdma_bytes, int64_t nvl_bytes,
                            const std::string& unique_id)
        : ProcessInternodeRuntime(rank, num_nodes, gpus, rdma_bytes, nvl_bytes, ep::Backend::kNvshmem) {
        uint8_t* symmetric = symmetric_region::adopt(rdma_, rank, world_size_, rdma_bytes, unique_id);
        // The symmetric heap has the same address on every PE: node m's rail peer is reached at ours.
        for (int m = 0; m < num_nodes; ++m) rdma_.alias(m * gpus + rank % gpus, symmetric);
    }
};
#endif

}  // namespace

void register_internode(py::module_& m) {
    register_internode_args(m);
    py::class_<InternodeRuntime> runtime(m, "InternodeRuntime");
    runtime.def("notify", &InternodeRuntime::notify)
        .def("get_dispatch_layout", &InternodeRuntime::get_dispatch_layout)
        .def("wait_recv_counts", &InternodeRuntime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("cached_notify", &InternodeRuntime::cached_notify)
        .def("dispatch", &InternodeRuntime::dispatch)
        .def("combine", &InternodeRuntime::combine)
        .def("rdma_region", &InternodeRuntime::rdma_region)
        .def("nvl_region", &InternodeRuntime::nvl_region);
    bind_runtime_core(runtime);
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
        .def_static("unique_id", &symmetric_region::unique_id);
    m.attr("with_nvshmem") = true;
#else
    m.attr("with_nvshmem") = false;
#endif
}
