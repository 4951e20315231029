"""Which of kernels_cuda's compiled extensions load here: `kernels_cuda._C` (CUDA) and `kernels_cuda._C_cpu`
(the CPU emulation), why one does not, and the command that builds it. The package's other modules reach the
extension through `extension(device)`, so none of them imports the package itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.machinery import PathFinder
from pathlib import Path

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
    spec = PathFinder.find_spec(name, [str(Path(__file__).parent)])
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
    return importlib.import_module(type(runtime).__module__)


def require_built() -> object:
    """The CUDA extension module, or KernelsNotBuilt with the reason."""
    return extension("cuda")


def default_device() -> str:
    """'cuda' where the CUDA build loads and a GPU is present, else 'cpu' (the emulation)."""
    import torch

    return "cuda" if is_built("cuda") and torch.cuda.is_available() else "cpu"
