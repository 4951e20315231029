// Shared-memory device allocations of the CPU emulation (memory.h).
#include "memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>
#include <string>

namespace ep_emu {

namespace {

struct Mapping {
    size_t bytes;
    int fd;  // the memfd of an allocation of this process, -1 for a peer's segment mapped here
};

// Every live mapping of this process, as the CUDA driver keeps its allocations.
std::mutex mappings_mutex;
std::map<void*, Mapping>& mappings() {
    static std::map<void*, Mapping> table;
    return table;
}

int map_fd(int fd, size_t bytes, void** ptr) {
    void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (memory == MAP_FAILED) return errno;
    *ptr = memory;
    return 0;
}

}  // namespace

int allocate_shared(void** ptr, size_t bytes) {
    const size_t size = bytes == 0 ? 1 : bytes;
    const int fd = memfd_create("kernels_cuda", MFD_CLOEXEC);
    if (fd < 0) return errno;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
        const int error = errno;
        close(fd);
        return error;
    }
    if (const int error = map_fd(fd, size, ptr); error != 0) {
        close(fd);
        return error;
    }
    const std::lock_guard<std::mutex> lock(mappings_mutex);
    mappings()[*ptr] = Mapping{size, fd};
    return 0;
}

int free_shared(void* ptr) {
    if (ptr == nullptr) return 0;
    Mapping mapping{};
    {
        const std::lock_guard<std::mutex> lock(mappings_mutex);
        const auto it = mappings().find(ptr);
        if (it == mappings().end() || it->second.fd < 0) return EINVAL;
        mapping = it->second;
        mappings().erase(it);
    }
    munmap(ptr, mapping.bytes);
    close(mapping.fd);
    return 0;
}

int export_shared(void* ptr, IpcHandle* handle) {
    const std::lock_guard<std::mutex> lock(mappings_mutex);
    const auto it = mappings().find(ptr);
    if (it == mappings().end() || it->second.fd < 0) return EINVAL;
    *handle = IpcHandle{kIpcMagic, static_cast<int32_t>(getpid()), it->second.fd, 0, it->second.bytes};
    return 0;
}

int map_shared(const IpcHandle& handle, void** ptr) {
    if (handle.magic != kIpcMagic || handle.bytes == 0) return EINVAL;
    const std::string path = "/proc/" + std::to_string(handle.pid) + "/fd/" + std::to_string(handle.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return errno;  // ENOENT: the owner exited (or freed the buffer)
    const int error = map_fd(fd, handle.bytes, ptr);
    close(fd);  // the mapping keeps the segment
    if (error != 0) return error;
    const std::lock_guard<std::mutex> lock(mappings_mutex);
    mappings()[*ptr] = Mapping{handle.bytes, -1};
    return 0;
}

int unmap_shared(void* ptr) {
    size_t bytes = 0;
    {
        const std::lock_guard<std::mutex> lock(mappings_mutex);
        const auto it = mappings().find(ptr);
        if (it == mappings().end() || it->second.fd >= 0) return EINVAL;
        bytes = it->second.bytes;
        mappings().erase(it);
    }
    munmap(ptr, bytes);
    return 0;
}

}  // namespace ep_emu
