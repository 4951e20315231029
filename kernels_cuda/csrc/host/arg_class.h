// ArgClass<T>: binds a host argument struct (host/op_args.h) as a Python class whose constructor takes
// the fields as keywords, e.g. `DispatchRank(rank=0, num_tokens=8, x=x, ...)`. Each field is named
// here once, when it is bound; the C++ side reads the struct's fields. A tensor field checks its device
// when set and, unless bound as optional, must be given (both errors name the field); an unknown
// keyword is an AttributeError naming it.
#pragma once
#include <torch/extension.h>

#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "device_api.h"

namespace py = pybind11;

// The data pointer of a tensor field, nullptr when it was not given (None). An empty tensor (a rank
// that receives nothing) has a null data pointer too, which the kernels never dereference.
template <typename T>
T* data_of(const at::Tensor& t) {
    return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// A tensor field that this op needs although the struct leaves it optional.
template <typename T>
T* required_data(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), "kernels_cuda: missing tensor '", name, "'");
    return data_of<T>(t);
}

template <typename T>
class ArgClass {
   public:
    ArgClass(py::module_& m, const char* name) : cls_(m, name) {
        cls_.def(py::init([name](const py::kwargs& fields) { return from_fields(name, fields); }));
    }

    // A tensor that must be given.
    template <typename Owner>
    ArgClass& tensor(const char* name, at::Tensor Owner::*member) {
        required().emplace_back(name, [member](const T& t) { return (t.*member).defined(); });
        return optional_tensor(name, member);
    }

    // A tensor that may be None (left out: None).
    template <typename Owner>
    ArgClass& optional_tensor(const char* name, at::Tensor Owner::*member) {
        cls_.def_property(
            name,
            [member](const T& t) { return (t.*member).defined() ? std::optional<at::Tensor>(t.*member) : std::nullopt; },
            [member, name](T& t, const std::optional<at::Tensor>& value) {
                TORCH_CHECK(!value || on_launch_device(*value), "kernels_cuda: tensor '", name, "' must be on the ",
                            kLaunchDevice);
                t.*member = value.value_or(at::Tensor());
            });
        return *this;
    }

    // A number or flag (left out: the struct's default).
    template <typename Owner, typename V>
    ArgClass& value(const char* name, V Owner::*member) {
        cls_.def_property(
            name, [member](const T& t) { return t.*member; }, [member](T& t, const V& v) { t.*member = v; });
        return *this;
    }

   private:
    using Check = std::pair<const char*, std::function<bool(const T&)>>;

    static std::vector<Check>& required() {
        static std::vector<Check> checks;
        return checks;
    }

    static T from_fields(const char* class_name, const py::kwargs& fields) {
        py::object self = py::cast(T{});
        for (const auto& [name, value] : fields) py::setattr(self, name, value);
        const T& t = self.cast<const T&>();
        for (const auto& [name, given] : required())
            TORCH_CHECK(given(t), "kernels_cuda: ", class_name, " needs tensor '", name, "'");
        return t;
    }

    py::class_<T> cls_;
};
