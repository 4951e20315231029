// RankArgs<Kernel, Host...>: one rank's arguments to a kernel as Python builds them (bound by ArgClass,
// arg_class.h). `kernel` is the kernel's own per-rank parameter struct (params/*.h), which the runtime
// copies into the launch's parameter block and completes with what only it knows (the peers' buffers);
// the tensors its pointers point into are kept with it (KeptTensors), so that they live as long as
// these arguments do. `Host` structs add the fields only the runtime reads.
#pragma once
#include <torch/extension.h>

#include <map>
#include <optional>
#include <string>

// Tensors kept by the name of the field that points into them.
class KeptTensors {
   public:
    // The tensor given for field `name`, nullopt when none was (or None).
    std::optional<at::Tensor> given(const std::string& name) const {
        const auto it = tensors_.find(name);
        return it == tensors_.end() ? std::nullopt : std::optional<at::Tensor>(it->second);
    }

    // A tensor field that this op needs although it is bound as optional.
    void require(const char* name) const {
        TORCH_CHECK(tensors_.count(name) > 0, "kernels_cuda: missing tensor '", name, "'");
    }

    void keep(const std::string& name, const std::optional<at::Tensor>& tensor) {
        if (tensor)
            tensors_[name] = *tensor;
        else
            tensors_.erase(name);
    }

   private:
    std::map<std::string, at::Tensor> tensors_;
};

template <typename Kernel, typename... Host>
struct RankArgs : KeptTensors, Host... {
    using KernelArgs = Kernel;

    Kernel kernel{};
};
