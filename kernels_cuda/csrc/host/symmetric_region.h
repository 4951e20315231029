// NVSHMEM back ends' regions (EP_WITH_NVSHMEM builds only): this PE's zeroed region in the symmetric
// heap, adopted by a RankRegions, and the unique id that starts the world; shared by the internode
// runtime's RDMA region and the low-latency region.
#pragma once
#if defined(EP_WITH_NVSHMEM)
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "cuda_check.h"
#include "nvshmem_world.h"
#include "rank_regions.h"

namespace symmetric_region {

namespace world = ep::nvshmem_world;

// Made on rank 0 and broadcast before the runtimes are constructed; empty once this process's NVSHMEM
// world exists (it is initialised once). Sizes the heap first: NVSHMEM may read it here.
inline py::bytes unique_id(int64_t bytes) {
    world::size_heap(bytes);
    return py::bytes(world::initialised() ? std::string() : world::unique_id());
}

// The world stays (it is finalised at process exit); the region goes once no peer uses it.
inline void free_region(void* region) {
    world::barrier();
    world::deallocate(region);
}

// Joins the world as PE `rank` of `num_pes` and makes `rank`'s region of `regions` a zeroed symmetric
// allocation (collective); returns its base, at which every peer's region is reached too.
inline uint8_t* adopt(RankRegions& regions, int rank, int num_pes, int64_t bytes, const std::string& id) {
    world::size_heap(bytes);
    world::join(id, rank, num_pes);
    regions.adopt(rank, world::allocate(bytes), free_region);
    uint8_t* symmetric = regions.at(rank);
    check_cuda(cudaMemset(symmetric, 0, bytes), "cudaMemset(symmetric region)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    world::barrier();  // every region is zero before any peer signals into it
    return symmetric;
}

}  // namespace symmetric_region
#endif
