"""Per-process buffers, all processes sharing the one GPU, against the pure-torch reference:
`kernels_cuda.Buffer` on one node (peers' buffers opened through CUDA IPC, handles exchanged over gloo)
and over simulated nodes (both hops through CUDA IPC)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


@pytest.mark.parametrize("world,gpus_per_node", [(2, 2), (4, 4), (2, 1), (4, 2)],
                         ids=["intranode-2", "intranode-4", "internode-2x1", "internode-2x2"])
def test_per_process_buffers_match_the_reference(world, gpus_per_node, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    logs = [tmp_path / f"rank{rank}.log" for rank in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.gpu.buffer_worker", str(rank), str(world),
                               str(gpus_per_node), str(tmp_path / "rendezvous")], cwd=ROOT, env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT) for rank, log in enumerate(logs)]
    deadline = time.monotonic() + DEADLINE_S
    try:  # one failed rank ends the test at once instead of leaving its peers blocked
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        out = log.read_text()
        assert proc.returncode == 0 and f"OK rank {rank}" in out, f"rank {rank} (rc {proc.returncode}):\n{out[-4000:]}"
