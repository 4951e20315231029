"""Emulated 8-rank dispatch/combine throughput: logical bytes / time, against a device-to-device copy
of the same bytes measured in the same run. Prints ratios; asserts nothing about timing.

Run: python -m tests.gpu.bench_emulated
"""
from __future__ import annotations

import torch

from kernels_cuda import Config, EmulatedGroup
from tests.kernels.cases import payload, routing, weights


def _time_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    num_ranks, tokens, hidden, topk_k, experts = 8, 4096, 7168, 8, 256
    # 8 ranks x 8 channels x 2 blocks = 128 co-resident blocks (one per SM) fit the 132 SMs of an H200.
    config = Config(num_sms=16, num_max_send_tokens=6, num_max_recv_tokens=256)
    group = EmulatedGroup(num_ranks, config.buffer_size_hint(num_ranks, hidden * 2, topk_k), config)
    topk = routing("random", num_ranks, tokens, experts, topk_k, seed=0)
    xs = payload("random", num_ranks, tokens, hidden, torch.bfloat16, seed=0)
    ws = weights(num_ranks, tokens, topk_k, 0)
    results = group.dispatch(xs, topk, ws, experts)
    rows = sum(r[0].shape[0] for r in results)
    nbytes = rows * hidden * 2
    handles = [r[4] for r in results]
    ys = [r[0] for r in results]

    dispatch_ms = _time_ms(lambda: group.dispatch(xs, topk, ws, experts))
    cached_ms = _time_ms(lambda: group.dispatch(xs, handles=handles))
    combine_ms = _time_ms(lambda: group.combine(ys, handles))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))

    def gbps(ms: float) -> float:
        return nbytes / ms / 1e6

    print(f"emulated EP{num_ranks}, {tokens} tokens/rank, H={hidden}, top-{topk_k}, {rows} rows, "
          f"{nbytes / 2**20:.0f} MiB logical, config {config}")
    print(f"d2d copy            {copy_ms:8.3f} ms  {gbps(copy_ms):8.1f} GB/s")
    for name, ms in (("dispatch (+notify)", dispatch_ms), ("dispatch cached", cached_ms), ("combine", combine_ms)):
        print(f"{name:19} {ms:8.3f} ms  {gbps(ms):8.1f} GB/s  ratio to copy {copy_ms / ms:.3f}")


if __name__ == "__main__":
    main()
