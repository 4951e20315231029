"""The MoE block's decoding exchange (`model.dispatcher.PackedExchange`) over DeepEP's low-latency
dispatch and combine (`LowLatencyExchange`): each decode step's tokens go into the packed per-expert
layout, the local experts run on it as a masked grouped GEMM (only the first `count[e]` rows), and
the combine brings the outputs back weighted by the router.

Every rank of the EP group calls `run_experts` once per MoE layer and step with at most
`max_tokens` tokens (DeepEP's `num_max_dispatch_tokens_per_rank`). Rows travel in the activations'
dtype without FP8 (bfloat16, or float32 through the reference's extension), so a float32 decode is
exact.
"""
from __future__ import annotations

import torch

from model.dispatcher import PackedExperts
from parallel.dispatch.comm import Comm
from parallel.dispatch.low_latency import LowLatencyExchange


class LowLatencyExperts:
    def __init__(self, comm: Comm, num_experts: int, max_tokens: int) -> None:
        self.exchange = LowLatencyExchange(comm)
        self.num_experts, self.max_tokens = num_experts, max_tokens

    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    experts: PackedExperts) -> torch.Tensor:
        recv_x, count, handle, _, _ = self.exchange.low_latency_dispatch(
            x, topk_idx, self.max_tokens, self.num_experts, use_fp8=False)
        combined, _, _ = self.exchange.low_latency_combine(experts(recv_x, count), topk_idx, topk_weights, handle)
        return combined
