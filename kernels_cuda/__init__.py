"""Our CUDA dispatch/combine kernels (optional; reports "not built" on machines without CUDA).

`is_built()` / `build_status()` say whether the extension `kernels_cuda._C` is importable here;
`Buffer` (one rank per process, NVLink peers), `EmulatedGroup` (every rank in one process on one
GPU), `EmulatedInternodeGroup` (nodes x GPUs emulated likewise, two-hop kernels) and
`InternodeBuffer` (one rank per process across nodes; the RDMA hop over CUDA IPC on one machine,
NVSHMEM across machines) raise `KernelsNotBuilt` with that reason when it is not (`InternodeBuffer`
across machines also when the extension was built without NVSHMEM). Nothing here needs CUDA to
import; loading the extension imports torch first (it links against torch's libraries).
"""
from __future__ import annotations

import importlib
import importlib.util

from kernels_cuda.config import Config

_HOW = "build with MOE_TRAIN_BUILD_CUDA=1 pip install --no-build-isolation -e . on a machine with CUDA"
if importlib.util.find_spec("kernels_cuda._C") is None:
    _C = None
    _STATUS = f"not built (no kernels_cuda._C extension); {_HOW}"
else:
    import torch  # noqa: F401  (loads libc10 / libtorch, which the extension links against)

    try:  # the torch extension built by kernels_cuda.build
        _C = importlib.import_module("kernels_cuda._C")
        _STATUS = "built"
    except ImportError as error:  # e.g. built against another torch or CUDA
        _C = None
        _STATUS = f"not built (kernels_cuda._C fails to load: {error}); {_HOW}"


class KernelsNotBuilt(RuntimeError):
    """kernels_cuda._C is missing: no CUDA build of torch or nvcc when the package was installed."""


def is_built() -> bool:
    return _C is not None


def build_status() -> str:
    """'built', or 'not built (<why>); <how to build>'."""
    return _STATUS


def require_built() -> object:
    """The extension module, or KernelsNotBuilt with the reason."""
    if _C is None:
        raise KernelsNotBuilt(f"kernels_cuda is {_STATUS}")
    return _C


from kernels_cuda.buffer import Buffer, EmulatedGroup, EventOverlap, Handle  # noqa: E402  (needs require_built)
from kernels_cuda.internode import EmulatedInternodeGroup, InternodeBuffer, InternodeHandle  # noqa: E402
from kernels_cuda.internode_config import InternodeConfig  # noqa: E402

__all__ = ["Buffer", "Config", "EmulatedGroup", "EmulatedInternodeGroup", "EventOverlap", "Handle", "InternodeBuffer",
           "InternodeConfig", "InternodeHandle", "KernelsNotBuilt", "build_status", "is_built", "require_built"]
