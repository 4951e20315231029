"""The CPU emulation build of kernels_cuda: `kernels_cuda._C_cpu`, the same kernel and host sources as
the CUDA extension, compiled by the host C++ compiler against csrc/emu/ (no CUDA toolkit, no GPU).

Each kernel file (`csrc/kernels/*.cu`) is compiled as C++ with csrc/emu/device.h force-included (as
nvcc includes cuda_runtime.h) and EP_CPU_EMULATION defined; the host files against torch's headers
with csrc/emu/ first on the include path (its cuda_runtime.h stands in for CUDA's). Objects are cached
under `$KERNELS_CUDA_CACHE` (default ~/.cache/kernels_cuda) by a hash of their source, every header, the
flags and torch's version and C++ ABI, so that changing one kernel recompiles that kernel only. The module
is written next to the sources with a stamp naming the hash of everything it was built from
(`is_current`). Absolute paths (this tree's, torch's and Python's include and library directories) are
left out of every hash, so another checkout or environment with the same sources and torch finds the
build current.

`--asan` builds the same with AddressSanitizer; load it with the ASan runtime preloaded (README,
"Kernels on the CPU"). `ensure_built()` picks that variant when the running process has ASan loaded.
Usage: `python -m kernels_cuda.build --device cpu [--asan] [--jobs N]`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kernels_cuda.build_cuda import HOST_SOURCES

PACKAGE_DIR = Path(__file__).resolve().parent
CSRC = PACKAGE_DIR / "csrc"
EMU = CSRC / "emu"
MODULE_NAME = "_C_cpu"
EMULATOR_FILES = ("emu/emulator.cpp", "emu/fiber.cpp", "emu/memory.cpp")
COMMON_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-fno-strict-aliasing", "-DEP_CPU_EMULATION", f"-I{EMU}", f"-I{CSRC}", "-Wall",
                "-Wno-unknown-pragmas", "-Wno-sign-compare"]
KERNEL_FLAGS = ["-x", "c++", "-include", str(EMU / "device.h")]
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]


class BuildError(RuntimeError):
    """The emulation could not be built (no compiler, or a compiler error: the message has its log)."""


def compiler() -> str | None:
    """$CXX, else g++, else c++ (None when there is none)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def module_path(package_dir: Path = PACKAGE_DIR) -> Path:
    return package_dir / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"


def stamp_path(package_dir: Path = PACKAGE_DIR) -> Path:
    return package_dir / f"{MODULE_NAME}.stamp.json"


def cache_dir() -> Path:
    return Path(os.environ.get("KERNELS_CUDA_CACHE", Path.home() / ".cache" / "kernels_cuda")) / "objects"


def asan_loaded() -> bool:
    """Whether this process runs with AddressSanitizer's runtime (then only an --asan build loads)."""
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _torch_flags() -> tuple[list[str], list[str], dict[str, str]]:
    """(compile flags, link flags) of a torch extension against the installed torch, and a name for each
    absolute path in them (`_portable`)."""
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [*(f"-isystem{p}" for p in includes), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     f"-DTORCH_EXTENSION_NAME={MODULE_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    libs = cpp_extension.library_paths()
    link_flags = [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
                  "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    names = {**{str(p): f"<include{i}>" for i, p in enumerate(includes)},
             **{str(p): f"<lib{i}>" for i, p in enumerate(libs)}}
    return compile_flags, link_flags, names


def _torch_identity() -> bytes:
    """What the objects depend on in the installed torch and Python, paths aside: torch's version and C++ ABI
    and the extension suffix (its headers are those of that version)."""
    import torch

    return (f"torch {torch.__version__} cxx11_abi {int(torch._C._GLIBCXX_USE_CXX11_ABI)} "
            f"{sysconfig.get_config_var('EXT_SUFFIX')}").encode()


def _portable(flags: list[str], names: dict[str, str]) -> str:
    """`flags` with each absolute path replaced by its name, longest first (a path may contain another), so
    that the same sources and the same torch hash alike in any tree and any environment."""
    text = " ".join(flags)
    for path in sorted(names, key=len, reverse=True):
        text = text.replace(path, names[path])
    return text


def _headers(csrc: Path) -> list[Path]:
    return sorted(p for pattern in ("*.h", "*.cuh") for p in csrc.rglob(pattern))


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:24]


@dataclass
class Plan:
    """What one build compiles and links, and the hash of all of it."""

    cxx: str
    asan: bool
    objects: list[tuple[Path, list[str], Path]]  # (source, flags, cached object)
    link_flags: list[str]
    digest: str


def plan(csrc: Path = CSRC, asan: bool = False) -> Plan:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    torch_compile, torch_link, names = _torch_flags()
    names[str(csrc)] = "<csrc>"
    emu = csrc / "emu"
    common = [f.replace(str(EMU), str(emu)).replace(str(CSRC), str(csrc)) for f in COMMON_FLAGS]
    kernel_flags = [f.replace(str(EMU), str(emu)) for f in KERNEL_FLAGS]
    extra = ASAN_FLAGS if asan else []
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    context = [version.encode(), _torch_identity(), *(h.read_bytes() for h in _headers(csrc))]
    objects = []
    kernels = sorted((csrc / "kernels").glob("*.cu"))
    hosts = [csrc / source.relative_to(CSRC) for source in HOST_SOURCES]
    emulator = [csrc / f for f in EMULATOR_FILES]
    for source in [*hosts, *kernels, *emulator]:
        flags = [*common, *extra]
        if source in kernels:
            flags += kernel_flags
        if source in hosts:
            flags += torch_compile
        # Paths differ between trees and environments; the object depends on contents and flags only.
        key = _digest([source.read_bytes(), _portable(flags, names).encode(), *context])
        objects.append((source, flags, cache_dir() / f"{source.name}.{key}.o"))
    link = [*extra, *torch_link]
    digest = _digest([o.name.encode() for _, _, o in objects] + [_portable(link, names).encode()])
    return Plan(cxx, asan, objects, link, digest)


def is_current(package_dir: Path = PACKAGE_DIR, asan: bool | None = None) -> bool:
    """Whether the module next to the sources was built from exactly these sources (and variant)."""
    try:
        stamp = json.loads(stamp_path(package_dir).read_text())
    except (OSError, ValueError):
        return False
    want_asan = asan_loaded() if asan is None else asan
    try:
        current = plan(package_dir / "csrc", want_asan).digest
    except BuildError:
        return False
    return module_path(package_dir).is_file() and stamp.get("digest") == current


def _compile(cxx: str, source: Path, flags: list[str], target: Path) -> tuple[Path, float, bool]:
    if target.is_file():
        return source, 0.0, True
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([cxx, *flags, "-c", str(source), "-o", str(partial)], capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(f"compiling {source.name} failed:\n{proc.stderr[-6000:]}")
    os.replace(partial, target)
    return source, time.perf_counter() - start, False


def build(package_dir: Path = PACKAGE_DIR, asan: bool = False, jobs: int | None = None, quiet: bool = False) -> Path:
    """Builds `kernels_cuda/_C_cpu*.so` in `package_dir`; returns its path. Raises BuildError."""
    start = time.perf_counter()
    p = plan(package_dir / "csrc", asan)
    say = (lambda *_: None) if quiet else (lambda text: print(text, flush=True))
    say(f"kernels_cuda: building the CPU emulation{' with AddressSanitizer' if asan else ''} "
        f"({len(p.objects)} sources, {p.cxx})")
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        futures = [pool.submit(_compile, p.cxx, s, f, o) for s, f, o in p.objects]
        for future in futures:
            source, seconds, cached = future.result()
            say(f"  {source.name}: {'cached' if cached else f'{seconds:.1f} s'}")
    target = module_path(package_dir)
    partial = target.with_name(target.name + f".{os.getpid()}.tmp")
    proc = subprocess.run([p.cxx, "-shared", *(str(o) for _, _, o in p.objects), *p.link_flags, "-o", str(partial)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(f"linking {target.name} failed:\n{proc.stderr[-6000:]}")
    os.replace(partial, target)
    stamp_path(package_dir).write_text(json.dumps({"digest": p.digest, "asan": asan}) + "\n")
    say(f"kernels_cuda: built {target.name} in {time.perf_counter() - start:.1f} s")
    return target


def ensure_built(package_dir: Path = PACKAGE_DIR) -> str | None:
    """Builds the emulation unless the current one is there (the variant this process can load);
    None when it is ready, else why it cannot be built (no compiler, a compiler error)."""
    asan = asan_loaded()
    if is_current(package_dir, asan):
        return None
    try:
        build(package_dir, asan=asan)
    except BuildError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kernels_cuda.build --device cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--asan", action="store_true", help="build with AddressSanitizer")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    args = parser.parse_args(argv)
    try:
        build(asan=args.asan, jobs=args.jobs)
    except BuildError as error:
        print(f"kernels_cuda: {error}", file=sys.stderr)
        return 2
    return 0
