"""Decoding: KV-cached decode vs recomputing the whole prefix, and per-step dispatch + combine latency of
the low-latency exchange vs the normal (all-to-all) dispatch for the same decode batch. Both
comparisons are measured in the same run, so the ratios are what to read (CPU times say little
about GPUs).

1. Greedy decode of `--new-tokens` after a `--prompt-tokens` prompt with the demo model (random
   weights, one process): `moe_train.generate.decoding.generate_ids` (cache, absorbed MLA, low-latency MoE
   exchange over a 1-rank group) vs a loop that runs the full forward over the prefix for every
   token (both pick the same tokens; checked).
2. One decode step's MoE exchange on `--ranks` EP ranks, `--batch` tokens per rank, DeepSeek-V3's
   top-8 of 256 experts, hidden 7168, bfloat16 rows: `LowLatencyExchange` dispatch + combine vs the
   `alltoall` dispatcher's layout + dispatch + combine, expert outputs = inputs; on the simulated
   group (threads) and on gloo processes.

Everything runs on one torch thread per rank.

    python benchmarks/decode.py [--prompt-tokens 512] [--new-tokens 32] [--ranks 4] [--batch 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.router import select_experts
from model.transformer import DeepSeekV3
from moe_train.config import load_config
from moe_train.generate.decoding import generate_ids
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.comm import Comm, ProcessGroupComm
from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.low_latency_experts import LowLatencyExperts
from parallel.dispatch.simulated import SimulatedEPGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERTS, TOPK, GROUPS, KEEP, HIDDEN = 256, 8, 8, 4, 7168


def decode_speed(prompt_tokens: int, new_tokens: int) -> None:
    config = load_config(os.path.join(ROOT, "moe_train/configs/demo.yaml"), ["model.mtp_num_layers=0"])
    torch.manual_seed(0)
    model = DeepSeekV3(config.model).eval()
    prompt = torch.randint(0, config.model.vocab_size, (prompt_tokens,)).tolist()
    exchange = LowLatencyExperts(LowLatencyExchange(SimulatedEPGroup(1, 1).comms[0].ep), config.model.num_moe_experts,
                                 max_tokens=1)

    start = time.perf_counter()
    cached = list(generate_ids(model, prompt, new_tokens, lambda logits: int(logits.argmax()), exchange))
    cached_s = time.perf_counter() - start

    start = time.perf_counter()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    recompute_s = time.perf_counter() - start
    assert ids[prompt_tokens:] == cached, "the cached decode chose other tokens than the full recompute"
    print(f"decode, demo model, {prompt_tokens}-token prompt + {new_tokens} tokens (prefill included): "
          f"KV cache {new_tokens / cached_s:.1f} tokens/s, full recompute {new_tokens / recompute_s:.1f} tokens/s, "
          f"ratio {recompute_s / cached_s:.2f}x")


def step_inputs(rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    scores = torch.randn(batch, EXPERTS, generator=gen).sigmoid()
    topk_idx = select_experts(scores, None, TOPK, GROUPS, KEEP)
    weights = scores.gather(1, topk_idx)
    return torch.randn(batch, HIDDEN, generator=gen).bfloat16(), topk_idx, weights / weights.sum(1, keepdim=True)


def timed(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exchange_latencies(comm: Comm, ranks_per_node: int, batch: int, repeats: int) -> tuple[float, float]:
    """(low-latency, normal) median seconds of one decode step's dispatch + combine on this rank."""
    x, topk_idx, weights = step_inputs(comm.rank, batch)
    low_latency = LowLatencyExchange(comm)
    normal = AllToAllDispatcher(comm, EXPERTS, ranks_per_node)

    def low_latency_step() -> None:
        recv, _, handle, _, _ = low_latency.low_latency_dispatch(x, topk_idx, batch, EXPERTS, use_fp8=False)
        low_latency.low_latency_combine(recv, topk_idx, weights, handle)

    def normal_step() -> None:
        layout = normal.layout(topk_idx, EXPERTS)
        recv_x, _, _, _, handle = normal.dispatch(x, topk_idx, weights, layout)
        normal.combine(recv_x, handle)

    return timed(low_latency_step, repeats), timed(normal_step, repeats)


def _gloo_rank(rank: int, world: int, store: str, batch: int, repeats: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        latencies = exchange_latencies(ProcessGroupComm(dist.group.WORLD), world, batch, repeats)
        if rank == 0:
            results.put(latencies)
    finally:
        dist.destroy_process_group()


def report(where: str, ranks: int, batch: int, latencies: tuple[float, float]) -> None:
    low, normal = latencies
    print(f"dispatch + combine, {where}, {ranks} ranks x {batch} tokens, top-{TOPK} of {EXPERTS}, hidden {HIDDEN}: "
          f"low-latency {low * 1e3:.2f} ms, normal {normal * 1e3:.2f} ms, normal / low-latency {normal / low:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    torch.set_num_threads(1)  # one per rank, as in the gloo processes; more only contend on a shared machine
    decode_speed(opts.prompt_tokens, opts.new_tokens)

    group = SimulatedEPGroup(opts.ranks, opts.ranks)
    simulated = group.run(lambda rank, comms: exchange_latencies(comms.ep, opts.ranks, opts.batch, opts.repeats))
    report("simulated group (threads)", opts.ranks, opts.batch, simulated[0])

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_gloo_rank, args=(opts.ranks, os.path.join(tmp, "store"), opts.batch, opts.repeats,
                                             results), nprocs=opts.ranks, start_method="spawn")
        report("gloo processes", opts.ranks, opts.batch, results.get())


if __name__ == "__main__":
    main()
