"""Our CUDA dispatch/combine kernels, and the CPU emulation build that runs the same sources.

Two extensions may be built from csrc/: `kernels_cuda._C` (CUDA: `MOE_TRAIN_BUILD_CUDA=1 pip install
--no-build-isolation -e .` on a machine with CUDA) and `kernels_cuda._C_cpu` (the CPU emulation:
`python -m kernels_cuda.build --device cpu`, built by the test suite when missing). `is_built(device)`
/ `build_status()` say which load here; `extension(device)` returns one or raises `KernelsNotBuilt`
with the reason. `Buffer` (one rank per process: the intranode kernels on one node, the two-hop
internode kernels across nodes, as deep_ep.Buffer), `EmulatedGroup` (every rank in this process) and
`EmulatedInternodeGroup` (nodes x GPUs likewise, two-hop kernels) run on either device, with a
`Schedule` for the emulation's fiber scheduler. `kernels_cuda.deep_ep` is DeepEP's API (`deep_ep.Buffer`,
`Config`, events, tuple handles) over `Buffer`, for code written against DeepEP. Nothing here needs CUDA
to import; loading an extension imports torch first (it links against torch's libraries).

The C++/CUDA sources, csrc/: params/ holds what host and device code share (plain C++: constants,
configurations and buffer layouts, the kernels' parameter blocks and launchers, the error record);
device/ the device helpers the kernels are built from (PTX memory-model wrappers, transports, rings,
barriers, timeout diagnostics, the launch helper); kernels/ the kernels (*.cu); host/ the pybind11
runtimes that fill the parameter blocks from torch tensors; emu/ the CPU emulation of CUDA's runtime
and device (the `_C_cpu` build).
"""
from __future__ import annotations

from kernels_cuda.config import Config, InternodeConfig
from kernels_cuda.extensions import (DEVICES, KernelsNotBuilt, build_problem, build_status, default_device, extension,
                                     is_built, require_built)
from kernels_cuda.buffer import Buffer, EmulatedGroup, EventOverlap, Handle
from kernels_cuda.emulation import Schedule
from kernels_cuda.internode import EmulatedInternodeGroup, InternodeHandle

__all__ = ["Buffer", "Config", "DEVICES", "EmulatedGroup", "EmulatedInternodeGroup", "EventOverlap", "Handle",
           "InternodeConfig", "InternodeHandle", "KernelsNotBuilt", "Schedule", "build_problem", "build_status",
           "default_device", "extension", "is_built", "require_built"]
