"""Expected expert-dispatch traffic per token and MoE layer, from the routing limits alone.

Node-limited two-hop dispatch (the hierarchical, native and DeepEP backends) over an EP group of
N nodes x L ranks: a token crosses the network once per destination node other than its own, then
each forwarder (same local rank on the destination node) fans it out inside its node.

Assumptions, each cross-checked against the real backends' byte counters in
tests/unit/test_plan.py (benchmarks/dispatch_volume.py's simulated 64-rank group):
- every token reaches the full node limit M (group_topk nodes when router groups = nodes; the
  top-2-sum group score makes each kept group win at least one expert), and its own node is one
  of the N uniformly, so it leaves its node for M (N-1) / N nodes;
- its k experts are otherwise uniform over the candidate experts of its kept groups, so the
  expected number of destination ranks is a hypergeometric expectation; a destination rank is the
  forwarder itself (no intra-node copy) with probability 1 / L.
Records: dispatch carries the payload (BF16, or FP8 with one fp32 scale per 128 channels) plus
top-k ids (int32) and weights (fp32); combine carries a BF16 payload. The backward pass mirrors
the forward (dispatch's backward is a combine, combine's a dispatch), both with BF16 payloads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kernels_cuda.config import Config as KernelConfig, InternodeConfig
from model.args import ModelArgs
from moe_train.config import Config
from parallel.dispatch.native import buffer_sizes

FP8_BLOCK = 128


@dataclass(frozen=True)
class Routing:
    """Expected destinations of one token in its EP group."""

    remote_nodes: float  # records that cross the network
    intra_rows: float  # records the forwarders copy to another rank of their node


@dataclass(frozen=True)
class TokenTraffic:
    """Bytes per token per MoE layer that leave a rank, forward + backward."""

    inter_node: float
    intra_node: float


def _miss_probability(candidates: int, held: int, draws: int) -> float:
    """P(none of `draws` experts drawn without replacement from `candidates` is one of `held`)."""
    if held >= candidates:
        return 0.0
    return math.comb(candidates - held, draws) / math.comb(candidates, draws)


def expected_routing(args: ModelArgs, ep: int, gpus_per_node: int) -> Routing:
    """Expected remote nodes and intra-node copies of one token for `ep` ranks, `gpus_per_node` per node."""
    per_node = min(ep, gpus_per_node)
    nodes = ep // per_node
    experts, groups, topk = args.num_moe_experts, args.moe_router_num_groups, args.moe_router_topk
    kept = args.moe_router_group_topk if groups > 1 else 1
    candidates = kept * experts // groups
    node_limit = min(nodes, topk, kept * max(1, nodes // groups))
    per_rank = experts // ep
    candidate_ranks = math.ceil(candidates / per_rank)
    ranks = candidate_ranks * (1.0 - _miss_probability(candidates, per_rank, topk))
    return Routing(remote_nodes=node_limit * (nodes - 1) / nodes, intra_rows=ranks * (1.0 - 1.0 / per_node))


def payload_bytes(hidden: int, fp8: bool) -> int:
    return hidden + 4 * math.ceil(hidden / FP8_BLOCK) if fp8 else 2 * hidden


def dispatch_record_bytes(args: ModelArgs, fp8: bool) -> int:
    """One dispatch record: payload plus int32 top-k ids and fp32 top-k weights."""
    return payload_bytes(args.hidden_size, fp8) + 8 * args.moe_router_topk


def token_traffic(args: ModelArgs, ep: int, gpus_per_node: int, fp8: bool) -> TokenTraffic:
    """Forward dispatch (BF16 or FP8) + combine, and their BF16 backward, per token per MoE layer."""
    routing = expected_routing(args, ep, gpus_per_node)
    bf16 = payload_bytes(args.hidden_size, fp8=False)
    per_record = dispatch_record_bytes(args, fp8) + 3 * bf16
    return TokenTraffic(routing.remote_nodes * per_record, routing.intra_rows * per_record)


def communication_buffer_bytes(config: Config, gpus_per_node: int) -> float:
    """Bytes of the `native` dispatcher's kernel buffer on each rank: its NVLink (and across nodes RDMA)
    regions, sized as parallel.dispatch sizes them for the MoE layers' rows (the fp32 residual stream
    of hidden_size channels, top-k ids). The other dispatchers keep no buffer of their own between
    calls (NCCL's are part of --reserve-gib)."""
    p, a = config.parallel, config.model
    if p.dispatcher != "native" or p.ep == 1 or a.num_moe_experts == 0:
        return 0.0
    per_node, sms = min(p.ep, gpus_per_node), {"num_sms": p.comm_sms}
    kind = InternodeConfig.for_nodes(p.ep // per_node, **sms) if p.ep > per_node else KernelConfig(**sms)
    sizes = buffer_sizes(kind, p.ep, per_node, 4 * a.hidden_size, a.moe_router_topk)
    return float(sizes.nvl_bytes + sizes.rdma_bytes)
