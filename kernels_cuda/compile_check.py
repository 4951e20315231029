"""Compile-check kernels_cuda without a GPU: device code for sm_90, host code against torch, and the
NVSHMEM back end when NVSHMEM is found.

Needs nvcc, a host C++ compiler and torch (any build; no GPU). nvcc sees the flags torch's build
gives it (torch's COMMON_NVCC_FLAGS, then kernels_cuda/build_cuda.py's). Passes:
- device: every kernel source for sm_90; prints registers, shared memory, stack and spills per kernel
  from `ptxas -v`;
- host: `g++ -fsyntax-only` of the host C++ sources against the headers of torch, Python and the CUDA
  toolkit (elsewhere only a CUDA build of torch compiles them);
- nvshmem (when $NVSHMEM_HOME or the nvidia-nvshmem-cu13 wheel is found): the internode kernels and
  host/nvshmem_world.cu with -DEP_WITH_NVSHMEM -rdc=true (the table then has the Backend::kNvshmem
  kernels), device-linked against libnvshmem_device as the build does (an unresolved NVSHMEM device
  symbol fails), linked into a shared object with --no-undefined against NVSHMEM's host library and
  cudart, and the host sources syntax-checked with -DEP_WITH_NVSHMEM.
Exits non-zero on any compiler or linker error and on any spill in a kernel.
Usage: `python -m kernels_cuda.compile_check [--jobs N] [--passes device,host,nvshmem]`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kernels_cuda import build_cuda
from kernels_cuda.build_cuda import ARCH_FLAGS, CSRC, CUDA_SOURCES, DEVICE_ONLY_FLAGS, NVCC_FLAGS, find_nvcc

PASSES = ("device", "host", "nvshmem")
NVSHMEM_NOT_FOUND = "skipped: NVSHMEM not found (pip install nvidia-nvshmem-cu13 or set NVSHMEM_HOME)"
HOST_STD = "-std=c++20"  # the standard torch's headers are compiled with
# The CPU torch wheel ships c10/cuda's headers but not this one, which torch's CMake build generates;
# the host pass writes a one-line stand-in into its temporary directory, first on the include path.
TORCH_CUDA_MACROS = Path("c10") / "cuda" / "impl" / "cuda_cmake_macros.h"
TORCH_CUDA_MACROS_SHIM = "#define C10_CUDA_BUILD_SHARED_LIBS\n"
# torch compiles extension sources with -fPIC; the NVSHMEM pass links a shared object as the build does.
PIC = ["-Xcompiler", "-fPIC"]
LOG_LINES = 60  # of a failed host step's log

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FUNCTION = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes cumulative stack size)?"
                   r"(?:, (\d+) bytes smem)?")
_RDC_PREFIX = re.compile(r"^__nv_static_\w*?_(?=_Z)")  # -rdc=true prefixes kernels of anonymous namespaces
_DRYRUN = re.compile(r"^#\$ (INCLUDES|SYSTEM_INCLUDES|LIBRARIES)=(.*)$")
# {0: 'kEmulated', ...} from `enum class Backend` in csrc/params/intranode.h, for the kernels' names.
_BACKEND_ENUM = re.search(r"enum class Backend[^}]*}", (CSRC / "params" / "intranode.h").read_text())[0]
BACKENDS = {int(value): name for name, value in re.findall(r"\b(k\w+) = (\d+)", _BACKEND_ENUM)}


@dataclass
class KernelReport:
    name: str
    arch: str
    registers: int = 0
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass
class SourceReport:
    source: Path
    ok: bool
    seconds: float
    kernels: list[KernelReport] = field(default_factory=list)
    log: str = ""


@dataclass
class StepReport:
    """A step without kernels: a host syntax check or a link."""

    label: str
    ok: bool
    seconds: float
    log: str = ""


@dataclass(frozen=True)
class Toolkit:
    """The CUDA toolkit directories nvcc hands to the host compiler and the linker."""

    include_dirs: tuple[str, ...]
    system_include_dirs: tuple[str, ...]
    library_dirs: tuple[str, ...]


def parse_ptxas(log: str) -> list[KernelReport]:
    """Kernel entries of a `ptxas -v` log (non-entry functions only contribute to their callers' stack)."""
    kernels: list[KernelReport] = []
    current: KernelReport | None = None
    properties_of: str | None = None
    for line in log.splitlines():
        if (m := _ENTRY.search(line)):
            current = KernelReport(m.group(1), m.group(2))
            kernels.append(current)
        elif (m := _FUNCTION.search(line)):
            properties_of = m.group(1)
        elif (m := _FRAME.search(line)) and current is not None and properties_of == current.name:
            current.stack = int(m.group(1))
            current.spill_stores, current.spill_loads = int(m.group(2)), int(m.group(3))
        elif (m := _USED.search(line)) and current is not None:
            current.registers = int(m.group(1))
            current.smem = int(m.group(4) or 0)
    return kernels


def demangle(names: list[str]) -> dict[str, str]:
    """Readable kernel names: `ep::internode_dispatch_kernel<kNvshmem>`."""
    plain = [_RDC_PREFIX.sub("", n) for n in names]
    try:
        out = subprocess.run(["c++filt"], input="\n".join(plain), capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}
    short = []
    for line in out.splitlines():
        line = line.replace("(anonymous namespace)::", "").removeprefix("void ")
        line = re.sub(r"\(ep::Backend\)(\d+)", lambda m: BACKENDS.get(int(m.group(1)), m.group(0)), line)
        short.append(re.sub(r"\([^()]*\)$", "", line))
    return dict(zip(names, short))


def parse_nvcc_dryrun(log: str) -> Toolkit:
    """The -I, -isystem and -L directories of `nvcc --dryrun` (its INCLUDES, SYSTEM_INCLUDES, LIBRARIES)."""
    words: list[str] = []
    for line in log.splitlines():
        if (m := _DRYRUN.match(line)):
            words += shlex.split(m.group(2))
    dirs: dict[str, list[str]] = {"-I": [], "-isystem": [], "-L": []}
    for i, word in enumerate(words):
        if word == "-isystem" and i + 1 < len(words):
            dirs["-isystem"].append(os.path.normpath(words[i + 1]))
        elif word[:2] in ("-I", "-L") and len(word) > 2:
            dirs[word[:2]].append(os.path.normpath(word[2:]))
    return Toolkit(tuple(dirs["-I"]), tuple(dirs["-isystem"]), tuple(dirs["-L"]))


def cuda_toolkit(nvcc: str) -> Toolkit:
    """Asks nvcc itself (it may be a wrapper script, e.g. /usr/local/bin/nvcc for /usr/local/cuda-13.0);
    falls back to $CUDA_HOME, else nvcc's grandparent directory."""
    proc = subprocess.run([nvcc, "--dryrun", "-c", "compile_check.cu"], capture_output=True, text=True)
    toolkit = parse_nvcc_dryrun(proc.stdout + proc.stderr)
    if toolkit.include_dirs:
        return toolkit
    home = Path(os.environ.get("CUDA_HOME") or Path(nvcc).resolve().parent.parent)
    return Toolkit((str(home / "include"),), (), (str(home / "lib64"),))


def torch_include_dirs() -> list[Path]:
    """torch's C++ include directories (found without importing torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("compile_check: torch is not installed (its headers are needed for the host pass)")
    root = Path(next(iter(spec.submodule_search_locations))) / "include"
    return [root, root / "torch" / "csrc" / "api" / "include"]


def write_torch_shim(directory: Path, torch_includes: list[Path]) -> Path | None:
    """The directory of a stand-in cuda_cmake_macros.h when torch's headers lack it (CPU wheels), else None."""
    if any((d / TORCH_CUDA_MACROS).is_file() for d in torch_includes):
        return None
    path = directory / TORCH_CUDA_MACROS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TORCH_CUDA_MACROS_SHIM)
    return directory


def host_check_command(cxx: str, source: Path, toolkit: Toolkit, torch_includes: list[Path], shim: Path | None,
                       nvshmem_root: Path | None = None) -> list[str]:
    """Syntax check of one host source with the headers and defines of the extension build."""
    includes = [*([shim] if shim else []), *torch_includes, sysconfig.get_paths()["include"], *toolkit.include_dirs]
    nvshmem = build_cuda.nvshmem_flags(nvshmem_root)["cxx"] if nvshmem_root else []
    return [cxx, HOST_STD, "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C", *(f"-I{d}" for d in includes),
            *(f"-isystem{d}" for d in toolkit.system_include_dirs), *build_cuda.CXX_FLAGS, *nvshmem, str(source)]


def run_step(label: str, cmd: list[str]) -> StepReport:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return StepReport(label, proc.returncode == 0, time.monotonic() - start, proc.stdout + proc.stderr)


def torch_nvcc_flags() -> list[str]:
    """The flags torch's BuildExtension puts before ours on every nvcc command line (-D__CUDA_NO_HALF_OPERATORS__
    and friends), so that a source that only builds without them fails here too."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return list(COMMON_NVCC_FLAGS)


def nvcc_flags(extra: list[str]) -> list[str]:
    """torch's flags, then the build's (build_cuda.py), then `extra`: the order of torch's nvcc command lines."""
    return [*DEVICE_ONLY_FLAGS, *torch_nvcc_flags(), *NVCC_FLAGS, *ARCH_FLAGS, *extra]


def compile_source(nvcc: str, source: Path, obj: Path, flags: list[str]) -> SourceReport:
    obj.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, *flags, "-Xptxas", "-v", "-c", str(source), "-o", str(obj)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    return SourceReport(source, proc.returncode == 0, time.monotonic() - start, parse_ptxas(log), log)


def link_nvshmem(nvcc: str, cxx: str, objects: list[Path], root: Path, toolkit: Toolkit, out: Path) -> list[StepReport]:
    """Device link as torch's build runs it (build_cuda.nvshmem_flags), then a shared object that must resolve
    every host symbol (NVSHMEM initialisation included) against NVSHMEM's libraries and cudart."""
    flags = build_cuda.nvshmem_flags(root)
    dlink = out / "dlink.o"
    steps = [run_step("device link (-lnvshmem_device)",
                      [nvcc, *map(str, objects), "-o", str(dlink), *flags["nvcc_dlink"], *PIC])]
    if steps[0].ok:
        libraries = [*(f"-L{d}" for d in [*flags["library_dirs"], *toolkit.library_dirs]),
                     *(f"-l{lib}" for lib in flags["libraries"]), "-lcudart"]
        steps.append(run_step("host link (shared, --no-undefined)",
                              [cxx, "-shared", *map(str, objects), str(dlink), "-o", str(out / "nvshmem_check.so"),
                               *libraries, "-Wl,--no-undefined"]))
    return steps


def nvshmem_version(root: Path) -> str:
    header = root / "include" / "non_abi" / "nvshmem_version.h"
    text = header.read_text() if header.is_file() else ""
    parts = [re.search(rf"#define NVSHMEM_VENDOR_{p}_VERSION (\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown version"


def report_kernels(reports: list[SourceReport], names: dict[str, str], failures: list[str],
                   expect_kernels: set[Path], rdc: bool = False) -> None:
    """One row per kernel. With -rdc=true static shared memory is placed at the device link, so ptxas
    reports none: the smem column shows '-'."""
    print(f"{'source':28} {'kernel':58} {'arch':6} {'regs':>4} {'smem':>6} {'stack':>5} {'spills':>7}")
    for report in reports:
        if not report.ok:
            failures.append(f"{report.source.name}: compile error")
            print(f"{report.source.name}: FAILED\n{report.log}", file=sys.stderr)
            continue
        if not report.kernels:
            if report.source in expect_kernels:
                failures.append(f"{report.source.name}: no kernels found in the ptxas output")
            print(f"{report.source.name:28} (no kernels, {report.seconds:.1f} s)")
        for k in report.kernels:
            spills = k.spill_stores + k.spill_loads
            smem = "-" if rdc else k.smem
            print(f"{report.source.name:28} {names.get(k.name, k.name)[:58]:58} {k.arch:6} {k.registers:>4} "
                  f"{smem:>6} {k.stack:>5} {spills:>7}")
            if spills:
                failures.append(f"{report.source.name}: {names.get(k.name, k.name)} spills {spills} bytes")


def report_steps(steps: list[StepReport], failures: list[str]) -> None:
    for step in steps:
        print(f"{step.label:60} {'ok' if step.ok else 'FAILED':6} {step.seconds:6.1f} s")
        if not step.ok:
            failures.append(f"{step.label}: failed")
            lines = step.log.splitlines()
            more = f"\n... ({len(lines) - LOG_LINES} more lines)" if len(lines) > LOG_LINES else ""
            print("\n".join(lines[:LOG_LINES]) + more, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="parallel compiler processes (default 1)")
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDA_HOME/bin/nvcc or PATH)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="host compiler (default: $CXX or g++)")
    parser.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated subset of {','.join(PASSES)}")
    args = parser.parse_args(argv)
    passes = set(args.passes.split(","))
    if not passes <= set(PASSES):
        parser.error(f"unknown pass in {args.passes!r} (choose from {', '.join(PASSES)})")
    nvcc = args.nvcc or find_nvcc()
    if nvcc is None:
        print("compile_check: nvcc not found (set CUDA_HOME or PATH)", file=sys.stderr)
        return 2
    nvshmem_root = build_cuda.find_nvshmem() if "nvshmem" in passes else None
    toolkit = cuda_toolkit(nvcc)
    start = time.monotonic()
    failures: list[str] = []
    summary: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_name, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        tmp = Path(tmp_name)
        torch_includes = torch_include_dirs() if passes & {"host", "nvshmem"} else []
        shim = write_torch_shim(tmp / "shim", torch_includes) if torch_includes else None

        def host_checks(root: Path | None) -> list[tuple[str, Future[StepReport]]]:
            suffix = " (-DEP_WITH_NVSHMEM)" if root else ""
            return [(s.name + suffix, pool.submit(run_step, s.name + suffix, host_check_command(
                args.cxx, s, toolkit, torch_includes, shim, root))) for s in build_cuda.HOST_SOURCES]

        device_flags = nvcc_flags([])
        device = [pool.submit(compile_source, nvcc, s, tmp / "device" / f"{s.stem}.o", device_flags)
                  for s in CUDA_SOURCES] if "device" in passes else []
        host = host_checks(None) if "host" in passes else []
        nvshmem_sources = [*build_cuda.NVSHMEM_KERNEL_SOURCES, *build_cuda.NVSHMEM_SOURCES] if nvshmem_root else []
        nvshmem_flags = nvcc_flags([*build_cuda.nvshmem_flags(nvshmem_root)["nvcc"], *PIC]) if nvshmem_root else []
        nvshmem = [pool.submit(compile_source, nvcc, s, tmp / "nvshmem" / f"{s.stem}.o", nvshmem_flags)
                   for s in nvshmem_sources]
        nvshmem_host = host_checks(nvshmem_root) if nvshmem_root else []

        if device:
            print(f"== device: {len(device)} CUDA sources ({' '.join(ARCH_FLAGS)})", flush=True)
            reports = [f.result() for f in device]
            report_kernels(reports, demangle([k.name for r in reports for k in r.kernels]), failures, set(CUDA_SOURCES))
            summary.append(f"device {len(reports)} sources {sum(len(r.kernels) for r in reports)} kernels")
        if host:
            print(f"== host: {len(host)} C++ sources, {args.cxx} {HOST_STD} -fsyntax-only"
                  f"{' (with ' + str(TORCH_CUDA_MACROS) + ' shim)' if shim else ''}", flush=True)
            report_steps([f.result() for _, f in host], failures)
            summary.append(f"host {len(host)} sources")
        if "nvshmem" in passes and nvshmem_root is None:
            print(f"== NVSHMEM back end: {NVSHMEM_NOT_FOUND}")
            summary.append("NVSHMEM skipped (not found)")
        elif nvshmem_root is not None:
            print(f"== NVSHMEM back end: NVSHMEM {nvshmem_version(nvshmem_root)} at {nvshmem_root} "
                  f"(-DEP_WITH_NVSHMEM -rdc=true)", flush=True)
            reports = [f.result() for f in nvshmem]
            report_kernels(reports, demangle([k.name for r in reports for k in r.kernels]), failures,
                           set(build_cuda.NVSHMEM_KERNEL_SOURCES), rdc=True)
            steps = link_nvshmem(nvcc, args.cxx, [tmp / "nvshmem" / f"{s.stem}.o" for s in nvshmem_sources],
                                 nvshmem_root, toolkit, tmp / "nvshmem") if all(r.ok for r in reports) else []
            report_steps([*steps, *(f.result() for _, f in nvshmem_host)], failures)
            linked = "linked" if steps and all(s.ok for s in steps) else "not linked"
            summary.append(f"NVSHMEM {len(reports)} sources {sum(len(r.kernels) for r in reports)} kernels, {linked}")
    print(f"compile_check: {'; '.join(summary)}; {len(failures)} problems, {time.monotonic() - start:.1f} s "
          f"({' '.join(ARCH_FLAGS)})")
    for failure in failures:
        print(f"  FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
