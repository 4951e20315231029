"""How much all-to-all time an overlapped FB pair hides, against the ideal max(compute, comm).

    python -m benchmarks.overlap [--ranks 2] [--layers 4] [--comm-ms 20] [--ratios 0.5,1,2]
        [--compute sleep|matmul]

Each of `--ranks` gloo processes runs one FB pair: a forward and a backward chunk of `--layers`
stand-in MoE layers, each layer two sub-steps of compute (calibrated to ratio x comm-ms: sleeps,
or 1-thread matmuls timed beforehand) each followed by a real gloo all-to-all whose completion is
delayed to at least `--comm-ms` after its launch (the injected latency). The pair runs once in
turn (forward chunk, then backward chunk) and once through `FBOverlap`; per ratio it prints the
rank-maximum times, the ideal max(compute, comm) and the fraction of communication hidden,
(sequential - overlapped) / comm, with comm = sequential - compute.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.handles import CommHandle, OverlapSwitch
from parallel.pipeline.overlap import FBOverlap

ROWS, HIDDEN = 256, 512


class LatencyHandle:
    """Completes no earlier than `ready_at` (perf_counter seconds)."""

    def __init__(self, inner: CommHandle, ready_at: float) -> None:
        self.inner, self.ready_at = inner, ready_at

    def wait(self) -> None:
        self.inner.wait()
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))


class LatencyComm(ProcessGroupComm):
    """The real gloo all-to-all, with `latency_s` injected between launch and completion."""

    def __init__(self, group: dist.ProcessGroup, latency_s: float, switch: OverlapSwitch) -> None:
        super().__init__(group, switch)
        self.latency_s = latency_s

    def all_to_all_async(self, send: torch.Tensor, send_splits: list[int],
                         recv_splits: list[int]) -> tuple[torch.Tensor, CommHandle]:
        out, handle = super().all_to_all_async(send, send_splits, recv_splits)
        return out, LatencyHandle(handle, time.perf_counter() + self.latency_s)


def stand_in_compute(kind: str, seconds: float) -> Callable[[], None]:
    """Work of about `seconds`: a sleep, or as many 256 x 256 matmuls as took that long here."""
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    a = torch.randn(256, 256)
    start, trial = time.perf_counter(), 50
    for _ in range(trial):
        a @ a
    count = max(1, round(seconds / ((time.perf_counter() - start) / trial)))

    def matmuls() -> None:
        for _ in range(count):
            a @ a
    return matmuls


def chunk(comm: LatencyComm, compute: Callable[[], None], layers: int) -> Callable[[], None]:
    rows = torch.randn(ROWS * comm.size, HIDDEN)
    splits = [ROWS] * comm.size

    def run() -> None:
        for _ in range(2 * layers):
            compute()
            comm.all_to_all(rows, splits, splits)
    return run


def timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank: int, ranks: int, store: str, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=120))
    switch = OverlapSwitch()
    comm = LatencyComm(dist.group.WORLD, args.comm_ms / 1e3, switch)
    rows = []
    for ratio in args.ratios:
        compute = stand_in_compute(args.compute, ratio * args.comm_ms / 1e3)
        forward, backward = chunk(comm, compute, args.layers), chunk(comm, compute, args.layers)
        hook = FBOverlap(switch)
        compute_s = min(timed(lambda: [compute() for _ in range(4 * args.layers)]) for _ in range(args.repeats))
        sequential = min(timed(lambda: (forward(), backward())) for _ in range(args.repeats))
        overlapped = min(timed(lambda: hook(forward, backward)) for _ in range(args.repeats))
        rows.append((ratio, compute_s, sequential, overlapped))
    if rank == 0:
        results["rows"] = rows
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--comm-ms", type=float, default=20.0)
    parser.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0])
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.ranks, os.path.join(tmp, "store"), args, results), nprocs=args.ranks)
    collectives = 4 * args.layers
    print(f"{args.ranks} ranks, FB pair of 2 x {args.layers} layers, {collectives} all-to-alls of "
          f"{ROWS} x {HIDDEN} fp32 rows per peer, injected latency {args.comm_ms:.0f} ms, compute: {args.compute}")
    print(f"{'compute/comm':>12} {'compute ms':>10} {'comm ms':>8} {'sequential':>10} {'overlapped':>10} "
          f"{'ideal':>8} {'hidden':>7}")
    for ratio, compute_s, sequential, overlapped in results["rows"]:
        comm_s = sequential - compute_s
        ideal = max(compute_s, comm_s)
        hidden = (sequential - overlapped) / comm_s
        print(f"{ratio:12.2f} {compute_s * 1e3:10.1f} {comm_s * 1e3:8.1f} {sequential * 1e3:10.1f} "
              f"{overlapped * 1e3:10.1f} {ideal * 1e3:8.1f} {hidden:7.1%}")


if __name__ == "__main__":
    main()
