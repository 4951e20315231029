"""The MoE block's decoding exchange (`model.dispatcher.PackedExchange`) over DeepEP's low-latency
dispatch and combine: the pure-torch `LowLatencyExchange`, or a `kernels_cuda.Buffer` in low-latency
mode (the same API). Each decode step's tokens go into the packed per-expert layout, the local
experts run on it as a masked grouped GEMM (only the first `count[e]` rows), and the combine brings
the outputs back weighted by the router.

Every rank of the EP group calls `run_experts` once per MoE layer and step with at most
`max_tokens` tokens (DeepEP's `num_max_dispatch_tokens_per_rank`). Rows travel without FP8 in
`row_dtype`: by default the activations' dtype (bfloat16, or float32 through the reference's
extension, so a float32 decode is exact); bfloat16 for the kernels, as DeepEP's, the result cast back.
"""
from __future__ import annotations

from typing import Any

import torch

from model.dispatcher import PackedExperts


class LowLatencyExperts:
    def __init__(self, exchange: Any, num_experts: int, max_tokens: int,
                 row_dtype: torch.dtype | None = None) -> None:
        self.exchange, self.num_experts, self.max_tokens, self.row_dtype = exchange, num_experts, max_tokens, row_dtype

    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    experts: PackedExperts) -> torch.Tensor:
        rows = x if self.row_dtype is None else x.to(self.row_dtype)
        recv_x, count, handle, _, _ = self.exchange.low_latency_dispatch(
            rows, topk_idx, self.max_tokens, self.num_experts, use_fp8=False)
        outputs = experts(recv_x.to(x.dtype), count).to(rows.dtype)
        combined, _, _ = self.exchange.low_latency_combine(outputs, topk_idx, topk_weights, handle)
        return combined.to(x.dtype)
