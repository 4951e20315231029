// Device memory of the CPU emulation: every cudaMalloc is a shared-memory segment (memfd_create +
// mmap), so that a buffer can be mapped by the other processes of one machine, as CUDA IPC maps a
// peer GPU's memory. A handle names the owning process and its descriptor; a peer opens it through
// /proc/<pid>/fd/<fd> while the owner is alive (the buffers' set-up is collective, so it is). A memfd
// has no name anywhere: once the owner freed it (or exited) and the peers unmapped it (or exited),
// the kernel releases the memory, so a crash leaves nothing behind in /dev/shm or elsewhere.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ep_emu {

struct IpcHandle {  // the first bytes of a cudaIpcMemHandle_t
    uint32_t magic;
    int32_t pid;
    int32_t fd;
    uint32_t reserved;
    uint64_t bytes;
};

constexpr uint32_t kIpcMagic = 0x6b637075;  // "kcpu"

// 0 on success, else an errno value.
int allocate_shared(void** ptr, size_t bytes);
int free_shared(void* ptr);
int export_shared(void* ptr, IpcHandle* handle);
int map_shared(const IpcHandle& handle, void** ptr);
int unmap_shared(void* ptr);

}  // namespace ep_emu
