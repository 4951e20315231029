// NVSHMEM set-up of the internode NVSHMEM back end (see nvshmem_world.h). nvshmemx_init_attr is a
// static inline calling nvshmemi_init_thread from libnvshmem_device.a, which initialises the device
// state of the image it is device-linked into: hence a .cu file compiled with -rdc=true and linked
// with the kernels (kernels_cuda/build.py). If initialisation fails, NVSHMEM itself prints the
// reason and exits the process.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "params/constants.h"
#include "nvshmem_world.h"

namespace ep::nvshmem_world {

namespace {

constexpr const char* kHeapVariable = "NVSHMEM_SYMMETRIC_SIZE";
// On top of the RDMA region: a quarter more and 256 MiB for NVSHMEM's own symmetric allocations.
constexpr int64_t kHeapMarginBytes = int64_t{256} << 20;

struct World {
    std::mutex mutex;
    int pe = -1;  // -1: not initialised
    int num_pes = 0;
    std::set<void*> allocations;
};

World& world() {
    static World instance;
    return instance;
}

void fail(const std::string& what) { throw std::runtime_error("kernels_cuda: NVSHMEM: " + what); }

std::string pe_text(int pe, int num_pes) { return "PE " + std::to_string(pe) + " of " + std::to_string(num_pes); }

// Registered with std::atexit by the first join: symmetric memory first, then the library.
void finalize() {
    World& w = world();
    const std::lock_guard<std::mutex> lock(w.mutex);
    for (void* ptr : w.allocations) nvshmem_free(ptr);
    w.allocations.clear();
    nvshmem_finalize();
    w.pe = -1;
}

}  // namespace

void size_heap(int64_t rdma_bytes) {
    const int64_t bytes = rdma_bytes + rdma_bytes / 4 + kHeapMarginBytes;
    setenv(kHeapVariable, std::to_string(bytes).c_str(), 0);
}

bool initialised() {
    World& w = world();
    const std::lock_guard<std::mutex> lock(w.mutex);
    return w.pe >= 0;
}

std::string unique_id() {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) != 0) fail("nvshmemx_get_uniqueid failed");
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void join(const std::string& unique_id, int pe, int num_pes) {
    World& w = world();
    const std::lock_guard<std::mutex> lock(w.mutex);
    if (w.pe >= 0) {
        if (w.pe != pe || w.num_pes != num_pes)
            fail("one world per process: this process is " + pe_text(w.pe, w.num_pes) + ", asked to be " +
                 pe_text(pe, num_pes));
        return;
    }
    if (pe < 0 || pe >= num_pes) fail("bad " + pe_text(pe, num_pes));
    if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) fail("malformed unique id");
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(pe, num_pes, &id, &attr) != 0) fail("nvshmemx_set_attr_uniqueid_args failed");
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) fail("nvshmemx_init_attr failed");
    w.pe = nvshmem_my_pe();
    w.num_pes = nvshmem_n_pes();
    std::atexit(finalize);
    if (w.pe != pe || w.num_pes != num_pes)
        fail("initialised as " + pe_text(w.pe, w.num_pes) + ", expected " + pe_text(pe, num_pes));
}

void* allocate(int64_t bytes) {
    World& w = world();
    const std::lock_guard<std::mutex> lock(w.mutex);
    void* ptr = nvshmem_align(kBufferAlign, static_cast<size_t>(bytes));
    if (ptr == nullptr) {
        const char* heap = std::getenv(kHeapVariable);
        fail("symmetric allocation of " + std::to_string(bytes) + " bytes failed: the symmetric heap is too small. " +
             "Set " + kHeapVariable + " (now " + (heap != nullptr ? heap : "unset") + ") above the RDMA bytes of " +
             "all internode buffers of this process together, before the first one is created");
    }
    w.allocations.insert(ptr);
    return ptr;
}

void deallocate(void* ptr) {
    World& w = world();
    const std::lock_guard<std::mutex> lock(w.mutex);
    if (w.allocations.erase(ptr) > 0) nvshmem_free(ptr);
}

void barrier() { nvshmem_barrier_all(); }

}  // namespace ep::nvshmem_world
