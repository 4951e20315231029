// Host side of the low-latency kernels: LowLatencyRuntime owns every rank's low-latency region as this
// process addresses it (one rank per process, its peers' regions mapped through CUDA IPC, or shared
// memory on the CPU emulation; or every rank emulated in one process; NvshmemLowLatencyRuntime: the
// region in NVSHMEM's symmetric heap, for peers on other machines), checks the sizes and fills the
// kernels' parameter block (ep_low_latency.h) from per-rank dicts of tensors. Which half an op uses,
// its number and the hook rule are kept by the Python engine (kernels_cuda/low_latency.py).
#include "low_latency_runtime.h"

#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "../ep_low_latency.h"
#include "rank_regions.h"
#include "runtime_common.h"
#include "tensor_args.h"

#include "symmetric_region.h"

namespace {

class LowLatencyRuntime : public RuntimeCore {
   public:
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_bytes, bool emulated)
        : LowLatencyRuntime(rank, num_ranks, num_bytes, emulated ? ep::Backend::kEmulated : ep::Backend::kNvlink) {
        if (emulated)
            regions_.allocate_all(num_bytes);
        else
            regions_.allocate(rank, num_bytes);
    }

    ~LowLatencyRuntime() override { destroy(); }

    // Bytes per rank for these sizes (Buffer.get_low_latency_rdma_size_hint).
    static int64_t size_hint(int max_tokens, int hidden, int num_experts) {
        return ep::make_low_latency_layout(num_experts, max_tokens, hidden).total;
    }

    void destroy() { regions_.release_when_idle(); }

    py::bytes ipc_handle() const {
        require_alive();
        return regions_.ipc_handle();
    }

    void open_ipc_handles(const std::vector<py::bytes>& handles) {
        TORCH_CHECK(!every_rank(), "kernels_cuda: the emulated back end has no IPC peers");
        regions_.open_peers(handles, launch_rank_);
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

    // `rank`'s whole region as bytes (get_local_buffer_tensor): a view, valid until destroy().
    at::Tensor region(int rank) const {
        require_alive();
        check_launch_rank(rank);
        return regions_.bytes_view(rank, num_bytes_);
    }

    void dispatch(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::LowLatencyParams p = params(ranks, s);
        p.use_fp8 = s["use_fp8"].cast<bool>();
        p.round_scale = s["round_scale"].cast<bool>();
        p.use_ue8m0 = s["use_ue8m0"].cast<bool>();
        TORCH_CHECK(!p.use_fp8 || p.hidden % 128 == 0, "kernels_cuda: FP8 needs the hidden size to be a multiple of 128");
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::LowLatencyRankArgs& a = p.ranks[i];
            a.packed_x = ptr<void>(d, "packed_x");
            a.packed_scales = ptr_or_null<void>(d, "packed_scales");
            a.packed_count = ptr<int>(d, "packed_count");
            a.stats = ptr_or_null<int>(d, "stats");
        }
        check_cuda(ep::launch_low_latency_dispatch(p, backend_, stream_.get()), "low_latency_dispatch");
    }

    void combine(const std::vector<py::dict>& ranks, const py::dict& s) {
        ep::LowLatencyParams p = params(ranks, s);
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::LowLatencyRankArgs& a = p.ranks[i];
            a.topk_weights = ptr<float>(d, "topk_weights");
            a.combined_x = ptr<void>(d, "combined_x");
        }
        check_cuda(ep::launch_low_latency_combine(p, backend_, stream_.get()), "low_latency_combine");
    }

    int64_t num_bytes() const { return num_bytes_; }

    // Whether the sources of the kernels' puts must lie in the region (NVSHMEM): the combine's input is
    // then copied into the zero-copy buffer first.
    bool symmetric_sources() const { return backend_ == ep::Backend::kNvshmem; }

   protected:
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_bytes, ep::Backend backend)
        : RuntimeCore(checked_world(num_ranks, num_bytes), rank, backend),
          num_bytes_(num_bytes),
          regions_("low-latency region", num_ranks) {}

    RankRegions regions_;  // by rank

   private:
    static int checked_world(int num_ranks, int64_t num_bytes) {
        TORCH_CHECK(num_ranks >= 1 && num_ranks <= ep::kMaxRanks, "kernels_cuda: num_ranks must be in [1, ",
                    ep::kMaxRanks, "]");
        check_buffer_bytes(num_bytes);
        return num_ranks;
    }

    void require_alive() const {
        TORCH_CHECK(regions_.allocated(), "kernels_cuda: the low-latency buffer was destroyed");
    }

    ep::LowLatencyLayout checked_layout(int num_experts, int max_tokens, int hidden) const {
        TORCH_CHECK(num_experts % world_size_ == 0 && max_tokens >= 1 && hidden >= 8 && hidden % 8 == 0,
                    "kernels_cuda: bad low-latency sizes (experts must split over ranks, hidden a multiple of 8: "
                    "rows of 16-byte vectors)");
        const ep::LowLatencyLayout l = ep::make_low_latency_layout(num_experts, max_tokens, hidden);
        check_fits("low-latency region", l.total, num_bytes_);
        return l;
    }

    // What dispatch and combine share: sizes, the op's half, number and phases, and per rank its
    // tokens, routing, the handle tensors and every rank's region as this process sees it.
    ep::LowLatencyParams params(const std::vector<py::dict>& ranks, const py::dict& s) const {
        ep::LowLatencyParams p{};
        fill_launch(p, ranks.size(), s["num_blocks"].cast<int>(), s["timeout_cycles"].cast<int64_t>());
        p.num_ranks = world_size_;
        p.num_experts = s["num_experts"].cast<int>();
        p.num_topk = s["num_topk"].cast<int>();
        p.hidden = s["hidden"].cast<int>();
        p.max_tokens = s["max_tokens"].cast<int>();
        p.half = s["half"].cast<int>();
        p.seq = s["seq"].cast<int>();
        p.phases = s["phases"].cast<int>();
        TORCH_CHECK(p.num_topk >= 1 && p.num_topk <= ep::kLowLatencyMaxTopk, "kernels_cuda: num_topk must be in [1, ",
                    ep::kLowLatencyMaxTopk, "]");
        TORCH_CHECK((p.half == 0 || p.half == 1) && p.seq > 0 && p.phases >= 1 && p.phases <= 3,
                    "kernels_cuda: bad low-latency op (half, seq or phases)");
        p.layout = checked_layout(p.num_experts, p.max_tokens, p.hidden);
        for (size_t i = 0; i < ranks.size(); ++i) {
            const py::dict& d = ranks[i];
            ep::LowLatencyRankArgs& a = p.ranks[i];
            a.rank = d["rank"].cast<int>();
            a.num_tokens = d["num_tokens"].cast<int>();
            check_launch_rank(a.rank);
            TORCH_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens, "kernels_cuda: rank ", a.rank, " has ",
                        a.num_tokens, " tokens, more than num_max_dispatch_tokens_per_rank=", p.max_tokens);
            for (int r = 0; r < world_size_; ++r) a.peers[r] = regions_.at(r);
            a.x = ptr<void>(d, "x");
            a.topk_idx = ptr<int64_t>(d, "topk_idx");
            a.src_info = ptr<int>(d, "src_info");
            a.layout_range = ptr<int64_t>(d, "layout_range");
        }
        return p;
    }

    const int64_t num_bytes_;
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
    py::class_<LowLatencyRuntime> runtime(m, "LowLatencyRuntime");
    runtime.def(py::init<int, int, int64_t, bool>())
        .def_static("size_hint", &LowLatencyRuntime::size_hint)
        .def("ipc_handle", &LowLatencyRuntime::ipc_handle)
        .def("open_ipc_handles", &LowLatencyRuntime::open_ipc_handles)
        .def("destroy", &LowLatencyRuntime::destroy)
        .def("clean", &LowLatencyRuntime::clean)
        .def("combine_buffer", &LowLatencyRuntime::combine_buffer)
        .def("region", &LowLatencyRuntime::region)
        .def("dispatch", &LowLatencyRuntime::dispatch)
        .def("combine", &LowLatencyRuntime::combine)
        .def_property_readonly("num_bytes", &LowLatencyRuntime::num_bytes)
        .def_property_readonly("symmetric_sources", &LowLatencyRuntime::symmetric_sources);
    bind_runtime_core(runtime);
#if defined(EP_WITH_NVSHMEM)
    py::class_<NvshmemLowLatencyRuntime, LowLatencyRuntime>(m, "NvshmemLowLatencyRuntime")
        .def(py::init<int, int, int64_t, const std::string&>())
        .def_static("unique_id", &symmetric_region::unique_id);
#endif
}
