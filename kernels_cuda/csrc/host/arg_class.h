// ArgClass<T>: binds a host argument struct as a Python class whose constructor takes the fields as
// keywords, e.g. `DispatchRank(rank=0, num_tokens=8, x=x, ...)`. T is an op's settings (op_args.h) or
// one rank's arguments, RankArgs (rank_args.h): there a field is the kernel's own parameter field, so
// each is named in its kernel struct (params/*.h) and here, where it is bound, and nowhere else. A
// tensor field checks its device when set and, unless bound as optional, must be given (both errors
// name the field); an unknown keyword is an AttributeError naming it.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "device_api.h"
#include "rank_args.h"

namespace py = pybind11;

template <typename T>
class ArgClass {
   public:
    ArgClass(py::module_& m, const char* name) : cls_(m, name) {
        cls_.def(py::init([name](const py::kwargs& fields) { return from_fields(name, fields); }));
    }

    // A tensor that must be given; its data pointer goes to the kernel's pointer field `member`.
    template <typename Kernel, typename P>
    ArgClass& tensor(const char* name, P* Kernel::*member) {
        required().push_back(name);
        return optional_tensor(name, member);
    }

    // A tensor that may be None (left out: None, a null pointer). An empty tensor (a rank that receives
    // nothing) has a null data pointer too, which the kernels never dereference.
    template <typename Kernel, typename P>
    ArgClass& optional_tensor(const char* name, P* Kernel::*member) {
        static_assert(std::is_same_v<Kernel, typename T::KernelArgs>, "a field of this rank's kernel struct");
        cls_.def_property(
            name, [name](const T& t) { return t.given(name); },
            [member, name](T& t, const std::optional<at::Tensor>& value) {
                TORCH_CHECK(!value || on_launch_device(*value), "kernels_cuda: tensor '", name, "' must be on the ",
                            kLaunchDevice);
                t.kernel.*member = value ? static_cast<P*>(value->data_ptr()) : nullptr;
                t.keep(name, value);
            });
        return *this;
    }

    // A number or flag (left out: the struct's default), of T itself or of its kernel struct.
    template <typename Owner, typename V>
    ArgClass& value(const char* name, V Owner::*member) {
        cls_.def_property(
            name, [member](const T& t) { return holder<Owner>(t).*member; },
            [member](T& t, const V& v) { holder<Owner>(t).*member = v; });
        return *this;
    }

   private:
    // Where a field of `Owner` lives: T (an op struct, or a rank's host-only fields), else T's kernel struct.
    template <typename Owner, typename Self>
    static auto& holder(Self& t) {
        if constexpr (std::is_base_of_v<Owner, T>)
            return t;
        else
            return t.kernel;
    }

    static std::vector<const char*>& required() {
        static std::vector<const char*> names;
        return names;
    }

    static T from_fields(const char* class_name, const py::kwargs& fields) {
        py::object self = py::cast(T{});
        for (const auto& [name, value] : fields) py::setattr(self, name, value);
        const T& t = self.cast<const T&>();
        if constexpr (std::is_base_of_v<KeptTensors, T>)
            for (const char* name : required())
                TORCH_CHECK(t.given(name), "kernels_cuda: ", class_name, " needs tensor '", name, "'");
        return t;
    }

    py::class_<T> cls_;
};
