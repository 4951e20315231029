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

import importlib.util
import sys
from importlib.machinery import PathFinder

from kernels_cuda.config import Config, InternodeConfig

DEVICES = ("cuda", "cpu")
_MODULES = {"cuda": "kernels_cuda._C", "cpu": "kernels_cuda._C_cpu"}
_HOW = {"cuda": "build with MOE_TRAIN_BUILD_CUDA=1 pip install --no-build-isolation -e . on a machine with CUDA",
        "cpu": "build it with python -m kernels_cuda.build --device cpu"}


class KernelsNotBuilt(RuntimeError):
    """The extension for a device is missing or does not load here."""


def _load(device: str) -> tuple[object | None, str]:
    """(module, '') or (None, why not). Looked up on every call, so a build made later in the process counts.
    Only this package's own directory is searched: an editable install's finder would otherwise hand a
    copy of the sources the extension built from another tree."""
    name = _MODULES[device]
    if name in sys.modules:
        return sys.modules[name], ""
    spec = PathFinder.find_spec(name, __path__)
    if spec is None:
        return None, f"not built (no {name} extension); {_HOW[device]}"
    import torch  # noqa: F401  (loads libc10 / libtorch, which the extension links against)

    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:  # e.g. built against another torch, or an ASan build without its runtime
        return None, f"not built ({name} fails to load: {error}); {_HOW[device]}"
    sys.modules[name] = module
    return module, ""


def is_built(device: str = "cuda") -> bool:
    return _load(device)[0] is not None


def build_problem(device: str) -> str | None:
    """Why the extension for `device` does not load here, with the command that builds it (None: it loads)."""
    module, why = _load(device)
    return None if module is not None else f"kernels_cuda for {device} is {why}"


def build_status() -> str:
    """'built', 'built (cpu emulation)', 'built (cuda and cpu emulation)', or 'not built (<why>); <how>'."""
    cuda, cpu = is_built("cuda"), is_built("cpu")
    if cuda:
        return "built (cuda and cpu emulation)" if cpu else "built"
    if cpu:
        return "built (cpu emulation)"
    return _load("cuda")[1]


def extension(device: str = "cuda") -> object:
    """The extension module for `device` ('cuda' or 'cpu'), or KernelsNotBuilt with the reason."""
    if device not in DEVICES:
        raise ValueError(f"kernels_cuda: device must be one of {', '.join(DEVICES)}, got {device!r}")
    problem = build_problem(device)
    if problem is not None:
        raise KernelsNotBuilt(problem)
    return _load(device)[0]


def extension_of(runtime: object) -> object:
    """The extension module that defines `runtime`'s class: its ops take the argument structs bound there."""
    import importlib

    return importlib.import_module(type(runtime).__module__)


def require_built() -> object:
    """The CUDA extension module, or KernelsNotBuilt with the reason."""
    return extension("cuda")


def default_device() -> str:
    """'cuda' where the CUDA build loads and a GPU is present, else 'cpu' (the emulation)."""
    import torch

    return "cuda" if is_built("cuda") and torch.cuda.is_available() else "cpu"


from kernels_cuda.buffer import Buffer, EmulatedGroup, EventOverlap, Handle  # noqa: E402  (needs extension)
from kernels_cuda.emulation import Schedule  # noqa: E402
from kernels_cuda.internode import EmulatedInternodeGroup, InternodeHandle  # noqa: E402

__all__ = ["Buffer", "Config", "DEVICES", "EmulatedGroup", "EmulatedInternodeGroup", "EventOverlap", "Handle",
           "InternodeConfig", "InternodeHandle", "KernelsNotBuilt", "Schedule", "build_problem", "build_status",
           "default_device", "extension", "is_built", "require_built"]
