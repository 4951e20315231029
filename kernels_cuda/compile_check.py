"""Compile every CUDA source of kernels_cuda for sm_90 (compile-only) and report per-kernel resources.

Runs on machines without a GPU or a CUDA build of torch: device sources depend only on the CUDA
toolkit. Prints registers, shared memory, stack and spills per kernel from `ptxas -v`, and exits
non-zero on any compiler error or any spill. Usage: `python -m kernels_cuda.compile_check [--jobs N]`.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kernels_cuda.build import ARCH_FLAGS, CUDA_SOURCES, DEVICE_ONLY_FLAGS, NVCC_FLAGS, find_nvcc

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FUNCTION = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes cumulative stack size)?"
                   r"(?:, (\d+) bytes smem)?")


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
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}
    short = []
    for line in out.splitlines():
        line = line.replace("(anonymous namespace)::", "").removeprefix("void ")
        short.append(re.sub(r"\([^()]*\)$", "", line))
    return dict(zip(names, short))


def compile_source(nvcc: str, source: Path, out_dir: Path) -> SourceReport:
    cmd = [nvcc, *DEVICE_ONLY_FLAGS, *NVCC_FLAGS, *ARCH_FLAGS, "-Xptxas", "-v", "-c", str(source), "-o", str(out_dir / (source.stem + ".o"))]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    return SourceReport(source, proc.returncode == 0, time.monotonic() - start, parse_ptxas(log), log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="parallel nvcc processes (default 1)")
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDA_HOME/bin/nvcc or PATH)")
    args = parser.parse_args(argv)
    nvcc = args.nvcc or find_nvcc()
    if nvcc is None:
        print("compile_check: nvcc not found (set CUDA_HOME or PATH)", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        reports = list(pool.map(lambda s: compile_source(nvcc, s, Path(tmp)), CUDA_SOURCES))
    names = demangle([k.name for r in reports for k in r.kernels])
    failures = []
    print(f"{'source':28} {'kernel':58} {'arch':6} {'regs':>4} {'smem':>6} {'stack':>5} {'spills':>7}")
    for report in reports:
        if not report.ok:
            failures.append(f"{report.source.name}: compile error")
            print(f"{report.source.name}: FAILED\n{report.log}", file=sys.stderr)
            continue
        if not report.kernels:
            failures.append(f"{report.source.name}: no kernels found in the ptxas output")
        for k in report.kernels:
            spills = k.spill_stores + k.spill_loads
            print(f"{report.source.name:28} {names.get(k.name, k.name)[:58]:58} {k.arch:6} {k.registers:>4} "
                  f"{k.smem:>6} {k.stack:>5} {spills:>7}")
            if spills:
                failures.append(f"{report.source.name}: {names.get(k.name, k.name)} spills {spills} bytes")
    kernels = sum(len(r.kernels) for r in reports)
    print(f"compile_check: {len(reports)} sources, {kernels} kernels, {len(failures)} problems, "
          f"{time.monotonic() - start:.1f} s ({' '.join(ARCH_FLAGS)})")
    for failure in failures:
        print(f"  FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
