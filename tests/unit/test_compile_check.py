"""kernels_cuda.compile_check without a GPU: the host pass's command (torch shim, include directories),
NVSHMEM detection and flags, and the NVSHMEM pass itself where nvcc and NVSHMEM are installed. (The
whole check, every pass, runs in test_kernels_build.py.)"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kernels_cuda import build_cuda, compile_check
from kernels_cuda.compile_check import (NVSHMEM_NOT_FOUND, TORCH_CUDA_MACROS, TORCH_CUDA_MACROS_SHIM, Toolkit,
                                        host_check_command, parse_nvcc_dryrun, write_torch_shim)

DRYRUN = """#$ _HERE_=/opt/cuda-13/bin
#$ TOP=/opt/cuda-13/bin/..
#$ INCLUDES="-I/opt/cuda-13/bin/../targets/x86_64-linux/include"
#$ SYSTEM_INCLUDES="-isystem" "/opt/cuda-13/bin/../targets/x86_64-linux/include/cccl"
#$ LIBRARIES=  "-L/opt/cuda-13/bin/../targets/x86_64-linux/lib/stubs" "-L/opt/cuda-13/bin/../targets/x86_64-linux/lib"
#$ gcc -E -x c++ "-I/elsewhere" x.cu
"""


def test_toolkit_directories_come_from_nvcc_dryrun():
    toolkit = parse_nvcc_dryrun(DRYRUN)
    assert toolkit.include_dirs == ("/opt/cuda-13/targets/x86_64-linux/include",)
    assert toolkit.system_include_dirs == ("/opt/cuda-13/targets/x86_64-linux/include/cccl",)
    assert toolkit.library_dirs == ("/opt/cuda-13/targets/x86_64-linux/lib/stubs",
                                    "/opt/cuda-13/targets/x86_64-linux/lib")


@pytest.mark.skipif(build_cuda.find_nvcc() is None, reason="nvcc not installed")
def test_the_installed_nvcc_leads_to_its_toolkit_even_through_a_wrapper():
    toolkit = compile_check.cuda_toolkit(build_cuda.find_nvcc())
    assert any((Path(d) / "cuda_runtime.h").is_file() for d in toolkit.include_dirs)
    assert any(list(Path(d).glob("libcudart.so*")) for d in toolkit.library_dirs)


def test_host_check_command_has_the_shim_first_then_torch_python_cuda_and_csrc(tmp_path):
    root = tmp_path / "torch" / "include"
    torch_includes = [root, root / "torch" / "csrc" / "api" / "include"]
    for d in torch_includes:
        d.mkdir(parents=True, exist_ok=True)
    shim = write_torch_shim(tmp_path / "shim", torch_includes)  # as in the CPU wheel: the generated header is missing
    assert shim is not None and (shim / TORCH_CUDA_MACROS).read_text() == TORCH_CUDA_MACROS_SHIM
    assert TORCH_CUDA_MACROS_SHIM.count("\n") == 1
    toolkit = Toolkit(("/cuda/include",), ("/cuda/include/cccl",), ("/cuda/lib",))
    source = build_cuda.HOST_SOURCES[0]
    cmd = host_check_command("g++", source, toolkit, torch_includes, shim)
    includes = [arg[2:] for arg in cmd if arg.startswith("-I")]
    assert includes[0] == str(shim)
    assert includes[1:3] == [str(d) for d in torch_includes]
    assert sysconfig.get_paths()["include"] in includes and "/cuda/include" in includes and str(build_cuda.CSRC) in includes
    assert "-isystem/cuda/include/cccl" in cmd
    assert {"-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C"} <= set(cmd) and cmd[-1] == str(source)
    assert "-DEP_WITH_NVSHMEM" not in cmd

    root = tmp_path / "nvshmem"
    nvshmem_cmd = host_check_command("g++", source, toolkit, torch_includes, shim, root)
    assert "-DEP_WITH_NVSHMEM" in nvshmem_cmd and f"-I{root / 'include'}" in nvshmem_cmd

    (torch_includes[0] / TORCH_CUDA_MACROS).parent.mkdir(parents=True)
    (torch_includes[0] / TORCH_CUDA_MACROS).write_text("")  # a CUDA build of torch has it: no shim
    assert write_torch_shim(tmp_path / "shim2", torch_includes) is None


def test_torch_include_dirs_hold_the_extension_header():
    root, api = compile_check.torch_include_dirs()
    assert (root / "torch" / "extension.h").is_file() and (api / "torch" / "all.h").is_file()


def test_nvshmem_home_is_found_and_its_flags_device_link_and_link_the_soname(tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nvshmem.h").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnvshmem_host.so.3").write_text("")  # the wheel ships only the soname
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    assert build_cuda.find_nvshmem() == tmp_path
    flags = build_cuda.nvshmem_flags(tmp_path)
    assert {"-DEP_WITH_NVSHMEM", "-rdc=true", f"-I{tmp_path / 'include'}"} <= set(flags["nvcc"])
    assert "-U__CUDA_NO_HALF_OPERATORS__" in flags["nvcc"]  # nvshmem.h needs what torch's flags switch off
    assert {"-DEP_WITH_NVSHMEM", f"-I{tmp_path / 'include'}"} <= set(flags["cxx"])
    dlink = flags["nvcc_dlink"]
    assert dlink[0] == "-dlink" and set(build_cuda.ARCH_FLAGS) <= set(dlink) and "-lnvshmem_device" in dlink
    assert "-dlto" not in dlink
    assert flags["libraries"] == ["nvshmem_device", ":libnvshmem_host.so.3"]
    assert flags["runtime_library_dirs"] == [str(tmp_path / "lib")]
    (tmp_path / "lib" / "libnvshmem_host.so").write_text("")
    assert build_cuda.nvshmem_host_library(tmp_path) == "nvshmem_host"


def test_the_skipped_nvshmem_pass_says_so(monkeypatch, capsys):
    monkeypatch.setattr(build_cuda, "find_nvshmem", lambda: None)
    monkeypatch.setattr(compile_check, "cuda_toolkit", lambda nvcc: Toolkit((), (), ()))
    assert compile_check.main(["--passes", "nvshmem", "--nvcc", "nvcc"]) == 0
    out = capsys.readouterr().out
    assert NVSHMEM_NOT_FOUND in out
    assert "skipped: NVSHMEM not found (pip install nvidia-nvshmem-cu13 or set NVSHMEM_HOME)" in out
    assert "NVSHMEM skipped" in out and " 0 problems" in out


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt")
def test_rdc_kernel_names_are_demangled_with_backend_names():
    name = ("__nv_static_43__cd6b643d_21_internode_dispatch_cu_53b82eee__ZN2ep54_GLOBAL__N__cd6b643d_21_internode_"
            "dispatch_cu_53b82eee25internode_dispatch_kernelILNS_7BackendE2EEEvNS_23InternodeDispatchParamsE")
    assert compile_check.demangle([name]) == {name: "ep::internode_dispatch_kernel<kNvshmem>"}


@pytest.mark.skipif(build_cuda.find_nvcc() is None or build_cuda.find_nvshmem() is None,
                    reason="needs nvcc and NVSHMEM (pip install nvidia-nvshmem-cu13)")
def test_nvshmem_pass_compiles_device_links_and_links_the_back_end():
    proc = subprocess.run([sys.executable, "-m", "kernels_cuda.compile_check", "--passes", "nvshmem", "--jobs", "2"],
                          capture_output=True, text=True, cwd=Path(build_cuda.PACKAGE_DIR).parent, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for kernel in ("internode_notify_kernel<kNvshmem>", "internode_cached_notify_kernel<kNvshmem>",
                   "internode_dispatch_kernel<kNvshmem>", "internode_combine_kernel<kNvshmem, float>",
                   "internode_combine_kernel<kNvshmem, __nv_bfloat16>", "low_latency_dispatch_kernel<kNvshmem>",
                   "low_latency_combine_kernel<kNvshmem>"):
        assert kernel in out
    assert "nvshmem_world.cu" in out
    for step in ("device link (-lnvshmem_device)", "host link (shared, --no-undefined)",
                 "bindings.cpp (-DEP_WITH_NVSHMEM)", "internode_runtime.cpp (-DEP_WITH_NVSHMEM)",
                 "low_latency_runtime.cpp (-DEP_WITH_NVSHMEM)"):
        assert re.search(re.escape(step) + r"\s+ok\s", out), step
    sources = len(build_cuda.NVSHMEM_KERNEL_SOURCES) + len(build_cuda.NVSHMEM_SOURCES)  # internode_*, low_latency_*, world
    assert sources == 6 and re.search(rf"NVSHMEM {sources} sources \d+ kernels, linked; 0 problems", out), out
