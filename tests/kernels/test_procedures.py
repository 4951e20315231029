"""The README's procedures for the CPU emulation: the build command, the AddressSanitizer build (it
finds a row written past the end of a tensor), and planting a bug to show the kernel tests catch it
(memory-ordering bugs: only in the relaxed memory mode).
Each runs on a scratch copy of the repository (tests/kernels/plant_bug.py), so the tree under test is
untouched; objects are cached by content, so only what a copy changes is recompiled."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kernels_cuda
from tests.kernels.plant_bug import BUGS, run_kernel_tests

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not kernels_cuda.is_built("cpu") or shutil.which("g++") is None,
                                                   reason="the CPU emulation is not built here")]


def test_the_build_command_builds_the_emulation():
    proc = subprocess.run([sys.executable, "-m", "kernels_cuda.build", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "built _C_cpu" in proc.stdout, proc.stdout + proc.stderr
    status = subprocess.run([sys.executable, "-c", "import kernels_cuda; print(kernels_cuda.build_status())"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "cpu emulation" in status, status


def test_a_planted_sender_that_skips_the_room_wait_is_caught():
    result = run_kernel_tests(BUGS["skip_room_wait"], "test_intranode and tiny_rings", asan=False)
    print(result.output[-3000:])
    assert result.ran >= 20 and len(result.failed) >= result.ran // 2, result.failed


def test_asan_finds_a_receiver_writing_one_row_too_far():
    clean = run_kernel_tests(None, "test_intranode and dispatch_and_combine and (0-cpu or 1-cpu)", asan=True)
    assert clean.ran >= 2 and not clean.failed, clean.output[-3000:]
    planted = run_kernel_tests(BUGS["row_too_far"], "test_intranode and dispatch_and_combine and 0-cpu", asan=True)
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in planted.output, planted.output[-3000:]
    assert "receive_record" in planted.output, planted.output[-3000:]  # the report names the kernel function


@pytest.mark.parametrize("bug,select", [("released_without_fence", "test_internode and dispatch_and_combine"),
                                        ("plain_tail_publish", "test_intranode and (dispatch_and_combine or tiny_rings)")])
def test_a_planted_memory_ordering_bug_is_caught_by_the_relaxed_memory_runs_only(bug, select):
    result = run_kernel_tests(BUGS[bug], select, asan=False)
    print("\n".join(result.failed))
    relaxed = [test for test in result.failed if test.endswith("-relaxed]")]
    assert relaxed and relaxed == result.failed, result.output[-3000:]  # the sequential runs pass
    assert result.ran >= 20 + len(relaxed), result.ran
