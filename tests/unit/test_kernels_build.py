"""kernels_cuda without CUDA: clean import, build decision, constants/config mirrors, compile_check."""
from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels_cuda
from kernels_cuda import build_cuda, constants
from kernels_cuda.compile_check import parse_ptxas
from kernels_cuda.config import Config, InternodeConfig, validate, validate_internode

CPU_TORCH = torch.version.cuda is None


@pytest.mark.skipif(kernels_cuda.is_built("cuda"), reason="the CUDA extension is built here")
def test_without_the_cuda_build_status_says_so_and_cuda_buffers_refuse_clearly():
    status = kernels_cuda.build_status()
    if kernels_cuda.is_built("cpu"):  # the kernel tests build the CPU emulation (tests/kernels/conftest.py)
        assert status == "built (cpu emulation)" and kernels_cuda.default_device() == "cpu"
    else:
        assert "not built" in status
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="for cuda is not built"):
        kernels_cuda.EmulatedGroup(2, 1 << 20, device="cuda")
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="for cuda is not built"):
        kernels_cuda.Buffer(None, 1 << 20, device="cuda")
    with pytest.raises(kernels_cuda.KernelsNotBuilt, match="for cuda is not built"):
        kernels_cuda.EmulatedInternodeGroup(2, 2, 1 << 20, 1 << 20, device="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        kernels_cuda.extension("tpu")


@pytest.mark.skipif(not CPU_TORCH, reason="needs a CPU build of torch")
def test_build_is_skipped_on_cpu_torch_and_forcing_it_fails_loudly(monkeypatch):
    monkeypatch.delenv(build_cuda.ENV_SWITCH, raising=False)
    decision, reason = build_cuda.build_decision()
    assert not decision and "not a CUDA build" in reason
    assert build_cuda.cuda_ext_modules() == [] and build_cuda.cuda_cmdclass() == {}
    monkeypatch.setenv(build_cuda.ENV_SWITCH, "1")
    with pytest.raises(RuntimeError, match="cannot be built"):
        build_cuda.build_decision()
    monkeypatch.setenv(build_cuda.ENV_SWITCH, "0")
    assert build_cuda.build_decision() == (False, f"{build_cuda.ENV_SWITCH}=0")


def test_sources_are_split_into_device_and_host_files():
    assert {p.name for p in build_cuda.CUDA_SOURCES} >= {"layout.cu", "notify.cu", "intranode_dispatch.cu",
                                                    "intranode_combine.cu", "internode_notify.cu",
                                                    "internode_dispatch.cu", "internode_combine.cu"}
    for source in build_cuda.CUDA_SOURCES:  # device code depends on the CUDA toolkit only
        assert "torch" not in source.read_text()
    for source in build_cuda.HOST_SOURCES:
        assert "torch/extension.h" in source.read_text()


def test_nvshmem_back_end_is_skipped_unless_asked_for(monkeypatch, tmp_path):
    monkeypatch.delenv(build_cuda.NVSHMEM_SWITCH, raising=False)
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nvshmem.h").write_text("")
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    assert build_cuda.find_nvshmem() == tmp_path
    assert build_cuda.nvshmem_options() == {}  # found, but not asked for
    monkeypatch.setenv(build_cuda.NVSHMEM_SWITCH, "1")
    options = build_cuda.nvshmem_options()
    assert "-DEP_WITH_NVSHMEM" in options["nvcc"] and "nvshmem_device" in options["libraries"]
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "missing"))
    if build_cuda.find_nvshmem() is None:  # no wheel either: skipped even when asked for
        assert build_cuda.nvshmem_options() == {}


def test_constants_come_from_the_header():
    parsed = constants.parse_constants(constants.HEADER.read_text())
    assert parsed["MAX_RANKS"] == constants.MAX_RANKS == 8
    assert parsed["COMBINE_WARPS"] > parsed["COMBINE_KEEPER_WARPS"]
    assert constants.ROLES[1] == "Barrier" and "ForwarderMeta" in constants.ROLES.values()
    assert constants.parse_constants("constexpr long long kBig = 12LL;\nconstexpr int kSmallOne = 3;") == {
        "BIG": 12, "SMALL_ONE": 3}


def test_error_records_read_as_one_line_naming_the_role_rank_and_peer():
    record = {"code": 1, "role_name": "CombineKeeper", "rank": 3, "channel": 5, "peer": 1, "head": 7, "tail": 9,
              "expected": 12}
    assert constants.describe_error(record).startswith(
        "device timeout: role CombineKeeper of rank 3 (channel 5) waited for peer 1: head=7 tail=9 expected=12")
    # A barrier belongs to no channel: the device records -1, the line leaves the channel out.
    barrier = constants.describe_error({**record, "role_name": "Barrier", "channel": -1})
    assert barrier.startswith("device timeout: role Barrier of rank 3 waited for peer 1:"), barrier
    assert "too small" in constants.describe_error({**record, "code": 2})


def test_config_defaults_are_valid_and_violations_are_named():
    cfg = Config()
    assert cfg.validate(8, 7168 * 2, 8, 32) is None
    assert "chunk" in Config(20, 300, 256).validate(8, 7168 * 2, 8, 32)
    assert "divide evenly" in cfg.validate(5, 7168 * 2, 8, 32)
    assert "too small" in cfg.validate(8, 7168 * 2, 8, 32, buffer_size=1 << 20)
    assert cfg.validate(8, 7168 * 2, 8, 32, buffer_size=cfg.buffer_size_hint(8, 7168 * 2, 8)) is None


GRID = list(itertools.product([1, 10, 65], [0, 1, 6, 300], [4, 256], [1, 2, 5, 8, 9], [256, 14336, 100], [0, 8, 33],
                              [1, 2000], [0, 1 << 20, 1 << 30]))


@pytest.fixture(scope="module")
def config_probe(tmp_path_factory):
    """Runs csrc/host/config_probe.cpp (compiled once) in a mode over a grid of cases: its answer lines."""
    if shutil.which("g++") is None:
        pytest.skip("no host C++ compiler")
    probe = tmp_path_factory.mktemp("probe") / "config_probe"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{build_cuda.CSRC}", str(build_cuda.CSRC / "host" / "config_probe.cpp"),
                    "-o", str(probe)], check=True)

    def run(mode: str, grid: list[tuple[int, ...]]) -> list[str]:
        lines = "\n".join(" ".join(map(str, case)) for case in grid)
        out = subprocess.run([str(probe), mode], input=lines, capture_output=True, text=True, check=True).stdout
        assert len(out.splitlines()) == len(grid)
        return out.splitlines()

    return run


def test_python_config_mirror_matches_the_header(config_probe):
    for case, line in zip(GRID, config_probe("intranode", GRID)):
        channels, chunk, capacity, ranks, hidden, topk, local_experts, buffer_size = case
        problem = validate(channels, chunk, capacity, ranks, hidden, topk, local_experts, buffer_size)
        if problem is None:
            assert line.startswith("OK "), (case, line)
            cfg = Config(2 * channels, chunk, capacity)
            assert int(line.split()[1]) == cfg.buffer_size_hint(ranks, hidden, topk), case
        else:
            assert line == f"ERR {problem}", case


def test_ptxas_parsing_reads_registers_smem_and_spills():
    log = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'
ptxas info    : Function properties for _Z1kv
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers, 16 bytes cumulative stack size, 512 bytes smem
"""
    (kernel,) = parse_ptxas(log)
    assert (kernel.name, kernel.arch, kernel.registers, kernel.smem) == ("_Z1kv", "sm_90", 90, 512)
    assert (kernel.stack, kernel.spill_stores, kernel.spill_loads) == (16, 8, 4)


@pytest.mark.skipif(build_cuda.find_nvcc() is None, reason="nvcc not installed")
def test_compile_check_compiles_every_kernel_for_sm90_without_spills_and_the_host_sources():
    # the NVSHMEM pass has its own test (tests/unit/test_compile_check.py)
    proc = subprocess.run([sys.executable, "-m", "kernels_cuda.compile_check", "--passes", "device,host", "--jobs", "2"],
                          capture_output=True, text=True, cwd=Path(build_cuda.PACKAGE_DIR).parent, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for kernel in ("get_dispatch_layout_kernel", "notify_dispatch_kernel", "cached_notify_kernel", "dispatch_kernel",
                   "combine_kernel", "internode_notify_kernel", "internode_cached_notify_kernel",
                   "internode_dispatch_kernel", "internode_combine_kernel"):
        assert kernel in proc.stdout
    assert " 0 problems" in proc.stdout and "bindings.cpp" in proc.stdout and "internode_runtime.cpp" in proc.stdout


INTERNODE_GRID = list(itertools.product([1, 65], [0, 1, 6, 300], [4, 288, 290], [1, 16, 64], [7, 128, 130],
                                        [1, 2, 4, 20, 21], [1, 8, 9], [256, 100], [8], [1, 2000]))


def test_python_internode_config_mirror_matches_the_header(config_probe):
    verdicts = set()
    for case, line in zip(INTERNODE_GRID, config_probe("internode", INTERNODE_GRID)):
        problem = validate_internode(*case)
        if problem is None:
            channels, nvl_chunk, nvl_capacity, rdma_chunk, rdma_capacity, nodes, gpus, hidden, topk, _ = case
            cfg = InternodeConfig(2 * channels, nvl_chunk, nvl_capacity, rdma_chunk, rdma_capacity)
            assert line == "OK {} {}".format(*cfg.buffer_size_hints(nodes, gpus, hidden, topk)), case
        else:
            assert line == f"ERR {problem}", case
        verdicts.add(line.split(":")[0] if problem else "OK")
    assert "OK" in verdicts and len(verdicts) >= 8  # the grid reaches every rule


def test_toolkit_root_is_what_nvcc_reports_even_through_a_wrapper(tmp_path):
    toolkit = tmp_path / "cuda-13.9"
    (toolkit / "bin").mkdir(parents=True)
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho '#$ _NVVM_BRANCH_=nvvm'\necho '#$ TOP={toolkit}/bin/..'\n")
    wrapper.chmod(0o755)
    assert build_cuda.toolkit_root(str(wrapper)) == toolkit  # not tmp_path, the wrapper's grandparent


@pytest.mark.skipif(build_cuda.find_nvcc() is None, reason="nvcc not installed")
def test_toolkit_root_of_the_installed_nvcc_holds_nvcc_and_the_runtime_headers():
    root = build_cuda.toolkit_root(build_cuda.find_nvcc())
    assert (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file()


def test_the_extension_is_loaded_after_torch(tmp_path):
    """A real build links libc10/libtorch without an rpath: loading it before torch fails (as a stand-in
    extension here does, the way the real one did on a CUDA build of torch)."""
    package = tmp_path / "kernels_cuda"
    shutil.copytree(build_cuda.PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__", "_C*.so"))
    (package / "_C.py").write_text("import sys\nif 'torch' not in sys.modules:\n"
                                   "    raise ImportError('libc10.so: cannot open shared object file')\n")
    proc = subprocess.run([sys.executable, "-c", "import kernels_cuda; print(kernels_cuda.build_status())"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("built"), proc.stdout + proc.stderr


def test_the_cpu_emulation_build_says_why_without_a_compiler(monkeypatch, tmp_path):
    from kernels_cuda import build_cpu

    monkeypatch.setattr(build_cpu, "compiler", lambda: None)
    problem = build_cpu.ensure_built(tmp_path)  # a package dir with no sources and no module
    assert problem is not None and "no C++ compiler found" in problem
    assert not build_cpu.is_current(tmp_path, asan=False)


def test_the_cpu_build_digest_names_torch_and_the_sources_not_where_they_are(monkeypatch, tmp_path):
    """The same sources and the same torch in another tree and environment (torch installed elsewhere)
    hash alike, so `is_current()` holds there; another torch version or ABI, or one changed header, does not."""
    from torch.utils import cpp_extension

    from kernels_cuda import build_cpu

    if build_cpu.compiler() is None:
        pytest.skip("no C++ compiler")
    here = build_cpu.plan()
    tree = tmp_path / "elsewhere" / "kernels_cuda"
    shutil.copytree(build_cpu.CSRC, tree / "csrc")
    includes, libs = cpp_extension.include_paths(), cpp_extension.library_paths()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [f"/other/env{p}" for p in includes])
    monkeypatch.setattr(cpp_extension, "library_paths", lambda *a, **k: [f"/other/env{p}" for p in libs])
    assert build_cpu.plan(tree / "csrc").digest == here.digest
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    assert build_cpu.plan(tree / "csrc").digest != here.digest
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert build_cpu.plan(tree / "csrc").digest != here.digest
    monkeypatch.undo()
    header = next((tree / "csrc" / "params").glob("*.h"))
    header.write_text(header.read_text() + "\n")
    assert build_cpu.plan(tree / "csrc").digest != here.digest
