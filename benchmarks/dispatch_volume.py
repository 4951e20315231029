"""Bytes per token on each link for flat all-to-all versus hierarchical node-limited dispatch.

DeepSeek-V3 routing (256 experts, top-8, 8 router groups = 8 nodes of 8 ranks, 4 groups kept,
hidden 7168) over an EP group of 64 ranks. 64 processes do not fit on a small machine, so the 64
ranks run as threads of one process: the real backends (layout, hop planning, record packing,
reordering, byte counters) run for every rank with the real hidden size; only the transport
moves rows in memory instead of over sockets. Then dispatch + combine are timed on gloo with a
few processes, for the record (on a shared CPU the times say little about GPUs).

    python benchmarks/dispatch_volume.py [--tokens 64] [--timing-world 4] [--skip-timing]
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.router import select_experts
from parallel.dispatch import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, make_dispatcher
from parallel.dispatch.simulated import SimulatedEPGroup
from parallel.topology import build_topology, routing_statement

EXPERTS, TOPK, GROUPS, KEEP, HIDDEN = 256, 8, 8, 4, 7168
EP, PER_NODE = 64, 8
BACKENDS = ("alltoall", "hierarchical")


def dsv3_inputs(seed: int, tokens: int, hidden: int, experts: int, groups: int, keep: int):
    """Sigmoid affinities of random logits through the DeepSeek-V3 group-limited selection."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=gen).sigmoid()
    topk_idx = select_experts(scores, None, TOPK, groups, keep)
    weights = scores.gather(1, topk_idx)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    return x, topk_idx, weights / weights.sum(-1, keepdim=True)


def simulated_traffic(name: str, tokens: int, fp8: bool, seed: int) -> tuple[dict, dict]:
    """Sum over the 64 simulated ranks of (bytes, rows) per (direction, link), for one dispatch + combine."""

    def one_rank(rank: int, comms) -> tuple[dict, dict]:
        x, topk_idx, weights = dsv3_inputs(seed + rank, tokens, HIDDEN, EXPERTS, GROUPS, KEEP)
        dispatcher = make_dispatcher(name, comms, EXPERTS, fp8=fp8)
        recv_x, _, _, _, handle = dispatcher.dispatch(x, topk_idx, weights, dispatcher.layout(topk_idx, EXPERTS))
        dispatcher.combine(recv_x, handle)
        return dict(dispatcher.traffic.bytes), dict(dispatcher.traffic.rows)

    per_rank = SimulatedEPGroup(EP, PER_NODE).run(one_rank)
    totals = [{}, {}]
    for counters in per_rank:
        for total, counter in zip(totals, counters):
            for key, value in counter.items():
                total[key] = total.get(key, 0) + value
    return totals[0], totals[1]


def routing_summary(tokens: int, seed: int) -> str:
    nodes, ranks, remote_nodes, remote_ranks = 0, 0, 0, 0
    for rank in range(EP):
        _, topk_idx, _ = dsv3_inputs(seed + rank, tokens, 0, EXPERTS, GROUPS, KEEP)
        owner = topk_idx // (EXPERTS // EP)
        for row in owner.tolist():
            dest_ranks, dest_nodes = set(row), {r // PER_NODE for r in row}
            ranks += len(dest_ranks)
            nodes += len(dest_nodes)
            remote_ranks += sum(r // PER_NODE != rank // PER_NODE for r in dest_ranks)
            remote_nodes += len(dest_nodes - {rank // PER_NODE})
    n = EP * tokens
    return (f"per token: {ranks / n:.2f} destination ranks ({remote_ranks / n:.2f} on other nodes), "
            f"{nodes / n:.2f} destination nodes ({remote_nodes / n:.2f} other nodes)")


def volume_report(tokens: int, seed: int) -> None:
    total_tokens = EP * tokens
    print(f"DeepSeek-V3 routing: {EXPERTS} experts, top-{TOPK}, {GROUPS} groups keep {KEEP}, hidden {HIDDEN}; "
          f"EP {EP} = {EP // PER_NODE} nodes x {PER_NODE} ranks")
    print(routing_statement(EP, PER_NODE, GROUPS, KEEP, TOPK))
    print(f"simulated: {EP} ranks as threads of one process running the real backends and their byte counters "
          f"(only the transport is in memory), {tokens} tokens per rank = {total_tokens} tokens, sigmoid scores "
          f"of random logits, no bias")
    print(routing_summary(tokens, seed))
    print("bytes per token that leave a rank, all ranks summed / tokens; records = payload (+ FP8 scales) "
          "+ top-k ids (int32) + weights (fp32) on dispatch, payload on combine")
    print(f"{'':28s}{'inter-node':>14s}{'intra-node':>14s}")
    inter = {}
    for fp8 in (False, True):
        for name in BACKENDS:
            nbytes, _ = simulated_traffic(name, tokens, fp8, seed)
            inter[name, fp8] = nbytes.get((DISPATCH, INTER_NODE), 0), nbytes.get((COMBINE, INTER_NODE), 0)
            print(f"dispatch {'FP8 ' if fp8 else 'BF16'} {name:14s}"
                  f"{nbytes.get((DISPATCH, INTER_NODE), 0) / total_tokens:14.0f}"
                  f"{nbytes.get((DISPATCH, INTRA_NODE), 0) / total_tokens:14.0f}")
            if not fp8:
                print(f"combine  BF16 {name:14s}{nbytes.get((COMBINE, INTER_NODE), 0) / total_tokens:14.0f}"
                      f"{nbytes.get((COMBINE, INTRA_NODE), 0) / total_tokens:14.0f}")
    for label, fp8, which in (("dispatch BF16", False, 0), ("dispatch FP8", True, 0), ("combine BF16", False, 1)):
        ratio = inter["alltoall", fp8][which] / inter["hierarchical", fp8][which]
        print(f"inter-node reduction (alltoall / hierarchical), {label}: {ratio:.2f}x")


def _timing_worker(rank: int, world: int, per_node: int, store: str, tokens: int, hidden: int,
                   repeats: int, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    topology = build_topology(1, world, per_node, timeout_s=120)
    experts, nodes = 8 * world, world // per_node
    x, topk_idx, weights = dsv3_inputs(rank, tokens, hidden, experts, nodes, max(1, nodes // 2))
    for name in BACKENDS:
        dispatcher = make_dispatcher(name, topology, experts)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            recv_x, _, _, _, handle = dispatcher.dispatch(x, topk_idx, weights, dispatcher.layout(topk_idx, experts))
            dispatcher.combine(recv_x, handle)
            times.append(time.perf_counter() - start)
        if rank == 0:
            results.put((name, statistics.median(times[1:])))
    topology.destroy_groups()
    dist.destroy_process_group()


def timing_report(world: int, per_node: int, tokens: int, hidden: int, repeats: int) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_timing_worker,
                             args=(r, world, per_node, os.path.join(tmp, "store"), tokens, hidden, repeats, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        timings = {}
        while len(timings) < len(BACKENDS):
            try:
                name, seconds = results.get(timeout=1)
                timings[name] = seconds
            except queue.Empty:
                failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
                if failed:
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError(f"timing rank {procs.index(failed[0])} exited with {failed[0].exitcode}")
        for proc in procs:
            proc.join()
    nodes = world // per_node
    print(f"gloo, {world} processes as {nodes} nodes x {per_node}, {tokens} tokens/rank, hidden {hidden} BF16, "
          f"{8 * world} experts top-{TOPK}, {nodes} groups keep {max(1, nodes // 2)}; "
          f"median of {repeats} dispatch+combine (for the record only):")
    for name in BACKENDS:
        print(f"  {name:14s}{timings[name] * 1000:9.1f} ms")
    print(f"  ratio alltoall / hierarchical: {timings['alltoall'] / timings['hierarchical']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per simulated rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-world", type=int, default=4)
    parser.add_argument("--timing-per-node", type=int, default=2)
    parser.add_argument("--timing-tokens", type=int, default=256)
    parser.add_argument("--timing-hidden", type=int, default=HIDDEN)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-timing", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    volume_report(opts.tokens, opts.seed)
    if not opts.skip_timing:
        timing_report(opts.timing_world, opts.timing_per_node, opts.timing_tokens, opts.timing_hidden, opts.repeats)


if __name__ == "__main__":
    main()
