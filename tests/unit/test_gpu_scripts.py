"""The GPU session's scripts, run here on CPU with small settings so that a lent GPU's minutes are not
spent on their bugs: the training benchmark that opens tests/gpu/run_gpu_checks.sh."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_training_benchmark_prints_its_figures(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.bench_training", "--config", "moe_train/configs/tiny.yaml",
                           "--steps", "2", "--set", "train.device=cpu", "--set", "train.global_batch_size=4", "--set", "train.precision=bf16",
                           "--set", f"data.cache_dir={tmp_path}", "--set", "data.demo_max_bytes=300000",
                           "--set", "model.recompute_modules=[layernorm,mla_up_proj,moe_act]"],  # as its second run
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(l for l in out.splitlines()
                if l.startswith("bf16 training, tiny.yaml, recompute layernorm,mla_up_proj,moe_act:"))
    assert "tokens/s, MFU" in line and "host syncs per step" in line and "of the recorded GEMM FLOPs in bf16" in line
    share = float(line.split("per step, ")[1].split("%")[0])
    assert share > 95.0, line
