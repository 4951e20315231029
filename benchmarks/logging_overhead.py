"""Step-time cost of logging and of the profiler, against a baseline measured in the same run.

Each variant is a fresh trainer (not timed) whose `Trainer.train()` is timed over `--steps` steps; its
final checkpoint is left out (the trainer's `save` is replaced by a no-op), so the time is that of the
steps, their read-backs and their logs. Both the wall time and this process's CPU time (all its threads)
are given: on a machine shared with other jobs the wall time drifts with their load, the CPU time much
less (rank 0's, with several processes). After one run that is not counted (the process's first-use costs),
the variants alternate `--repeats` times, so that drifting step times on a shared machine reach each of
them, and the median of each is compared with the baseline:

- baseline: one record, at the last step (`train.log_interval` = steps);
- every step logged: `train.log_interval=1`: the read-back, the console line and the `metrics.jsonl`
  record with the per-MoE-layer keys, TensorBoard scalars when the package is installed, and with
  `--nproc` > 1 the straggler exchange (one all-gather per record);
- every step profiled: `logging.profile_steps=[1, steps]` with the baseline's logging, the Chrome
  trace's export at the last step included.

`--nproc N` runs it on N gloo processes (data parallel) spawned here, rank 0 timing.

    python -m benchmarks.logging_overhead [--config moe_train/configs/tiny.yaml] [--steps 20] [--repeats 5]
        [--nproc 1] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_train.config import load_config
from moe_train.data import build_demo_corpus, load_tokenizer
from moe_train.train import Trainer
from parallel.topology import Topology, build_topology

ROOT = Path(__file__).resolve().parents[1]
DEMO_BYTES = 400_000
BASELINE = "baseline (one record)"


def variants(steps: int) -> dict[str, list[str]]:
    return {BASELINE: [f"train.log_interval={steps}"],
            "every step logged": ["train.log_interval=1"],
            "every step profiled": [f"train.log_interval={steps}", f"logging.profile_steps=[1,{steps}]"]}


def timed_run(args: argparse.Namespace, overrides: list[str], run_dir: str,
              topology: Topology | None) -> tuple[float, float]:
    """(wall, CPU) seconds per step of `Trainer.train()` on `args.config` with `overrides` (no final save)."""
    config = load_config(args.config, [
        f"logging.dir={run_dir}", "checkpoint.resume=none", f"train.steps={args.steps}",
        f"train.threads={args.threads}", "train.eval_interval=0", f"data.cache_dir={args.cache}",
        f"data.demo_max_bytes={DEMO_BYTES}", *overrides])
    trainer = Trainer(config, topology)
    trainer.save = lambda wait=False: Path(run_dir)  # the steps alone: no checkpoint at the end
    if topology is not None:
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    assert trainer.train() == 0
    return (time.perf_counter() - start) / args.steps, (time.process_time() - cpu) / args.steps


def measure(args: argparse.Namespace, topology: Topology | None) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per step of each variant, `args.repeats` times, alternately."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants(args.steps)}
    timed_run(args, variants(args.steps)[BASELINE], os.path.join(args.runs, "warm-up"), topology)  # not counted
    for repeat in range(args.repeats):
        for index, (name, overrides) in enumerate(variants(args.steps).items()):
            run_dir = os.path.join(args.runs, f"{repeat}-{index}")
            times[name].append(timed_run(args, overrides, run_dir, topology))
    return times


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc,
                            timeout=timedelta(seconds=300))
    topology = build_topology(pp=1, ep=1, gpus_per_node=args.nproc, timeout_s=300)
    try:
        times = measure(args, topology)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        topology.destroy_groups()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "moe_train/configs/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.cache, args.runs = os.path.join(tmp, "cache"), os.path.join(tmp, "runs")
        build_demo_corpus(args.cache, load_tokenizer("byte"), max_bytes=DEMO_BYTES)
        if args.nproc == 1:
            times = measure(args, None)
        else:
            out = os.path.join(tmp, "times.json")
            mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=args.nproc)
            times = json.loads(Path(out).read_text())
    try:
        import tensorboard  # noqa: F401 - only whether it is installed
        board = "TensorBoard scalars written"
    except ImportError:
        board = "no TensorBoard (not installed)"
    print(f"{Path(args.config).name}, {args.steps} steps, {args.nproc} process(es) x {args.threads} thread(s), "
          f"torch {torch.__version__}, {board}; median of {args.repeats} per variant")
    for clock, index in (("wall", 0), ("CPU", 1)):
        base = statistics.median(run[index] for run in times[BASELINE])
        for name, runs in times.items():
            seconds = [run[index] for run in runs]
            median = statistics.median(seconds)
            listed = ", ".join(f"{1e3 * s:.1f}" for s in seconds)
            print(f"{clock} {name}: {1e3 * median:.1f} ms per step (runs {listed}); x{median / base:.3f} the "
                  f"baseline, {1e3 * (median - base):+.1f} ms per step")


if __name__ == "__main__":
    main()
