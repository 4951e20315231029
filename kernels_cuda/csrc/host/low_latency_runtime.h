// Low-latency part of kernels_cuda._C (host/low_latency_runtime.cpp): registers LowLatencyRuntime.
#pragma once
#include <torch/extension.h>

void register_low_latency(pybind11::module_& m);
