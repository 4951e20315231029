// Host side of the low-latency kernels: LowLatencyRuntime owns every rank's low-latency region as this
// process addresses it (one rank per process, its peers' regions mapped through CUDA IPC, or shared
// memory on the CPU emulation; or every rank emulated in one process; NvshmemLowLatencyRuntime: the
// region in NVSHMEM's symmetric heap, for peers on other machines), checks the sizes and fills the
// kernels' parameter block (params/low_latency.h) from the typed arguments bound here (op_args.h,
// rank_args.h). Which half an op uses, its number and the hook rule are kept by the Python engine
// (kernels_cuda/low_latency.py).
#include "low_latency_runtime.h"

#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "params/low_latency.h"
#include "op_args.h"
#include "rank_args.h"
#include "region_runtime.h"
#include "runtime_common.h"
#include "cuda_check.h"

#include "symmetric_region.h"

namespace {

// Dispatch and combine take the same kernel struct, each its own fields of it (two Python classes).
struct LowLatencyDispatchRank : RankArgs<ep::LowLatencyRankArgs> {};
struct LowLatencyCombineRank : RankArgs<ep::LowLatencyRankArgs> {};

// Sizes and the op's half and number (kept by kernels_cuda/low_latency.py); the phases are the call's.
struct LowLatencySettings {
    int num_experts = 0;
    int num_topk = 0;
    int hidden = 0;
    int max_tokens = 0;
    int half = 0;
    int seq = 0;
    int num_blocks = 0;
    int64_t timeout_cycles = 0;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        using S = LowLatencySettings;
        c.value("num_experts", &S::num_experts).value("num_topk", &S::num_topk).value("hidden", &S::hidden);
        c.value("max_tokens", &S::max_tokens).value("half", &S::half).value("seq", &S::seq);
        c.value("num_blocks", &S::num_blocks).value("timeout_cycles", &S::timeout_cycles);
    }
};

// How a dispatch casts its rows (FP8 or not, and the scales' form).
struct LowLatencyCast {
    bool use_fp8 = false;
    bool round_scale = false;
    bool use_ue8m0 = false;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        c.value("use_fp8", &LowLatencyCast::use_fp8);
        c.value("round_scale", &LowLatencyCast::round_scale).value("use_ue8m0", &LowLatencyCast::use_ue8m0);
    }
};
using LowLatencyOp = OpArgs<LowLatencySettings>;
using LowLatencyDispatchOp = OpArgs<LowLatencySettings, LowLatencyCast>;

// What a rank's dispatch and combine both take: its tokens and routing, and the handle's tensors.
template <typename T>
void bind_low_latency_rank(ArgClass<T>& c) {
    using K = ep::LowLatencyRankArgs;
    bind_rank_tokens(c);
    c.tensor("x", &K::x)
        .tensor("topk_idx", &K::topk_idx)
        .tensor("src_info", &K::src_info)
        .tensor("layout_range", &K::layout_range);
}

void register_low_latency_args(py::module_& m) {
    ArgClass<LowLatencyDispatchRank> dispatch(m, "LowLatencyDispatchRank");
    bind_low_latency_rank(dispatch);
    using K = ep::LowLatencyRankArgs;
    dispatch.tensor("packed_x", &K::packed_x)                 // out
        .optional_tensor("packed_scales", &K::packed_scales)  // out; None without FP8
        .tensor("packed_count", &K::packed_count)             // out
        .optional_tensor("stats", &K::stats);                 // cumulative_local_expert_recv_stats, or None
    ArgClass<LowLatencyCombineRank> combine(m, "LowLatencyCombineRank");
    bind_low_latency_rank(combine);
    combine.tensor("topk_weights", &K::topk_weights)
        .tensor("combined_x", &K::combined_x);  // out
    LowLatencyOp::bind(m, "LowLatencyOp");
    LowLatencyDispatchOp::bind(m, "LowLatencyDispatchOp");
}

class LowLatencyRuntime : public RegionRuntime {
   public:
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_bytes, bool emulated)
        : LowLatencyRuntime(rank, num_ranks, num_bytes, emulated ? ep::Backend::kEmulated : ep::Backend::kNvlink) {
        allocate_own();
    }

    // Bytes per rank for these sizes (Buffer.get_low_latency_rdma_size_hint).
    static int64_t size_hint(int max_tokens, int hidden, int num_experts) {
        return ep::make_low_latency_layout(num_experts, max_tokens, hidden).total;
    }

    // Zeroes the regions of the ranks this process launches: signals, counters and the clean word.
    void clean() {
        require_alive();
        const int first = every_rank() ? 0 : launch_rank_, last = every_rank() ? world_size_ : launch_rank_ + 1;
        for (int r = first; r < last; ++r) check_cuda(cudaMemset(regions_.at(r), 0, num_bytes_), "cudaMemset");
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }

    // The zero-copy combine input of `rank` in `half`: bfloat16 [E_local, R * T_max, H], a view of the region.
    at::Tensor combine_buffer(int rank, int half, int max_tokens, int hidden, int num_experts) {
        require_alive();
        check_launch_rank(rank);
        TORCH_CHECK(half == 0 || half == 1, "kernels_cuda: half must be 0 or 1");
        const ep::LowLatencyLayout l = checked_layout(num_experts, max_tokens, hidden);
        uint8_t* base = regions_.at(rank) + half * l.half_bytes + l.combine_send;
        return torch::from_blob(base, {num_experts / world_size_, static_cast<int64_t>(world_size_) * max_tokens, hidden},
                                launch_device_options(at::kBFloat16));
    }

    void dispatch(const std::vector<LowLatencyDispatchRank>& ranks, const LowLatencyDispatchOp& op, int phases) {
        ep::LowLatencyParams p = params(ranks, op, phases);
        p.use_fp8 = op.use_fp8;
        p.round_scale = op.round_scale;
        p.use_ue8m0 = op.use_ue8m0;
        TORCH_CHECK(!p.use_fp8 || p.hidden % 128 == 0, "kernels_cuda: FP8 needs the hidden size to be a multiple of 128");
        check_cuda(ep::launch_low_latency_dispatch(p, backend_, stream_.get()), "low_latency_dispatch");
    }

    void combine(const std::vector<LowLatencyCombineRank>& ranks, const LowLatencyOp& op, int phases) {
        ep::LowLatencyParams p = params(ranks, op, phases);
        check_cuda(ep::launch_low_latency_combine(p, backend_, stream_.get()), "low_latency_combine");
    }

    // Whether the sources of the kernels' puts must lie in the region (NVSHMEM): the combine's input is
    // then copied into the zero-copy buffer first.
    bool symmetric_sources() const { return backend_ == ep::Backend::kNvshmem; }

   protected:
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_bytes, ep::Backend backend)
        : RegionRuntime("low-latency region", rank, num_ranks, num_bytes, backend) {}

   private:
    ep::LowLatencyLayout checked_layout(int num_experts, int max_tokens, int hidden) const {
        TORCH_CHECK(num_experts % world_size_ == 0 && max_tokens >= 1 && hidden >= 8 && hidden % 8 == 0,
                    "kernels_cuda: bad low-latency sizes (experts must split over ranks, hidden a multiple of 8: "
                    "rows of 16-byte vectors)");
        const ep::LowLatencyLayout l = ep::make_low_latency_layout(num_experts, max_tokens, hidden);
        check_fits("low-latency region", l.total, num_bytes_);
        return l;
    }

    // What dispatch and combine share: sizes, the op's half, number and phases; per rank its arguments
    // as bound, and every rank's region as this process sees it.
    template <typename Rank>
    ep::LowLatencyParams params(const std::vector<Rank>& ranks, const LowLatencySettings& op, int phases) const {
        ep::LowLatencyParams p{};
        fill_launch(p, ranks.size(), op.num_blocks, op.timeout_cycles);
        p.num_ranks = world_size_;
        p.num_experts = op.num_experts;
        p.num_topk = op.num_topk;
        p.hidden = op.hidden;
        p.max_tokens = op.max_tokens;
        p.half = op.half;
        p.seq = op.seq;
        p.phases = phases;
        TORCH_CHECK(p.num_topk >= 1 && p.num_topk <= ep::kLowLatencyMaxTopk, "kernels_cuda: num_topk must be in [1, ",
                    ep::kLowLatencyMaxTopk, "]");
        TORCH_CHECK((p.half == 0 || p.half == 1) && p.seq > 0 && p.phases >= 1 && p.phases <= 3,
                    "kernels_cuda: bad low-latency op (half, seq or phases)");
        p.layout = checked_layout(p.num_experts, p.max_tokens, p.hidden);
        for (size_t i = 0; i < ranks.size(); ++i) {
            ep::LowLatencyRankArgs& a = p.ranks[i] = ranks[i].kernel;
            check_launch_rank(a.rank);
            TORCH_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens, "kernels_cuda: rank ", a.rank, " has ",
                        a.num_tokens, " tokens, more than num_max_dispatch_tokens_per_rank=", p.max_tokens);
            for (int r = 0; r < world_size_; ++r) a.peers[r] = regions_.at(r);
        }
        return p;
    }
};

#if defined(EP_WITH_NVSHMEM)
// The region in NVSHMEM's symmetric heap (Backend::kNvshmem, PE = EP rank), for EP groups across
// machines. Collective over the group: every rank constructs one with the unique id made by rank 0
// (empty once this process's NVSHMEM world exists, e.g. from an internode buffer).
class NvshmemLowLatencyRuntime final : public LowLatencyRuntime {
   public:
    NvshmemLowLatencyRuntime(int rank, int num_ranks, int64_t num_bytes, const std::string& unique_id)
        : LowLatencyRuntime(rank, num_ranks, num_bytes, ep::Backend::kNvshmem) {
        uint8_t* symmetric = symmetric_region::adopt(regions_, rank, world_size_, num_bytes, unique_id);
        for (int r = 0; r < num_ranks; ++r) regions_.alias(r, symmetric);  // the same address on every PE
    }
};
#endif

}  // namespace

void register_low_latency(py::module_& m) {
    register_low_latency_args(m);
    py::class_<LowLatencyRuntime> runtime(m, "LowLatencyRuntime");
    runtime.def(py::init<int, int, int64_t, bool>())
        .def_static("size_hint", &LowLatencyRuntime::size_hint)
        .def("clean", &LowLatencyRuntime::clean)
        .def("combine_buffer", &LowLatencyRuntime::combine_buffer)
        .def("dispatch", &LowLatencyRuntime::dispatch)
        .def("combine", &LowLatencyRuntime::combine)
        .def_property_readonly("symmetric_sources", &LowLatencyRuntime::symmetric_sources);
    bind_region_runtime(runtime);
#if defined(EP_WITH_NVSHMEM)
    py::class_<NvshmemLowLatencyRuntime, LowLatencyRuntime>(m, "NvshmemLowLatencyRuntime")
        .def(py::init<int, int, int64_t, const std::string&>())
        .def_static("unique_id", &symmetric_region::unique_id);
#endif
}
