// This process's NVSHMEM world for the internode kernels' NVSHMEM back end (one EP rank per process,
// PE = EP rank = node * gpus_per_node + gpu, as RdmaTransport<kNvshmem> in ../device/rdma.cuh assumes).
// Plain C++ signatures, so the torch host code can call them; defined in nvshmem_world.cu, which nvcc
// compiles with relocatable device code: NVSHMEM's initialisation must be linked into the same
// device-linked image as the kernels that use it. Built only with EP_WITH_NVSHMEM. Errors throw
// std::runtime_error (a RuntimeError in Python).
//
// NVSHMEM may be initialised only once per process, so the world outlives the buffers that use it:
// the first `join` initialises it and registers its finalisation at process exit (collective, after
// freeing any symmetric memory still allocated); later buffers join the same world, and its symmetric
// heap keeps the size it started with.
#pragma once
#include <cstdint>
#include <string>

namespace ep::nvshmem_world {

// Sets NVSHMEM_SYMMETRIC_SIZE from the RDMA bytes the caller will allocate (plus a margin) unless it
// is set already (by the user, or by an earlier call); NVSHMEM reads it when it starts.
void size_heap(int64_t rdma_bytes);

bool initialised();

// A fresh unique id (its raw bytes): made on PE 0 and sent to every PE before the first `join`.
std::string unique_id();

// Joins the world as PE `pe` of `num_pes` on the current CUDA device: the first call initialises
// NVSHMEM with `unique_id` (collective over all PEs); later calls check that PE and size match.
void join(const std::string& unique_id, int pe, int num_pes);

// Symmetric heap allocation (collective; same size on every PE), aligned to kBufferAlign.
void* allocate(int64_t bytes);
void deallocate(void* ptr);

// Host-side barrier over all PEs; earlier stores to symmetric memory are complete after it.
void barrier();

}  // namespace ep::nvshmem_world
