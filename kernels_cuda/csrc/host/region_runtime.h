// RegionRuntime: a runtime over one region per rank (the intranode Runtime's buffer, host/bindings.cpp;
// LowLatencyRuntime's region, host/low_latency_runtime.cpp), and its lifecycle: every rank's region
// allocated when this process emulates them all, else this rank's, its peers' opened from their IPC
// handles; views of a rank's region; destroy. bind_region_runtime binds those methods.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "rank_regions.h"
#include "runtime_common.h"

class RegionRuntime : public RuntimeCore {
   public:
    ~RegionRuntime() override { destroy(); }

    // Unmaps the peers' regions and frees this rank's (collective: the caller synchronises the ranks
    // first); the destructor calls it when the caller did not. Later ops fail naming the unmapped peer.
    void destroy() { regions_.release_when_idle(); }

    py::bytes ipc_handle() const {
        require_alive();
        return regions_.ipc_handle();
    }

    void open_ipc_handles(const std::vector<py::bytes>& handles) {
        TORCH_CHECK(!every_rank(), "kernels_cuda: the emulated back end has no IPC peers");
        regions_.open_peers(handles, launch_rank_);
    }

    // `rank`'s whole region as bytes (get_local_buffer_tensor): a view, valid until destroy().
    at::Tensor region(int rank) const {
        require_alive();
        check_launch_rank(rank);
        return regions_.bytes_view(rank, num_bytes_);
    }

    int64_t num_bytes() const { return num_bytes_; }

   protected:
    // Allocates nothing: the subclass allocates (allocate_own) or adopts its regions.
    RegionRuntime(const char* name, int rank, int num_ranks, int64_t num_bytes, ep::Backend backend)
        : RuntimeCore(checked_world(num_ranks, num_bytes), rank, backend),
          num_bytes_(num_bytes),
          regions_(name, num_ranks) {}

    // Every rank's region when this process emulates them all, else this rank's.
    void allocate_own() {
        if (every_rank())
            regions_.allocate_all(num_bytes_);
        else
            regions_.allocate(launch_rank_, num_bytes_);
    }

    void require_alive() const { regions_.require_allocated(); }

    const int64_t num_bytes_;
    RankRegions regions_;  // by rank

   private:
    static int checked_world(int num_ranks, int64_t num_bytes) {
        TORCH_CHECK(num_ranks >= 1 && num_ranks <= ep::kMaxRanks, "kernels_cuda: num_ranks must be in [1, ",
                    ep::kMaxRanks, "]");
        check_buffer_bytes(num_bytes);
        return num_ranks;
    }
};

template <typename Runtime, typename... Options>
void bind_region_runtime(py::class_<Runtime, Options...>& cls) {
    cls.def("ipc_handle", &Runtime::ipc_handle)
        .def("open_ipc_handles", &Runtime::open_ipc_handles)
        .def("destroy", &Runtime::destroy)
        .def("region", &Runtime::region)
        .def_property_readonly("num_bytes", &Runtime::num_bytes);
    bind_runtime_core(cls);
}
