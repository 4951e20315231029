"""logging.memory_snapshot on CUDA (run by tests/gpu/run_gpu_checks.sh as its own step): a 2-step tiny run
writes one allocator snapshot after step 1 whose trace, replayed, peaks at the step-1 peak that the run's
own record reports (torch.cuda.max_memory_allocated at the first log). The run uses tiny.yaml's seed."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def replayed_peak(trace: list[dict]) -> int:
    """Most bytes allocated at once in a device trace (alloc adds a block, free_completed returns it)."""
    live = peak = 0
    for event in trace:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
        peak = max(peak, live)
    return peak


def test_the_snapshot_holds_the_first_steps_peak(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "moe_train.train", "--config", str(ROOT / "moe_train/configs/tiny.yaml")]
    for kv in (f"logging.dir={run}", "logging.tensorboard=false", "train.device=cuda", "train.steps=2",
               "train.log_interval=1", f"data.cache_dir={tmp_path / 'cache'}", "data.demo_max_bytes=200000",
               "logging.memory_snapshot=true"):
        args += ["--set", kv]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = run / "memory_snapshot" / "rank0_step1.pickle"
    assert f"memory snapshot through step 1 written to {path}" in proc.stdout
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    assert snapshot["segments"] and any(event["action"] == "alloc" for event in trace)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    logged = first["mem_allocated_peak_gib"] * 2**30
    print(f"replayed peak {replayed_peak(trace)} B, logged step-1 peak {logged:.0f} B, {len(trace)} events")
    assert 0.9 * logged <= replayed_peak(trace) <= logged
