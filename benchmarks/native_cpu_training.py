"""Tokens/s of the tiny config trained on 4 CPU processes (EP 4 over 2 simulated nodes) with the
`native` dispatcher (our kernels on the CPU emulation, one buffer per process in shared memory) against
`hierarchical` (the same two hops in pure torch over gloo), measured in the same run through the
launcher.

The emulation runs every CUDA thread of a kernel as a fiber on one core (a dispatch with
`parallel.comm_sms=4` is 4 blocks x 768 threads per rank), and its ranks take turns on 2 cores, so
`native` on the CPU is a correctness path, not a fast one; the ratio says what it costs. The default
`comm_sms=20` launches 5x the fibers.

    python benchmarks/native_cpu_training.py [--steps 12] [--sms 4 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tokens_per_s(dispatcher: str, steps: int, work: Path, *extra: str) -> float:
    """The median tokens/s of the steps after the first two (start-up and first-call costs excluded)."""
    run = work / f"{dispatcher}{'-'.join(extra).replace('=', '')}"
    sets = [f"parallel.ep=4", "parallel.gpus_per_node=2", f"parallel.dispatcher={dispatcher}",
            "train.micro_batch_size=2", f"train.steps={steps}", "train.log_interval=1", "train.eval_interval=0",
            "checkpoint.interval=0", f"logging.dir={run}", f"data.cache_dir={work / 'cache'}",
            "data.demo_max_bytes=300000", "logging.tensorboard=false", *extra]
    argv = ["bash", str(ROOT / "scripts/pretrain_dsv3.sh"), str(ROOT / "moe_train/configs/tiny.yaml")]
    for item in sets:
        argv += ["--set", item]
    env = dict(os.environ, NPROC_PER_NODE="4", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    subprocess.run(argv, check=True, env=env, cwd=work, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][2:]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sms", type=int, nargs="+", default=[4, 20], help="parallel.comm_sms values for native")
    args = parser.parse_args()
    from kernels_cuda import build_cpu

    problem = build_cpu.ensure_built()
    if problem is not None:
        sys.exit(f"the CPU emulation cannot be built here: {problem}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        baseline = tokens_per_s("hierarchical", args.steps, work)
        print(f"hierarchical (pure torch, gloo): {baseline:,.0f} tokens/s (baseline)")
        for sms in args.sms:
            rate = tokens_per_s("native", args.steps, work, f"parallel.comm_sms={sms}")
            print(f"native, CPU emulation, comm_sms={sms}: {rate:,.0f} tokens/s = {rate / baseline:.2f}x hierarchical")


if __name__ == "__main__":
    main()
