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
    planned = float(line.split("(planned ")[1].split(")")[0])  # moe_train.plan's figure for the run on one GPU
    assert 0 < planned < 1, line
    share = float(line.split("per step, ")[1].split("%")[0])
    assert share > 95.0, line


def test_the_fp8_gemm_benchmark_prints_a_line_per_shape():
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.bench_fp8_gemm", "--device", "cpu", "--tokens", "16",
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "cpu: FP8 GEMMs through the emulation (no blockwise kernel)" in out
    lines = [l for l in out.splitlines() if "TFLOP/s" in l]
    assert [l.split(" K ")[0].strip() for l in lines] == ["q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj",
                                                         "expert gate_up", "expert down", "expert gate_up x4",
                                                         "expert down x4"]
    assert all("fp8 / bf16 speed" in l for l in lines) and all("(grouped, 32 rows each)" in l for l in lines[-2:])
