"""One decoding step's all-to-all on the CPU emulation of kernels_cuda (or, `--device cuda`, every rank on
one GPU, as tests/gpu/run_gpu_checks.sh runs it): the low-latency kernels
(dispatch + combine into the packed per-expert layout) against the normal intranode kernels (layout,
notify, dispatch, combine) on the same batch, both measured in this run on emulated ranks (one launch
for all ranks), and the pure-torch low-latency reference on simulated ranks as a third line.

The emulation runs every CUDA thread as a fiber on one core, so the times say how much work each
protocol is (launches, waits, hand-offs), not how fast a GPU runs it; a GPU's numbers come from
tests/gpu/run_gpu_checks.sh.

    python benchmarks/low_latency_kernels.py [--ranks 4] [--tokens 8] [--hidden 1024] [--topk 4] [--repeats 5]
        [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import kernels_cuda
from kernels_cuda import Buffer, Config, EmulatedGroup, Schedule, build_cpu
from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.simulated import SimulatedEPGroup


def median_seconds(step: Callable[[], None], repeats: int, device: str) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens per rank (num_max_dispatch_tokens_per_rank)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    problem = build_cpu.ensure_built() if args.device == "cpu" else None
    if problem is not None or not kernels_cuda.is_built(args.device):
        raise SystemExit(f"kernels_cuda for {args.device} is not available: {problem or kernels_cuda.build_status()}")
    device = args.device
    R, T, H, K = args.ranks, args.tokens, args.hidden, args.topk
    E = 8 * R
    seed = 0
    print(f"seed {seed}: {R} ranks x {T} tokens x {H} bf16, top-{K} of {E} experts, median of {args.repeats}")
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g).bfloat16().to(device) for _ in range(R)]
    idx = [torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(device) for _ in range(R)]
    ws = [torch.rand(T, K, generator=g).to(device) for _ in range(R)]

    config = Config(num_sms=4, num_max_send_tokens=8, num_max_recv_tokens=64)
    group = EmulatedGroup(R, config.buffer_size_hint(R, 2 * H, K), config, device=device,
                          schedule=Schedule("random", 1) if device == "cpu" else None,
                          num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, R, E))

    def normal() -> None:
        results = group.dispatch(xs, idx, ws, E)
        group.combine([r[0] for r in results], [r[4] for r in results], [r[2] for r in results])

    def low_latency() -> None:
        results = group.low_latency_dispatch(xs, idx, T, E, use_fp8=False)
        group.low_latency_combine([r[0] for r in results], idx, ws, [r[2] for r in results])

    def reference() -> None:
        def step(rank: int, comms) -> None:
            ll = LowLatencyExchange(comms.ep)
            recv_x, _, handle, _, _ = ll.low_latency_dispatch(xs[rank], idx[rank], T, E, use_fp8=False)
            ll.low_latency_combine(recv_x, idx[rank], ws[rank], handle)

        SimulatedEPGroup(R, R).run(step)

    baseline = median_seconds(normal, args.repeats, device)
    print(f"  normal kernels (layout, notify, dispatch, combine): {1e3 * baseline:8.1f} ms")
    seconds = median_seconds(low_latency, args.repeats, device)
    print(f"  low-latency kernels (dispatch, combine):            {1e3 * seconds:8.1f} ms  "
          f"({seconds / baseline:5.2f}x the normal kernels)")
    if device == "cpu":
        seconds = median_seconds(reference, args.repeats, device)
        print(f"  low-latency reference (pure torch, threads):        {1e3 * seconds:8.1f} ms  "
              f"({seconds / baseline:5.2f}x the normal kernels)")


if __name__ == "__main__":
    main()
