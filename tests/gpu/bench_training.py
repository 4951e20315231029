"""One-GPU bf16 training benchmark (the first measurement of tests/gpu/run_gpu_checks.sh): a few steps
of moe_train/configs/dsv3_proxy_h200.yaml (or `--config`), then tokens/s and MFU of the steps after
the first (warm-up) as the trainer logs them, and the peak GPU memory.

Run: python -m tests.gpu.bench_training [--config PATH] [--steps N] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from moe_train import train
from moe_train.metrics import METRICS_FILE

PROXY = Path(__file__).resolve().parents[2] / "moe_train" / "configs" / "dsv3_proxy_h200.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(PROXY))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"train.steps={args.steps}", "train.log_interval=1", "train.global_batch_size=2",
                     f"logging.dir={run_dir}", "logging.tensorboard=false", *args.overrides]
        torch.cuda.reset_peak_memory_stats()
        status = train.main(["--config", args.config, *(x for o in overrides for x in ("--set", o))])
        peak = torch.cuda.max_memory_allocated() / 2**30
        steps = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line]
    timed = [s for s in steps if "tokens_per_s" in s][1:] or steps
    tokens = statistics.median(s["tokens_per_s"] for s in timed)
    mfu = statistics.median(s.get("mfu", float("nan")) for s in timed)
    print(f"bf16 training, {Path(args.config).name}: {tokens:,.0f} tokens/s, MFU {100 * mfu:.1f}%, "
          f"peak memory {peak:.1f} GiB over {len(timed)} timed steps (exit {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
