"""FP8 against bf16 GEMM throughput at DeepSeek-V3's shapes (a measurement of tests/gpu/run_gpu_checks.sh):
per shape, `model.fp8.fp8_mm` (1x128 activation tiles against 128x128 weight blocks: torch's blockwise
scaled_mm where the device runs it, else the emulation, as the line says) and a bf16 matmul of the
same operands, in TFLOP/s and as a ratio measured in the same run; the activation's quantization is
timed apart (in training it runs once per GEMM input). Then the routed experts' grouped GEMMs,
`model.fp8.fp8_grouped_mm` (one kernel GEMM per expert where the device runs the kernel) against
`model.layers.grouped_mm` in bf16, for 4 local experts (EP 64 of 256) of 2 x tokens rows each.

Run: python -m tests.gpu.bench_fp8_gemm [--tokens 4096] [--repeats 20]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from model.fp8 import blockwise_scaled_mm_supported, fp8_grouped_mm, fp8_mm, quantize_128x128, quantize_1x128
from model.layers import GroupEnds, grouped_mm

# (name, in features K, out features N) of DeepSeek-V3's weight GEMMs (hidden 7,168; 128 heads).
SHAPES = [("q_a_proj", 7168, 1536), ("q_b_proj", 1536, 24576), ("kv_a_proj", 7168, 576),
          ("kv_b_proj", 512, 32768), ("o_proj", 16384, 7168), ("expert gate_up", 7168, 4096),
          ("expert down", 2048, 7168)]


def seconds(fn: Callable[[], torch.Tensor], repeats: int, cuda: bool) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device, cuda = torch.device(args.device), args.device == "cuda"
    kernel = blockwise_scaled_mm_supported(device)
    print(f"{device}: FP8 GEMMs through {'torch blockwise scaled_mm' if kernel else 'the emulation (no blockwise kernel)'}; "
          f"{args.tokens} tokens, median of {args.repeats}")
    gen = torch.Generator(device=device).manual_seed(0)
    print("seed 0")
    for name, k, n in SHAPES:
        x = torch.randn(args.tokens, k, device=device, generator=gen).bfloat16()
        weight = (torch.randn(n, k, device=device, generator=gen) * 0.02).bfloat16()
        x_q, w_q = quantize_1x128(x), quantize_128x128(weight)
        flops = 2 * args.tokens * k * n
        fp8 = seconds(lambda: fp8_mm(x_q, w_q), args.repeats, cuda)
        bf16 = seconds(lambda: x @ weight.t(), args.repeats, cuda)
        quantize = seconds(lambda: quantize_1x128(x).data, args.repeats, cuda)
        print(f"{name:15s} K {k:6d} N {n:6d}: fp8 {flops / fp8 / 1e12:8.2f} TFLOP/s, bf16 {flops / bf16 / 1e12:8.2f} "
              f"TFLOP/s, fp8 / bf16 speed {bf16 / fp8:5.2f}x; quantizing the activation {1e3 * quantize:.3f} ms "
              f"({quantize / fp8:.2f} of the FP8 GEMM)")
    experts, rows = 4, 2 * args.tokens
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    groups = GroupEnds(offsets)  # its ends read to the host once, as a MoE layer's GEMMs share them
    for name, k, n in SHAPES[-2:]:
        x = torch.randn(experts * rows, k, device=device, generator=gen).bfloat16()
        weight = (torch.randn(experts, n, k, device=device, generator=gen) * 0.02).bfloat16()
        x_q, w_q = quantize_1x128(x), quantize_128x128(weight)
        flops = 2 * experts * rows * k * n
        fp8 = seconds(lambda: fp8_grouped_mm(x_q, w_q, groups), args.repeats, cuda)
        bf16 = seconds(lambda: grouped_mm(x, weight.transpose(1, 2), offsets), args.repeats, cuda)
        print(f"{name + ' x' + str(experts):15s} K {k:6d} N {n:6d}: fp8 {flops / fp8 / 1e12:8.2f} TFLOP/s, bf16 "
              f"{flops / bf16 / 1e12:8.2f} TFLOP/s, fp8 / bf16 speed {bf16 / fp8:5.2f}x (grouped, {rows} rows each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
