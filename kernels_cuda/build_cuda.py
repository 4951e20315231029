"""Build hook for the CUDA extension `kernels_cuda._C`, called from setup.py, which loads this file by path
(standard library only at import); `python -m kernels_cuda.build` builds it in place (kernels_cuda/build.py).

The extension is built when torch is a CUDA build and nvcc is found, or when
MOE_TRAIN_BUILD_CUDA=1 (which turns "cannot build" into an error); MOE_TRAIN_BUILD_CUDA=0 skips
it. Everywhere else installation proceeds without it and `kernels_cuda.build_status()` says why.
torch is imported only here, lazily: under pip's build isolation it may be missing, which means
"skip" (install with `--no-build-isolation` to build against the installed torch).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
CSRC = PACKAGE_DIR / "csrc"
CUDA_SOURCES = sorted((CSRC / "kernels").glob("*.cu"))
HOST_SOURCES = [CSRC / "host" / name for name in ("bindings.cpp", "internode_runtime.cpp", "low_latency_runtime.cpp")]
# Kernel sources with a Backend::kNvshmem instantiation, and the NVSHMEM set-up (host code, compiled by
# nvcc so that NVSHMEM's initialisation is device-linked with those kernels): NVSHMEM builds only.
NVSHMEM_KERNEL_SOURCES = [p for p in CUDA_SOURCES if p.name.startswith(("internode_", "low_latency_"))]
NVSHMEM_SOURCES = [CSRC / "host" / "nvshmem_world.cu"]
# No Hopper-only instructions (TMA, wgmma, setmaxnreg) are used yet, so plain sm_90 suffices;
# switch to compute_90a/sm_90a when they are.
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]
# No -std here: torch's BuildExtension picks the standard its headers need (C++17 or newer).
NVCC_FLAGS = ["-O3", f"-I{CSRC}", "--expt-relaxed-constexpr"]
CXX_FLAGS = ["-O3", f"-I{CSRC}"]
# Device sources alone (compile_check) need only C++17.
DEVICE_ONLY_FLAGS = ["-std=c++17"]
ENV_SWITCH = "MOE_TRAIN_BUILD_CUDA"
# The internode kernels' NVSHMEM back end (Backend::kNvshmem, kernels_cuda.Buffer across machines: one EP
# rank per process, the RDMA hop through NVSHMEM) is compiled only when asked for with
# MOE_TRAIN_NVSHMEM=1 and NVSHMEM is found ($NVSHMEM_HOME, else the nvidia-nvshmem-cu13 wheel); it
# needs relocatable device code, device-linked against libnvshmem_device. Everywhere else the build
# skips it and the internode kernels run on EMULATED ranks only. `python -m kernels_cuda.compile_check`
# compiles and links it whenever NVSHMEM is found.
NVSHMEM_SWITCH = "MOE_TRAIN_NVSHMEM"
NVSHMEM_HOW = f"set {NVSHMEM_SWITCH}=1 and install nvidia-nvshmem-cu13 (or set NVSHMEM_HOME), then rebuild"


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME (or $CUDA_PATH), else from PATH, else /usr/local/cuda."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def toolkit_root(nvcc: str) -> Path:
    """The CUDA toolkit `nvcc` belongs to, as nvcc reports it (its TOP), so a wrapper script such as
    /usr/local/bin/nvcc -> /usr/local/cuda-13.0 leads to the toolkit, not to /usr/local."""
    proc = subprocess.run([nvcc, "--dryrun", "-c", "toolkit_root.cu"], capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.removeprefix("#$ TOP=")).resolve()
    return Path(nvcc).resolve().parent.parent


def find_nvshmem() -> Path | None:
    """NVSHMEM's root (with include/nvshmem.h): $NVSHMEM_HOME, else the nvidia-nvshmem-cu13 wheel."""
    roots = [Path(os.environ["NVSHMEM_HOME"])] if os.environ.get("NVSHMEM_HOME") else []
    try:
        import nvidia.nvshmem  # type: ignore[import-not-found]
        roots += [Path(p) for p in nvidia.nvshmem.__path__]
    except ImportError:
        pass
    return next((root for root in roots if (root / "include" / "nvshmem.h").is_file()), None)


# torch compiles every .cu file with -D__CUDA_NO_HALF_OPERATORS__ and friends (COMMON_NVCC_FLAGS), which
# breaks nvshmem.h (its device reductions use half operators); these flags, placed after torch's, undo them.
NVSHMEM_HALF_OPERATORS = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                          "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]


def nvshmem_host_library(root: Path) -> str:
    """The name to link NVSHMEM's host library by: the wheel ships only its soname (libnvshmem_host.so.3),
    which GNU ld takes as `-l:libnvshmem_host.so.3`."""
    lib = root / "lib"
    if (lib / "libnvshmem_host.so").exists():
        return "nvshmem_host"
    sonames = sorted(lib.glob("libnvshmem_host.so.*"))
    return f":{sonames[0].name}" if sonames else "nvshmem_host"


def nvshmem_flags(root: Path) -> dict[str, list[str]]:
    """Compile and link flags of the NVSHMEM back end for the NVSHMEM installation at `root`.

    "nvcc_dlink" is torch's device-link step (BuildExtension adds -fPIC, and our arch flags keep it
    from adding its own). It is passed directly rather than through CUDAExtension(dlink=True), which
    would add -dlto: our objects carry SASS, not LTO IR. libnvshmem_device is linked twice: its device
    code in the device link, its host part (nvshmemi_init_thread) in the final link.
    """
    include, lib = root / "include", root / "lib"
    return {"nvcc": ["-DEP_WITH_NVSHMEM", f"-I{include}", "-rdc=true", *NVSHMEM_HALF_OPERATORS],
            "cxx": ["-DEP_WITH_NVSHMEM", f"-I{include}"],
            "nvcc_dlink": ["-dlink", *ARCH_FLAGS, f"-L{lib}", "-lnvshmem_device"],
            "library_dirs": [str(lib)], "runtime_library_dirs": [str(lib)],
            "libraries": ["nvshmem_device", nvshmem_host_library(root)]}


def nvshmem_options() -> dict[str, list[str]]:
    """`nvshmem_flags` when MOE_TRAIN_NVSHMEM=1 and NVSHMEM is found, else {} (the back end is skipped)."""
    root = find_nvshmem() if os.environ.get(NVSHMEM_SWITCH) == "1" else None
    return {} if root is None else nvshmem_flags(root)


def build_decision() -> tuple[bool, str]:
    """(build?, reason). Raises RuntimeError when MOE_TRAIN_BUILD_CUDA=1 but building is impossible."""
    switch = os.environ.get(ENV_SWITCH, "").strip()
    if switch == "0":
        return False, f"{ENV_SWITCH}=0"
    problems = []
    try:
        import torch
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is not a CUDA build")
    except ImportError:
        problems.append("torch is not importable at build time (use pip install --no-build-isolation)")
    if find_nvcc() is None:
        problems.append("nvcc not found (set CUDA_HOME)")
    if not problems:
        return True, "CUDA torch and nvcc found"
    if switch == "1":
        raise RuntimeError(f"{ENV_SWITCH}=1 but the CUDA extension cannot be built: " + "; ".join(problems))
    return False, "; ".join(problems)


def cuda_ext_modules() -> list[Any]:
    """[CUDAExtension('kernels_cuda._C')] when building, else []."""
    build, reason = build_decision()
    print(f"kernels_cuda: {'building' if build else 'skipping'} the CUDA extension ({reason})")
    if not build:
        return []
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        # torch derives CUDA_HOME from `which nvcc`'s grandparent, which is wrong for a wrapper script
        os.environ["CUDA_HOME"] = str(toolkit_root(find_nvcc()))
    from torch.utils.cpp_extension import CUDAExtension

    root = PACKAGE_DIR.parent
    nvshmem = nvshmem_options()
    print(f"kernels_cuda: NVSHMEM back end {'on' if nvshmem else f'skipped ({NVSHMEM_HOW})'}")
    if nvshmem and shutil.which("ninja") is None:
        raise RuntimeError("kernels_cuda: the NVSHMEM back end needs ninja (pip install ninja): torch runs its "
                           "device-link step only in ninja builds")
    sources = [*HOST_SOURCES, *CUDA_SOURCES, *(NVSHMEM_SOURCES if nvshmem else [])]
    compile_args = {"cxx": [*CXX_FLAGS, *nvshmem.get("cxx", [])],
                    "nvcc": [*NVCC_FLAGS, *ARCH_FLAGS, *nvshmem.get("nvcc", [])]}
    if nvshmem:
        compile_args["nvcc_dlink"] = nvshmem["nvcc_dlink"]
    return [CUDAExtension(
        name="kernels_cuda._C", sources=[str(p.relative_to(root)) for p in sources], extra_compile_args=compile_args,
        library_dirs=nvshmem.get("library_dirs", []), runtime_library_dirs=nvshmem.get("runtime_library_dirs", []),
        libraries=nvshmem.get("libraries", []),
    )]


def cuda_cmdclass() -> dict[str, Any]:
    """{'build_ext': torch's BuildExtension} when building, else {}."""
    if not build_decision()[0]:
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


def build_inplace() -> None:
    """Build kernels_cuda/_C*.so next to the sources (what tests/gpu/run_gpu_checks.sh uses)."""
    from setuptools import setup

    os.environ.setdefault(ENV_SWITCH, "1")
    cwd = Path.cwd()
    os.chdir(PACKAGE_DIR.parent)  # the extension's sources are given relative to the repository root
    try:
        setup(name="kernels_cuda_ext", ext_modules=cuda_ext_modules(), cmdclass=cuda_cmdclass(),
              script_args=["build_ext", "--inplace"])
    finally:
        os.chdir(cwd)
