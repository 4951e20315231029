"""The DeepSeek-V3 router (noaux_tc): sigmoid scores, correction bias, group-limited top-k.

Also the two load-balancing rules: the sequence-wise balance loss and the auxiliary-loss-free
bias update. Group-limited routing becomes node-limited routing when router groups coincide with
the nodes of an expert-parallel group (experts are placed contiguously by id).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs
from model.dispatcher import count_per_expert
from model.recompute import Recompute


@dataclass
class Routing:
    topk_idx: torch.Tensor  # [N, K] int64 global expert ids
    topk_weights: torch.Tensor  # [N, K] fp32, gradient flows to the router weight
    scores: torch.Tensor  # [N, E] fp32 unbiased affinities


def select_experts(scores: torch.Tensor, bias: torch.Tensor | None, topk: int, num_groups: int,
                   group_topk: int) -> torch.Tensor:
    """Top-k expert ids by biased score, restricted to the `group_topk` best groups.

    A group's score is the sum of its two best biased scores; experts of dropped groups are masked
    with -inf (not 0: biased scores may be negative).
    """
    choice = scores.detach() if bias is None else scores.detach() + bias
    if num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        kept = group_scores.topk(group_topk, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return choice.topk(topk, dim=-1, sorted=False).indices


def sequence_balance_loss(scores: torch.Tensor, topk_idx: torch.Tensor, num_sequences: int,
                          coeff: float) -> torch.Tensor:
    """alpha * sum_i f_i * P_i per sequence (DeepSeek-V3 eq. 17-20), averaged over sequences.

    f_i = E / (K T) * #tokens of the sequence routed to i (a constant), P_i = mean over the
    sequence of the scores normalised over all experts (carries the gradient).
    """
    tokens, experts = scores.shape
    topk = topk_idx.shape[1]
    seq_len = tokens // num_sequences
    counts = torch.zeros(num_sequences, experts, device=scores.device, dtype=torch.float32)
    seq_of_slot = torch.arange(num_sequences, device=scores.device).repeat_interleave(seq_len * topk)
    counts.index_put_((seq_of_slot, topk_idx.reshape(-1)), torch.ones((), device=scores.device),
                      accumulate=True)
    f = counts * (experts / (topk * seq_len))
    normalized = scores / scores.sum(-1, keepdim=True)
    p = normalized.view(num_sequences, seq_len, experts).mean(1)
    return coeff * (f * p).sum(-1).mean()


def expert_bias_update(load: torch.Tensor, rate: float | torch.Tensor) -> torch.Tensor:
    """The aux-loss-free update b += rate * sign(mean load - load): overloaded experts go down."""
    load = load.float()
    return rate * torch.sign(load.mean() - load)


class Router(nn.Module):
    """Router weight (fp32 parameter), correction bias (fp32 buffer) and expert-load counter."""

    def __init__(self, args: ModelArgs, recompute: Recompute | None = None) -> None:
        """`recompute`: the decoder layer's (model.recompute). Under `layernorm` the fp32 copy of a
        bf16 input that the logits' GEMM saves for the weight gradient is rebuilt in backward from the
        norm's replay instead of kept (4 bytes per token and channel)."""
        super().__init__()
        self.recompute = recompute if recompute is not None else Recompute(())
        self.topk = args.moe_router_topk
        self.num_groups = args.moe_router_num_groups
        self.group_topk = args.moe_router_group_topk
        self.scaling_factor = args.moe_router_topk_scaling_factor
        self.score_function = args.moe_router_score_function
        self.init_std = args.init_method_std
        experts = args.num_moe_experts
        self.weight = nn.Parameter(torch.empty(experts, args.hidden_size, dtype=torch.float32))
        self.use_bias = args.moe_router_enable_expert_bias
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, d] -> Routing; logits are computed in fp32 whatever the activation dtype."""
        x32 = x if x.dtype == torch.float32 else self.recompute.derived(torch.Tensor.float, x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x32, self.weight.float())
        if self.score_function == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        bias = self.e_score_correction_bias if self.use_bias else None
        topk_idx = select_experts(scores, bias, self.topk, self.num_groups, self.group_topk)
        weights = scores.gather(1, topk_idx)
        if self.score_function == "sigmoid" and self.topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.training:
            with torch.no_grad():
                self.expert_load += count_per_expert(topk_idx, self.expert_load.numel())
        return Routing(topk_idx, weights * self.scaling_factor, scores)

    @torch.no_grad()
    def apply_bias_update(self, load: torch.Tensor, rate: float | torch.Tensor) -> None:
        """Update the correction bias from a (globally reduced) load vector (a 0-d tensor rate: 0 skips on the device)."""
        if self.use_bias:
            self.e_score_correction_bias += expert_bias_update(load.to(self.e_score_correction_bias.device), rate)
