"""One-GPU bf16 training benchmark (the first measurement of tests/gpu/run_gpu_checks.sh): a warm-up
step and `--steps` timed steps of moe_train/configs/dsv3_proxy_h200.yaml (or `--config`), printing
tokens/s, MFU, peak GPU memory beside what `python -m moe_train.plan` plans for the run on one GPU
(its reserve aside), the host syncs per step (tests/host_syncs.py) and the bf16 share of one
forward+backward's GEMM FLOPs (benchmarks/gemm_precision.py; on CUDA the attention kernels are not
among the recorded ones, so the share is of the weight GEMMs).

Run: python -m tests.gpu.bench_training [--config PATH] [--steps N] [--set key=value ...]
(run_gpu_checks.sh runs it as configured, with DeepSeek-V3's selective recompute, in fp8 and in fp8 with
the selective recompute, to compare the peak memory and tokens/s of each)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gemm_precision import census_step
from moe_train.config import load_config
from moe_train.preflight.plan import make_plan
from moe_train.train import Trainer, read_metrics
from tests.host_syncs import HostSyncCounter

PROXY = Path(__file__).resolve().parents[2] / "moe_train" / "configs" / "dsv3_proxy_h200.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(PROXY))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(args.config, ["train.global_batch_size=2", f"logging.dir={run_dir}",
                                           "logging.tensorboard=false", "checkpoint.resume=none", *args.overrides])
        trainer = Trainer(config)
        cuda = trainer.device.type == "cuda"  # (a CPU run of the script checks it before a GPU session)
        read_metrics([trainer.train_step()])  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with HostSyncCounter() as syncs:
            start = time.perf_counter()
            records = read_metrics([trainer.train_step() for _ in range(args.steps)])
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        tokens = args.steps * config.train.global_batch_size * config.train.seq_length / elapsed
        mfu = tokens * trainer.flops_per_token / (config.train.peak_tflops * 1e12)
        ids = torch.randint(0, config.model.vocab_size, (1, config.train.seq_length), device=trainer.device)
        census = census_step(trainer.model, ids, ids.roll(-1, dims=1))
    planned = make_plan(config, nodes=1, gpus_per_node=1).ranks[0].total / 2**30
    recompute = ",".join(config.model.recompute_modules) or "none"
    print(f"{config.train.precision} training, {Path(args.config).name}, recompute {recompute}: {tokens:,.0f} tokens/s, MFU {100 * mfu:.1f}%, peak memory "
          f"{peak:.2f} GiB (planned {planned:.2f}), {len(syncs) / args.steps:.1f} host syncs per step, "
          f"{100 * census.share():.1f}% of the "
          f"recorded GEMM FLOPs in bf16 (loss {records[-1]['loss']:.3f} after {args.steps + 1} steps)")
    print(syncs.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
