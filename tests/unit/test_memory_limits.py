"""What one process may allocate (moe_train.preflight.memory_limits): cgroup limits of both hierarchies and
the process's own rlimits bound the start-up memory check, not only the machine's free RAM.

The cgroup trees are written by the tests (no cgroup is changed); the rlimit test lowers the
address-space limit of a child process only. No random inputs are drawn."""
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_train.preflight.memory_limits import available_memory, cgroup_headroom_bytes

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "moe_train/configs/tiny.yaml")
MIB = 2**20


def write_group(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_a_v2_limit_on_an_ancestor_bounds_a_group_without_one(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    write_group(tmp_path / "slurm" / "job_7", memory_max=str(4096 * MIB), memory_current=str(1500 * MIB),
                memory_stat=f"anon 1\ninactive_file {500 * MIB}\n")
    write_group(tmp_path / "slurm" / "job_7" / "step_0", memory_max="max", memory_current=str(900 * MIB))
    headroom = cgroup_headroom_bytes(tmp_path, "0::/slurm/job_7/step_0\n")
    assert headroom == (4096 - (1500 - 500)) * MIB  # reclaimable page cache is not counted as used


def test_the_tightest_of_the_own_and_ancestor_limits_wins(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    write_group(tmp_path / "a", memory_max=str(8000 * MIB), memory_current=str(1000 * MIB))
    write_group(tmp_path / "a" / "b", memory_max=str(2000 * MIB), memory_current=str(1500 * MIB))
    assert cgroup_headroom_bytes(tmp_path, "0::/a/b\n") == 500 * MIB


def test_a_v1_memory_controller_in_a_cgroup_namespace_is_read_at_its_mount(tmp_path):
    """Inside a container the memory mount is the process's own group: its path in /proc/self/cgroup
    does not exist below the mount."""
    write_group(tmp_path / "memory", memory_limit_in_bytes=str(3072 * MIB), memory_usage_in_bytes=str(1024 * MIB),
                memory_stat=f"cache 9\ntotal_inactive_file {24 * MIB}\n")
    text = "4:memory:/process_api/0123abcd\n0::/\n"
    assert cgroup_headroom_bytes(tmp_path, text) == (3072 - 1000) * MIB


@pytest.mark.parametrize("limit", ["max", str(9223372036854771712)], ids=["v2-max", "v1-page-rounded-max"])
def test_no_limit_is_no_bound(tmp_path, limit):
    if limit == "max":
        (tmp_path / "cgroup.controllers").write_text("memory\n")
        write_group(tmp_path / "g", memory_max=limit, memory_current="5")
        assert cgroup_headroom_bytes(tmp_path, "0::/g\n") is None
    else:
        write_group(tmp_path / "memory", memory_limit_in_bytes=limit, memory_usage_in_bytes="5")
        assert cgroup_headroom_bytes(tmp_path, "3:memory:/\n") is None


def test_a_cgroup_limit_is_shared_by_the_processes_here_and_named(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    write_group(tmp_path / "job", memory_max=str(2048 * MIB), memory_current="0")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/job\n")
    (proc / "status").write_text("VmSize:\t1000 kB\nVmData:\t1000 kB\n")
    limit = available_memory(torch.device("cpu"), 4, cgroup_root=tmp_path, proc_self=proc)
    assert limit.gib == pytest.approx(0.5) and "cgroup" in limit.source and "--mem" in limit.source


def test_an_address_space_limit_refuses_a_model_it_cannot_hold_before_allocating(tmp_path):
    """ulimit -v 2 GiB and a model whose weights alone need more: refused at start-up naming the limit.
    Without reading the rlimit the check passes (the machine has the RAM) and the run dies allocating
    the weights (MemoryError traceback)."""
    limit = 2 * 2**30

    def lower_the_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "moe_train.train", "--config", TINY, "--set", "model.hidden_size=8192",
                           "--set", f"logging.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=lower_the_limit)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "the address-space limit (ulimit -v)" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not run.exists()
