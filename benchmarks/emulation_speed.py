"""Speed of the CPU emulation of kernels_cuda (kernels_cuda/csrc/emu): one intranode dispatch + combine
of `--tokens` x `--hidden` bf16 rows per rank over `--ranks` emulated ranks (every CUDA thread a
fiber), per scheduler policy, against the same op of the pure-torch `alltoall` backend on simulated
ranks (threads) measured in the same run. The emulation is a correctness tool: the ratio says what a
test case costs, not how fast the kernels are. `--memory relaxed` times the relaxed memory mode.

    python benchmarks/emulation_speed.py [--ranks 4] [--tokens 256] [--hidden 1024] [--repeats 3] [--memory relaxed]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kernels_cuda
from kernels_cuda import Config, EmulatedGroup, Schedule, build_cpu
from parallel.dispatch import make_dispatcher
from parallel.dispatch.simulated import SimulatedEPGroup


def inputs(ranks: int, tokens: int, hidden: int, experts: int, topk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=g).bfloat16() for _ in range(ranks)]
    idx = [torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices for _ in range(ranks)]
    ws = [torch.rand(tokens, topk, generator=g) for _ in range(ranks)]
    return xs, idx, ws


def time_emulated(policy: str, args, xs, idx, ws, experts: int) -> float:
    config = Config(num_sms=4, num_max_send_tokens=8, num_max_recv_tokens=64)
    group = EmulatedGroup(args.ranks, config.buffer_size_hint(args.ranks, 2 * args.hidden, args.topk), config,
                          device="cpu", schedule=Schedule(policy, seed=1, memory=args.memory))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = group.dispatch(xs, idx, ws, experts)
        group.combine([r[0] for r in results], [r[4] for r in results], [r[2] for r in results])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_alltoall(args, xs, idx, ws, experts: int) -> float:
    def step(rank: int, comms) -> None:
        d = make_dispatcher("alltoall", comms, experts)
        recv_x, _, _, _, plan = d.dispatch(xs[rank], idx[rank], ws[rank], d.layout(idx[rank], experts))
        d.combine(recv_x, plan)

    group = SimulatedEPGroup(args.ranks, args.ranks)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        with torch.no_grad():
            group.run(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", choices=("sequential", "relaxed"), default="sequential")
    args = parser.parse_args()
    problem = build_cpu.ensure_built()
    if problem is not None or not kernels_cuda.is_built("cpu"):
        raise SystemExit(f"the CPU emulation is not available: {problem or kernels_cuda.build_status()}")
    experts = 8 * args.ranks
    xs, idx, ws = inputs(args.ranks, args.tokens, args.hidden, experts, args.topk, seed=0)
    baseline = time_alltoall(args, xs, idx, ws, experts)
    print(f"{args.ranks} ranks x {args.tokens} tokens x {args.hidden} bf16, top-{args.topk} of {experts} experts, "
          f"dispatch + combine, median of {args.repeats}, {args.memory} memory")
    print(f"  pure-torch alltoall (simulated ranks): {1e3 * baseline:8.1f} ms")
    for policy in ("round_robin", "random", "pct"):
        seconds = time_emulated(policy, args, xs, idx, ws, experts)
        print(f"  CPU emulation, {policy:<11}:        {1e3 * seconds:8.1f} ms  ({seconds / baseline:6.1f}x the baseline)")


if __name__ == "__main__":
    main()
