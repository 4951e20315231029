// RankRegions: every rank's region of one kind (the intranode buffer, an internode RDMA or NVLink
// region) as this process addresses it. Either one allocation sliced into all ranks' regions (one
// process emulates every rank), or this rank's own region with its peers' mapped through CUDA IPC
// (a cudaMalloc'ed base travels as the raw bytes of its cudaIpcMemHandle_t, all-gathered with
// torch.distributed, and is opened by each peer) or reached at NVSHMEM's symmetric address.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "device_api.h"

class RankRegions {
   public:
    using Free = void (*)(void*);

    RankRegions(const char* kind, int num_ranks) : kind_(kind), base_(num_ranks, nullptr), opened_(num_ranks, false) {}
    RankRegions(const RankRegions&) = delete;
    RankRegions& operator=(const RankRegions&) = delete;
    ~RankRegions() { release(); }

    // One zeroed allocation holding every rank's region, rank r's at r * bytes.
    void allocate_all(int64_t bytes) {
        memory_ = Memory(zeroed(bytes * static_cast<int64_t>(base_.size())), cuda_free);
        for (size_t r = 0; r < base_.size(); ++r) base_[r] = static_cast<uint8_t*>(memory_.get()) + r * bytes;
    }

    // This rank's zeroed region, cudaMalloc'ed so that it can be exported with ipc_handle().
    void allocate(int rank, int64_t bytes) { adopt(rank, zeroed(bytes), cuda_free); }

    // This rank's region, allocated elsewhere (NVSHMEM's symmetric heap) and freed by `free` on release().
    void adopt(int rank, void* memory, Free free) {
        memory_ = Memory(memory, free);
        base_[rank] = static_cast<uint8_t*>(memory);
    }

    // Where `rank`'s region is reached at an address this process already has (NVSHMEM: the symmetric
    // heap has the same address on every PE).
    void alias(int rank, uint8_t* base) { base_[rank] = base; }

    bool allocated() const { return memory_ != nullptr; }

    void require_allocated() const { TORCH_CHECK(allocated(), "kernels_cuda: the ", kind_, " was destroyed"); }

    py::bytes ipc_handle() const {
        cudaIpcMemHandle_t handle;
        check_cuda(cudaIpcGetMemHandle(&handle, memory_.get()), "cudaIpcGetMemHandle");
        return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }

    // Maps `rank`'s region from the handle its process exported, unless it is mapped already.
    void open(int rank, const std::string& raw) {
        if (base_[rank] != nullptr) return;
        TORCH_CHECK(raw.size() == sizeof(cudaIpcMemHandle_t), "kernels_cuda: malformed IPC handle");
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, raw.data(), sizeof(handle));
        void* mapped = nullptr;
        check_cuda(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
        base_[rank] = static_cast<uint8_t*>(mapped);
        opened_[rank] = true;
    }

    // Maps every peer's region from the handles their processes exported (one per rank, `self`'s skipped).
    void open_peers(const std::vector<py::bytes>& handles, int self) {
        require_allocated();
        TORCH_CHECK(handles.size() == base_.size(), "kernels_cuda: need one IPC handle per rank");
        for (int r = 0; r < static_cast<int>(base_.size()); ++r)
            if (r != self) open(r, handles[r]);
    }

    // release() once the device is idle, if not released yet (destroy() of every runtime).
    void release_when_idle() {
        if (!allocated()) return;
        cudaDeviceSynchronize();
        release();
    }

    // `rank`'s region, `bytes` long, as a uint8 tensor on the launch device: a view (no copy) that is
    // valid until release().
    at::Tensor bytes_view(int rank, int64_t bytes) const {
        return torch::from_blob(at(rank), {bytes}, launch_device_options(at::kByte));
    }

    uint8_t* at(int rank) const {
        TORCH_CHECK(base_[rank] != nullptr, "kernels_cuda: the ", kind_, " of rank ", rank,
                    " is not mapped here (open_ipc_handles not called, or the buffer was destroyed)");
        return base_[rank];
    }

    // Unmaps the peers' regions and frees this rank's; later at() calls fail naming the region. The
    // caller makes sure no kernel uses them any more.
    void release() {
        for (size_t r = 0; r < base_.size(); ++r) {
            if (opened_[r]) cudaIpcCloseMemHandle(base_[r]);
            base_[r] = nullptr;
            opened_[r] = false;
        }
        memory_.reset();
    }

   private:
    using Memory = std::unique_ptr<void, Free>;

    static void cuda_free(void* memory) { cudaFree(memory); }

    // Zeroed before any peer maps it (the device is synchronised: peers read it from other streams).
    void* zeroed(int64_t bytes) const {
        const std::string what = std::string("cudaMalloc(") + kind_ + ")";
        void* memory = nullptr;
        check_cuda(cudaMalloc(&memory, bytes), what.c_str());
        Memory guard(memory, cuda_free);
        check_cuda(cudaMemset(memory, 0, bytes), what.c_str());
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        return guard.release();
    }

    const char* kind_;
    std::vector<uint8_t*> base_;
    std::vector<bool> opened_;  // by rank: mapped through CUDA IPC, to be closed
    Memory memory_{nullptr, cuda_free};
};
